"""Vocabulary-parallel plumbing shared by every implementation: the ``shard_map`` specs, the merge of
per-shard statistics, W's rows gathered over the axis that shards d, and dW blocks reduced over the
batch axes and put in place (see the package docstring, "Vocabulary parallelism")."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tieflax.ops.cross_entropy.loss_config import Cfg


def slice_rows(w, v0, bv):
    return lax.dynamic_slice_in_dim(w, v0, bv)



def add_block(dw, db, v0, dw_blk, db_blk, fresh=None):
    """dW[v0 : v0 + rows] += dw_blk (and db). Rows shared with the previous block got zero gradient
    (masked), so adding is exact.

    With ``fresh`` ([rows] bool: the rows no earlier block wrote) the block is written instead: fresh
    rows take it, the others keep theirs. Each row is then written once rather than accumulated, so XLA
    does not move the block's data-parallel reduction out of the loop (as one all-reduce of the whole dW
    after it; at large V that whole-matrix reduction made the TPU compiler evict the fp32 dH accumulator
    from on-chip memory, an [N, d] fp32 temporary at 256k but not at 64k)."""
    rows = dw_blk.shape[0]
    old_w, old_b = slice_rows(dw, v0, rows), slice_rows(db, v0, rows)
    if fresh is None:
        new_w, new_b = old_w + dw_blk.astype(dw.dtype), old_b + db_blk.astype(db.dtype)
    else:
        new_w = jnp.where(fresh[:, None], dw_blk.astype(dw.dtype), old_w)
        new_b = jnp.where(fresh, db_blk.astype(db.dtype), old_b)
    return lax.dynamic_update_slice_in_dim(dw, new_w, v0, 0), lax.dynamic_update_slice_in_dim(db, new_b, v0, 0)


def put_block(cfg: Cfg, v_local: int):
    """How a finished gradient block enters dW: added in place, or, when W's rows are whole on every
    device (``rows_whole``), all-gathered over the vocab axis (one [shards, rows, d] block, never the
    shard) and added at each shard's rows, so dW leaves whole as W came."""
    if not cfg.rows_whole:
        return add_block

    def put(dw, db, v0, dw_blk, db_blk, fresh=None):
        gw = lax.all_gather(dw_blk, cfg.vocab_axis)   # [shards, rows, d_local]
        gb = lax.all_gather(db_blk, cfg.vocab_axis)
        for t in range(gw.shape[0]):
            dw, db = add_block(dw, db, t * v_local + v0, gw[t], gb[t], fresh)
        return dw, db

    return put


def combine_local(m, s, zy, sz):
    return m, s, zy, sz


def combine_vocab(axis, m, s, zy, sz):
    """Merge per-shard statistics into global ones: one pmax and one psum of [N, 3]."""
    gm = lax.pmax(m, axis)
    tot = lax.psum(jnp.stack([s * jnp.exp(m - gm), zy, sz], axis=-1), axis)
    return gm, tot[..., 0], tot[..., 1], tot[..., 2]


def partition_specs(cfg: Cfg):
    bax = cfg.batch_axes if cfg.batch_axes else None
    rows = None if cfg.rows_whole else cfg.vocab_axis
    return dict(h=P(bax, None), w=P(rows, cfg.embed_axis), b=P(rows), n=P(bax))


def local_view(cfg: Cfg, w) -> tuple[Any, int, int]:
    """(v_off, row0, v_local) inside the map: the global index of this shard's first vocabulary row,
    where that row sits in the ``w`` the device holds (0 unless W's rows are whole), and how many."""
    if not cfg.rows_whole:
        return v_offset(cfg, w.shape[0]), 0, w.shape[0]
    v_local = w.shape[0] // cfg.mesh.shape[cfg.vocab_axis]
    v_off = v_offset(cfg, v_local)
    return v_off, v_off, v_local


def shmap(cfg: Cfg, fn, in_specs, out_specs):
    # check_vma=False: every collective is written out explicitly below, no autodiff runs through these
    # maps (the custom_vjp sits outside them), so replication is guaranteed by construction.
    return jax.shard_map(fn, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def v_offset(cfg: Cfg, v_local: int):
    return lax.axis_index(cfg.vocab_axis) * v_local


def take_w(cfg: Cfg):
    """(w, v0, bv) -> rows v0:v0+bv of the local W with the full d: gathered over the axis that shards
    d (one [bv, d] block at a time, never the whole matrix)."""
    if cfg.embed_axis is None:
        return slice_rows

    def take(w, v0, bv):
        # Gathered along a new leading axis, then put in place: gathering along d directly makes XLA
        # give the whole local W a d-major layout, i.e. a weight-sized copy before the loop.
        g = lax.all_gather(slice_rows(w, v0, bv), cfg.embed_axis, axis=0)  # [f, bv, d_local]
        return jnp.moveaxis(g, 0, 1).reshape(bv, -1)

    return take


def reduce_dw(cfg: Cfg):
    """Data-parallel reduction of a finished ([bv, d], [bv]) gradient block: a reduce-scatter over
    the axis that shards d (so dW leaves in the parameter's own layout) and a sum over the others."""
    rest = tuple(a for a in cfg.batch_axes if a != cfg.embed_axis)

    def reduce(blk):
        dw, db = blk
        if cfg.embed_axis is not None:  # scattered over a leading axis, for the reason in take_w
            f = cfg.mesh.shape[cfg.embed_axis]
            dw = jnp.moveaxis(dw.reshape(dw.shape[0], f, -1), 1, 0)
            dw = lax.psum_scatter(dw, cfg.embed_axis, scatter_dimension=0)
        if rest:
            dw = lax.psum(dw, rest)
        return dw, lax.psum(db, cfg.batch_axes)

    return reduce


def batch_size(cfg: Cfg) -> int:
    return math.prod(cfg.mesh.shape[a] for a in cfg.batch_axes)

