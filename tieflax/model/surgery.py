"""Tie/untie surgery on parameter trees (unboxed or boxed), the basis of checkpoint conversion.

Tied trees hold ``embed/embedding`` only; untied trees add ``lm_head/embedding`` of the same shape and
orientation. So untying is a copy and tying chooses (or averages) one of two matrices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

TIE_SOURCES = ("input", "output", "mean")


def is_tied(params: dict) -> bool:
    return "lm_head" not in params


def untie(params: dict) -> dict:
    """Tied -> untied: the head becomes its own copy of the embedding (same values, separate array)."""
    if not is_tied(params):
        raise ValueError("params are already untied (they have an 'lm_head'); nothing to untie")
    out = dict(params)
    out["lm_head"] = {"embedding": jax.tree.map(jnp.copy, params["embed"]["embedding"])}
    return out


def tie(params: dict, source: str = "input") -> tuple[dict, dict[str, Any]]:
    """Untied -> tied, keeping the input matrix, the output matrix or their mean.

    Returns (tied params, report) where the report says what was discarded: the relative Frobenius
    distance between the two matrices (valid and padded rows alike) and which one was dropped.
    """
    if source not in TIE_SOURCES:
        raise ValueError(f"tie source {source!r} is not one of {TIE_SOURCES}")
    if is_tied(params):
        raise ValueError("params are already tied (no 'lm_head'); nothing to tie")
    w_in, w_out = params["embed"]["embedding"], params["lm_head"]["embedding"]
    raw_in, raw_out = _unbox(w_in), _unbox(w_out)
    merged = {"input": raw_in, "output": raw_out, "mean": (raw_in + raw_out) / 2}[source]
    out = {k: v for k, v in params.items() if k != "lm_head"}
    out["embed"] = dict(params["embed"], embedding=_rebox(w_in, merged))
    distance = float(jnp.linalg.norm(raw_in - raw_out) / jnp.maximum(jnp.linalg.norm(raw_in), 1e-30))
    discarded = {"input": "output matrix (lm_head)", "output": "input matrix (embed)",
                 "mean": "the difference between the two matrices"}[source]
    return out, {"source": source, "discarded": discarded, "relative_distance_in_out": distance}


def _unbox(x):
    return x.value if hasattr(x, "value") and hasattr(x, "names") else x


def _rebox(like, value):
    return like.replace_boxed(value) if hasattr(like, "replace_boxed") else value
