"""A static key/value cache for generation: a fixed number of slots per sequence, written in place.

The cache of a batch holds, for every layer, keys and values ``[B, S, K, Dh]`` (S slots, K key/value
heads), and once for all layers the position ``[B, S]`` and validity ``[B, S]`` of each slot, plus the
next slot to write (``index``, a scalar shared by all rows). Rows of different lengths are *left-padded*
to one prompt length, so every row writes the same slot at every step (one ``dynamic_update_slice``),
while each row keeps its own positions (a pad's slot is invalid and is never attended to).

Attention over the cache masks by *position*, not by slot: query at position p sees the valid slots at
positions <= p (and > p - window on sliding-window layers). With left padding this is exactly the causal
mask of the unpadded sequence, so cached decoding computes the same function as the training forward.
All S slots are kept on sliding-window layers too (simple, and exact; a ring buffer would save memory).

    cache = init_cache(config, batch=B, slots=S, dtype=jnp.float32)
    logits, cache = model.apply({'params': p}, tokens, positions, valid, cache, method='decode')
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tieflax.model.config import ModelConfig

Array = jax.Array
Cache = dict[str, Any]   # {'layers': [{'k', 'v'}] * n_layers, 'positions', 'valid', 'index'}


def init_cache(c: ModelConfig, *, batch: int, slots: int, dtype=jnp.float32) -> Cache:
    """An empty cache: zero keys/values [B, S, K, Dh] per layer, no valid slot, ``index`` 0."""
    shape = (batch, slots, c.kv_heads, c.dim_per_head)
    return {"layers": [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(c.n_layers)],
            "positions": jnp.zeros((batch, slots), jnp.int32),
            "valid": jnp.zeros((batch, slots), bool),
            "index": jnp.zeros((), jnp.int32)}


def write_slots(cache: Cache, positions: Array, valid: Array) -> Cache:
    """The cache with the positions [B, t] and validity [B, t] of t new tokens written at ``index``.

    ``index`` itself is not advanced here: the layers still write their keys at it; ``advance`` does.
    """
    at = (0, cache["index"])
    return {**cache, "positions": jax.lax.dynamic_update_slice(cache["positions"], positions.astype(jnp.int32), at),
            "valid": jax.lax.dynamic_update_slice(cache["valid"], valid.astype(bool), at)}


def advance(cache: Cache, t: int) -> Cache:
    return {**cache, "index": cache["index"] + t}


def cached_attention(q: Array, k: Array, v: Array, layer: dict, *, positions: Array, slot_positions: Array,
                     slot_valid: Array, index: Array, scale: float, softcap: float = 0.0,
                     window: int = 0) -> tuple[Array, dict]:
    """Attention of t new queries over the cache, after writing their keys and values into it.

    Args:
      q: [B, t, H, Dh]; k, v: [B, t, K, Dh], the new tokens' (already rotated) keys and values.
      layer: this layer's ``{'k', 'v'}`` [B, S, K, Dh].
      positions: [B, t] the new tokens' positions; slot_positions, slot_valid: [B, S], already
        holding the new tokens' (``write_slots``); index: the slot of the first new token.
      scale, softcap, window: as ``tieflax.ops.attention.xla_attention``, whose numerics this follows
        (q scaled in its dtype, fp32 scores, probabilities cast back to q's dtype).
    Returns:
      ([B, t, H, Dh] in q's dtype, the layer's updated ``{'k', 'v'}``).
    """
    at = (0, index, 0, 0)
    keys = jax.lax.dynamic_update_slice(layer["k"], k.astype(layer["k"].dtype), at)
    values = jax.lax.dynamic_update_slice(layer["v"], v.astype(layer["v"].dtype), at)
    b, t, h, dh = q.shape
    kvh = keys.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg * jnp.asarray(scale, q.dtype), keys.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    qpos, kpos = positions[:, :, None], slot_positions[:, None, :]      # [B, t, 1], [B, 1, S]
    mask = slot_valid[:, None, :] & (kpos <= qpos)
    if window:
        mask = mask & (qpos - kpos < window)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values.astype(q.dtype)).reshape(b, t, h, dh)
    return out, {"k": keys, "v": values}
