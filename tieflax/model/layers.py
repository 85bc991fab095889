"""Transformer body layers: norms, rotary positions, grouped-query attention and the MLPs.

Kernels carry logical axis names (``nn.with_logical_partitioning``) and activations logical constraints,
so one rules table (``tieflax.sharding.LOGICAL_AXIS_RULES``) decides the device layout.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from tieflax.model.config import ModelConfig
from tieflax.model.kv_cache import cached_attention
from tieflax.model.remat import LAYER_INPUT
from tieflax.ops.attention import attention

Array = jax.Array

# Activation layouts (logical names). Activations use their own names so that, e.g., the hidden size of
# an activation is not sharded over 'fsdp' while its batch already is.
BTD = ("batch", "activation_length", "activation_embed")
BTHD = ("batch", "activation_length", "activation_heads", "head_dim")
BTF = ("batch", "activation_length", "activation_mlp")


def dtype_of(name: str):
    return jnp.dtype(name)


def dense_init(std: float, names: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def recast_in_backward(fn, remat: str):
    """``fn`` (whose first step casts fp32 parameters to the compute dtype) under ``jax.checkpoint`` when
    ``remat`` is 'none', else ``fn`` itself.

    Autodiff of a matmul keeps its operands: for ``x @ kernel.astype(bf16)`` that is the bf16 copy of the
    kernel, which a layer scan stacks over the layers and holds until the backward reaches the layer
    (with remat 'none', a bf16 copy of every layer's weights: 1.8 GiB for Llama-3.2-1B), beside the fp32
    parameters it came from, which the backward holds anyway (the scan's own input, not a copy). Under
    ``jax.checkpoint`` the residuals are ``fn``'s inputs and the backward casts again: one elementwise
    pass over a layer's weights, the same values. A matmul's output is no residual of its own VJP, so
    nothing else is recomputed. Under the other remat policies the block's checkpoint already recasts,
    and a nested checkpoint would hide the matmuls from their policies: ``fn`` is returned unchanged.
    """
    return jax.checkpoint(fn) if remat == "none" else fn


def cast_kernel(kernel: Array, dtype) -> Array:
    """``kernel.astype(dtype)``, the same values, in a form XLA:TPU leaves inside a layer loop (fp32 to bf16;
    any other cast is ``astype``). Any shape.

    XLA:TPU moves the narrowing ``convert`` of a scanned layer's kernel shard up across the loop's
    ``dynamic_slice`` and out of the loop: a bf16 copy of every layer's MLP shards, made before the forward
    loop and held through both loops (216 MiB of Gemma-2B's peak on v5e:4x4, 168 MiB of Llama-3-8B's on
    v5p:4x4x4; an ``optimization_barrier`` before the cast did not stop it; benchmarks/README.md). Here the
    rounding (to nearest, ties to even, as ``convert``) is integer arithmetic, which it does not move;
    a NaN stays a NaN, a subnormal stays subnormal (a TPU's ``convert`` may flush it to zero). The
    gradient is the cotangent cast back to fp32, as ``astype``'s.
    """
    if kernel.dtype != jnp.float32 or jnp.dtype(dtype) != jnp.bfloat16:
        return kernel.astype(dtype)
    return _fp32_to_bf16(kernel)


def _round_to_bf16(x: Array) -> Array:
    """fp32 -> bf16 by integer operations on the bits: round to nearest even, the high 16 bits kept."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = bits + (jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1)))   # ties to the even neighbour
    y = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jnp.where(jnp.isnan(x), jnp.asarray(jnp.nan, jnp.bfloat16), y)   # a NaN's rounding could carry


@jax.custom_vjp
def _fp32_to_bf16(x: Array) -> Array:
    return _round_to_bf16(x)


_fp32_to_bf16.defvjp(lambda x: (_round_to_bf16(x), None), lambda _, g: (g.astype(jnp.float32),))


class Norm(nn.Module):
    """LayerNorm (GPT-2) or RMSNorm (Llama), the latter optionally scaled by (1 + w) (Gemma).

    Statistics are computed in float32 whatever the compute dtype; ``x``: [..., d] -> [..., d].
    With ``remat='none'`` the normalisation is still recomputed in the backward pass from its input
    (``jax.checkpoint``): autodiff would otherwise keep three fp32 copies of a [B, T, d] input per norm
    (x, 2x and x * rsqrt; two norms a block: six fp32 [layers, B, T, d] stacks under scanned layers, 12 GiB
    for Llama-3.2-1B at 8 x 2048, each zero-filled before the loop), where recomputing needs only the
    input, which the backward holds anyway. The same operations run in both passes, so the values do not
    change. Under any other remat policy the enclosing block's checkpoint already recomputes them.
    A block's pre-norms are taken further under remat 'none': ``deferred=True`` returns the normalisation
    as a function that the attention and the MLP apply inside their matmuls' checkpoint, so the
    normalised output is not kept either (``Block``).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, deferred: bool = False):
        """-> the normalised x; with ``deferred``, the normalisation as a function of x (its parameters
        bound), for a caller that applies it inside its own ``jax.checkpoint`` (``Block`` under remat 'none')."""
        c = self.config
        d = x.shape[-1]
        pdt = dtype_of(c.param_dtype)
        if c.norm == "layernorm":
            scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (d,), pdt)
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (d,), pdt)
        else:
            init = nn.initializers.zeros if c.norm_unit_offset else nn.initializers.ones
            scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (d,), pdt)
            bias = None
        normalize = functools.partial(_normalize, layernorm=c.norm == "layernorm", eps=c.norm_eps,
                                      unit_offset=c.norm_unit_offset)
        if deferred:
            return lambda v: normalize(v, scale, bias)
        if c.remat == "none":
            normalize = jax.checkpoint(normalize)
        return normalize(x, scale, bias)


def _normalize(x: Array, scale: Array, bias: Optional[Array], *, layernorm: bool, eps: float,
               unit_offset: bool) -> Array:
    """``Norm``'s arithmetic: x [..., d] -> [..., d] in x's dtype, statistics in fp32; scale, bias [d]."""
    x32 = x.astype(jnp.float32)
    if layernorm:
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + eps)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    else:
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
        scale = scale.astype(jnp.float32)
        y = y * (1.0 + scale if unit_offset else scale)
    return y.astype(x.dtype)


def rope_frequencies(c: ModelConfig) -> Array:
    """Inverse frequencies [head_dim // 2] fp32, with llama3-style scaling when configured."""
    dim = c.dim_per_head
    inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if not c.rope_scaling_factor:
        return inv_freq
    # Llama 3.1/3.2: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly (as in the reference implementation and Hugging Face transformers).
    factor, low, high = c.rope_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor
    old_len = c.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def _rotate(x: Array, positions: Array, inv_freq: Array, sign: float) -> Array:
    """x rotated by ``sign`` * its angles (rotate-half layout), in fp32, returned in x's dtype.

    The half-swap ``[-x2, x1]`` is a product with a signed permutation matrix, exact in any dtype (one
    +-1 term per output), rather than slices and a concatenation, which the TPU compiler materialises
    as fp32 [B, T, H, Dh/2] pieces: the largest temporaries of a long-sequence step.
    """
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = sign * jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    half = x.shape[-1] // 2
    eye = jnp.eye(half, dtype=x.dtype)
    zero = jnp.zeros_like(eye)
    swap = jnp.block([[zero, eye], [-eye, zero]])   # [Dh, Dh]: x @ swap = [-x2, x1]
    rotated = jnp.einsum("bthd,de->bthe", x, swap, precision=jax.lax.Precision.HIGHEST)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


@jax.custom_vjp
def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotary embedding in the rotate-half layout. x: [B, T, H, Dh]; positions: [B, T] int.

    The gradient is the inverse rotation of the cotangent (a rotation's transpose), computed the same
    way: automatic differentiation would instead keep fp32 [B, T, H, Dh/2] pieces of the slices and
    concatenations, the largest temporaries of a long-sequence attention backward. ``inv_freq`` and
    ``positions`` are constants of the model and get no gradient.
    """
    return _rotate(x, positions, inv_freq, 1.0)


def _rope_fwd(x, positions, inv_freq):
    return _rotate(x, positions, inv_freq, 1.0), (positions, inv_freq)


def _rope_bwd(residuals, cotangent):
    positions, inv_freq = residuals
    return _rotate(cotangent, positions, inv_freq, -1.0), None, None


apply_rope.defvjp(_rope_fwd, _rope_bwd)


class Attention(nn.Module):
    """Grouped-query self-attention. x: [B, T, d] -> [B, T, d].

    ``n_kv_heads < n_heads`` shares each key/value head across ``n_heads / n_kv_heads`` query heads.
    The attention itself is ``tieflax.ops.attention`` by ``config.attention`` (einsum, splash, cuDNN);
    ``mesh`` is the mesh the program is compiled for, if any (it picks and shards the kernel).
    """

    config: ModelConfig
    layer: int
    mesh: Optional[Mesh] = None

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Optional[Array], kv_cache: Optional[tuple] = None,
                 norm: Optional[Callable[[Array], Array]] = None):
        """x [B, T, d] -> [B, T, d]; with ``kv_cache`` = (this layer's {'k', 'v'}, the cache, see
        ``tieflax.model.kv_cache``) -> ([B, T, d], the layer's updated {'k', 'v'}) (generation).

        ``norm``: the block's pre-norm (``Norm(..., deferred=True)``), applied to x here, inside the q/k/v
        projections' checkpoint (``recast_in_backward``), so that under remat 'none' the backward
        recomputes the normalised x from x instead of keeping it; None: x is normalised already.
        """
        c = self.config
        h, kvh, dh = c.n_heads, c.kv_heads, c.dim_per_head

        dt = dtype_of(c.dtype)
        heads = {"query": (h, "heads"), "key": (kvh, "kv_heads"), "value": (kvh, "kv_heads")}
        weights = {name: ProjectionParams((c.d_model, n, dh), ("embed", axis, "head_dim"), "btd,dhk->bthk",
                                          use_bias=c.qkv_bias, config=c, name=name)()
                   for name, (n, axis) in heads.items()}

        def project(x, kernels):   # -> [q, k, v] before their biases; the pre-norm first, if given
            x = x if norm is None else norm(x)
            return [jnp.einsum("btd,dhk->bthk", x.astype(dt), kernel.astype(dt)) for kernel in kernels]

        # Under remat 'none' one checkpoint: the backward casts the kernels and normalises x again.
        qkv = recast_in_backward(project, c.remat)(x, [kernel for kernel, _ in weights.values()])
        q, k, v = (checkpoint_name(y if bias is None else y + bias.astype(dt), f"{name}_proj")  # for the
                   for y, (name, (_, bias)) in zip(qkv, weights.items()))                      # remat policies
        q = nn.with_logical_constraint(q, BTHD)
        if c.position == "rope":
            inv_freq = rope_frequencies(c)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)

        window = c.sliding_window if c.is_local_attention_layer(self.layer) else 0
        scale = (c.query_pre_attn_scalar or dh) ** -0.5
        if kv_cache is None:
            out = attention(q, k, v, segment_ids, scale=scale, softcap=c.attn_softcap, window=window,
                            implementation=c.attention, mesh=self.mesh)
        else:
            layer, cache = kv_cache
            out, layer = cached_attention(q, k, v, layer, positions=positions, slot_positions=cache["positions"],
                                          slot_valid=cache["valid"], index=cache["index"], scale=scale,
                                          softcap=c.attn_softcap, window=window)
        out = nn.with_logical_constraint(out, BTHD)
        out = Projection((h, dh, c.d_model), ("heads", "head_dim", "embed"), "bthk,hkd->btd",
                         use_bias=c.attn_out_bias, config=c, name="out")(out)
        return out if kv_cache is None else (out, layer)


def _kernel_and_bias(module: nn.Module, kernel_shape: tuple[int, ...], kernel_axes: tuple[str, ...], equation: str,
                     use_bias: bool, c: ModelConfig) -> tuple[Array, Optional[Array]]:
    """The parameters of an einsum projection, created in ``module``: kernel ``kernel_shape`` and, with
    ``use_bias``, a bias over the output's non-[B, T] dims, in the parameter dtype."""
    pdt = dtype_of(c.param_dtype)
    kernel = module.param("kernel", dense_init(c.init_std, kernel_axes), kernel_shape, pdt)
    if not use_bias:
        return kernel, None
    out_rank = len(equation.split("->")[1]) - 2  # the output's non-[B, T] dims
    axes = kernel_axes[-out_rank:]
    return kernel, module.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, axes),
                                kernel_shape[-out_rank:], pdt)


class ProjectionParams(nn.Module):
    """``Projection``'s parameters (``kernel``, ``bias`` or None), uncast, without the einsum: for a caller
    that runs several projections of one input together (``Attention``'s q, k, v)."""

    kernel_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    equation: str
    use_bias: bool
    config: ModelConfig

    @nn.compact
    def __call__(self) -> tuple[Array, Optional[Array]]:
        return _kernel_and_bias(self, self.kernel_shape, self.kernel_axes, self.equation, self.use_bias,
                                self.config)


class Projection(nn.Module):
    """An einsum with a kernel of any rank, e.g. [d, heads, head_dim], and an optional bias.

    ``nn.DenseGeneral`` initialises a flattened 2-D kernel and reshapes it, so a rank-3 logical
    partitioning would be applied to the 2-D array (and fails inside a mesh context); here the kernel is
    created in its own shape. Parameter names match ``DenseGeneral``'s: ``kernel`` and ``bias``.
    """

    kernel_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    equation: str
    use_bias: bool
    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c = self.config
        dt = dtype_of(c.dtype)
        kernel, bias = _kernel_and_bias(self, self.kernel_shape, self.kernel_axes, self.equation, self.use_bias, c)
        project = recast_in_backward(lambda v, w: jnp.einsum(self.equation, v.astype(dt), w.astype(dt)), c.remat)
        y = project(x, kernel)
        return y if bias is None else y + bias.astype(dt)


class DenseParams(nn.Module):
    """The parameters of a dense layer, ``kernel`` [in, out] and ``bias`` [out], as ``nn.Dense`` names them.

    Returns them uncast, so that the caller can run the matmul where it chooses (``Mlp``'s chunk loop).
    """

    features_in: int
    features: int
    axes: tuple[str, str]
    use_bias: bool
    config: ModelConfig

    @nn.compact
    def __call__(self) -> tuple[Array, Optional[Array]]:
        c = self.config
        pdt = dtype_of(c.param_dtype)
        kernel = self.param("kernel", dense_init(c.init_std, self.axes), (self.features_in, self.features), pdt)
        bias = (self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes[-1:]),
                           (self.features,), pdt) if self.use_bias else None)
        return kernel, bias


def _gelu(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)


def _activation(kind: str, up: Array, gate: Optional[Array]) -> Array:
    """The MLP's hidden activation [B, t, d_ff]: gelu(up) (``kind='gelu'``), else act(gate) * up with
    act = silu (SwiGLU) or gelu (GeGLU)."""
    if kind == "gelu":
        return _gelu(up)
    return (jax.nn.silu if kind == "swiglu" else _gelu)(gate) * up


class Mlp(nn.Module):
    """GELU MLP (GPT-2) or gated SwiGLU (Llama) / GeGLU (Gemma). x: [B, T, d] -> [B, T, d].

    With ``config.mlp_chunk = n`` > 0 the tokens go through n per device at a time: each of a device's
    r rows t = n // r positions at a time (``mlp_chunk_length``; the last chunk may be shorter), one chunk
    after another, each rematerialised: the backward pass then holds the [B, t, d_ff] activations of one
    chunk instead of [B, T, d_ff], which at long sequences are the widest tensors of a block. The weights
    are cast once, outside the chunk loop; their gradients add up over the chunks in the compute dtype.
    ``mesh``: the mesh the program is compiled for, if any (how many rows a device holds).
    """

    config: ModelConfig
    mesh: Optional[Mesh] = None

    @nn.compact
    def __call__(self, x: Array, norm: Optional[Callable[[Array], Array]] = None) -> Array:
        """x [B, T, d] -> [B, T, d]. ``norm``: the block's pre-norm (``Norm(..., deferred=True)``), applied
        to x here, inside the checkpoint of the input matmuls (or of the chunk loop), so that under remat
        'none' the backward recomputes the normalised x from x instead of keeping it; None: x is
        normalised already."""
        c = self.config
        dt = dtype_of(c.dtype)

        def dense(name, features_in, features, axes):  # -> (fp32 kernel, bias in the compute dtype)
            kernel, bias = DenseParams(features_in, features, axes, c.mlp_bias, c, name=name)()
            return kernel, None if bias is None else bias.astype(dt)

        d = x.shape[-1]
        weights = {"up": dense("up", d, c.d_ff, ("embed", "mlp"))}
        if c.mlp != "gelu":
            weights["gate"] = dense("gate", d, c.d_ff, ("embed", "mlp"))
        weights["down"] = dense("down", c.d_ff, c.d_model, ("mlp", "embed"))
        inputs = [name for name in ("up", "gate") if name in weights]   # the matmuls of x

        def prenormed(x):   # x, normalised if the norm is applied here, in the compute dtype
            return (x if norm is None else norm(x)).astype(dt)

        x = x if norm is not None else x.astype(dt)
        b, t = x.shape[:2]
        chunk = mlp_chunk_length(c.mlp_chunk, b, self.mesh)
        chunked = bool(chunk) and chunk < t
        activation = functools.partial(_activation, c.mlp)
        if c.remat == "none" and not chunked:
            # Kept otherwise: the activation's inner values, each [B, T, d_ff] (sigmoid, products...): six
            # bf16 [layers, B, T, d_ff] stacks for a scanned Llama (24 GiB for Llama-3.2-1B at 8 x 2048).
            # Recomputed from the matmul outputs instead, elementwise and with the same operations (a
            # chunked MLP is rematerialised whole already).
            activation = jax.checkpoint(activation)
        # Unchunked, each matmul casts its kernel (once) and under remat 'none' casts it again in the
        # backward instead of keeping the bf16 copy (``recast_in_backward``); chunked, the kernels are cast
        # once outside the chunk loop, below, so the cast must not move into it.
        matmul = recast_in_backward(lambda v, kernel: jnp.einsum("btd,df->btf", v, kernel.astype(dt)),
                                    "none" if c.remat == "none" and not chunked else "")

        def apply(w, h, first=None):  # h [B, t, d] -> [B, t, d]; first: up (and gate) of h, if made already
            def biased(name, y):
                return y if w[name][1] is None else y + w[name][1]

            if first is None:
                first = [matmul(h, w[name][0]) for name in inputs]
            up, *gate = [biased(name, y) for name, y in zip(inputs, first)]
            hidden = activation(up, gate[0] if gate else None)
            hidden = nn.with_logical_constraint(hidden, BTF)
            return biased("down", matmul(hidden, w["down"][0]))

        if not chunked:
            if norm is None:
                return apply(weights, x)
            # The norm and the input matmuls in one checkpoint under remat 'none': the backward normalises
            # x and casts the two kernels again, and keeps neither the normalised x nor the cast kernels.
            def first_matmuls(v, kernels):   # the norm once, then up (and gate)
                h = prenormed(v)
                return [jnp.einsum("btd,df->btf", h, kernel.astype(dt)) for kernel in kernels]

            first = recast_in_backward(first_matmuls, c.remat)(x, [weights[name][0] for name in inputs])
            return apply(weights, x, first)

        def chunk_loop(x, weights):
            # The kernels cast once for all the chunks (``cast_kernel``: kept in the layer loop); their
            # gradients add up over the chunks in the compute dtype.
            x = prenormed(x)
            w = {k: (cast_kernel(kernel, dt), bias) for k, (kernel, bias) in weights.items()}
            step = jax.checkpoint(apply, prevent_cse=False)   # inside a loop: nothing for CSE to merge
            n = t // chunk
            chunks = x[:, :n * chunk].reshape(b, n, chunk, d).swapaxes(0, 1)   # [n, B, chunk, d]
            _, out = jax.lax.scan(lambda carry, h: (carry, step(w, h)), None, chunks)
            out = out.swapaxes(0, 1).reshape(b, n * chunk, c.d_model)
            if n * chunk < t:   # a shorter last chunk
                out = jnp.concatenate([out, step(w, x[:, n * chunk:])], axis=1)
            return out

        # remat 'none': the chunks' checkpoints keep their inputs, the cast kernels among them; around the
        # whole loop the checkpoint keeps x (before the norm, when the norm is applied here) and the fp32
        # kernels instead (``recast_in_backward``).
        return recast_in_backward(chunk_loop, c.remat)(x, weights)


def mlp_chunk_length(tokens: int, rows: int, mesh: Optional[Mesh]) -> int:
    """Positions per row of one MLP chunk for ``tokens`` (``config.mlp_chunk``) tokens per device at a
    time, of a [rows, T] batch; 0 (no chunks) when ``tokens`` is 0.

    The batch is sharded over the mesh's ('data', 'fsdp') axes when they divide it (the 'batch' rule of
    ``tieflax.sharding``), so a device holds rows / shards rows, all of them in each chunk: a chunk of n
    positions per row is n * rows / shards tokens per device. Pod configs hold one row per device, and n =
    ``tokens``; one GPU with a batch of 8 rows takes ``tokens`` // 8 positions per row, so that a chunk's
    [8, n, d_ff] activations are those of ``tokens`` tokens (they were 8 times that: Llama-3.2-1B's 1 GiB
    of one chunk's backward at 8 x 2048 under remat 'none', benchmarks/README.md).
    """
    if not tokens:
        return 0
    shards = 1 if mesh is None else mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    local_rows = rows // shards if rows % shards == 0 else rows
    return max(1, tokens // local_rows)


class Block(nn.Module):
    """Pre-norm residual block; Gemma 2 adds a norm after attention and after the MLP. x: [B, T, d]."""

    config: ModelConfig
    layer: int
    mesh: Optional[Mesh] = None  # passed to the attention kernel

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Optional[Array], kv_cache: Optional[tuple] = None):
        """-> x [B, T, d]; with ``kv_cache`` (see ``Attention``) -> (x, the layer's updated {'k', 'v'})."""
        c = self.config
        x = checkpoint_name(x, LAYER_INPUT)  # what every remat policy keeps; may be offloaded (model/remat.py)
        # Under remat 'none' the pre-norms run inside the checkpoints of the matmuls they feed, so the
        # backward keeps the block input and the attention's residual sum, not the normalised copies of
        # them (two [B, T, d] stacks); other policies recompute the whole block already.
        prenorm = c.remat == "none" and kv_cache is None
        h, norm = _normed(Norm(c, name="attn_norm"), x, prenorm)
        y = Attention(c, self.layer, mesh=self.mesh, name="attn")(h, positions, segment_ids, kv_cache, norm=norm)
        if kv_cache is not None:
            y, layer = y
        y = checkpoint_name(y, "out_proj")  # the attention's output projection, for the remat policies
        if c.sandwich_norms:
            y = Norm(c, name="attn_post_norm")(y)
        x = nn.with_logical_constraint(x + y, BTD)
        h, norm = _normed(Norm(c, name="mlp_norm"), x, prenorm)
        y = checkpoint_name(Mlp(c, mesh=self.mesh, name="mlp")(h, norm=norm), "mlpwo")
        if c.sandwich_norms:
            y = Norm(c, name="mlp_post_norm")(y)
        x = nn.with_logical_constraint(x + y, BTD)
        return x if kv_cache is None else (x, layer)


def _normed(norm: Norm, x: Array, deferred: bool) -> tuple[Array, Optional[Callable[[Array], Array]]]:
    """A sublayer's (input, norm to apply to it): (x, the norm as a function) when the sublayer is to
    apply the norm itself (``deferred``), else (norm(x), None)."""
    return (x, norm(x, deferred=True)) if deferred else (norm(x), None)
