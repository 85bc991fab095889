"""Gradient interference on a tied matrix: the lookup (input) and head (output) contributions.

With tying, autodiff sums two gradients into one ``[V_pad, d]`` array: the *lookup* gradient, non-zero
only on rows of tokens that appear in the batch's inputs, and the *head* gradient, non-zero on every valid
row (each row's logit sits in every token's softmax denominator). To see them apart, apply the model
*untied* to ``untie(params)`` (the same values passed as two arguments) and take the two gradients: their
sum is exactly the tied gradient (``tests/test_model.py`` checks this).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tieflax.analysis.frequency import as_matrix, bucket_means, check_counts, frequency_buckets


def split_embedding_gradients(model_config, params: dict, batch: dict,
                              **loss_options: Any) -> tuple[jax.Array, jax.Array]:
    """(lookup gradient, head gradient), each [V_pad, d] fp32, of the mean token loss on ``batch``.

    model_config: the ``ModelConfig`` of ``params`` (tied or untied). params: the unboxed parameter tree.
    batch: ``inputs`` and ``targets`` [B, T] int (negative targets ignored), optional ``positions`` and
    ``segment_ids`` [B, T]. ``loss_options`` go to the fused loss (z_loss, label_smoothing...).
    For a tied model the two arrays sum to its gradient; for an untied one they are the gradients of
    ``embed`` and ``lm_head``.
    """
    from tieflax.model.surgery import is_tied, untie  # noqa: PLC0415

    split = untie(params) if is_tied(params) else params
    if "out_proj" in split["embed"]:  # decoupled width, tied: the head's projection moves with the head
        split = dict(split, embed={k: v for k, v in split["embed"].items() if k != "out_proj"},
                     lm_head=dict(split["lm_head"], out_proj=split["embed"]["out_proj"]))
    grads = _grad_fn(model_config.replace(tie_embeddings=False, head_init="normal"),
                     tuple(sorted(loss_options.items())))(split, batch)
    return _unbox(grads["embed"]["embedding"]), _unbox(grads["lm_head"]["embedding"])


@functools.lru_cache(maxsize=16)
def _grad_fn(untied_config, loss_options: tuple):
    """One jitted gradient per (config, loss options): analysing many checkpoints compiles once."""
    from tieflax.model import TransformerLM  # noqa: PLC0415

    model = TransformerLM(untied_config)

    def loss_fn(p, batch):
        loss, _ = model.apply({"params": p}, batch["inputs"], batch["targets"], batch.get("positions"),
                              batch.get("segment_ids"), method=TransformerLM.loss, **dict(loss_options))
        n = jnp.maximum(jnp.sum(batch["targets"] >= 0), 1)
        return loss.sum() / n

    return jax.jit(jax.grad(loss_fn))


def _unbox(x):
    return getattr(x, "value", x)


def gradient_interference(lookup_grad, head_grad, token_counts, n_buckets: int = 4) -> dict:
    """Per-row interplay of the lookup and head gradients of one step, overall and by frequency bucket.

    Definitions, over valid rows ``i < V`` (``V = len(token_counts)``), with ``g_L``, ``g_H`` [V_pad, d]:

    - ``rows_lookup`` / ``rows_head`` / ``rows_both``: fraction of rows with a non-zero lookup / head /
      both gradient: the rows each path updates this step (the head's is ~1: dense; the lookup's is the
      fraction of the vocabulary present in the batch: sparse).
    - ``cosine_mean``: mean over rows updated by both of ``cos(g_L[i], g_H[i])``; ``conflict_fraction``:
      the fraction of those rows where it is negative (the two signals pull apart).
    - ``norm_ratio_median``: median over rows updated by both of ``||g_L[i]|| / ||g_H[i]||``.
    - ``head_share``: ``sum ||g_H||^2 / (sum ||g_L||^2 + sum ||g_H||^2)`` over all valid rows.
    - ``matrix_cosine``: cosine of the two whole (flattened) gradients.
    - ``bucket_*``: the same per frequency bucket (rarest first; NaN where no row qualifies).
    """
    counts = check_counts(token_counts)
    v = counts.size
    gl, gh = as_matrix(lookup_grad, v), as_matrix(head_grad, v)
    if gl.shape != gh.shape:
        raise ValueError(f"lookup_grad {gl.shape} and head_grad {gh.shape} must have the same shape")
    nl, nh = np.linalg.norm(gl, axis=1), np.linalg.norm(gh, axis=1)
    both = (nl > 0) & (nh > 0)
    cos = np.where(both, (gl * gh).sum(1) / np.where(both, nl * nh, 1.0), np.nan)
    ratio = np.where(both, nl / np.where(nh > 0, nh, 1.0), np.nan)
    buckets = frequency_buckets(counts, n_buckets)
    total_sq = (nl ** 2).sum() + (nh ** 2).sum()
    flat = np.linalg.norm(gl) * np.linalg.norm(gh)

    def median(x, sel):
        return float(np.median(x[sel])) if sel.any() else float("nan")

    out = dict(
        rows_lookup=float((nl > 0).mean()), rows_head=float((nh > 0).mean()), rows_both=float(both.mean()),
        cosine_mean=float(np.nanmean(cos)) if both.any() else float("nan"),
        conflict_fraction=float((cos[both] < 0).mean()) if both.any() else float("nan"),
        norm_ratio_median=median(ratio, both),
        head_share=float((nh ** 2).sum() / total_sq) if total_sq > 0 else float("nan"),
        matrix_cosine=float((gl * gh).sum() / flat) if flat > 0 else float("nan"),
        lookup_norm=float(np.linalg.norm(gl)), head_norm=float(np.linalg.norm(gh)),
    )
    out["bucket_cosine"] = bucket_means(np.nan_to_num(cos), buckets, n_buckets, mask=both)
    out["bucket_norm_ratio"] = [median(ratio, both & (buckets == b)) for b in range(n_buckets)]
    out["bucket_rows_lookup"] = bucket_means((nl > 0).astype(float), buckets, n_buckets)
    out["bucket_rows_head"] = bucket_means((nh > 0).astype(float), buckets, n_buckets)
    return out
