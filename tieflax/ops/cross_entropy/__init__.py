"""Fused, blockwise, vocabulary-parallel softmax cross-entropy.

``cross_entropy(hidden, weight, labels, valid_vocab=...)`` computes the exact full-vocabulary softmax
loss from the final hidden states and the head matrix without ever holding ``[tokens, vocab]`` logits.

Algorithm (``mode='recompute'``, the default)
    forward   loop over token blocks x vocab blocks; each ``[bt, bv]`` fp32 tile of logits updates
              running per-token statistics (max, sum of exp, label logit, sum of logits) and is dropped.
              Only the ``[N]`` log-sum-exp is saved for the backward.
    backward  loop over vocab blocks x token blocks; recompute each tile, turn it into d(logits) and
              accumulate ``dH += dZ @ W_blk`` ([N, d] fp32) and ``dW_blk += dZ^T @ H_blk`` ([bv, d] fp32).
    Cost: 4 matmuls of ``2 N V d`` FLOPs (naive autodiff: 3), live memory one tile + ``[N, d]`` fp32.
    The default token block (8192) usually covers all local tokens, so each loop is a single pass over
    vocab blocks and no copy of the hidden states is sliced.

``mode='fused'`` (gradient in the forward, Liger-style)
    One loop over token blocks; each step computes the ``[bt, V_local]`` logits once, the softmax
    statistics, the per-token gradient and both matmuls. Cost: 3 matmuls (= naive), but the tile spans
    the whole local vocabulary and the forward keeps ``dH`` ([N, d]) and ``dW`` ([V, d]) as residuals.
    The stored ``dW`` assumes the cotangent of ``loss_per_token`` is the same for every contributing
    token (``loss.sum()``, ``loss.mean()`` or ``loss.sum() / n``: put per-token weights in ``weights``);
    any other cotangent is detected at run time and handled exactly by the recompute mode's two passes
    (statistics, then gradients) in the backward.
    Pick ``'fused'`` when ``bt * V_local * 4`` bytes plus a second weight-sized buffer fit, i.e. small
    vocabularies or many vocab shards; pick ``'recompute'`` for 128k-256k vocabularies per device.

Vocabulary parallelism (``mesh`` given)
    ``jax.shard_map`` with ``weight`` sharded ``P(vocab_axis, None)`` and tokens over ``batch_axes``.
    Cross-device traffic: one ``pmax`` and one ``psum`` of ``[N_local]`` statistics per forward (per
    token block in fused mode), one ``psum`` of ``dH`` [N_local, d] over the vocab axis, and the usual
    data-parallel reduction of ``dW`` [V_local, d] over the batch axes (recompute mode: one ``[bv, d]``
    block at a time, so no second weight-sized buffer). No logits-sized collective; the weight is never
    gathered over vocab. Per-device memory is flat in V.

W sharded over d (``weight_embed_axis``, default ``'fsdp'``, the model's ``P('tensor', 'fsdp')``)
    Inside the map each device holds ``[V_local, d / fsdp]``; each ``[bv, d_local]`` block is
    all-gathered over that axis when the loop reaches it, and each finished dW block is
    reduce-scattered back over it (``psum_scatter``) and summed over the other batch axes, so dW leaves
    in the parameter's own layout and, in recompute mode, neither W nor dW is ever whole on a device
    (fused mode gathers the local shard whole: it holds weight-sized buffers anyway).

A replicated W (``weight_rows_sharded=False``)
    Every device holds all of W's rows; each reads its vocabulary shard's rows in place, block by block,
    and each finished dW block is all-gathered over the vocab axis and added at every shard's rows, so dW
    leaves whole, as W came, with no weight-sized copy on the way. The caller declares W's layout (this
    and ``weight_embed_axis``): under ``jit`` the loss cannot see it, and a mismatch is resliced by the
    compiler on the way in (a copy of part of W).

Implementations (``impl``), one file each
    ``'xla'`` (``xla.py``): the loops above, with the tiles of the platform lowered for
    (``tiles.py``). With bf16 hidden states and an fp32 W: on TPU each W block is rounded to bf16 inside
    the loop (XLA's default precision would round it anyway, but with one hoisted convert of the whole
    matrix); on GPU W is cast to bf16 once per call (a V x d bf16 copy) so the tile matmuls are bf16.
    ``'pallas'`` (``pallas_tpu.py``): the Mosaic TPU kernels (recompute mode, 5 matmuls).
    ``'mosaic_gpu'`` (``mosaic_gpu.py``): the Pallas Mosaic GPU kernels for Hopper and newer (recompute
    mode, 4 matmuls: a statistics pass, then one backward pass that recomputes each logit tile once into
    a bounded bf16 dZ chunk and makes dH and dW from it; no copy of W beyond a bounded chunk). Both
    Pallas paths run inside the same ``shard_map`` and collectives (``pallas_driver.py``), and are
    interpreted when compiled for another platform (how the tests run them; the Mosaic GPU interpreter
    needs jax >= 0.12). ``'auto'`` (default): the TPU kernels when the program is lowered for a TPU, the
    Mosaic GPU kernels when lowered for a CUDA GPU of Hopper or newer (bf16 hidden states, d a multiple
    of 64), XLA elsewhere (``lax.platform_dependent``: decided at lowering, so a deviceless compile for
    a TPU topology or a GPU target from a CPU picks them; on a mesh of CPUs, when tracing). The Pallas
    Triton kernels (``'pallas_gpu'``, 5 matmuls) were removed: JAX deprecated that backend, jax 0.12
    cannot lower it without a GPU, and no GPU measurement ever showed them ahead of XLA.

Semantics (global valid vocabulary ``V = valid_vocab``; ``j`` runs over rows ``< V``)::

    raw_j  = logit_scale * <h, w_j> + bias_j
    z_j    = softcap * tanh(raw_j / softcap)          (if softcap, Gemma 2 order)
    lse    = log sum_j exp(z_j)
    loss   = weights * [lse - (1 - eps) z_y - (eps / V) sum_j z_j + z_loss * lse^2]

Labels ``< 0`` are ignored and labels ``>= valid_vocab`` are invalid: both give loss 0 and no gradient;
invalid ones are counted in ``aux['invalid_label_count']`` and never clipped. Rows ``>= valid_vocab``
(vocabulary padding) get no probability mass and a zero gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from tieflax.ops.cross_entropy import mosaic_gpu, pallas_driver, pallas_tpu, tiles, xla
from tieflax.ops.cross_entropy.loss_config import IMPLS, MODES, Cfg, acc_dtype
from tieflax.ops.cross_entropy.sharding import batch_size
from tieflax.ops.cross_entropy.tiles import DEFAULT_FUSED_TOKEN_BLOCK, DEFAULT_TOKEN_BLOCK, DEFAULT_VOCAB_BLOCK

__all__ = ["cross_entropy", "DEFAULT_TOKEN_BLOCK", "DEFAULT_VOCAB_BLOCK", "DEFAULT_FUSED_TOKEN_BLOCK",
           "MODES", "IMPLS"]


# ------------------------------------------------------------------------- implementation by platform

def _xla_on(cfg: Cfg, xla_fn):
    """``xla_fn`` for each platform, with that platform's tiles (``Cfg.on``); one callable per distinct
    configuration, so ``lax.platform_dependent`` traces CUDA and ROCm once."""
    gpu = functools.partial(xla_fn, cfg.on("gpu"))
    return dict(tpu=functools.partial(xla_fn, cfg.on("tpu")), cuda=gpu, rocm=gpu,
                default=functools.partial(xla_fn, cfg.on("cpu")))


def _mosaic_refused(why: str):
    def refuse(*args):
        raise ValueError(f"impl='mosaic_gpu': {why}; use impl='auto' (the XLA path takes this case) or "
                         f"impl='xla'.")
    return refuse


def _mosaic_not_here(kind: str, why: str):
    """The CPU branch of impl='mosaic_gpu' on a jax without the Mosaic GPU interpreter. It must trace
    (a deviceless compile for a GPU traces every branch), so it refuses when it runs, in one line."""
    def refuse(h, w, b, y, *rest):
        def fail(*_):
            raise ValueError(f"impl='mosaic_gpu' on a CPU needs the Mosaic GPU interpreter: {why}; use the "
                             f"Python 3.12 stack (jax 0.12), or impl='xla'.")
        acc = acc_dtype(h.dtype, w.dtype)
        out = ((jax.ShapeDtypeStruct((h.shape[0],), acc),) * 4 if kind == "stats" else
               (jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype),
                jax.ShapeDtypeStruct((w.shape[0],), acc)))
        return jax.experimental.io_callback(fail, out, h[:1, :1])
    return refuse


def _on_platform(cfg: Cfg, kind: str, *args):
    """Runs the implementation ``cfg.impl`` names of ``kind`` ('stats' or 'grads'), chosen when lowering,
    for the platform the program is compiled for (a TPU topology or a GPU target compiled from a CPU
    process picks its kernel). A Pallas kernel compiled for another platform than its own is interpreted
    (its JAX ops run as XLA), which is how the tests run them on a CPU."""
    xla_fn = getattr(xla, kind)
    tpu_fn = functools.partial(getattr(pallas_driver, kind), pallas_tpu)
    gpu_fn = functools.partial(getattr(pallas_driver, kind), mosaic_gpu)
    branches = _xla_on(cfg, xla_fn)
    if cfg.impl == "pallas":
        branches = dict(tpu=functools.partial(tpu_fn, cfg.on("tpu"), False),
                        default=functools.partial(tpu_fn, cfg, True))
    elif cfg.impl == "mosaic_gpu":
        if cfg.mosaic_ok:
            branches = dict(default=_mosaic_refused(cfg.mosaic_ok))
        else:
            interpretable, why = mosaic_gpu.interpretable()
            branches = dict(cuda=functools.partial(gpu_fn, cfg.on("gpu"), False),
                            default=functools.partial(gpu_fn, cfg, True) if interpretable else
                            _mosaic_not_here(kind, why))
    elif cfg.impl == "auto":
        branches["tpu"] = functools.partial(tpu_fn, cfg.on("tpu"), False)
        if not cfg.mosaic_ok:
            branches["cuda"] = functools.partial(gpu_fn, cfg.on("gpu"), False)
    return _by_platform(cfg, args, branches)


def _by_platform(cfg: Cfg, args: tuple, branches: dict):
    """``lax.platform_dependent(*args, **branches)``, or the default branch alone when the mesh's every
    device is a CPU: the program is then compiled for CPUs (a compile-only TPU topology or GPU target has
    that platform's devices; the attention also picks its kernel by the mesh's platform when tracing), and
    ``platform_dependent`` would trace the TPU and Mosaic GPU kernels only for the lowering to drop them
    (0.27 CPU-s on a first trace at d=64 bf16). The CPU branch is the same function either way: the loss
    and its gradients are bit-identical (tests/test_cross_entropy.py compares them on a mesh of CPUs).
    Without a mesh the platform is known only when lowering."""
    if cfg.mesh is not None and all(d.platform == "cpu" for d in cfg.mesh.devices.flat):
        return branches["default"](*args)
    return lax.platform_dependent(*args, **branches)


def _stats(cfg: Cfg, h, w, b, y):
    """Global [N] statistics (max, sumexp, label logit, sum of logits), acc dtype."""
    return _on_platform(cfg, "stats", h, w, b, y)


def _grads(cfg: Cfg, h, w, b, y, lse, coef):
    """Recompute backward: dH [N, d] h.dtype, dW [V, d] w.dtype, db [V] acc (all fully reduced)."""
    return _on_platform(cfg, "grads", h, w, b, y, lse, coef)


def _fused(cfg: Cfg, h, w, b, y, aw):
    """Gradient-in-forward (XLA on every platform, with the platform's tiles)."""
    return _by_platform(cfg, (h, w, b, y, aw), _xla_on(cfg, xla.fused))


# ---------------------------------------------------------------------------------- custom VJP

def _finish(cfg: Cfg, stats, y, weights):
    """Per-token loss and aux from global statistics; everything [N] fp32 (fp64 for fp64 inputs)."""
    m, s, zy, sz = stats
    eps = cfg.label_smoothing
    lse = m + jnp.log(s)
    valid = (y >= 0) & (y < cfg.valid_vocab)
    aw = jnp.where(valid, weights.astype(lse.dtype), 0.0)
    ce = lse - (1.0 - eps) * zy - (eps / cfg.valid_vocab) * sz
    zterm = cfg.z_loss * jnp.square(lse)
    loss_unweighted = jnp.where(valid, ce + zterm, 0.0)
    aux = dict(lse=lse, z_loss=aw * zterm, correct=valid & (zy >= m), max_logit=m,
               invalid_label_count=jnp.sum(y >= cfg.valid_vocab, dtype=jnp.int32))
    return aw * loss_unweighted, aux, aw, loss_unweighted


def _recomputed_lse(cfg: Cfg, h, w, b, y):
    """[N] log-sum-exp from the blockwise statistics pass, for the fused mode's exact fallback. The
    recompute gradient forms p = exp(z - lse) from its own blockwise logits; the fused forward's lse
    (one [bt, V] tile, compiled into another program) can differ from theirs in the last bits (by up to
    0.002 at |z| ~ 1e4), and a dominant label's p - 1 then loses its digits: dW and db were off by 0.2%
    of their scale on XLA:CPU with jax 0.12 (tests/test_cross_entropy.py, the 1e4-logit case)."""
    m, s = _stats(cfg, h, w, b, y)[:2]
    return m + jnp.log(s)


@functools.lru_cache(maxsize=None)
def _build(cfg: Cfg):
    @jax.custom_vjp
    def ce(h, w, b, y, weights):
        loss, aux, _, _ = _finish(cfg, _stats(cfg, h, w, b, y), y, weights)
        return loss, aux

    def fwd(h, w, b, y, weights):
        if cfg.mode == "recompute":
            stats = _stats(cfg, h, w, b, y)
            loss, aux, aw, lu = _finish(cfg, stats, y, weights)
            return (loss, aux), (h, w, b, y, weights, aux["lse"], aw, lu, None)
        aw0 = jnp.where((y >= 0) & (y < cfg.valid_vocab), weights, 0.0)
        stats, dh, dw, db = _fused(cfg, h, w, b, y, aw0.astype(acc_dtype(h.dtype, w.dtype)))
        loss, aux, aw, lu = _finish(cfg, stats, y, weights)
        return (loss, aux), (h, w, b, y, weights, aux["lse"], aw, lu, (dh, dw, db))

    def bwd(res, cts):
        h, w, b, y, weights, lse, aw, lu, unit = res
        g = cts[0].astype(lse.dtype)  # aux outputs carry no gradient
        d_weights = (g * lu).astype(weights.dtype)
        if unit is None:
            dh, dw, db = _grads(cfg, h, w, b, y, lse, g * aw)
        else:
            dh_u, dw_u, db_u = unit
            dh = g[:, None] * dh_u
            active = aw != 0
            scale = jnp.max(jnp.where(active, g, -jnp.inf))
            uniform = jnp.all(jnp.where(active, g == scale, True)) | ~jnp.any(active)
            scale = jnp.where(jnp.any(active), scale, 0.0)
            dw, db = lax.cond(uniform, lambda: ((scale * dw_u).astype(w.dtype), scale * db_u),
                              lambda: _grads(cfg, h, w, b, y, _recomputed_lse(cfg, h, w, b, y), g * aw)[1:])
        db = None if b is None else db.astype(b.dtype)
        return dh.astype(h.dtype), dw.astype(w.dtype), db, None, d_weights

    ce.defvjp(fwd, bwd)
    return ce


def _check(cfg: Cfg, hidden, weight, labels, weights, bias):
    d = hidden.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [V_pad, d] = [*, {d}] (vocab rows, like the input embedding); "
                         f"got {weight.shape}. Pass the head matrix untransposed.")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {labels.shape} must equal hidden.shape[:-1] = {hidden.shape[:-1]}.")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integers, got {labels.dtype}.")
    if weights is not None and weights.shape != labels.shape:
        raise ValueError(f"weights shape {weights.shape} must equal labels shape {labels.shape}.")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias shape {bias.shape} must be [V_pad] = ({weight.shape[0]},).")
    if not 0 < cfg.valid_vocab <= weight.shape[0]:
        raise ValueError(f"valid_vocab={cfg.valid_vocab} must be in [1, V_pad={weight.shape[0]}].")
    if cfg.mode not in MODES:
        raise ValueError(f"mode={cfg.mode!r}; use one of {MODES}.")
    if cfg.impl == "pallas_gpu":
        raise ValueError("impl='pallas_gpu' (the Pallas Triton kernels) was removed: use "
                         "impl='mosaic_gpu' (Hopper or newer) or impl='auto'.")
    if cfg.impl not in IMPLS:
        raise ValueError(f"impl={cfg.impl!r}; use one of {IMPLS}.")
    if cfg.impl in ("pallas", "mosaic_gpu") and cfg.mode != "recompute":
        raise ValueError(f"impl={cfg.impl!r} implements mode='recompute' only; got mode={cfg.mode!r}. "
                         f"Use impl='xla' (or 'auto') for mode='fused'.")
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={cfg.label_smoothing} must be in [0, 1).")
    if cfg.softcap is not None and cfg.softcap <= 0:
        raise ValueError(f"softcap={cfg.softcap} must be positive or None.")
    if cfg.chunk < 0:
        raise ValueError(f"vocab_chunk={cfg.chunk} must be >= 1 (or None for the default).")
    if cfg.token_block < 0 or cfg.vocab_block < 0:
        raise ValueError(f"token_block={cfg.token_block}, vocab_block={cfg.vocab_block} must be >= 1 "
                         f"(or None for the platform's default).")
    if cfg.mesh is None:
        return
    names = cfg.mesh.axis_names
    for ax in (cfg.vocab_axis,) + cfg.batch_axes:
        if ax not in names:
            raise ValueError(f"axis {ax!r} is not in the mesh axes {names}; fix vocab_axis/batch_axes.")
    nv = cfg.mesh.shape[cfg.vocab_axis]
    if weight.shape[0] % nv:
        raise ValueError(f"V_pad={weight.shape[0]} must be a multiple of the {cfg.vocab_axis!r} axis size "
                         f"{nv}; pad the vocabulary (tieflax rounds V up to shards x 128).")
    nb = batch_size(cfg)
    n = math.prod(labels.shape)
    if n % nb:
        raise ValueError(f"{n} tokens cannot be split over batch axes {cfg.batch_axes} of total size {nb}; "
                         f"use a batch that divides evenly or pass batch_axes=().")


def _device_kind(mesh: Mesh | None) -> str:
    """The TPU generation the Pallas blocks are sized for: the mesh's devices (a compile-only topology
    included), else this process's TPU; compiling for a TPU without a mesh from elsewhere gets the
    table's conservative default. (Block sizes only: which implementation runs is decided at lowering.)"""
    if mesh is not None:
        return mesh.devices.flat[0].device_kind
    return jax.devices()[0].device_kind if jax.default_backend() == "tpu" else ""


def _mosaic_refusal(impl: str, mesh: Mesh | None, d: int, h_dtype) -> str:
    """'' when the Mosaic GPU kernels take this case compiled for a CUDA GPU, else why not. ``'auto'``
    also wants bf16 hidden states (the kernels round fp32 ones to bf16; XLA keeps them) and a GPU of
    Hopper or newer: the mesh's devices (a compile-only target included), else this process's GPU; with
    neither known, Hopper, as Mosaic GPU itself assumes when it lowers without a device.

    ``'auto'`` on a mesh of CPUs or TPUs is answered before the Mosaic GPU API is imported: the program
    is compiled for that platform, whose branch never runs the kernels (the import cost 0.13 CPU-s with
    jax 0.10.2 and 0.26 with jax 0.12.1, in every process that traced a loss), and without a CUDA branch
    a TPU mesh's ``platform_dependent`` does not trace the kernels only for the lowering to drop them."""
    if impl == "auto" and mesh is not None and mesh.devices.flat[0].platform in ("cpu", "tpu"):
        return f"the mesh's devices are {mesh.devices.flat[0].platform.upper()}s"
    for ok, why in (mosaic_gpu.available(), mosaic_gpu.supported(d, h_dtype)):
        if not ok:
            return why
    if impl != "auto":
        return ""
    if jnp.dtype(h_dtype) != jnp.dtype(jnp.bfloat16):
        return f"hidden states are {jnp.dtype(h_dtype).name} ('auto' leaves them to XLA)"
    if mesh is not None:
        device = mesh.devices.flat[0]
    else:
        device = jax.devices()[0] if jax.default_backend() == "gpu" else None
    return mosaic_gpu.before_hopper(device)


def _embed_axis(mesh: Mesh | None, axis: str | None, batch_axes: tuple[str, ...], d: int) -> str | None:
    """``weight_embed_axis`` when the blockwise gather / reduce-scatter over it applies: a mesh axis of
    size > 1 that also splits the tokens (dW is summed over it) and divides d. Otherwise None: W enters
    the map replicated over d (``shard_map`` gathers it whole, as before this option existed)."""
    if mesh is None or axis is None or axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return None
    if axis not in batch_axes or d % mesh.shape[axis]:
        return None
    return axis


def cross_entropy(hidden: jax.Array, weight: jax.Array, labels: jax.Array, *, valid_vocab: int,
                  weights: jax.Array | None = None, z_loss: float = 0.0, label_smoothing: float = 0.0,
                  logit_scale: float = 1.0, softcap: float | None = None, bias: jax.Array | None = None,
                  token_block: int | None = None, vocab_block: int | None = None,
                  mode: str = "recompute", mesh: Mesh | None = None, vocab_axis: str = "tensor",
                  batch_axes: tuple[str, ...] = ("data", "fsdp"), impl: str = "auto",
                  weight_embed_axis: str | None = "fsdp", weight_rows_sharded: bool = True,
                  vocab_chunk: int | None = None) -> tuple[jax.Array, dict]:
    """Softmax cross-entropy of ``hidden @ weight.T`` against ``labels`` without materialising logits.

    Args:
      hidden: ``[..., d]`` bf16/fp32 final hidden states.
      weight: ``[V_pad, d]`` head matrix, vocab rows (the input embedding's orientation; tied or not).
      labels: ``[...]`` int. ``< 0``: ignored. ``>= valid_vocab``: invalid, counted, loss 0, no gradient.
      valid_vocab: real vocabulary size V; rows ``>= V`` are padding and get no mass and no gradient.
      weights: ``[...]`` per-token loss weights (default 1); its gradient is ``cotangent * loss``.
      z_loss: coefficient of ``lse^2`` added to each token's loss (PaLM).
      label_smoothing: eps; the target is ``(1 - eps) onehot + eps / V`` over the global valid V.
      logit_scale, softcap, bias: ``z = softcap * tanh((logit_scale * h.w + bias) / softcap)``.
      token_block, vocab_block: tile sizes. In ``'fused'`` mode the vocab tile is the local vocab.
        Defaults (``tiles.py``): XLA 8192 x 256 (recompute), 512 x V_local (fused), on a GPU 16384 x
        2048 and 2048 x V_local; Pallas TPU per generation (read from the mesh's devices; without a
        mesh 512 x 512, which fits every generation from v4 on); Mosaic GPU 128 x 128 (given blocks
        rounded down to multiples of 64). Given explicitly, they apply to every implementation.
      mode: ``'recompute'`` (memory-lean, 4 matmuls) or ``'fused'`` (3 matmuls); see the module doc.
      mesh: ``None`` for one device, else a mesh with ``vocab_axis`` and ``batch_axes`` (sizes may be 1).
        Tokens (the flattened leading dims) are split over ``batch_axes``, vocab rows over ``vocab_axis``.
      impl: ``'xla'`` (blockwise loops in XLA), ``'pallas'`` (Pallas TPU kernels) or ``'mosaic_gpu'``
        (Pallas Mosaic GPU kernels, Hopper or newer), each Pallas one interpreted when the program is
        compiled for another platform (for tests; Mosaic GPU's interpreter needs jax >= 0.12), or
        ``'auto'``: the TPU kernels when the program is compiled for a TPU, the Mosaic GPU kernels when
        compiled for a CUDA GPU of Hopper or newer with bf16 hidden states and d a multiple of 64, XLA
        elsewhere (decided at lowering, so compiling for a TPU topology or a GPU target from a CPU picks
        them).
        ``mode='fused'`` always runs on XLA.
      weight_embed_axis: the mesh axis that shards W's d in the parameter layout (tieflax's embedding
        is ``P('tensor', 'fsdp')``). When that axis has size > 1, W's rows are gathered over it one
        block at a time and dW is reduce-scattered back over it, so the gradient leaves in the
        parameter's own layout. Used when it is one of ``batch_axes`` and divides d; otherwise (and
        with ``None``) W enters replicated over d. Declare W's layout here: a W whose d is not sharded
        (Megatron's ``P('tensor', None)``, or replicated) passed with the default ``'fsdp'`` is resliced
        by the compiler on the way in, a copy of half the local shard.
      weight_rows_sharded: W's rows are sharded over ``vocab_axis`` in its layout (the default, the
        model's). ``False``: W's rows are whole on every device (a replicated head); each device reads
        its vocabulary shard's rows in place, block by block, and dW comes back whole, each finished
        block all-gathered over ``vocab_axis``; no slice of W nor of dW is ever copied.
      vocab_chunk: Pallas paths with W's d sharded, or dW reduced over batch shards: local vocab rows
        gathered / reduced per step (default: an fp32 ``[rows, d]`` of about 4 MiB, rows a multiple of
        128). Larger chunks cost memory; smaller ones re-read the fp32 dH accumulator more often.

    Returns:
      ``(loss_per_token [...] fp32, aux)``; ``aux`` (no gradient flows through it):
        ``lse`` [...]: log-sum-exp of the logits (every token, ignored ones included);
        ``z_loss`` [...]: the weighted ``z_loss * lse^2`` part of the loss (0 where inactive);
        ``correct`` [...] bool: the label's logit is the maximum (ties count as correct);
        ``max_logit`` [...]: the largest logit, for monitoring logit growth;
        ``invalid_label_count``: int32 scalar, labels ``>= valid_vocab``.
    """
    d = hidden.shape[-1]
    pallas = tiles.tpu_blocks(_device_kind(mesh), d, jnp.dtype(weight.dtype).itemsize)
    pallas = tiles.TpuBlocks(token_block or pallas.token, vocab_block or pallas.vocab, pallas.vmem_limit_mib)
    impl = "xla" if impl == "auto" and mode == "fused" else impl
    cfg = Cfg(int(valid_vocab), float(z_loss), float(label_smoothing), float(logit_scale),
              None if softcap is None else float(softcap), int(token_block or 0), int(vocab_block or 0),
              mode, mesh, vocab_axis, tuple(batch_axes), impl,
              _embed_axis(mesh, weight_embed_axis, tuple(batch_axes), d), pallas, int(vocab_chunk or 0),
              mesh is not None and not weight_rows_sharded, tiles.mosaic_tiles(token_block, vocab_block),
              mosaic_ok=_mosaic_refusal(impl, mesh, d, hidden.dtype))
    _check(cfg, hidden, weight, labels, weights, bias)
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).astype(jnp.int32)
    wts = jnp.ones(y.shape, jnp.float32) if weights is None else weights.reshape(-1)
    loss, aux = _build(cfg)(h, weight, bias, y, wts)
    aux = {k: (v if v.ndim == 0 else v.reshape(lead)) for k, v in aux.items()}
    return loss.reshape(lead), aux
