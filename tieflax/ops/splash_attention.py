"""Causal attention through JAX's Pallas TPU splash attention kernel.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) is a block-sparse flash
attention: it never materialises the [heads, T, T] scores and skips the blocks that the mask empties
(the upper triangle, blocks outside a sliding window), in the forward and the backward pass. Off a TPU
it runs in Pallas interpret mode, which is slow but exact, so the tests can compare it with the einsum
reference on a CPU.

Layout: q [B, T, H, Dh], k/v [B, T, K, Dh] (K divides H: grouped-query / multi-query attention, query
head h reads key/value head h // (H / K), as the einsum reference does), segment_ids [B, T] int.
The kernel sees one device's shard; ``tieflax.ops.attention`` shards it over a mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

Array = jax.Array

# Tile sizes: 512 x 512 tiles suit T = 2k..32k on v4/v5e/v5p/v6e for head_dim 64..256 (MaxText uses
# the same defaults); shorter sequences use one tile of the (padded) length.
DEFAULT_BLOCK = 512
LANES = 128  # the kernel's tiles must be multiples of the TPU lane width


def block_size(t: int, block: int = DEFAULT_BLOCK) -> int:
    """The tile size used for a sequence of length ``t``: ``block``, or ``t`` rounded up to 128 if smaller."""
    if block % LANES:
        raise ValueError(f"splash attention block size {block} must be a multiple of {LANES}")
    return min(block, _round_up(t, LANES))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, t: int, window: int, softcap: float, block: int, interpret: bool):
    """A splash kernel for ``heads`` local query heads over a padded length ``t`` (cached: building the
    block masks is numpy work that would otherwise repeat in every layer)."""
    if window:
        # Causal and within `window` tokens: key k is visible to query q iff q - window < k <= q.
        mask = splash_mask.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    else:
        mask = splash_mask.CausalMask((t, t))
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    # Concrete mask arrays, also when first built inside a trace, so the cached kernel holds no tracer.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(splash_mask.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                      head_shards=1, q_seq_shards=1, attn_logits_soft_cap=softcap or None,
                                      interpret=interpret)


def splash_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, scale: float,
                     softcap: float = 0.0, window: int = 0, interpret: bool = False,
                     block: int = DEFAULT_BLOCK) -> Array:
    """Causal (optionally sliding-window, soft-capped) attention within segments, on one device's shard
    (``tieflax.ops.attention.attention`` shards it over a mesh).

    Args:
      q: [B, T, H, Dh]; k, v: [B, T, K, Dh] with K dividing H.
      segment_ids: [B, T] int; tokens attend only within their own segment (packed documents).
      scale: multiplies q before the logits (1/sqrt(Dh), or Gemma 2's query_pre_attn_scalar ** -0.5).
      softcap: if > 0, logits become softcap * tanh(logits / softcap) (Gemma 2).
      window: if > 0, query q sees keys k with q - window < k <= q (sliding-window layers).
      interpret: run the kernel in Pallas interpret mode (any platform; slow, for tests).
      block: tile size (a multiple of 128); T is padded up to a multiple of the tile.
    Returns:
      [B, T, H, Dh] in q's dtype.
    """
    b, t, h, dh = q.shape
    bs = block_size(t, block)
    t_pad = _round_up(t, bs)
    if t_pad != t:
        # Padding at the end is invisible to the real queries under a causal mask; the padded query
        # rows attend to themselves (so no empty softmax) and are sliced off.
        pad = ((0, 0), (0, t_pad - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, t_pad - t)))
    kernel = _kernel(h, t_pad, window, float(softcap), bs, interpret)
    # The kernel takes [heads, T, Dh] per sequence and applies no scale of its own.
    qs = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)
    ks, vs = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1)))(
        qs, ks, vs, segment_ids.astype(jnp.int32))
    return jnp.swapaxes(out, 1, 2)[:, :t].astype(q.dtype)
