"""The Pallas paths' driver under ``shard_map``, shared by the TPU and the GPU kernels.

``ops`` is a kernel module (``pallas_tpu`` or ``mosaic_gpu``) with ``plan(cfg, interpret)`` and, over one
vocabulary shard's rows ``lo:`` of ``w``:

- ``local_stats(plan, h, w, b, y, v_off, lo)`` -> 4 x [N] fp32 (max, sum exp, label logit, logit sum);
- either ``local_dh(plan, h, w, b, y, lse, coef, v_off, dh_in, lo)`` -> dh_in + dZ @ W, [N, d]
  dh_in.dtype, and ``local_dw(plan, h, w, b, y, lse, coef, v_off, dw_dtype, lo)`` -> (dW [V, d]
  dw_dtype, db [V] fp32), each recomputing the logits (``pallas_tpu``);
- or ``local_grads(plan, h, w, b, y, lse, coef, v_off, dh_in, dw_dtype, lo)`` -> (dh, dW, db) from one
  recomputation of the logits (``mosaic_gpu``).

When W arrives chunk by chunk (its d sharded and gathered, its rows whole, or dW reduced over batch
shards) an XLA loop over vocabulary chunks calls the kernels once per chunk.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tieflax.ops.cross_entropy import tiles
from tieflax.ops.cross_entropy.loss_config import MASK, Cfg, acc_dtype, block_start, split_blocks
from tieflax.ops.cross_entropy.sharding import (
    batch_size,
    combine_vocab,
    local_view,
    partition_specs,
    put_block,
    reduce_dw,
    shmap,
    slice_rows,
    take_w,
)


def _chunks(cfg: Cfg, v: int, d: int) -> tuple[int, int]:
    """(rows, count) of the vocab chunks of the local W that the Pallas path loops over in XLA
    (W's d sharded, or its rows whole, or dW reduced over batch shards)."""
    return split_blocks(v, cfg.chunk or max(128, tiles.PALLAS_CHUNK_BYTES // (d * 4) // 128 * 128))


def _chunk_loop(cfg: Cfg, w, b, d: int, body, init, row0=0, v_local=None):
    """fori_loop over vocab chunks: body(c, carry, v0, lo, w_chunk [rows, d], b_chunk) -> carry.
    The last chunk is shifted back to end at V_local; its first ``lo`` rows belong to the previous one.
    The local vocabulary is rows ``row0 : row0 + v_local`` of ``w``; ``v0`` counts from ``row0``."""
    v = v_local or w.shape[0]
    rows, nc = _chunks(cfg, v, d)
    take = take_w(cfg)

    def step(c, carry):
        v0 = block_start(c, rows, v)
        bc = None if b is None else slice_rows(b, row0 + v0, rows)
        return body(carry, v0, c * rows - v0, take(w, row0 + v0, rows), bc)

    return lax.fori_loop(0, nc, step, init)


def _local_stats(ops, cfg: Cfg, plan, h, w, b, y, v_base, row0=0, v_local=None):
    if cfg.embed_axis is None and not cfg.rows_whole:
        return ops.local_stats(plan, h, w, b, y, v_base)

    def body(carry, v0, lo, wc, bc):
        m, s, zy, sz = carry
        cm, cs, czy, csz = ops.local_stats(plan, h, wc, bc, y, v_base + v0, lo)
        m_new = jnp.maximum(m, cm)
        return m_new, s * jnp.exp(m - m_new) + cs * jnp.exp(cm - m_new), zy + czy, sz + csz

    n = h.shape[0]
    init = (jnp.full((n,), MASK, jnp.float32),) + (jnp.zeros((n,), jnp.float32),) * 3
    return _chunk_loop(cfg, w, b, h.shape[1], body, init, row0, v_local)


def stats(ops, cfg: Cfg, interpret: bool, h, w, b, y):
    """Global [N] statistics (max, sumexp, label logit, logit sum) from the kernels of ``ops``."""
    acc = acc_dtype(h.dtype, w.dtype)
    plan = ops.plan(cfg, interpret)
    if cfg.mesh is None:
        return tuple(x.astype(acc) for x in ops.local_stats(plan, h, w, b, y, 0))
    sp = partition_specs(cfg)

    def body(h, w, b, y):
        v_off, row0, v_local = local_view(cfg, w)
        loc = _local_stats(ops, cfg, plan, h, w, b, y, v_off, row0, v_local)
        return tuple(x.astype(acc) for x in combine_vocab(cfg.vocab_axis, *loc))

    return shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"]),
                  (sp["n"],) * 4)(h, w, b, y)


def _local_grads(ops, cfg: Cfg, plan, h, w, b, y, lse, coef, v_base, dh_dtype, reduce, row0=0,
                 v_local=None):
    """dH [N, d] dh_dtype (partial over vocab shards), dW [V, d_local] w.dtype, db [V] fp32.
    ``reduce`` (None: nothing to reduce) sums a dW/db chunk over the batch shards."""
    lse, coef = lse.astype(jnp.float32), coef.astype(jnp.float32)
    dh0 = jnp.zeros(h.shape, dh_dtype)
    chunked_dh = cfg.embed_axis is not None or cfg.rows_whole   # W's rows arrive chunk by chunk
    put = put_block(cfg, v_local or w.shape[0])
    joint = hasattr(ops, "local_grads")   # dH and dW from one recomputation of each logit tile
    if joint and not chunked_dh and reduce is None:
        return ops.local_grads(plan, h, w, b, y, lse, coef, v_base, dh0, w.dtype)
    if joint:
        # Each chunk's call adds its dZ @ W into dH, summed in fp32 over the chunks (the caller casts).
        chunked_dh, dh0 = True, jnp.zeros(h.shape, jnp.float32)
    elif not chunked_dh:
        # W is whole here: one dH kernel over all rows; dW in one piece when nothing is reduced.
        dh = ops.local_dh(plan, h, w, b, y, lse, coef, v_base, dh0)
        if reduce is None:
            return (dh,) + ops.local_dw(plan, h, w, b, y, lse, coef, v_base, w.dtype)

    def body(carry, v0, lo, wc, bc):
        dh, dw, db = carry
        if joint:
            dh, dwc, dbc = ops.local_grads(plan, h, wc, bc, y, lse, coef, v_base + v0, dh, jnp.float32, lo)
        else:
            if chunked_dh:  # dH accumulates over the chunks
                dh = ops.local_dh(plan, h, wc, bc, y, lse, coef, v_base + v0, dh, lo)
            dwc, dbc = ops.local_dw(plan, h, wc, bc, y, lse, coef, v_base + v0, jnp.float32, lo)
        if reduce is not None:
            dwc, dbc = reduce((dwc, dbc))
        # Written, not added (see add_block): added, XLA:TPU (libtpu 0.0.52) moves the chunks' reduction
        # out of the loop as one all-reduce of the whole local dW, a weight-sized fp32 temporary.
        dw, db = put(dw, db, v0, dwc, dbc, jnp.arange(dwc.shape[0]) >= lo)
        return dh, dw, db

    init = (dh0 if chunked_dh else dh, jnp.zeros(w.shape, w.dtype), jnp.zeros((w.shape[0],), jnp.float32))
    return _chunk_loop(cfg, w, b, h.shape[1], body, init, row0, v_local)


def grads(ops, cfg: Cfg, interpret: bool, h, w, b, y, lse, coef):
    """dH [N, d] h.dtype, dW [V, d] w.dtype, db [V] acc (fully reduced) from the kernels of ``ops``."""
    acc = acc_dtype(h.dtype, w.dtype)
    plan = ops.plan(cfg, interpret)
    if cfg.mesh is None:
        dh, dw, db = _local_grads(ops, cfg, plan, h, w, b, y, lse, coef, 0, h.dtype, None)
        return dh, dw, db.astype(acc)
    sp = partition_specs(cfg)
    # The vocab shards' dH partials are summed in fp32; alone, the kernel writes h.dtype directly.
    summed = cfg.mesh.shape[cfg.vocab_axis] > 1 or cfg.embed_axis is not None or cfg.rows_whole
    reduce = reduce_dw(cfg) if cfg.batch_axes and batch_size(cfg) > 1 else None

    def body(h, w, b, y, lse, coef):
        v_off, row0, v_local = local_view(cfg, w)
        dh, dw, db = _local_grads(ops, cfg, plan, h, w, b, y, lse, coef, v_off,
                                  jnp.float32 if summed else h.dtype, reduce, row0, v_local)
        if cfg.mesh.shape[cfg.vocab_axis] > 1:
            dh = lax.psum(dh, cfg.vocab_axis)
        return dh.astype(h.dtype), dw, db.astype(acc)

    return shmap(cfg, body, (sp["h"], sp["w"], None if b is None else sp["b"], sp["n"], sp["n"],
                              sp["n"]), (sp["h"], sp["w"], sp["b"]))(h, w, b, y, lse, coef)


