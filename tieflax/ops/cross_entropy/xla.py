"""The blockwise XLA path (``impl='xla'``): ``lax.fori_loop`` over ``[token block x vocab block]``
tiles, on one vocabulary shard, and its ``shard_map`` wrappers (``stats``, ``grads``, ``fused``).
Algorithms and costs: the package docstring."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from tieflax.ops.cross_entropy.loss_config import MASK, Cfg, acc_dtype, block_start, fresh_rows, split_blocks
from tieflax.ops.cross_entropy.sharding import (
    add_block,
    combine_local,
    combine_vocab,
    local_view,
    partition_specs,
    put_block,
    reduce_dw,
    shmap,
    slice_rows,
    take_w,
)

# ----------------------------------------------------------------------------------------- tile math

def _tile(cfg: Cfg, h_blk, w_blk, b_blk, ok, acc):
    """Logits of one tile. h_blk [bt, d], w_blk [bv, d], b_blk [bv] | None, ok [bv] bool -> [bt, bv] acc."""
    raw = lax.dot_general(h_blk, w_blk, (((1,), (1,)), ((), ())), preferred_element_type=acc)
    if cfg.logit_scale != 1.0:
        raw = raw * cfg.logit_scale
    if b_blk is not None:
        raw = raw + b_blk.astype(acc)
    if cfg.softcap is not None:
        raw = cfg.softcap * jnp.tanh(raw / cfg.softcap)
    return jnp.where(ok[None, :], raw, MASK)


def _tile_stats(cfg: Cfg, z, ok, cols, y):
    """Per-row statistics of a masked tile: (max, sum exp(z - max), label logit, sum of valid logits)."""
    m = z.max(axis=1)
    s = jnp.exp(z - m[:, None]).sum(axis=1)
    zy = jnp.where((cols[None, :] == y[:, None]) & ok[None, :], z, 0.0).sum(axis=1)
    sz = jnp.where(ok[None, :], z, 0.0).sum(axis=1) if cfg.label_smoothing else jnp.zeros_like(m)
    return m, s, zy, sz


def _tile_grad(cfg: Cfg, z, ok, cols, y, lse, coef, p=None):
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



def _bf16_round(x):
    """fp32 -> bf16 round-to-nearest-even in integer arithmetic (NaN and inf kept)."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    u = u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))
    return lax.bitcast_convert_type((u >> 16).astype(jnp.uint16), jnp.bfloat16)


def _matmul_block(cfg: Cfg, w_blk, h_dtype):
    """The W block as the tile matmuls read it. fp32 W with bf16 hidden states on TPU: XLA's default
    precision rounds W to bf16 anyway, and does it with one ``convert`` of the whole matrix hoisted out
    of the loop (a V x d x 2-byte copy, 1.1 GiB at 256000 x 2304). Rounding each block here, by
    integer arithmetic that XLA does not treat as a convert, gives the same values with no copy. Other
    platforms: see ``_matmul_weight``."""
    if cfg.platform != "tpu" or h_dtype != jnp.bfloat16 or w_blk.dtype != jnp.float32:
        return w_blk
    return _bf16_round(w_blk).astype(jnp.float32)


def _matmul_weight(cfg: Cfg, w, h_dtype):
    """W (the local shard) as the tile matmuls read it, once per call. On a GPU with bf16 hidden states
    and an fp32 W: one bf16 copy (V x d x 2 bytes, 1 GiB at the Llama-3-8B head), so every tile matmul
    is a bf16 one, as on TPU. Left fp32, the bf16 hidden states were promoted and the matmuls ran in
    fp32: 296 ms against 175 ms with a bf16 W at the Llama-3.2-1B head on an H200 (issue figures).
    Converting block by block would not help: XLA hoists a loop-invariant convert of W out of the loop
    (the TPU's integer rounding above exists to avoid that copy, at the price of integer ops the GPU
    would run per tile). dW stays fp32 (``dw_dtype``). Elsewhere W is kept as it is."""
    if cfg.platform == "gpu" and h_dtype == jnp.bfloat16 and w.dtype == jnp.float32:
        return w.astype(jnp.bfloat16)
    return w


def _local_stats(cfg: Cfg, h, w, b, y, v_off, take_w=slice_rows, row0=0, v_local=None):
    """Forward statistics over the local vocabulary. h [N, d], w [V, d_local], y [N] -> 4 x [N] acc;
    ``take_w(w, v0, bv)`` returns rows ``v0:v0+bv`` with the full d (gathered when d is sharded). The
    local vocabulary is rows ``row0 : row0 + v_local`` of ``w`` (default: all of them)."""
    acc = acc_dtype(h.dtype, w.dtype)
    n, v = h.shape[0], v_local or w.shape[0]
    bt, nt = split_blocks(n, cfg.token_block)
    bv, nv = split_blocks(v, cfg.vocab_block)

    def token_step(i, out):
        t0 = block_start(i, bt, n)
        h_blk = lax.dynamic_slice_in_dim(h, t0, bt)
        y_blk = lax.dynamic_slice_in_dim(y, t0, bt)

        def vocab_step(k, carry):
            m, s, zy, sz = carry
            v0 = block_start(k, bv, v)
            cols = v_off + v0 + jnp.arange(bv)
            ok = fresh_rows(v0, k, bv) & (cols < cfg.valid_vocab)
            b_blk = None if b is None else lax.dynamic_slice_in_dim(b, row0 + v0, bv)
            z = _tile(cfg, h_blk, _matmul_block(cfg, take_w(w, row0 + v0, bv), h.dtype), b_blk, ok, acc)
            tm, ts, tzy, tsz = _tile_stats(cfg, z, ok, cols, y_blk)
            m_new = jnp.maximum(m, tm)
            s = s * jnp.exp(m - m_new) + ts * jnp.exp(tm - m_new)
            return m_new, s, zy + tzy, sz + tsz

        init = (jnp.full((bt,), MASK, acc),) + (jnp.zeros((bt,), acc),) * 3
        blk = lax.fori_loop(0, nv, vocab_step, init)
        return tuple(lax.dynamic_update_slice_in_dim(o, r, t0, 0) for o, r in zip(out, blk))

    out = tuple(jnp.zeros((n,), acc) for _ in range(4))
    return lax.fori_loop(0, nt, token_step, out)


def _local_grads(cfg: Cfg, h, w, b, y, lse, coef, v_off, reduce_blk=lambda x: x, take_w=slice_rows,
                 row0=0, v_local=None, put=None, dw_dtype=None):
    """Recompute backward over the local shard. Returns dH [N, d] acc (partial over vocab shards),
    dW [V, d_local] w.dtype and db [V] acc; ``reduce_blk`` sums a finished ([bv, d], [bv]) block over
    the batch shards (into [bv, d_local] when d is sharded), so the loop-carried dW is already the
    final buffer (no second weight-sized copy). ``row0``, ``v_local``: as in ``_local_stats``;
    ``put(dw, db, v0, dw_blk, db_blk, fresh)`` writes a finished block into dW and db (``put_block``)."""
    acc = acc_dtype(h.dtype, w.dtype)
    cdt = jnp.result_type(h.dtype, w.dtype)
    n, v = h.shape[0], v_local or w.shape[0]
    put = put or add_block
    bt, nt = split_blocks(n, cfg.token_block)
    bv, nv = split_blocks(v, cfg.vocab_block)

    def vocab_step(k, carry):
        dh, dw, db = carry
        v0 = block_start(k, bv, v)
        cols = v_off + v0 + jnp.arange(bv)
        ok = fresh_rows(v0, k, bv) & (cols < cfg.valid_vocab)
        w_blk = _matmul_block(cfg, take_w(w, row0 + v0, bv), h.dtype)
        b_blk = None if b is None else lax.dynamic_slice_in_dim(b, row0 + v0, bv)

        def token_step(i, inner):
            dh, dw_blk, db_blk = inner
            t0 = block_start(i, bt, n)
            h_blk = lax.dynamic_slice_in_dim(h, t0, bt)
            sl = functools.partial(lax.dynamic_slice_in_dim, start_index=t0, slice_size=bt)
            c_blk = jnp.where(fresh_rows(t0, i, bt), sl(coef), 0.0)
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
        dw, db = put(dw, db, v0, dw_blk, db_blk, fresh_rows(v0, k, bv))
        return dh, dw, db

    init = (jnp.zeros(h.shape, acc), jnp.zeros(w.shape, dw_dtype or w.dtype), jnp.zeros((w.shape[0],), acc))
    return lax.fori_loop(0, nv, vocab_step, init)



def _local_fused(cfg: Cfg, h, w, b, y, aw, v_off, combine, psum_vocab):
    """Gradient-in-forward over the local shard: one [bt, V_local] tile per token block.

    Returns global statistics (4 x [N]), dH_unit [N, d] acc (already summed over vocab shards),
    dW_unit [V, d] acc and db_unit [V] acc (partial over batch shards), all for a unit cotangent.
    """
    acc = acc_dtype(h.dtype, w.dtype)
    cdt = jnp.result_type(h.dtype, w.dtype)
    n, v = h.shape[0], w.shape[0]
    bt, nt = split_blocks(n, cfg.token_block)
    cols = v_off + jnp.arange(v)
    ok = cols < cfg.valid_vocab

    def token_step(i, carry):
        stats, dh, dw, db = carry
        t0 = block_start(i, bt, n)
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
        fresh = fresh_rows(t0, i, bt)
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


def stats(cfg: Cfg, h, w, b, y):
    """Global [N] statistics (max, sum exp, label logit, logit sum), acc dtype."""
    if cfg.mesh is None:
        return _local_stats(cfg, h, _matmul_weight(cfg, w, h.dtype), b, y, 0)
    sp = partition_specs(cfg)

    def body(h, w, b, y):
        v_off, row0, v_local = local_view(cfg, w)
        loc = _local_stats(cfg, h, _matmul_weight(cfg, w, h.dtype), b, y, v_off, take_w(cfg), row0, v_local)
        return combine_vocab(cfg.vocab_axis, *loc)

    return shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"]),
                  (sp["n"],) * 4)(h, w, b, y)


def grads(cfg: Cfg, h, w, b, y, lse, coef):
    """dH [N, d] h.dtype, dW [V, d] w.dtype, db [V] acc (fully reduced)."""
    if cfg.mesh is None:
        dh, dw, db = _local_grads(cfg, h, _matmul_weight(cfg, w, h.dtype), b, y, lse, coef, 0, dw_dtype=w.dtype)
        return dh.astype(h.dtype), dw, db
    sp = partition_specs(cfg)

    def body(h, w, b, y, lse, coef):
        # The data-parallel weight-gradient reduction, one [bv, d] block at a time.
        v_off, row0, v_local = local_view(cfg, w)
        dh, dw, db = _local_grads(cfg, h, _matmul_weight(cfg, w, h.dtype), b, y, lse, coef, v_off,
                                  reduce_dw(cfg) if cfg.batch_axes else (lambda x: x), take_w(cfg),
                                  row0, v_local, put_block(cfg, v_local), w.dtype)
        return lax.psum(dh, cfg.vocab_axis).astype(h.dtype), dw, db

    return shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"],
                              sp["n"]), (sp["h"], sp["w"], sp["b"]))(h, w, b, y, lse, coef)


def fused(cfg: Cfg, h, w, b, y, aw):
    """Gradient in the forward: global statistics, dH, dW (w.dtype), db for a unit cotangent."""
    if cfg.mesh is None:
        stats, dh, dw, db = _local_fused(cfg, h, _matmul_weight(cfg, w, h.dtype), b, y, aw, 0, combine_local,
                                         lambda x: x)
        return stats, dh, dw.astype(w.dtype), db
    sp = partition_specs(cfg)

    def body(h, w, b, y, aw):
        if cfg.embed_axis is not None:  # fused mode holds weight-sized buffers anyway
            w = lax.all_gather(w, cfg.embed_axis, axis=1, tiled=True)
        v_off, row0, v_local = local_view(cfg, w)
        if cfg.rows_whole:   # (so does this slice of the local shard)
            w = lax.dynamic_slice_in_dim(w, row0, v_local)
            b = None if b is None else lax.dynamic_slice_in_dim(b, row0, v_local)
        stats, dh, dw, db = _local_fused(cfg, h, _matmul_weight(cfg, w, h.dtype), b, y, aw, v_off,
                                         functools.partial(combine_vocab, cfg.vocab_axis),
                                         functools.partial(lax.psum, axis_name=cfg.vocab_axis))
        if cfg.batch_axes:  # the data-parallel weight-gradient reduction, [V_local, d]
            dw, db = reduce_dw(cfg)((dw, db))
        if cfg.rows_whole:
            dw = lax.all_gather(dw, cfg.vocab_axis, axis=0, tiled=True)
            db = lax.all_gather(db, cfg.vocab_axis, axis=0, tiled=True)
        return stats, dh, dw.astype(w.dtype), db

    return shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"]),
                  ((sp["n"],) * 4, sp["h"], sp["w"], sp["b"]))(h, w, b, y, aw)


