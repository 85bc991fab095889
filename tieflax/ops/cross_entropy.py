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

Implementations (``impl``)
    ``'xla'``: the loops above. On TPU with bf16 hidden states and an fp32 W, each W block is rounded
    to bf16 inside the loop (XLA's default precision would round it anyway, but with one hoisted
    convert of the whole matrix). ``'pallas'``: the Mosaic TPU kernels of ``cross_entropy_pallas``
    (recompute mode, 5 matmuls), inside the same ``shard_map`` and collectives. ``'auto'`` (default):
    Pallas when the program is lowered for a TPU, XLA elsewhere (``lax.platform_dependent``).

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

from tieflax.ops import cross_entropy_pallas as pallas_ce

# Large finite negative used for masked logits: exp(MASK - m) == 0 for any real max m, and unlike -inf it
# never makes (m_old - m_new) a NaN when a whole tile or shard is masked.
_MASK = -1e30

DEFAULT_TOKEN_BLOCK = 8192
DEFAULT_VOCAB_BLOCK = 256
DEFAULT_FUSED_TOKEN_BLOCK = 512
MODES = ("recompute", "fused")
IMPLS = ("auto", "xla", "pallas")
# Pallas path on a mesh: rows of W gathered over the axis that shards d, and of dW reduced over the
# batch axes, one chunk at a time (an XLA loop around the kernels); one fp32 [rows, d] chunk is about
# this many bytes. Larger chunks re-read the fp32 dH
# accumulator fewer times (it is read and written once per chunk) at the cost of memory.
PALLAS_CHUNK_BYTES = 4 * 2**20


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
    impl: str = "xla"
    embed_axis: str | None = None  # mesh axis sharding W's d (dW is reduce-scattered over it)
    pallas: pallas_ce.Blocks = pallas_ce.Blocks(512, 512, 28)
    chunk: int = 0  # Pallas path, W's d sharded: vocab rows gathered per step
    rows_whole: bool = False  # W's rows not sharded in its layout: each device reads its shard in place


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

def _slice_rows(w, v0, bv):
    return lax.dynamic_slice_in_dim(w, v0, bv)


def _bf16_round(x):
    """fp32 -> bf16 round-to-nearest-even in integer arithmetic (NaN and inf kept)."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    u = u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))
    return lax.bitcast_convert_type((u >> 16).astype(jnp.uint16), jnp.bfloat16)


def _matmul_block(w_blk, h_dtype):
    """The W block as the tile matmuls read it. fp32 W with bf16 hidden states on TPU: XLA's default
    precision rounds W to bf16 anyway, and does it with one ``convert`` of the whole matrix hoisted out
    of the loop (a V x d x 2-byte copy, 1.1 GiB at 256000 x 2304). Rounding each block here, by
    integer arithmetic that XLA does not treat as a convert, gives the same values with no copy. Other
    platforms keep the fp32 block (their default fp32 matmul does not round to bf16)."""
    if h_dtype != jnp.bfloat16 or w_blk.dtype != jnp.float32:
        return w_blk
    return lax.platform_dependent(w_blk, tpu=lambda x: _bf16_round(x).astype(jnp.float32),
                                  default=lambda x: x)


def _local_stats(cfg: _Cfg, h, w, b, y, v_off, take_w=_slice_rows, row0=0, v_local=None):
    """Forward statistics over the local vocabulary. h [N, d], w [V, d_local], y [N] -> 4 x [N] acc;
    ``take_w(w, v0, bv)`` returns rows ``v0:v0+bv`` with the full d (gathered when d is sharded). The
    local vocabulary is rows ``row0 : row0 + v_local`` of ``w`` (default: all of them)."""
    acc = _acc_dtype(h.dtype, w.dtype)
    n, v = h.shape[0], v_local or w.shape[0]
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
            b_blk = None if b is None else lax.dynamic_slice_in_dim(b, row0 + v0, bv)
            z = _tile(cfg, h_blk, _matmul_block(take_w(w, row0 + v0, bv), h.dtype), b_blk, ok, acc)
            tm, ts, tzy, tsz = _tile_stats(cfg, z, ok, cols, y_blk)
            m_new = jnp.maximum(m, tm)
            s = s * jnp.exp(m - m_new) + ts * jnp.exp(tm - m_new)
            return m_new, s, zy + tzy, sz + tsz

        init = (jnp.full((bt,), _MASK, acc),) + (jnp.zeros((bt,), acc),) * 3
        blk = lax.fori_loop(0, nv, vocab_step, init)
        return tuple(lax.dynamic_update_slice_in_dim(o, r, t0, 0) for o, r in zip(out, blk))

    out = tuple(jnp.zeros((n,), acc) for _ in range(4))
    return lax.fori_loop(0, nt, token_step, out)


def _local_grads(cfg: _Cfg, h, w, b, y, lse, coef, v_off, reduce_blk=lambda x: x, take_w=_slice_rows,
                 row0=0, v_local=None, put=None):
    """Recompute backward over the local shard. Returns dH [N, d] acc (partial over vocab shards),
    dW [V, d_local] w.dtype and db [V] acc; ``reduce_blk`` sums a finished ([bv, d], [bv]) block over
    the batch shards (into [bv, d_local] when d is sharded), so the loop-carried dW is already the
    final buffer (no second weight-sized copy). ``row0``, ``v_local``: as in ``_local_stats``;
    ``put(dw, db, v0, dw_blk, db_blk, fresh)`` writes a finished block into dW and db (``_put_block``)."""
    acc = _acc_dtype(h.dtype, w.dtype)
    cdt = jnp.result_type(h.dtype, w.dtype)
    n, v = h.shape[0], v_local or w.shape[0]
    put = put or _add_block
    bt, nt = _blocks(n, cfg.token_block)
    bv, nv = _blocks(v, cfg.vocab_block)

    def vocab_step(k, carry):
        dh, dw, db = carry
        v0 = _block_start(k, bv, v)
        cols = v_off + v0 + jnp.arange(bv)
        ok = _fresh(v0, k, bv) & (cols < cfg.valid_vocab)
        w_blk = _matmul_block(take_w(w, row0 + v0, bv), h.dtype)
        b_blk = None if b is None else lax.dynamic_slice_in_dim(b, row0 + v0, bv)

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

        init = (dh, jnp.zeros((bv, h.shape[1]), acc), jnp.zeros((bv,), acc))
        dh, dw_blk, db_blk = lax.fori_loop(0, nt, token_step, init)
        dw_blk, db_blk = reduce_blk((dw_blk, db_blk))
        dw, db = put(dw, db, v0, dw_blk, db_blk, _fresh(v0, k, bv))
        return dh, dw, db

    init = (jnp.zeros(h.shape, acc), jnp.zeros(w.shape, w.dtype), jnp.zeros((w.shape[0],), acc))
    return lax.fori_loop(0, nv, vocab_step, init)


def _add_block(dw, db, v0, dw_blk, db_blk, fresh=None):
    """dW[v0 : v0 + rows] += dw_blk (and db). Rows shared with the previous block got zero gradient
    (masked), so adding is exact.

    With ``fresh`` ([rows] bool: the rows no earlier block wrote) the block is written instead: fresh
    rows take it, the others keep theirs. Each row is then written once rather than accumulated, so XLA
    does not move the block's data-parallel reduction out of the loop (as one all-reduce of the whole dW
    after it; at large V that whole-matrix reduction made the TPU compiler evict the fp32 dH accumulator
    from on-chip memory, an [N, d] fp32 temporary at 256k but not at 64k)."""
    rows = dw_blk.shape[0]
    old_w, old_b = _slice_rows(dw, v0, rows), _slice_rows(db, v0, rows)
    if fresh is None:
        new_w, new_b = old_w + dw_blk.astype(dw.dtype), old_b + db_blk.astype(db.dtype)
    else:
        new_w = jnp.where(fresh[:, None], dw_blk.astype(dw.dtype), old_w)
        new_b = jnp.where(fresh, db_blk.astype(db.dtype), old_b)
    return lax.dynamic_update_slice_in_dim(dw, new_w, v0, 0), lax.dynamic_update_slice_in_dim(db, new_b, v0, 0)


def _put_block(cfg: _Cfg, v_local: int):
    """How a finished gradient block enters dW: added in place, or, when W's rows are whole on every
    device (``rows_whole``), all-gathered over the vocab axis (one [shards, rows, d] block, never the
    shard) and added at each shard's rows, so dW leaves whole as W came."""
    if not cfg.rows_whole:
        return _add_block

    def put(dw, db, v0, dw_blk, db_blk, fresh=None):
        gw = lax.all_gather(dw_blk, cfg.vocab_axis)   # [shards, rows, d_local]
        gb = lax.all_gather(db_blk, cfg.vocab_axis)
        for t in range(gw.shape[0]):
            dw, db = _add_block(dw, db, t * v_local + v0, gw[t], gb[t], fresh)
        return dw, db

    return put


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
    rows = None if cfg.rows_whole else cfg.vocab_axis
    return dict(h=P(bax, None), w=P(rows, cfg.embed_axis), b=P(rows), n=P(bax))


def _local_view(cfg: _Cfg, w) -> tuple[Any, int, int]:
    """(v_off, row0, v_local) inside the map: the global index of this shard's first vocabulary row,
    where that row sits in the ``w`` the device holds (0 unless W's rows are whole), and how many."""
    if not cfg.rows_whole:
        return _v_offset(cfg, w.shape[0]), 0, w.shape[0]
    v_local = w.shape[0] // cfg.mesh.shape[cfg.vocab_axis]
    v_off = _v_offset(cfg, v_local)
    return v_off, v_off, v_local


def _shmap(cfg: _Cfg, fn, in_specs, out_specs):
    # check_vma=False: every collective is written out explicitly below, no autodiff runs through these
    # maps (the custom_vjp sits outside them), so replication is guaranteed by construction.
    return jax.shard_map(fn, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _v_offset(cfg: _Cfg, v_local: int):
    return lax.axis_index(cfg.vocab_axis) * v_local


def _take_w(cfg: _Cfg):
    """(w, v0, bv) -> rows v0:v0+bv of the local W with the full d: gathered over the axis that shards
    d (one [bv, d] block at a time, never the whole matrix)."""
    if cfg.embed_axis is None:
        return _slice_rows

    def take(w, v0, bv):
        # Gathered along a new leading axis, then put in place: gathering along d directly makes XLA
        # give the whole local W a d-major layout, i.e. a weight-sized copy before the loop.
        g = lax.all_gather(_slice_rows(w, v0, bv), cfg.embed_axis, axis=0)  # [f, bv, d_local]
        return jnp.moveaxis(g, 0, 1).reshape(bv, -1)

    return take


def _reduce_dw(cfg: _Cfg):
    """Data-parallel reduction of a finished ([bv, d], [bv]) gradient block: a reduce-scatter over
    the axis that shards d (so dW leaves in the parameter's own layout) and a sum over the others."""
    rest = tuple(a for a in cfg.batch_axes if a != cfg.embed_axis)

    def reduce(blk):
        dw, db = blk
        if cfg.embed_axis is not None:  # scattered over a leading axis, for the reason in _take_w
            f = cfg.mesh.shape[cfg.embed_axis]
            dw = jnp.moveaxis(dw.reshape(dw.shape[0], f, -1), 1, 0)
            dw = lax.psum_scatter(dw, cfg.embed_axis, scatter_dimension=0)
        if rest:
            dw = lax.psum(dw, rest)
        return dw, lax.psum(db, cfg.batch_axes)

    return reduce


def _batch_size(cfg: _Cfg) -> int:
    return math.prod(cfg.mesh.shape[a] for a in cfg.batch_axes)


def _on_platform(cfg: _Cfg, xla_fn, pallas_fn, *args):
    """Runs ``pallas_fn(cfg, interpret, *args)`` or ``xla_fn(cfg, *args)`` by ``cfg.impl``. The choice
    for 'auto' (and compiled vs interpreted Pallas) is made when lowering, for the platform the program
    is compiled for (a TPU topology compiled from a CPU process picks the kernel)."""
    if cfg.impl == "xla":
        return xla_fn(cfg, *args)
    other = (functools.partial(pallas_fn, cfg, True) if cfg.impl == "pallas"
             else functools.partial(xla_fn, cfg))
    return lax.platform_dependent(*args, tpu=functools.partial(pallas_fn, cfg, False), default=other)


def _stats(cfg: _Cfg, h, w, b, y):
    """Global [N] statistics (max, sumexp, label logit, sum of logits), acc dtype."""
    return _on_platform(cfg, _stats_xla, _stats_pallas, h, w, b, y)


def _grads(cfg: _Cfg, h, w, b, y, lse, coef):
    """Recompute backward: dH [N, d] h.dtype, dW [V, d] w.dtype, db [V] acc (all fully reduced)."""
    return _on_platform(cfg, _grads_xla, _grads_pallas, h, w, b, y, lse, coef)


def _stats_xla(cfg: _Cfg, h, w, b, y):
    if cfg.mesh is None:
        return _local_stats(cfg, h, w, b, y, 0)
    sp = _specs(cfg)

    def body(h, w, b, y):
        v_off, row0, v_local = _local_view(cfg, w)
        loc = _local_stats(cfg, h, w, b, y, v_off, _take_w(cfg), row0, v_local)
        return _combine_vocab(cfg.vocab_axis, *loc)

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"]),
                  (sp["n"],) * 4)(h, w, b, y)


def _grads_xla(cfg: _Cfg, h, w, b, y, lse, coef):
    if cfg.mesh is None:
        dh, dw, db = _local_grads(cfg, h, w, b, y, lse, coef, 0)
        return dh.astype(h.dtype), dw, db
    sp = _specs(cfg)

    def body(h, w, b, y, lse, coef):
        # The data-parallel weight-gradient reduction, one [bv, d] block at a time.
        v_off, row0, v_local = _local_view(cfg, w)
        dh, dw, db = _local_grads(cfg, h, w, b, y, lse, coef, v_off,
                                  _reduce_dw(cfg) if cfg.batch_axes else (lambda x: x), _take_w(cfg),
                                  row0, v_local, _put_block(cfg, v_local))
        return lax.psum(dh, cfg.vocab_axis).astype(h.dtype), dw, db

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"],
                              sp["n"]), (sp["h"], sp["w"], sp["b"]))(h, w, b, y, lse, coef)


def _fused(cfg: _Cfg, h, w, b, y, aw):
    if cfg.mesh is None:
        stats, dh, dw, db = _local_fused(cfg, h, w, b, y, aw, 0, _combine_local, lambda x: x)
        return stats, dh, dw.astype(w.dtype), db
    sp = _specs(cfg)

    def body(h, w, b, y, aw):
        if cfg.embed_axis is not None:  # fused mode holds weight-sized buffers anyway
            w = lax.all_gather(w, cfg.embed_axis, axis=1, tiled=True)
        v_off, row0, v_local = _local_view(cfg, w)
        if cfg.rows_whole:   # (so does this slice of the local shard)
            w = lax.dynamic_slice_in_dim(w, row0, v_local)
            b = None if b is None else lax.dynamic_slice_in_dim(b, row0, v_local)
        stats, dh, dw, db = _local_fused(cfg, h, w, b, y, aw, v_off,
                                         functools.partial(_combine_vocab, cfg.vocab_axis),
                                         functools.partial(lax.psum, axis_name=cfg.vocab_axis))
        if cfg.batch_axes:  # the data-parallel weight-gradient reduction, [V_local, d]
            dw, db = _reduce_dw(cfg)((dw, db))
        if cfg.rows_whole:
            dw = lax.all_gather(dw, cfg.vocab_axis, axis=0, tiled=True)
            db = lax.all_gather(db, cfg.vocab_axis, axis=0, tiled=True)
        return stats, dh, dw.astype(w.dtype), db

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"]),
                  ((sp["n"],) * 4, sp["h"], sp["w"], sp["b"]))(h, w, b, y, aw)


# ------------------------------------------------------------------------------------ Pallas path

def _pallas_plan(cfg: _Cfg, interpret: bool) -> pallas_ce.Plan:
    sem = pallas_ce.Semantics(cfg.valid_vocab, cfg.z_loss, cfg.label_smoothing, cfg.logit_scale,
                              cfg.softcap)
    return pallas_ce.Plan(sem, cfg.pallas.token, cfg.pallas.vocab, cfg.pallas.vmem_limit_mib, interpret)


def _chunks(cfg: _Cfg, v: int, d: int) -> tuple[int, int]:
    """(rows, count) of the vocab chunks of the local W that the Pallas path loops over in XLA."""
    return _blocks(v, cfg.chunk or max(128, PALLAS_CHUNK_BYTES // (d * 4) // 128 * 128))


def _chunk_loop(cfg: _Cfg, w, b, d: int, body, init, row0=0, v_local=None):
    """fori_loop over vocab chunks: body(c, carry, v0, lo, w_chunk [rows, d], b_chunk) -> carry.
    The last chunk is shifted back to end at V_local; its first ``lo`` rows belong to the previous one.
    The local vocabulary is rows ``row0 : row0 + v_local`` of ``w``; ``v0`` counts from ``row0``."""
    v = v_local or w.shape[0]
    rows, nc = _chunks(cfg, v, d)
    take = _take_w(cfg)

    def step(c, carry):
        v0 = _block_start(c, rows, v)
        bc = None if b is None else _slice_rows(b, row0 + v0, rows)
        return body(carry, v0, c * rows - v0, take(w, row0 + v0, rows), bc)

    return lax.fori_loop(0, nc, step, init)


def _pallas_local_stats(cfg: _Cfg, plan, h, w, b, y, v_base, row0=0, v_local=None):
    if cfg.embed_axis is None and not cfg.rows_whole:
        return pallas_ce.local_stats(plan, h, w, b, y, v_base)

    def body(carry, v0, lo, wc, bc):
        m, s, zy, sz = carry
        cm, cs, czy, csz = pallas_ce.local_stats(plan, h, wc, bc, y, v_base + v0, lo)
        m_new = jnp.maximum(m, cm)
        return m_new, s * jnp.exp(m - m_new) + cs * jnp.exp(cm - m_new), zy + czy, sz + csz

    n = h.shape[0]
    init = (jnp.full((n,), _MASK, jnp.float32),) + (jnp.zeros((n,), jnp.float32),) * 3
    return _chunk_loop(cfg, w, b, h.shape[1], body, init, row0, v_local)


def _stats_pallas(cfg: _Cfg, interpret: bool, h, w, b, y):
    acc = _acc_dtype(h.dtype, w.dtype)
    plan = _pallas_plan(cfg, interpret)
    if cfg.mesh is None:
        return tuple(x.astype(acc) for x in pallas_ce.local_stats(plan, h, w, b, y, 0))
    sp = _specs(cfg)

    def body(h, w, b, y):
        v_off, row0, v_local = _local_view(cfg, w)
        loc = _pallas_local_stats(cfg, plan, h, w, b, y, v_off, row0, v_local)
        return tuple(x.astype(acc) for x in _combine_vocab(cfg.vocab_axis, *loc))

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"]),
                  (sp["n"],) * 4)(h, w, b, y)


def _pallas_local_grads(cfg: _Cfg, plan, h, w, b, y, lse, coef, v_base, dh_dtype, reduce, row0=0,
                        v_local=None):
    """dH [N, d] dh_dtype (partial over vocab shards), dW [V, d_local] w.dtype, db [V] fp32.
    ``reduce`` (None: nothing to reduce) sums a dW/db chunk over the batch shards."""
    lse, coef = lse.astype(jnp.float32), coef.astype(jnp.float32)
    dh0 = jnp.zeros(h.shape, dh_dtype)
    chunked_dh = cfg.embed_axis is not None or cfg.rows_whole   # W's rows arrive chunk by chunk
    put = _put_block(cfg, v_local or w.shape[0])
    if not chunked_dh:
        # W is whole here: one dH kernel over all rows; dW in one piece when nothing is reduced.
        dh = pallas_ce.local_dh(plan, h, w, b, y, lse, coef, v_base, dh0)
        if reduce is None:
            return (dh,) + pallas_ce.local_dw(plan, h, w, b, y, lse, coef, v_base, w.dtype)

    def body(carry, v0, lo, wc, bc):
        dh, dw, db = carry
        if chunked_dh:  # dH accumulates over the chunks
            dh = pallas_ce.local_dh(plan, h, wc, bc, y, lse, coef, v_base + v0, dh, lo)
        dwc, dbc = pallas_ce.local_dw(plan, h, wc, bc, y, lse, coef, v_base + v0, jnp.float32, lo)
        if reduce is not None:
            dwc, dbc = reduce((dwc, dbc))
        # Written, not added (see _add_block): added, XLA:TPU (libtpu 0.0.52) moves the chunks' reduction
        # out of the loop as one all-reduce of the whole local dW, a weight-sized fp32 temporary.
        dw, db = put(dw, db, v0, dwc, dbc, jnp.arange(dwc.shape[0]) >= lo)
        return dh, dw, db

    init = (dh0 if chunked_dh else dh, jnp.zeros(w.shape, w.dtype), jnp.zeros((w.shape[0],), jnp.float32))
    return _chunk_loop(cfg, w, b, h.shape[1], body, init, row0, v_local)


def _grads_pallas(cfg: _Cfg, interpret: bool, h, w, b, y, lse, coef):
    acc = _acc_dtype(h.dtype, w.dtype)
    plan = _pallas_plan(cfg, interpret)
    if cfg.mesh is None:
        dh, dw, db = _pallas_local_grads(cfg, plan, h, w, b, y, lse, coef, 0, h.dtype, None)
        return dh, dw, db.astype(acc)
    sp = _specs(cfg)
    # The vocab shards' dH partials are summed in fp32; alone, the kernel writes h.dtype directly.
    summed = cfg.mesh.shape[cfg.vocab_axis] > 1 or cfg.embed_axis is not None or cfg.rows_whole
    reduce = _reduce_dw(cfg) if cfg.batch_axes and _batch_size(cfg) > 1 else None

    def body(h, w, b, y, lse, coef):
        v_off, row0, v_local = _local_view(cfg, w)
        dh, dw, db = _pallas_local_grads(cfg, plan, h, w, b, y, lse, coef, v_off,
                                         jnp.float32 if summed else h.dtype, reduce, row0, v_local)
        if cfg.mesh.shape[cfg.vocab_axis] > 1:
            dh = lax.psum(dh, cfg.vocab_axis)
        return dh.astype(h.dtype), dw, db.astype(acc)

    return _shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"],
                              sp["n"]), (sp["h"], sp["w"], sp["b"]))(h, w, b, y, lse, coef)


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


def _recomputed_lse(cfg: _Cfg, h, w, b, y):
    """[N] log-sum-exp from the blockwise statistics pass, for the fused mode's exact fallback. The
    recompute gradient forms p = exp(z - lse) from its own blockwise logits; the fused forward's lse
    (one [bt, V] tile, compiled into another program) can differ from theirs in the last bits (by up to
    0.002 at |z| ~ 1e4), and a dominant label's p - 1 then loses its digits: dW and db were off by 0.2%
    of their scale on XLA:CPU with jax 0.12 (tests/test_cross_entropy.py, the 1e4-logit case)."""
    m, s = _stats(cfg, h, w, b, y)[:2]
    return m + jnp.log(s)


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
            dw, db = lax.cond(uniform, lambda: ((scale * dw_u).astype(w.dtype), scale * db_u),
                              lambda: _grads(cfg, h, w, b, y, _recomputed_lse(cfg, h, w, b, y), g * aw)[1:])
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
    if cfg.impl not in IMPLS:
        raise ValueError(f"impl={cfg.impl!r}; use one of {IMPLS}.")
    if cfg.impl == "pallas" and cfg.mode != "recompute":
        raise ValueError(f"impl='pallas' implements mode='recompute' only; got mode={cfg.mode!r}. "
                         f"Use impl='xla' (or 'auto') for mode='fused'.")
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={cfg.label_smoothing} must be in [0, 1).")
    if cfg.softcap is not None and cfg.softcap <= 0:
        raise ValueError(f"softcap={cfg.softcap} must be positive or None.")
    if cfg.chunk < 0:
        raise ValueError(f"vocab_chunk={cfg.chunk} must be >= 1 (or None for the default).")
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
    nb = _batch_size(cfg)
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
        Defaults: XLA 8192 x 256 (recompute), 512 x V_local (fused); Pallas per TPU generation (read
        from the mesh's devices; without a mesh 512 x 512, which fits every generation from v4 on).
        Given explicitly, they apply to both implementations.
      mode: ``'recompute'`` (memory-lean, 4 matmuls) or ``'fused'`` (3 matmuls); see the module doc.
      mesh: ``None`` for one device, else a mesh with ``vocab_axis`` and ``batch_axes`` (sizes may be 1).
        Tokens (the flattened leading dims) are split over ``batch_axes``, vocab rows over ``vocab_axis``.
      impl: ``'xla'`` (blockwise loops in XLA), ``'pallas'`` (Pallas TPU kernels; interpreted when the
        program is compiled for another platform, for tests), or ``'auto'``: Pallas when the program is
        compiled for a TPU (decided at lowering, so compiling for a TPU topology from a CPU picks it),
        XLA elsewhere. ``mode='fused'`` always runs on XLA.
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
      vocab_chunk: Pallas path with W's d sharded, or dW reduced over batch shards: local vocab rows
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
    pallas = pallas_ce.blocks_for(_device_kind(mesh), d, jnp.dtype(weight.dtype).itemsize)
    pallas = pallas_ce.Blocks(token_block or pallas.token, vocab_block or pallas.vocab, pallas.vmem_limit_mib)
    if token_block is None:
        token_block = DEFAULT_FUSED_TOKEN_BLOCK if mode == "fused" else DEFAULT_TOKEN_BLOCK
    cfg = _Cfg(int(valid_vocab), float(z_loss), float(label_smoothing), float(logit_scale),
               None if softcap is None else float(softcap), int(token_block),
               int(vocab_block or DEFAULT_VOCAB_BLOCK), mode, mesh, vocab_axis, tuple(batch_axes),
               "xla" if impl == "auto" and mode == "fused" else impl,
               _embed_axis(mesh, weight_embed_axis, tuple(batch_axes), d), pallas, int(vocab_chunk or 0),
               mesh is not None and not weight_rows_sharded)
    _check(cfg, hidden, weight, labels, weights, bias)
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).astype(jnp.int32)
    wts = jnp.ones(y.shape, jnp.float32) if weights is None else weights.reshape(-1)
    loss, aux = _build(cfg)(h, weight, bias, y, wts)
    aux = {k: (v if v.ndim == 0 else v.reshape(lead)) for k, v in aux.items()}
    return loss.reshape(lead), aux
