"""Pallas Mosaic TPU kernels of the fused cross-entropy (``impl='pallas'``), one vocabulary shard, and
their driver under ``shard_map`` (an XLA loop over vocabulary chunks when W arrives chunk by chunk).

Three kernels, each a grid over (token blocks, vocab blocks) of ``[bt, d] x [bv, d]`` tiles read from
HBM block by block (W in its own dtype, fp32 or bf16: no converted copy of the matrix ever exists; a
block is cast in VMEM when the hidden states are bf16, like XLA's default TPU matmul precision):

- ``stats``: grid (token, vocab), vocab innermost; the ``[bt, 1]`` outputs stay in VMEM across the
  vocab axis and accumulate the online max / sum-exp / label logit / logit sum.
- ``dh``:    grid (token, vocab); an fp32 ``[bt, d]`` VMEM accumulator of ``dZ @ W_blk``; it starts
  from ``dh_in`` (aliased to the output), so a caller can sum over vocab chunks without a second buffer.
- ``dw``:    grid (vocab, token), tokens innermost; fp32 ``[bv, d]`` / ``[1, bv]`` accumulators of
  ``dZ^T @ H_blk`` and the bias gradient.

Each recomputes its logit tile (5 matmuls of ``2 N V d`` FLOPs per loss+grad). Edge blocks (N or V not
a multiple of the block) are padded by Pallas; padded vocab rows are masked like vocabulary padding and
padded token rows are zeroed before any product that sums over tokens. ``v_off`` (scalar-prefetched)
is the global index of the first row of ``w``, so label matching, ``valid_vocab`` and smoothing see
global columns. Semantics are those of ``tieflax.ops.cross_entropy`` (see its module docstring).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tieflax.ops.cross_entropy.loss_config import MASK, Cfg, Semantics


def _fit(block: int, n: int, align: int, interpret: bool) -> int:
    """A block no larger than the array; compiled blocks are rounded up to the TPU tile (8 rows of
    tokens, 128 lanes of vocab) unless they cover the whole dimension."""
    if block >= n:
        return n
    return block if interpret else max(align, -(-block // align) * align)


# ------------------------------------------------------------------------------------- tile math

def _columns(sem: Semantics, voff_ref, j, bv: int, v: int):
    """Global columns [1, bv] of vocab block j and their mask: rows of ``w`` from ``voff_ref[1]`` on
    (earlier ones belong to a previous chunk), global index < valid V."""
    local = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    cols = voff_ref[0] + local
    return cols, (local < v) & (local >= voff_ref[1]) & (cols < sem.valid_vocab)


def _logits(sem: Semantics, h, w, b_ref, ok, cdt):
    """[bt, bv] fp32 logits of one tile: scale, bias, soft-cap, then masked columns set to -1e30."""
    raw = lax.dot_general(h.astype(cdt), w.astype(cdt), (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    if sem.logit_scale != 1.0:
        raw = raw * sem.logit_scale
    if b_ref is not None:
        raw = raw + b_ref[...].astype(jnp.float32)
    if sem.softcap is not None:
        raw = sem.softcap * jnp.tanh(raw / sem.softcap)
    return jnp.where(ok, raw, MASK)


def _dlogits(sem: Semantics, z, ok, cols, y, lse, coef):
    """d(loss)/d(raw logit) of one tile, [bt, bv] fp32; y, lse, coef are [bt, 1] columns."""
    eps = sem.label_smoothing
    p = jnp.exp(z - lse)
    c = 1.0 + 2.0 * sem.z_loss * lse if sem.z_loss else 1.0
    dz = c * p - jnp.where(cols == y, 1.0 - eps, 0.0)
    if eps:
        dz = dz - eps / sem.valid_vocab
    if sem.softcap is not None:
        dz = dz * (1.0 - jnp.square(z / sem.softcap))
    # Mask last: masked logits are -1e30, so tanh' there overflows and must not reach the product.
    return jnp.where(ok, dz * coef, 0.0)


def _split(refs, has_bias: bool, n_in: int):
    """(inputs with b_ref = None when absent, outputs+scratch)."""
    ins = list(refs[:n_in])
    if not has_bias:
        ins.insert(2, None)
    return ins, refs[n_in:]


# ---------------------------------------------------------------------------------------- kernels

def _stats_kernel(sem, cdt, bv, v, has_bias, voff_ref, *refs):
    (h_ref, w_ref, b_ref, y_ref), (m_ref, s_ref, zy_ref, sz_ref) = _split(refs, has_bias, 3 + has_bias)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK, jnp.float32)
        for r in (s_ref, zy_ref, sz_ref):
            r[...] = jnp.zeros(r.shape, jnp.float32)

    cols, ok = _columns(sem, voff_ref, j, bv, v)
    z = _logits(sem, h_ref[...], w_ref[...], b_ref, ok, cdt)
    tm = z.max(axis=1, keepdims=True)
    m_old = m_ref[...]
    m_new = jnp.maximum(m_old, tm)
    s_ref[...] = s_ref[...] * jnp.exp(m_old - m_new) + jnp.exp(z - m_new).sum(axis=1, keepdims=True)
    m_ref[...] = m_new
    zy_ref[...] += jnp.where((cols == y_ref[...]) & ok, z, 0.0).sum(axis=1, keepdims=True)
    if sem.label_smoothing:
        sz_ref[...] += jnp.where(ok, z, 0.0).sum(axis=1, keepdims=True)


def _dh_kernel(sem, cdt, bv, v, has_bias, voff_ref, *refs):
    (h_ref, w_ref, b_ref, y_ref, lse_ref, coef_ref, dh_in_ref), (dh_ref, acc_ref) = _split(
        refs, has_bias, 6 + has_bias)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = dh_in_ref[...].astype(jnp.float32)

    cols, ok = _columns(sem, voff_ref, j, bv, v)
    w = w_ref[...]
    if v % bv:  # rows past the end of W are padding of unknown content: 0 * NaN would poison dH
        w = jnp.where(j * bv + lax.broadcasted_iota(jnp.int32, (bv, 1), 0) < v, w, 0)
    z = _logits(sem, h_ref[...], w, b_ref, ok, cdt)
    dz = _dlogits(sem, z, ok, cols, y_ref[...], lse_ref[...], coef_ref[...]) * sem.logit_scale
    acc_ref[...] += jnp.dot(dz.astype(cdt), w.astype(cdt), preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _out():
        dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)


def _dw_kernel(sem, cdt, bt, n, bv, v, has_bias, voff_ref, *refs):
    (h_ref, w_ref, b_ref, y_ref, lse_ref, coef_ref), (dw_ref, db_ref, acc_ref, dbacc_ref) = _split(
        refs, has_bias, 5 + has_bias)
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        dbacc_ref[...] = jnp.zeros(dbacc_ref.shape, jnp.float32)

    cols, ok = _columns(sem, voff_ref, j, bv, v)
    h = h_ref[...]
    z = _logits(sem, h, w_ref[...], b_ref, ok, cdt)
    dz = _dlogits(sem, z, ok, cols, y_ref[...], lse_ref[...], coef_ref[...])
    if n % bt:  # token rows past the end are padding of unknown content: keep them out of the sums
        live = i * bt + lax.broadcasted_iota(jnp.int32, (bt, 1), 0) < n
        dz, h = jnp.where(live, dz, 0.0), jnp.where(live, h, 0)
    dbacc_ref[...] += dz.sum(axis=0, keepdims=True)
    dz = (dz * sem.logit_scale).astype(cdt)
    acc_ref[...] += lax.dot_general(dz, h.astype(cdt), (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(1) - 1)
    def _out():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)
        db_ref[...] = dbacc_ref[...]


# ------------------------------------------------------------------------------------- wrappers

@dataclasses.dataclass(frozen=True)
class Plan:
    sem: Semantics
    token_block: int
    vocab_block: int
    vmem_limit_mib: int
    interpret: bool


def _compute_dtype(h_dtype, w_dtype):
    # bf16 hidden states: the matmul runs in bf16 (W blocks cast in VMEM), as XLA's default precision
    # does on TPU; otherwise in the promoted dtype.
    return jnp.bfloat16 if h_dtype == jnp.bfloat16 else jnp.result_type(h_dtype, w_dtype)


def _call(plan: Plan, kernel, grid, in_specs, out_specs, out_shape, scratch=(), aliases=None, order=None):
    sem = ("parallel", "arbitrary")
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=list(scratch)),
        out_shape=out_shape, input_output_aliases=aliases or {}, interpret=plan.interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=order or sem,
                                             vmem_limit_bytes=plan.vmem_limit_mib * 2**20))


def _scalars(v_off, lo):
    """The scalar-prefetch operand: [global index of w's row 0, first row of w to use]."""
    return jnp.stack([jnp.asarray(v_off, jnp.int32), jnp.asarray(lo, jnp.int32)])


def _common(plan: Plan, h, w, b):
    n, d = h.shape
    v = w.shape[0]
    bt = _fit(plan.token_block, n, 8, plan.interpret)
    bv = _fit(plan.vocab_block, v, 128, plan.interpret)
    return n, d, v, bt, bv, b is not None, _compute_dtype(h.dtype, w.dtype)


def _block_inputs(h, w, b, y, bt, bv, tok, voc, bias_map):
    """BlockSpecs and operands every kernel reads: h [bt, d], w [bv, d], the bias [1, bv] (if any) and the
    labels [bt, 1]; ``tok``/``voc``/``bias_map`` are the grid's index maps for token and vocabulary blocks."""
    n, d = h.shape
    specs, args = [pl.BlockSpec((bt, d), tok), pl.BlockSpec((bv, d), voc)], [h, w]
    if b is not None:
        specs.append(pl.BlockSpec((1, bv), bias_map))
        args.append(b.reshape(1, w.shape[0]))
    specs.append(pl.BlockSpec((bt, 1), tok))
    args.append(y.reshape(n, 1))
    return specs, args


def local_stats(plan: Plan, h, w, b, y, v_off, lo=0):
    """h [N, d], w [V, d], b [V] | None, y [N] int32, v_off int32 scalar -> (max, sumexp, label logit,
    logit sum), 4 x [N] fp32, over the rows ``lo:`` of ``w`` only."""
    n, d, v, bt, bv, hb, cdt = _common(plan, h, w, b)
    tok = lambda i, j, o: (i, 0)  # noqa: E731
    specs, args = _block_inputs(h, w, b, y, bt, bv, tok, lambda i, j, o: (j, 0), lambda i, j, o: (0, j))
    col = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    out = _call(plan, functools.partial(_stats_kernel, plan.sem, cdt, bv, v, hb),
                (pl.cdiv(n, bt), pl.cdiv(v, bv)), specs, [pl.BlockSpec((bt, 1), tok)] * 4, [col] * 4)(
        _scalars(v_off, lo), *args)
    return tuple(o[:, 0] for o in out)


def local_dh(plan: Plan, h, w, b, y, lse, coef, v_off, dh_in, lo=0):
    """dh_in + sum over this shard's rows of dZ @ W: [N, d] in dh_in's dtype (updated in place)."""
    n, d, v, bt, bv, hb, cdt = _common(plan, h, w, b)
    tok = lambda i, j, o: (i, 0)  # noqa: E731
    specs, args = _block_inputs(h, w, b, y, bt, bv, tok, lambda i, j, o: (j, 0), lambda i, j, o: (0, j))
    specs += [pl.BlockSpec((bt, 1), tok)] * 2 + [pl.BlockSpec((bt, d), tok)]
    args += [lse.reshape(n, 1), coef.reshape(n, 1), dh_in]
    return _call(plan, functools.partial(_dh_kernel, plan.sem, cdt, bv, v, hb),
                 (pl.cdiv(n, bt), pl.cdiv(v, bv)), specs, pl.BlockSpec((bt, d), tok),
                 jax.ShapeDtypeStruct(dh_in.shape, dh_in.dtype), [pltpu.VMEM((bt, d), jnp.float32)],
                 aliases={len(args): 0})(_scalars(v_off, lo), *args)


def local_dw(plan: Plan, h, w, b, y, lse, coef, v_off, dw_dtype, lo=0):
    """(dW [V, d] dw_dtype, db [V] fp32) of this shard's rows, summed over the local tokens."""
    n, d, v, bt, bv, hb, cdt = _common(plan, h, w, b)
    tok = lambda j, i, o: (i, 0)  # noqa: E731
    voc = lambda j, i, o: (j, 0)  # noqa: E731
    specs, args = _block_inputs(h, w, b, y, bt, bv, tok, voc, lambda j, i, o: (0, j))
    specs += [pl.BlockSpec((bt, 1), tok)] * 2
    args += [lse.reshape(n, 1), coef.reshape(n, 1)]
    dw, db = _call(plan, functools.partial(_dw_kernel, plan.sem, cdt, bt, n, bv, v, hb),
                   (pl.cdiv(v, bv), pl.cdiv(n, bt)), specs,
                   [pl.BlockSpec((bv, d), voc), pl.BlockSpec((1, bv), lambda j, i, o: (0, j))],
                   [jax.ShapeDtypeStruct((v, d), dw_dtype), jax.ShapeDtypeStruct((1, v), jnp.float32)],
                   [pltpu.VMEM((bv, d), jnp.float32), pltpu.VMEM((1, bv), jnp.float32)])(
        _scalars(v_off, lo), *args)
    return dw, db[0]


def plan(cfg: Cfg, interpret: bool) -> Plan:
    """The kernels' static plan for one call: semantics, this generation's blocks, interpret or compile."""
    return Plan(Semantics.of(cfg), cfg.pallas.token, cfg.pallas.vocab, cfg.pallas.vmem_limit_mib, interpret)
