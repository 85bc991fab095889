"""Causal attention through cuDNN's fused flash attention (``jax.nn.dot_product_attention``, GPU only).

cuDNN computes the causal mask and a sliding window (``local_window_size``) inside the kernel, so the
[heads, T, T] scores are never stored. Without segment ids (one document per row) that is all it gets:
the causal flag, no mask operand. Segment ids (packed documents) have no cuDNN mask of their own in
``jax.nn.dot_product_attention``: they are passed as a boolean [B, 1, T, T] mask, which JAX turns into
an additive bias shared by all heads (B * T^2 elements of the compute dtype: 128 MiB per 8192-token
sequence in bfloat16, against H * T^2 fp32 scores for the einsum), read by the forward and backward
kernels, and the backward also writes its gradient (jax 0.10 always asks cuDNN for it). cuDNN's own form
for packed documents, the ragged layout (``q_offsets`` / ``kv_offsets`` with per-segment lengths in
JAX's private ``fused_attention_stablehlo``, Hopper and later), needs a static bound M on documents per
row and keeps softmax statistics of [B * M, heads, T] fp32 (M = T at worst, one-token documents),
and a row with more than M documents would be silently wrong; so packed rows keep the mask. cuDNN has no logit
soft-cap and needs 16-bit inputs and head_dim a multiple of 8 (at most 128 before Hopper, 256 on it);
``unsupported_reason`` says which of these a configuration breaks.

Layout as in ``tieflax.ops.splash_attention``: q [B, T, H, Dh], k/v [B, T, K, Dh], segment_ids [B, T].
"""

from __future__ import annotations

import functools
from typing import Optional

import jax

Array = jax.Array

CUDNN_DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256  # Hopper and later; 128 on older GPUs (cuDNN raises then)


def unsupported_reason(*, dtype: str, head_dim: int, softcap: float) -> Optional[tuple[str, str]]:
    """(config field, why) when cuDNN attention cannot run this configuration, else None."""
    if softcap:
        return "attn_softcap", "cuDNN flash attention has no attention-logit soft-cap"
    if dtype not in CUDNN_DTYPES:
        return "dtype", f"cuDNN flash attention needs a 16-bit compute dtype {CUDNN_DTYPES}, got {dtype!r}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return "head_dim", f"cuDNN flash attention needs head_dim <= {MAX_HEAD_DIM} and a multiple of 8, got {head_dim}"
    return None


@functools.lru_cache(maxsize=1)
def cudnn_available() -> bool:
    """Whether cuDNN attention can be traced here (the CUDA plugin with cuDNN is installed)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo  # noqa: PLC0415

        fused_attention_stablehlo.check_cudnn_version()
        return True
    except Exception:  # noqa: BLE001 (any import or detection failure means "not available")
        return False


def cudnn_attention(q: Array, k: Array, v: Array, segment_ids: Optional[Array], *, scale: float,
                    window: int = 0) -> Array:
    """Causal (optionally sliding-window) attention within segments, on cuDNN, on one device's shard
    (``tieflax.ops.attention.attention`` shards it over a mesh).

    Args:
      q: [B, T, H, Dh] bf16/fp16; k, v: [B, T, K, Dh] with K dividing H.
      segment_ids: [B, T] int; tokens attend only within their own segment. None: one segment per
        row, the causal flag alone (no mask operand).
      scale: multiplies the logits.
      window: if > 0, query q sees keys k with q - window < k <= q.
    Returns:
      [B, T, H, Dh] in q's dtype.
    """
    same_segment = (None if segment_ids is None else
                    segment_ids[:, None, :, None] == segment_ids[:, None, None, :])  # [B, 1, T, T]
    return jax.nn.dot_product_attention(
        q, k, v, mask=same_segment, scale=scale, is_causal=True,
        local_window_size=(window - 1, 0) if window else None, implementation="cudnn")
