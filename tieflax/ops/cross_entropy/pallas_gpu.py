"""Pallas GPU (Triton) kernels of the fused cross-entropy (``impl='pallas_gpu'``), one vocabulary shard.

Every kernel works on ``[bt, bv]`` logit tiles, each the sum over ``d`` of ``[bt, dk] x [bv, dk]``
products read from HBM block by block (W in its own dtype, fp32 or bf16: with bf16 hidden states a W
block is cast to bf16 in registers, so an fp32 head costs twice the W reads and no converted copy):

- ``stats``: grid (token blocks, vocab splits); each program walks its split's vocab blocks with the
  online max / sum-exp / label logit / logit sum in registers and writes ``[bt]`` partials per split,
  merged in XLA (a split of ``[N]`` vectors).
- ``dh``:    grid (token blocks of a token chunk, vocab splits); each tile's ``dZ`` times W's
  ``[bv, dk]`` column blocks is atomically added into an fp32 ``[chunk, d]`` buffer.
- ``dw``:    grid (vocab blocks of a vocab chunk, token splits); ``dZ^T`` times H's ``[bt, dk]``
  column blocks is atomically added into an fp32 ``[chunk, d]`` buffer, the bias gradient beside it.

The chunks (an XLA loop) bound the fp32 buffers (``tiles.GPU_CHUNK_BYTES`` each): neither an fp32
``[N, d]`` nor an fp32 ``[V, d]`` ever exists, so an fp32 W and a bf16 W hold the same temporaries.
The splits give the GPU enough programs when a chunk has few blocks. Five matmuls of ``2 N V d`` FLOPs
per loss+grad, as the TPU kernels. Ragged edges (N or V not a multiple of a block) are masked loads
reading zeros; the fp32 buffers are padded to whole blocks, so atomic adds never need a mask.
Semantics are those of ``tieflax.ops.cross_entropy`` (its docstring); the tile math mirrors
``pallas_tpu``'s. Interpreted (``interpret=True``) when the program is compiled for another platform.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tieflax.ops.cross_entropy import tiles
from tieflax.ops.cross_entropy.config import MASK, Cfg, Semantics, block_start, split_blocks


@dataclasses.dataclass(frozen=True)
class Plan:
    sem: Semantics
    tiles: tiles.GpuTiles
    interpret: bool


def plan(cfg: Cfg, interpret: bool) -> Plan:
    """The kernels' static plan for one call: semantics, tiles, interpret or compile."""
    return Plan(Semantics.of(cfg), cfg.gpu, interpret)


@dataclasses.dataclass(frozen=True)
class _View:
    """Static shape of what one kernel call sees: ``n`` token rows of h from ``t_off`` and ``v`` rows of
    w from ``w_off`` (offsets in the scalar operand), d columns, and the tile sizes."""
    n: int
    v: int
    d: int
    bt: int
    bv: int
    dk: int
    has_bias: bool
    cdt: object  # compute dtype of the tile matmuls
    acc: object  # accumulation dtype (fp32; fp64 for fp64 inputs, interpreted)


# ------------------------------------------------------------------------------------- tile math

def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _load_rows(ref, r0, rows: int, limit: int, c0=None, cols: int = 0, other=0):
    """Rows ``r0 : r0 + rows`` (and columns ``c0 : c0 + cols`` of a 2-D ref); rows at or past ``limit``
    (an absolute row index) read ``other``."""
    if c0 is None:
        ok = r0 + _iota((rows,), 0) < limit
        return plgpu.load(ref.at[pl.ds(r0, rows)], mask=ok, other=other)
    ok = r0 + _iota((rows, cols), 0) < limit
    return plgpu.load(ref.at[pl.ds(r0, rows), pl.ds(c0, cols)], mask=ok, other=other)


def _columns(sem: Semantics, vw: _View, sc_ref, c0):
    """Global columns [bv] of the vocab block at local row c0 and their mask: inside the view, at or after
    the first row to use (``lo``), below the valid vocabulary."""
    local = c0 + _iota((vw.bv,), 0)
    row = sc_ref[3] + local          # row of w
    cols = sc_ref[0] + row           # global vocabulary index
    return cols, (local < vw.v) & (row >= sc_ref[1]) & (cols < sem.valid_vocab)


def _logits(sem: Semantics, vw: _View, h_ref, w_ref, b_ref, sc_ref, r0, c0, ok):
    """[bt, bv] logits of token rows ``r0`` and vocab rows ``c0`` (view-local): scale, bias, soft-cap, then
    masked columns set to MASK."""
    t_abs, w_abs = sc_ref[2] + r0, sc_ref[3] + c0
    t_end, w_end = sc_ref[2] + vw.n, sc_ref[3] + vw.v

    def step(k, acc):
        hb = _load_rows(h_ref, t_abs, vw.bt, t_end, k * vw.dk, vw.dk).astype(vw.cdt)
        wb = _load_rows(w_ref, w_abs, vw.bv, w_end, k * vw.dk, vw.dk).astype(vw.cdt)
        return acc + lax.dot_general(hb, wb, (((1,), (1,)), ((), ())), preferred_element_type=vw.acc)

    raw = lax.fori_loop(0, vw.d // vw.dk, step, jnp.zeros((vw.bt, vw.bv), vw.acc))
    if sem.logit_scale != 1.0:
        raw = raw * sem.logit_scale
    if b_ref is not None:
        raw = raw + _load_rows(b_ref, w_abs, vw.bv, w_end).astype(vw.acc)[None, :]
    if sem.softcap is not None:
        raw = sem.softcap * jnp.tanh(raw / sem.softcap)
    return jnp.where(ok[None, :], raw, MASK)


def _dlogits(sem: Semantics, z, ok, cols, y, lse, coef):
    """d(loss)/d(raw logit) of one tile, [bt, bv]; y, lse, coef are [bt]."""
    eps = sem.label_smoothing
    p = jnp.exp(z - lse[:, None])
    c = (1.0 + 2.0 * sem.z_loss * lse)[:, None] if sem.z_loss else 1.0
    dz = c * p - jnp.where(cols[None, :] == y[:, None], 1.0 - eps, 0.0)
    if eps:
        dz = dz - eps / sem.valid_vocab
    if sem.softcap is not None:
        dz = dz * (1.0 - jnp.square(z / sem.softcap))
    # Mask last: masked logits are -1e30, so tanh' there overflows and must not reach the product.
    return jnp.where(ok[None, :], dz * coef[:, None], 0.0)


def _token_vectors(vw: _View, sc_ref, r0, y_ref, lse_ref=None, coef_ref=None):
    """Labels, lse and coef [bt] of token rows r0 (view-local); rows past the view: label -1, coef 0."""
    t_abs, t_end = sc_ref[2] + r0, sc_ref[2] + vw.n
    y = _load_rows(y_ref, t_abs, vw.bt, t_end, other=-1)
    if lse_ref is None:
        return y
    return (y, _load_rows(lse_ref, t_abs, vw.bt, t_end).astype(vw.acc),
            _load_rows(coef_ref, t_abs, vw.bt, t_end).astype(vw.acc))


def _unpack(refs, has_bias: bool, n_in: int):
    """(inputs with b_ref = None when absent, outputs)."""
    ins = list(refs[:n_in])
    if not has_bias:
        ins.insert(2, None)
    return ins, refs[n_in:]


# ---------------------------------------------------------------------------------------- kernels

def _stats_kernel(sem: Semantics, vw: _View, per: int, n_pad: int, sc_ref, *refs):
    (h_ref, w_ref, b_ref, y_ref), (m_ref, s_ref, zy_ref, sz_ref) = _unpack(refs, vw.has_bias, 3 + vw.has_bias)
    i, split = pl.program_id(0), pl.program_id(1)
    r0 = i * vw.bt
    y = _token_vectors(vw, sc_ref, r0, y_ref)

    def step(t, carry):
        m, s, zy, sz = carry
        c0 = (split * per + t) * vw.bv
        cols, ok = _columns(sem, vw, sc_ref, c0)
        z = _logits(sem, vw, h_ref, w_ref, b_ref, sc_ref, r0, c0, ok)
        m_new = jnp.maximum(m, z.max(axis=1))
        s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[:, None]).sum(axis=1)
        zy = zy + jnp.where((cols[None, :] == y[:, None]) & ok[None, :], z, 0.0).sum(axis=1)
        if sem.label_smoothing:
            sz = sz + jnp.where(ok[None, :], z, 0.0).sum(axis=1)
        return m_new, s, zy, sz

    zero = jnp.zeros((vw.bt,), vw.acc)
    out = lax.fori_loop(0, per, step, (jnp.full((vw.bt,), MASK, vw.acc), zero, zero, zero))
    at = pl.ds(split * n_pad + r0, vw.bt)
    for ref, val in zip((m_ref, s_ref, zy_ref, sz_ref), out, strict=True):
        ref[at] = val


def _dh_kernel(sem: Semantics, vw: _View, per: int, sc_ref, *refs):
    (h_ref, w_ref, b_ref, y_ref, lse_ref, coef_ref, _), (acc_ref,) = _unpack(refs, vw.has_bias,
                                                                             6 + vw.has_bias)
    i, split = pl.program_id(0), pl.program_id(1)
    r0 = i * vw.bt
    y, lse, coef = _token_vectors(vw, sc_ref, r0, y_ref, lse_ref, coef_ref)
    w_end = sc_ref[3] + vw.v

    @pl.loop(0, per)
    def _vocab_block(t):
        c0 = (split * per + t) * vw.bv

        @pl.when(c0 < vw.v)
        def _():
            cols, ok = _columns(sem, vw, sc_ref, c0)
            z = _logits(sem, vw, h_ref, w_ref, b_ref, sc_ref, r0, c0, ok)
            dz = (_dlogits(sem, z, ok, cols, y, lse, coef) * sem.logit_scale).astype(vw.cdt)

            @pl.loop(0, vw.d // vw.dk)
            def _column_block(k):
                # Rows past W's end read zeros: their logits are masked, and 0 * garbage could be NaN.
                wb = _load_rows(w_ref, sc_ref[3] + c0, vw.bv, w_end, k * vw.dk, vw.dk).astype(vw.cdt)
                part = jnp.dot(dz, wb, preferred_element_type=vw.acc)
                plgpu.atomic_add(acc_ref, (pl.ds(r0, vw.bt), pl.ds(k * vw.dk, vw.dk)), part.astype(acc_ref.dtype))


def _dw_kernel(sem: Semantics, vw: _View, per: int, sc_ref, *refs):
    (h_ref, w_ref, b_ref, y_ref, lse_ref, coef_ref, _, _), (dw_ref, db_ref) = _unpack(
        refs, vw.has_bias, 7 + vw.has_bias)
    j, split = pl.program_id(0), pl.program_id(1)
    c0 = j * vw.bv
    cols, ok = _columns(sem, vw, sc_ref, c0)
    t_end = sc_ref[2] + vw.n

    @pl.loop(0, per)
    def _token_block(t):
        r0 = (split * per + t) * vw.bt

        @pl.when(r0 < vw.n)
        def _():
            y, lse, coef = _token_vectors(vw, sc_ref, r0, y_ref, lse_ref, coef_ref)
            z = _logits(sem, vw, h_ref, w_ref, b_ref, sc_ref, r0, c0, ok)
            dz = _dlogits(sem, z, ok, cols, y, lse, coef)   # rows past the view: coef 0, so dz 0
            plgpu.atomic_add(db_ref, (pl.ds(c0, vw.bv),), dz.sum(axis=0).astype(db_ref.dtype))
            dz = (dz * sem.logit_scale).astype(vw.cdt)

            @pl.loop(0, vw.d // vw.dk)
            def _column_block(k):
                hb = _load_rows(h_ref, sc_ref[2] + r0, vw.bt, t_end, k * vw.dk, vw.dk).astype(vw.cdt)
                part = lax.dot_general(dz, hb, (((0,), (0,)), ((), ())), preferred_element_type=vw.acc)
                plgpu.atomic_add(dw_ref, (pl.ds(c0, vw.bv), pl.ds(k * vw.dk, vw.dk)), part.astype(dw_ref.dtype))


# ------------------------------------------------------------------------------------- wrappers

def _compute_dtype(h_dtype, w_dtype):
    # bf16 hidden states: the tile matmuls run in bf16 (an fp32 W block is cast in registers), as XLA's
    # default precision rounds them; otherwise in the promoted dtype.
    return jnp.bfloat16 if h_dtype == jnp.bfloat16 else jnp.result_type(h_dtype, w_dtype)


def _view(plan: Plan, kernel: str, h, w, b, n: int, v: int) -> _View:
    t = plan.tiles
    cdt = _compute_dtype(h.dtype, w.dtype)
    acc = jnp.float64 if cdt == jnp.float64 else jnp.float32
    return _View(n, v, h.shape[1], t.token_block(kernel, n, plan.interpret),
                 t.vocab_block(kernel, v, plan.interpret), t.depth_block(h.shape[1]), b is not None, cdt, acc)


def _splits(blocks: int, other_blocks: int, t: tiles.GpuTiles) -> tuple[int, int]:
    """(splits, blocks per split) of the inner loop's ``other_blocks`` so that ``blocks x splits`` programs
    come near ``t.programs`` (enough to fill the GPU), each split a contiguous run of blocks."""
    want = max(1, min(other_blocks, -(-t.programs // max(blocks, 1))))
    per = -(-other_blocks // want)
    return -(-other_blocks // per), per


def _scalars(v_off, lo, t_off=0, w_off=0):
    """The scalar operand: [global index of w's row 0, first row of w to use, view's first token row,
    view's first row of w]."""
    return jnp.stack([jnp.asarray(x, jnp.int32) for x in (v_off, lo, t_off, w_off)])


def _call(plan: Plan, kernel, grid, out_shape, aliases=None, name="ce"):
    return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, input_output_aliases=aliases or {},
                          interpret=plan.interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=plan.tiles.warps,
                                                               num_stages=plan.tiles.stages))


def _operands(h, w, b, y, *rest):
    return (h, w) + (() if b is None else (b,)) + (y,) + rest


def local_stats(plan: Plan, h, w, b, y, v_off, lo=0):
    """h [N, d], w [V, d], b [V] | None, y [N] int32 -> (max, sumexp, label logit, logit sum), 4 x [N]
    fp32, over the rows ``lo:`` of ``w`` only."""
    n, v = h.shape[0], w.shape[0]
    vw = _view(plan, "stats", h, w, b, n, v)
    nbt, nbv = pl.cdiv(n, vw.bt), pl.cdiv(v, vw.bv)
    splits, per = _splits(nbt, nbv, plan.tiles)
    n_pad = nbt * vw.bt
    col = jax.ShapeDtypeStruct((splits * n_pad,), vw.acc)
    out = _call(plan, functools.partial(_stats_kernel, plan.sem, vw, per, n_pad), (nbt, splits), [col] * 4,
                name="ce_stats")(_scalars(v_off, lo), *_operands(h, w, b, y))
    m, s, zy, sz = (o.reshape(splits, n_pad)[:, :n] for o in out)
    gm = m.max(axis=0)   # the splits' partials merged as the vocabulary shards' are
    return gm, (s * jnp.exp(m - gm)).sum(axis=0), zy.sum(axis=0), sz.sum(axis=0)


def _chunk_rows(d: int, block: int, total: int) -> int:
    """Rows per chunk: an fp32 [rows, d] buffer of about ``tiles.GPU_CHUNK_BYTES``, whole blocks."""
    rows = max(block, tiles.GPU_CHUNK_BYTES // (4 * d) // block * block)
    return min(rows, -(-total // block) * block) if total >= block else total


def local_dh(plan: Plan, h, w, b, y, lse, coef, v_off, dh_in, lo=0):
    """dh_in + sum over this shard's rows ``lo:`` of dZ @ W: [N, d] in dh_in's dtype. Token chunks of
    ``_chunk_rows`` rows; each chunk's fp32 buffer is added into its rows of the result."""
    n, d = h.shape
    bt = plan.tiles.token_block("dh", n, plan.interpret)
    rows, count = split_blocks(n, _chunk_rows(d, bt, n))
    vw = _view(plan, "dh", h, w, b, rows, w.shape[0])
    nbt = pl.cdiv(rows, vw.bt)
    splits, per = _splits(nbt, pl.cdiv(vw.v, vw.bv), plan.tiles)
    lse, coef = lse.astype(jnp.float32), coef.astype(jnp.float32)
    kernel = _call(plan, functools.partial(_dh_kernel, plan.sem, vw, per), (nbt, splits),
                   jax.ShapeDtypeStruct((nbt * vw.bt, d), vw.acc), aliases={len(_operands(h, w, b, y)) + 3: 0},
                   name="ce_dh")

    def chunk(c, dh):
        t0 = block_start(c, rows, n)
        buf = kernel(_scalars(v_off, lo, t0), *_operands(h, w, b, y, lse, coef),
                     jnp.zeros((nbt * vw.bt, d), vw.acc))[:rows]
        old = lax.dynamic_slice_in_dim(dh, t0, rows)
        # The last chunk is shifted back to end at N: rows the previous chunk wrote keep their value.
        fresh = t0 + jnp.arange(rows) >= c * rows
        new = jnp.where(fresh[:, None], (old.astype(vw.acc) + buf).astype(dh.dtype), old)
        return lax.dynamic_update_slice_in_dim(dh, new, t0, 0)

    return lax.fori_loop(0, count, chunk, dh_in)


def local_dw(plan: Plan, h, w, b, y, lse, coef, v_off, dw_dtype, lo=0):
    """(dW [V, d] dw_dtype, db [V] fp32) of this shard's rows (rows before ``lo`` get zeros), summed over
    the local tokens. Vocabulary chunks of ``_chunk_rows`` rows, each written once."""
    n, d = h.shape
    v = w.shape[0]
    bv = plan.tiles.vocab_block("dw", v, plan.interpret)
    rows, count = split_blocks(v, _chunk_rows(d, bv, v))
    vw = _view(plan, "dw", h, w, b, n, rows)
    nbv = pl.cdiv(rows, vw.bv)
    splits, per = _splits(nbv, pl.cdiv(n, vw.bt), plan.tiles)
    lse, coef = lse.astype(jnp.float32), coef.astype(jnp.float32)
    n_ops = len(_operands(h, w, b, y))
    kernel = _call(plan, functools.partial(_dw_kernel, plan.sem, vw, per), (nbv, splits),
                   [jax.ShapeDtypeStruct((nbv * vw.bv, d), vw.acc),
                    jax.ShapeDtypeStruct((nbv * vw.bv,), vw.acc)],
                   aliases={n_ops + 3: 0, n_ops + 4: 1}, name="ce_dw")

    def chunk(c, carry):
        dw, db = carry
        r0 = block_start(c, rows, v)
        bw, bb = kernel(_scalars(v_off, lo, 0, r0), *_operands(h, w, b, y, lse, coef),
                        jnp.zeros((nbv * vw.bv, d), vw.acc), jnp.zeros((nbv * vw.bv,), vw.acc))
        # Each row's value is complete in its chunk: rows shared with the previous chunk are rewritten
        # with the same sums.
        return (lax.dynamic_update_slice_in_dim(dw, bw[:rows].astype(dw_dtype), r0, 0),
                lax.dynamic_update_slice_in_dim(db, bb[:rows].astype(db.dtype), r0, 0))

    return lax.fori_loop(0, count, chunk, (jnp.zeros((v, d), dw_dtype), jnp.zeros((v,), jnp.float32)))


def supported(d: int) -> tuple[bool, str]:
    """Whether the compiled kernels take this case, and why not: Triton's dots need tiles of at least 16
    along d, so d must be a multiple of 16 (ragged token and vocabulary edges are masked)."""
    if d % 16:
        return False, f"d={d} is not a multiple of 16 (the Triton tile matmuls need 16-wide column blocks)"
    return True, ""
