"""Stacked (scanned) <-> per-layer parameter trees: the same parameters in the two layouts a model holds.

Unscanned models hold one subtree per layer, ``params['block_{i}']`` for i < n_layers. Scanned models
(``config.model.scan_layers``) hold ``params['layers']['block_{j}']`` for j < p, ``p =
layers_per_scan_step`` (1, or Gemma 2's local/global pair), every leaf with a leading axis of
``n_layers / p`` (logical name ``layers``): row ``s`` of ``block_j`` is layer ``s * p + j``.

Everything else (embeddings, final norm, head) is the same in both layouts, so tie/untie surgery,
embedding diagnostics and parameter counts do not depend on the layout.

    stacked = stack_layers(params, config)       # per-layer -> scanned
    params = unstack_layers(stacked, config)     # scanned -> per-layer
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tieflax.model.config import ModelConfig

LAYERS_AXIS = "layers"   # the logical axis name of the stacked dimension (replicated by the sharding rules)


def is_stacked(params: dict) -> bool:
    """Whether ``params`` has the scanned layout (a ``layers`` subtree)."""
    return LAYERS_AXIS in params


def _stack(*xs: Any) -> Any:
    # Host arrays stay on the host: converting a large checkpoint should not need device memory.
    return np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)


def stack_layers(params: dict, config: ModelConfig) -> dict:
    """Per-layer ``{'block_0': ..., 'block_{L-1}': ...}`` -> scanned ``{'layers': {'block_j': ...}}``.

    ``params`` are unboxed (plain arrays: numpy, or jax arrays); other entries are passed through.
    """
    if is_stacked(params):
        raise ValueError("params are already stacked (they have a 'layers' subtree)")
    n, p = config.n_layers, config.layers_per_scan_step
    names = [f"block_{i}" for i in range(n)]
    missing = [name for name in names if name not in params]
    if missing or n % p:
        raise ValueError(f"cannot stack {n} layers in steps of {p}: missing {missing[:4]}" if missing else
                         f"n_layers={n} is not a multiple of the scan step {p}")
    out = {k: v for k, v in params.items() if k not in names}
    out[LAYERS_AXIS] = {f"block_{j}": jax.tree.map(_stack, *[params[f"block_{s * p + j}"] for s in range(n // p)])
                        for j in range(p)}
    return out


def unstack_layers(params: dict, config: ModelConfig) -> dict:
    """Scanned ``{'layers': {'block_j': ...}}`` -> per-layer ``{'block_{i}': ...}`` (the inverse)."""
    if not is_stacked(params):
        raise ValueError("params are not stacked (they have no 'layers' subtree)")
    n, p = config.n_layers, config.layers_per_scan_step
    stacked = params[LAYERS_AXIS]
    if sorted(stacked) != sorted(f"block_{j}" for j in range(p)):
        raise ValueError(f"the 'layers' subtree holds {sorted(stacked)}; a scan step of {p} layers needs "
                         f"block_0..block_{p - 1}")
    out = {k: v for k, v in params.items() if k != LAYERS_AXIS}
    for i in range(n):
        out[f"block_{i}"] = jax.tree.map(lambda x, s=i // p: x[s], stacked[f"block_{i % p}"])
    return out


def to_layout(params: dict, config: ModelConfig) -> dict:
    """``params`` in the layout ``config.scan_layers`` asks for, converting only if needed."""
    if config.scan_layers != is_stacked(params):
        return stack_layers(params, config) if config.scan_layers else unstack_layers(params, config)
    return params
