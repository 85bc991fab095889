"""Causal self-attention by name: the einsum reference (``xla``), Pallas TPU ``splash``, ``cudnn``, ``auto``.

Every implementation computes the same function (``ModelConfig.attention`` picks one):

    out[b, t, h] = sum_s softmax_s(cap(scale * q[b, t, h] . k[b, s, h // g])) v[b, s, h // g],

over keys s <= t in t's segment (and t - s < window on sliding-window layers), where g = H / K query
heads share a key/value head and cap(x) = softcap * tanh(x / softcap) when a soft-cap is set.
``segment_ids=None`` means one segment per row (no packed documents): plain causal attention, which
cuDNN then runs by its causal flag alone, with no [B, 1, T, T] mask (see ``tieflax.ops.cudnn_attention``).

* ``xla``: two einsums with the fp32 scores [B, K, g, T, T] materialised; runs anywhere, the reference.
* ``splash``: ``tieflax.ops.splash_attention`` (TPU; Pallas interpret mode elsewhere, for tests).
* ``cudnn``: ``tieflax.ops.cudnn_attention`` (GPU; no soft-cap, 16-bit dtypes only).
* ``auto``: splash when the program is compiled for a TPU, cuDNN for a CUDA GPU when it supports the
  configuration, else xla. The platform is the one the program is *compiled for* (the mesh's devices,
  or ``jax.lax.platform_dependent`` without a mesh), not the process's default backend, so compiling
  for a TPU topology from a CPU-only host picks splash.

On a mesh, splash and cuDNN run under ``shard_map``: batch over ('data', 'fsdp'), heads over 'tensor'
(each when it divides), so every device attends over its own sequences and heads with no communication.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tieflax.errors import ConfigError
from tieflax.ops import cudnn_attention as cudnn_lib
from tieflax.ops.splash_attention import splash_attention

Array = jax.Array

IMPLEMENTATIONS = ("auto", "xla", "splash", "cudnn")
CUDA_PLATFORMS = ("cuda", "gpu")


def attention_mask(segment_ids: Optional[Array], window: int, length: Optional[int] = None) -> Array:
    """[B, 1, T, T] bool: causal by index, within one segment, and within `window` tokens if > 0.

    ``segment_ids=None`` (one segment per row): [1, 1, T, T] with T = ``length``, broadcast over rows.
    """
    t = segment_ids.shape[-1] if segment_ids is not None else length
    q = jnp.arange(t)[:, None]
    k = jnp.arange(t)[None, :]
    mask = k <= q
    if window:
        mask = mask & (q - k < window)
    if segment_ids is None:
        return mask[None, None]
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (mask[None] & same_segment)[:, None]


def xla_attention(q: Array, k: Array, v: Array, segment_ids: Optional[Array], *, scale: float,
                  softcap: float = 0.0, window: int = 0) -> Array:
    """The einsum reference. q [B, T, H, Dh], k/v [B, T, K, Dh], segment_ids [B, T] or None (one
    segment per row) -> [B, T, H, Dh].

    Scores are fp32 whatever the inputs' dtype; the probabilities are cast back to q's dtype for the
    second einsum.
    """
    b, t, h, dh = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, t, kvh, h // kvh, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q * jnp.asarray(scale, q.dtype), k,
                        preferred_element_type=jnp.float32)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = attention_mask(segment_ids, window, t)[:, :, None]  # [B or 1, 1, 1, T, S]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, dh)


def auto_choice(platform: str, *, dtype: str, head_dim: int, softcap: float) -> str:
    """What ``auto`` runs on ``platform`` ('tpu', 'cuda'/'gpu', 'cpu'...) for this configuration."""
    if platform == "tpu":
        return "splash"
    if platform in CUDA_PLATFORMS and cudnn_lib.unsupported_reason(
            dtype=dtype, head_dim=head_dim, softcap=softcap) is None:
        return "cudnn"
    return "xla"


def mesh_platform(mesh: Mesh) -> str:
    """The platform of the mesh's devices ('tpu' also for the abstract chips of a TPU topology)."""
    return mesh.devices.flat[0].platform


def attention(q: Array, k: Array, v: Array, segment_ids: Optional[Array], *, scale: float,
              softcap: float = 0.0, window: int = 0, implementation: str = "auto",
              mesh: Optional[Mesh] = None) -> Array:
    """Causal self-attention within segments, by ``implementation`` (see the module docstring).

    Args:
      q: [B, T, H, Dh]; k, v: [B, T, K, Dh] with K dividing H (GQA / MQA).
      segment_ids: [B, T] int; tokens attend only within their own segment (packed documents). None:
        one segment per row, plain causal attention (cuDNN: the causal flag, no [B, 1, T, T] mask).
      scale: multiplies the logits (q is scaled in its own dtype first, as the reference does).
      softcap: if > 0, Gemma 2's attention-logit soft-cap.
      window: if > 0, query t sees keys s with t - window < s <= t (sliding-window layers).
      implementation: one of ``IMPLEMENTATIONS``.
      mesh: the ('data', 'fsdp', 'tensor') mesh the program is compiled for, if any.
    Returns:
      [B, T, H, Dh] in q's dtype.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"attention implementation {implementation!r} is not one of {IMPLEMENTATIONS} "
                         "(set config.model.attention)")
    options = dict(scale=scale, softcap=softcap, window=window)
    dtype, head_dim = jnp.dtype(q.dtype).name, q.shape[-1]
    reason = cudnn_lib.unsupported_reason(dtype=dtype, head_dim=head_dim, softcap=softcap)
    if implementation == "cudnn":
        if reason:
            raise ConfigError(f"config.model.attention='cudnn': {reason[1]} (config.model.{reason[0]}); "
                             "use 'auto' or 'xla'")
    if mesh is not None:
        platform = mesh_platform(mesh)
        if implementation == "auto":
            implementation = auto_choice(platform, dtype=dtype, head_dim=head_dim, softcap=softcap)
        return _run(implementation, platform, options, mesh, q, k, v, segment_ids)

    if implementation == "xla":
        return xla_attention(q, k, v, segment_ids, **options)
    if implementation == "cudnn":
        if not cudnn_lib.cudnn_available():
            raise ConfigError(_cudnn_elsewhere(jax.default_backend()))
        return _run("cudnn", "cuda", options, None, q, k, v, segment_ids)
    # No mesh: the platform is known only when lowering; platform_dependent keeps the branch of the
    # platform the program is lowered for.
    branches: dict[str, Callable] = {"tpu": functools.partial(_run, "splash", "tpu", options, None)}
    if implementation == "auto" and reason is None and cudnn_lib.cudnn_available():
        branches["cuda"] = functools.partial(_run, "cudnn", "cuda", options, None)
    # Elsewhere: explicit splash runs in Pallas interpret mode (how the tests check it on a CPU).
    default = functools.partial(_run, implementation if implementation == "splash" else "xla", "cpu",
                                options, None)
    return jax.lax.platform_dependent(q, k, v, segment_ids, default=default, **branches)


def _run(implementation: str, platform: str, options: dict, mesh: Optional[Mesh], q: Array, k: Array,
         v: Array, segment_ids: Optional[Array]) -> Array:
    """Runs one implementation, under ``shard_map`` over ``mesh`` for the kernels."""
    if implementation == "xla":
        return xla_attention(q, k, v, segment_ids, **options)
    if implementation == "splash":
        local = functools.partial(splash_attention, **options, interpret=platform != "tpu")
        if segment_ids is None:  # splash takes one segment as ids of zeros, as it always has
            segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    else:
        if platform not in CUDA_PLATFORMS or not cudnn_lib.cudnn_available():
            raise ConfigError(_cudnn_elsewhere(platform))
        local = functools.partial(cudnn_lib.cudnn_attention, scale=options["scale"], window=options["window"])
    if mesh is None:
        return local(q, k, v, segment_ids)
    q_spec, kv_spec, k, v = _shard_specs(q, k, v, mesh)
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q, k, v)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], None)),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)


def check_platform(implementation: str, platform: str) -> None:
    """Refuses, before tracing, an implementation that cannot run on ``platform`` ('tpu', 'cuda', 'cpu')."""
    if implementation == "cudnn" and (platform not in CUDA_PLATFORMS or not cudnn_lib.cudnn_available()):
        raise ConfigError(_cudnn_elsewhere(platform))


def _cudnn_elsewhere(platform: str) -> str:
    """Why 'cudnn' cannot run for ``platform``, with the fix that is right there."""
    head = "config.model.attention='cudnn' is the NVIDIA GPU kernel"
    if platform == "tpu":
        return f"{head}, but the program is compiled for a TPU: use 'splash' (the TPU flash kernel) or 'auto'"
    if platform in CUDA_PLATFORMS:
        return (f"{head} and needs JAX's CUDA plugin with cuDNN, which is not installed: pip install "
                "'jax[cuda12]', or use 'auto' or 'xla'")
    return (f"{head}, but the program runs on {platform!r} (no NVIDIA GPU): use 'auto' or 'xla' here, and "
            "'cudnn' on a GPU machine")


def _shard_specs(q: Array, k: Array, v: Array, mesh: Mesh):
    """PartitionSpecs of q and k/v for ``shard_map``, and k/v with heads repeated if need be.

    Batch over ('data', 'fsdp') and heads over 'tensor' when they divide (replicated otherwise). When
    'tensor' divides the query heads but not the key/value heads (e.g. multi-query attention on 4
    tensor shards), each key/value head is repeated r times, r = lcm(K, tensor) / K: head j of the
    result is head j // r of the input, so query head i still reads key/value head i // (H / K).
    """
    b, _, h, _ = q.shape
    kh = k.shape[2]
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    tensor = mesh.shape["tensor"]
    batch = ("data", "fsdp") if b % batch_shards == 0 else None
    heads = "tensor" if h % tensor == 0 and tensor > 1 else None
    if heads and kh % tensor:
        r = math.lcm(kh, tensor) // kh
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    spec = P(batch, None, heads, None)
    return spec, spec, k, v
