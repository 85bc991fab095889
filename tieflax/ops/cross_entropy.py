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
    any other cotangent is detected at run time and handled exactly by the recompute backward.
    Pick ``'fused'`` when ``bt * V_local * 4`` bytes plus a second weight-sized buffer fit, i.e. small
    vocabularies or many vocab shards; pick ``'recompute'`` for 128k-256k vocabularies per device.

Vocabulary parallelism (``mesh`` given)
    ``jax.shard_map`` with ``weight`` sharded ``P(vocab_axis, None)`` and tokens over ``batch_axes``.
    Cross-device traffic: one ``pmax`` and one ``psum`` of ``[N_local]`` statistics per forward (per
    token block in fused mode), one ``psum`` of ``dH`` [N_local, d] over the vocab axis, and the usual
    data-parallel reduction of ``dW`` [V_local, d] over the batch axes (recompute mode: one ``[bv, d]``
    block at a time, so no second weight-sized buffer). No logits-sized collective; the weight is never
    gathered over vocab. Per-device memory is flat in V.

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

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# Large finite negative used for masked logits: exp(MASK - m) == 0 for any real max m, and unlike -inf it
# never makes (m_old - m_new) a NaN when a whole tile or shard is masked.
_MASK = -1e30

DEFAULT_TOKEN_BLOCK = 8192
DEFAULT_VOCAB_BLOCK = 256
DEFAULT_FUSED_TOKEN_BLOCK = 512
MODES = ("recompute", "fused")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    valid_vocab: int
    z_loss: float
    label_smoothing: float
    logit_scale: float
    softcap: float | None
    token_block: int
    vocab_block: int
    mode: str
    mesh: Mesh | None
    vocab_axis: str
    batch_axes: tuple[str, ...]


# ----------------------------------------------------------------------------------------- tile math

def _acc_dtype(*dtypes) -> Any:
    """fp32 accumulation, or fp64 when the inputs are fp64 (used by gradient checks)."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def _tile(cfg: _Cfg, h_blk, w_blk, b_blk, ok, acc):
    """Logits of one tile. h_blk [bt, d], w_blk [bv, d], b_blk [bv] | None, ok [bv] bool -> [bt, bv] acc."""
    raw = lax.dot_general(h_blk, w_blk, (((1,), (1,)), ((), ())), preferred_element_type=acc)
    if cfg.logit_scale != 1.0:
        raw = raw * cfg.logit_scale
    if b_blk is not None:
        raw = raw + b_blk.astype(acc)
    if cfg.softcap is not None:
        raw = cfg.softcap * jnp.tanh(raw / cfg.softcap)
    return jnp.where(ok[None, :], raw, _MASK)


def _tile_stats(cfg: _Cfg, z, ok, cols, y):
    """Per-row statistics of a masked tile: (max, sum exp(z - max), label logit, sum of valid logits)."""
    m = z.max(axis=1)
    s = jnp.exp(z - m[:, None]).sum(axis=1)
    zy = jnp.where((cols[None, :] == y[:, None]) & ok[None, :], z, 0.0).sum(axis=1)
    sz = jnp.where(ok[None, :], z, 0.0).sum(axis=1) if cfg.label_smoothing else jnp.zeros_like(m)
    return m, s, zy, sz


def _tile_grad(cfg: _Cfg, z, ok, cols, y, lse, coef, p=None):
    """d(loss)/d(raw logits) of one tile, [bt, bv] acc; coef [bt] = cotangent * weight (0: inactive);
    p: the tile's softmax probabilities when already at hand."""
    eps, vv = cfg.label_smoothing, cfg.valid_vocab
    p = jnp.exp(z - lse[:, None]) if p is None else p
    c = 1.0 + 2.0 * cfg.z_loss * lse if cfg.z_loss else jnp.ones_like(lse)
    dz = c[:, None] * p - (1.0 - eps) * (cols[None, :] == y[:, None]).astype(z.dtype)
    if eps:
        dz = dz - eps / vv
    if cfg.softcap is not None:
        dz = dz * (1.0 - jnp.square(z / cfg.softcap))  # tanh' at the capped logit
    # Mask last: masked logits are -1e30, so tanh' there overflows and must not reach the product.
    return jnp.where(ok[None, :], dz * coef[:, None], 0.0)


def _blocks(n: int, block: int) -> tuple[int, int]:
    b = max(1, min(block, n))
    return b, -(-n // b)


def _block_start(i, b: int, n: int):
    # The last block is shifted back to end at n (no padding copy of the operand); rows it shares with
    # the previous block are masked by `_fresh`.
    return jnp.minimum(i * b, n - b)


def _fresh(start, i, b: int):
    return start + jnp.arange(b) >= i * b


# ------------------------------------------------------------------------------- per-shard kernels

def _local_stats(cfg: _Cfg, h, w, b, y, v_off):
    """Forward statistics over the local vocabulary. h [N, d], w [V, d], y [N] -> 4 x [N] acc."""
    acc = _acc_dtype(h.dtype, w.dtype)
    n, v = h.shape[0], w.shape[0]
    bt, nt = _blocks(n, cfg.token_block)
    bv, nv = _blocks(v, cfg.vocab_block)

    def token_step(i, out):
        t0 = _block_start(i, bt, n)
        h_blk = lax.dynamic_slice_in_dim(h, t0, bt)
        y_blk = lax.dynamic_slice_in_dim(y, t0, bt)

        def vocab_step(k, carry):
            m, s, zy, sz = carry
            v0 = _block_start(k, bv, v)
            cols = v_off + v0 + jnp.arange(bv)
            ok = _fresh(v0, k, bv) & (cols < cfg.valid_vocab)
            b_blk = None if b is None else lax.dynamic_slice_in_dim(b, v0, bv)
            z = _tile(cfg, h_blk, lax.dynamic_slice_in_dim(w, v0, bv), b_blk, ok, acc)
            tm, ts, tzy, tsz = _tile_stats(cfg, z, ok, cols, y_blk)
            m_new = jnp.maximum(m, tm)
            s = s * jnp.exp(m - m_new) + ts * jnp.exp(tm - m_new)
            return m_new, s, zy + tzy, sz + tsz

        init = (jnp.full((bt,), _MASK, acc),) + (jnp.zeros((bt,), acc),) * 3
        blk = lax.fori_loop(0, nv, vocab_step, init)
        return tuple(lax.dynamic_update_slice_in_dim(o, r, t0, 0) for o, r in zip(out, blk))

    out = tuple(jnp.zeros((n,), acc) for _ in range(4))
    return lax.fori_loop(0, nt, token_step, out)


def _local_grads(cfg: _Cfg, h, w, b, y, lse, coef, v_off, reduce_blk=lambda x: x):
    """Recompute backward over the local shard. Returns dH [N, d] acc (partial over vocab shards),
    dW [V, d] w.dtype and db [V] acc; ``reduce_blk`` sums a finished ([bv, d], [bv]) block over the
    batch shards, so the loop-carried dW is already the final buffer (no second weight-sized copy)."""
    acc = _acc_dtype(h.dtype, w.dtype)
    cdt = jnp.result_type(h.dtype, w.dtype)
    n, v = h.shape[0], w.shape[0]
    bt, nt = _blocks(n, cfg.token_block)
    bv, nv = _blocks(v, cfg.vocab_block)

    def vocab_step(k, carry):
        dh, dw, db = carry
        v0 = _block_start(k, bv, v)
        cols = v_off + v0 + jnp.arange(bv)
        ok = _fresh(v0, k, bv) & (cols < cfg.valid_vocab)
        w_blk = lax.dynamic_slice_in_dim(w, v0, bv)
        b_blk = None if b is None else lax.dynamic_slice_in_dim(b, v0, bv)

        def token_step(i, inner):
            dh, dw_blk, db_blk = inner
            t0 = _block_start(i, bt, n)
            h_blk = lax.dynamic_slice_in_dim(h, t0, bt)
            sl = functools.partial(lax.dynamic_slice_in_dim, start_index=t0, slice_size=bt)
            c_blk = jnp.where(_fresh(t0, i, bt), sl(coef), 0.0)
            z = _tile(cfg, h_blk, w_blk, b_blk, ok, acc)
            dz = _tile_grad(cfg, z, ok, cols, sl(y), sl(lse), c_blk)
            db_blk = db_blk + dz.sum(axis=0)
            dz = (dz * cfg.logit_scale).astype(cdt)
            dh_blk = jnp.dot(dz, w_blk, preferred_element_type=acc)
            dh = lax.dynamic_update_slice_in_dim(dh, sl(dh) + dh_blk, t0, 0)
            dw_blk = dw_blk + lax.dot_general(dz, h_blk, (((0,), (0,)), ((), ())),
                                              preferred_element_type=acc)
            return dh, dw_blk, db_blk

        init = (dh, jnp.zeros((bv, w.shape[1]), acc), jnp.zeros((bv,), acc))
        dh, dw_blk, db_blk = lax.fori_loop(0, nt, token_step, init)
        dw_blk, db_blk = reduce_blk((dw_blk, db_blk))
        # Rows shared with the previous block got zero here (masked), so adding is exact.
        dw = lax.dynamic_update_slice_in_dim(
            dw, lax.dynamic_slice_in_dim(dw, v0, bv) + dw_blk.astype(dw.dtype), v0, 0)
        db = lax.dynamic_update_slice_in_dim(db, lax.dynamic_slice_in_dim(db, v0, bv) + db_blk, v0, 0)
        return dh, dw, db

    init = (jnp.zeros(h.shape, acc), jnp.zeros(w.shape, w.dtype), jnp.zeros((v,), acc))
    return lax.fori_loop(0, nv, vocab_step, init)


def _local_fused(cfg: _Cfg, h, w, b, y, aw, v_off, combine, psum_vocab):
    """Gradient-in-forward over the local shard: one [bt, V_local] tile per token block.

    Returns global statistics (4 x [N]), dH_unit [N, d] acc (already summed over vocab shards),
    dW_unit [V, d] acc and db_unit [V] acc (partial over batch shards), all for a unit cotangent.
    """
    acc = _acc_dtype(h.dtype, w.dtype)
    cdt = jnp.result_type(h.dtype, w.dtype)
    n, v = h.shape[0], w.shape[0]
    bt, nt = _blocks(n, cfg.token_block)
    cols = v_off + jnp.arange(v)
    ok = cols < cfg.valid_vocab

    def token_step(i, carry):
        stats, dh, dw, db = carry
        t0 = _block_start(i, bt, n)
        sl = functools.partial(lax.dynamic_slice_in_dim, start_index=t0, slice_size=bt)
        h_blk, y_blk = sl(h), sl(y)
        z = _tile(cfg, h_blk, w, b, ok, acc)
        # One exp pass over the tile serves both the statistics and the probabilities.
        m_loc = z.max(axis=1)
        e = jnp.exp(z - m_loc[:, None])
        zy = jnp.where((cols[None, :] == y_blk[:, None]) & ok[None, :], z, 0.0).sum(axis=1)
        sz = jnp.where(ok[None, :], z, 0.0).sum(axis=1) if cfg.label_smoothing else jnp.zeros_like(zy)
        blk = combine(m_loc, e.sum(axis=1), zy, sz)
        lse = blk[0] + jnp.log(blk[1])
        p = e * jnp.exp(m_loc - lse)[:, None]
        fresh = _fresh(t0, i, bt)
        dz = _tile_grad(cfg, z, ok, cols, y_blk, lse, jnp.where(fresh, sl(aw), 0.0), p)
        db = db + dz.sum(axis=0)
        dz = (dz * cfg.logit_scale).astype(cdt)
        dh_blk = psum_vocab(jnp.dot(dz, w, preferred_element_type=acc))
        stats = tuple(lax.dynamic_update_slice_in_dim(o, r, t0, 0) for o, r in zip(stats, blk))
        # Rows shared with the previous block were zeroed above (so dW counts them once): keep theirs.
        dh_blk = jnp.where(fresh[:, None], dh_blk, sl(dh))
        dh = lax.dynamic_update_slice_in_dim(dh, dh_blk, t0, 0)
        dw = dw + lax.dot_general(dz, h_blk, (((0,), (0,)), ((), ())), preferred_element_type=acc)
        return stats, dh, dw, db

    init = (tuple(jnp.zeros((n,), acc) for _ in range(4)), jnp.zeros(h.shape, acc),
            jnp.zeros(w.shape, acc), jnp.zeros((v,), acc))
    return lax.fori_loop(0, nt, token_step, init)


# ------------------------------------------------------------------------------ sharding plumbing

def _combine_local(m, s, zy, sz):
    return m, s, zy, sz


def _combine_vocab(axis, m, s, zy, sz):
    """Merge per-shard statistics into global ones: one pmax and one psum of [N, 3]."""
    gm = lax.pmax(m, axis)
    tot = lax.psum(jnp.stack([s * jnp.exp(m - gm), zy, sz], axis=-1), axis)
    return gm, tot[..., 0], tot[..., 1], tot[..., 2]


def _specs(cfg: _Cfg):
    bax = cfg.batch_axes if cfg.batch_axes else None
    return dict(h=P(bax, None), w=P(cfg.vocab_axis, None), b=P(cfg.vocab_axis), n=P(bax))


def _shmap(cfg: _Cfg, fn, in_specs, out_specs):
    # check_vma=False: every collective is written out explicitly below, no autodiff runs through these
    # maps (the custom_vjp sits outside them), so replication is guaranteed by construction.
    return jax.shard_map(fn, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _v_offset(cfg: _Cfg, v_local: int):
    return lax.axis_index(cfg.vocab_axis) * v_local


def _stats(cfg: _Cfg, h, w, b, y):
    """Global [N] statistics (max, sumexp, label logit, sum of logits)."""
    if cfg.mesh is None:
        return _local_stats(cfg, h, w, b, y, 0)
    sp = _specs(cfg)

    def body(h, w, b, y):
        loc = _local_stats(cfg, h, w, b, y, _v_offset(cfg, w.shape[0]))
        return _combine_vocab(cfg.vocab_axis, *loc)

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"]),
                  (sp["n"],) * 4)(h, w, b, y)


def _grads(cfg: _Cfg, h, w, b, y, lse, coef):
    """Recompute backward: dH [N, d] acc, dW [V, d] w.dtype, db [V] acc (all fully reduced)."""
    if cfg.mesh is None:
        return _local_grads(cfg, h, w, b, y, lse, coef, 0)
    sp = _specs(cfg)

    def body(h, w, b, y, lse, coef):
        # The data-parallel weight-gradient reduction, one [bv, d] block at a time.
        reduce_blk = functools.partial(lax.psum, axis_name=cfg.batch_axes) if cfg.batch_axes else None
        dh, dw, db = _local_grads(cfg, h, w, b, y, lse, coef, _v_offset(cfg, w.shape[0]),
                                  *([reduce_blk] if reduce_blk else []))
        return lax.psum(dh, cfg.vocab_axis), dw, db

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"],
                              sp["n"]), (sp["h"], sp["w"], sp["b"]))(h, w, b, y, lse, coef)


def _fused(cfg: _Cfg, h, w, b, y, aw):
    if cfg.mesh is None:
        stats, dh, dw, db = _local_fused(cfg, h, w, b, y, aw, 0, _combine_local, lambda x: x)
        return stats, dh, dw.astype(w.dtype), db
    sp = _specs(cfg)

    def body(h, w, b, y, aw):
        stats, dh, dw, db = _local_fused(cfg, h, w, b, y, aw, _v_offset(cfg, w.shape[0]),
                                         functools.partial(_combine_vocab, cfg.vocab_axis),
                                         functools.partial(lax.psum, axis_name=cfg.vocab_axis))
        if cfg.batch_axes:  # the data-parallel weight-gradient reduction, [V_local, d]
            dw, db = lax.psum((dw, db), cfg.batch_axes)
        return stats, dh, dw.astype(w.dtype), db

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"]),
                  ((sp["n"],) * 4, sp["h"], sp["w"], sp["b"]))(h, w, b, y, aw)


# ---------------------------------------------------------------------------------- custom VJP

def _finish(cfg: _Cfg, stats, y, weights):
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


@functools.lru_cache(maxsize=None)
def _build(cfg: _Cfg):
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
        stats, dh, dw, db = _fused(cfg, h, w, b, y, aw0.astype(_acc_dtype(h.dtype, w.dtype)))
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
            dw, db = lax.cond(
                uniform,
                lambda: ((scale * dw_u).astype(w.dtype), scale * db_u),
                lambda: _grads(cfg, h, w, b, y, lse, g * aw)[1:])
        db = None if b is None else db.astype(b.dtype)
        return dh.astype(h.dtype), dw.astype(w.dtype), db, None, d_weights

    ce.defvjp(fwd, bwd)
    return ce


def _check(cfg: _Cfg, hidden, weight, labels, weights, bias):
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
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={cfg.label_smoothing} must be in [0, 1).")
    if cfg.softcap is not None and cfg.softcap <= 0:
        raise ValueError(f"softcap={cfg.softcap} must be positive or None.")
    if cfg.token_block < 1 or cfg.vocab_block < 1:
        raise ValueError(f"token_block={cfg.token_block}, vocab_block={cfg.vocab_block} must be >= 1.")
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
    nb = math.prod(cfg.mesh.shape[a] for a in cfg.batch_axes)
    n = math.prod(labels.shape)
    if n % nb:
        raise ValueError(f"{n} tokens cannot be split over batch axes {cfg.batch_axes} of total size {nb}; "
                         f"use a batch that divides evenly or pass batch_axes=().")


def cross_entropy(hidden: jax.Array, weight: jax.Array, labels: jax.Array, *, valid_vocab: int,
                  weights: jax.Array | None = None, z_loss: float = 0.0, label_smoothing: float = 0.0,
                  logit_scale: float = 1.0, softcap: float | None = None, bias: jax.Array | None = None,
                  token_block: int | None = None, vocab_block: int = DEFAULT_VOCAB_BLOCK,
                  mode: str = "recompute", mesh: Mesh | None = None, vocab_axis: str = "tensor",
                  batch_axes: tuple[str, ...] = ("data", "fsdp")) -> tuple[jax.Array, dict]:
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
        Defaults: 8192 x 256 (recompute), 512 x V_local (fused); see benchmarks/README.md.
      mode: ``'recompute'`` (memory-lean, 4 matmuls) or ``'fused'`` (3 matmuls); see the module doc.
      mesh: ``None`` for one device, else a mesh with ``vocab_axis`` and ``batch_axes`` (sizes may be 1).
        Tokens (the flattened leading dims) are split over ``batch_axes``, vocab rows over ``vocab_axis``.

    Returns:
      ``(loss_per_token [...] fp32, aux)``; ``aux`` (no gradient flows through it):
        ``lse`` [...]: log-sum-exp of the logits (every token, ignored ones included);
        ``z_loss`` [...]: the weighted ``z_loss * lse^2`` part of the loss (0 where inactive);
        ``correct`` [...] bool: the label's logit is the maximum (ties count as correct);
        ``max_logit`` [...]: the largest logit, for monitoring logit growth;
        ``invalid_label_count``: int32 scalar, labels ``>= valid_vocab``.
    """
    if token_block is None:
        token_block = DEFAULT_FUSED_TOKEN_BLOCK if mode == "fused" else DEFAULT_TOKEN_BLOCK
    cfg = _Cfg(int(valid_vocab), float(z_loss), float(label_smoothing), float(logit_scale),
               None if softcap is None else float(softcap), int(token_block), int(vocab_block), mode,
               mesh, vocab_axis, tuple(batch_axes))
    _check(cfg, hidden, weight, labels, weights, bias)
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).astype(jnp.int32)
    wts = jnp.ones(y.shape, jnp.float32) if weights is None else weights.reshape(-1)
    loss, aux = _build(cfg)(h, weight, bias, y, wts)
    aux = {k: (v if v.ndim == 0 else v.reshape(lead)) for k, v in aux.items()}
    return loss.reshape(lead), aux
