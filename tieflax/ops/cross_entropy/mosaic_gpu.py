"""Pallas **Mosaic GPU** kernels of the fused cross-entropy (``impl='mosaic_gpu'``), one vocabulary shard.

Hopper and newer (wgmma, TMA). Four matmul passes of ``2 N V d`` FLOPs per loss + gradients:

1. **statistics** (forward): kernel ``_stats_body``. Each CTA takes one token block of ``bt`` rows and a
   run of ``bv``-row vocabulary blocks; a logit tile ``[bt, bv]`` is the sum over ``d`` of ``[bt, dk] x
   [bv, dk]`` wgmma products whose operands TMA brings into shared memory ``steps`` blocks ahead
   (``plgpu.emit_pipeline``); the online max / sum-exp / label logit / logit sum stay in registers and
   each CTA writes ``[bt]`` partials per run (merged in XLA like vocabulary shards).
2. **backward**: kernel ``_dz_body`` recomputes each logit tile **once** (the same pipeline), turns it
   into ``dZ = d loss / d raw logit`` in registers and stores it, bf16, into a bounded ``[Nc, Vc]``
   chunk; then the **two gradient matmuls** of that chunk, ``dH_c += dZ @ W_v`` and ``dW_v += dZ^T @
   H_c``, run as plain GEMMs (XLA's, i.e. cuBLAS on a GPU: a GEMM is already at the chip's matmul floor,
   so a hand-written one would not pay). 1 + 1 + 2 = 4 matmul passes; the Triton kernels took 5.

Where the gradients accumulate (shapes at the Llama-3-8B head, N=16384, d=4096, V=128256, tiles.py's
``MosaicTiles`` defaults: token chunks of ``Nc = 2048`` rows, vocabulary chunks of ``Vc = 2048`` rows):

- ``dH``: an fp32 ``[Nc, d]`` buffer (32 MiB) per token chunk, summed over every vocabulary chunk, then
  written once into dH (h.dtype, or the fp32 partial the driver sums over vocabulary shards).
- ``dW``: added chunk by chunk into dW itself, ``[Vc, d]`` at a time (the GEMM's fp32 block: 32 MiB).
  With W fp32 dW is fp32 and exact; with W bf16 dW is bf16 and rounds once per token chunk
  (``N / Nc = 8`` roundings at the 8B head; an fp32 ``[V, d]`` accumulator would be a 2 GiB temporary).
  The driver's chunked paths (W's d sharded, rows whole, dW reduced over batch shards) pass an fp32
  chunk instead.
- The bias gradient: ``dZ`` summed over tokens in fp32 per chunk.
- Temporaries: the dH buffer, the dW block, the bf16 ``dZ`` chunk ``[Nc, Vc]`` (8 MiB), the bf16 copy
  of the W chunk ``[Vc, d]`` (16 MiB: W fp32 is rounded here, per chunk, never as a whole) and of the H
  chunk ``[Nc, d]`` (16 MiB). Compiled for an H100 and an H200 without a device: 88.2 MiB of
  temporaries for W bf16 and W fp32 alike (``benchmarks/README.md``).

Rounding accepted (against the fp32 reference): the tile matmuls are bf16 x bf16 -> fp32 wgmma (fp32
hidden states or W are rounded to bf16 in the chunk copies, as XLA's default GPU precision would), and
``dZ`` is rounded to bf16 before the gradient GEMMs, as on the XLA path. The interpreter tests hold the
loss to 2e-3 and the gradients to 1e-2 of the largest reference value (float64 oracle fed the same
inputs; ``tests/test_cross_entropy_mosaic_gpu.py``).

Ragged edges never reach a kernel: chunks are sliced in XLA with the last one shifted back to end at the
array's end (rows shared with the previous chunk get no weight: ``coef`` 0 for tokens, the column mask
for vocabulary rows) and padded with zeros to whole tiles only when a dimension is smaller than a chunk.
Each vocabulary chunk carries a ``[2, Vc]`` column operand (bias; 1 where the row is a real, fresh
vocabulary row below ``valid_vocab``), and labels are shifted to the chunk's rows, so the kernels need no
scalars. Semantics are those of ``tieflax.ops.cross_entropy`` (its docstring).

Interpreted (jax >= 0.12's Mosaic GPU interpreter, ``InterpretGPUParams``: shared memory, barriers, TMA
and wgmma simulated on a CPU) when the program is compiled for another platform: how the tests run it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax

from tieflax.ops.cross_entropy import tiles
from tieflax.ops.cross_entropy.loss_config import MASK, Cfg, Semantics, block_start

# The Pallas Mosaic GPU API (jax >= 0.7 has it; jaxlib ships Mosaic GPU's lowering on every platform),
# imported where first needed (``available``, ``interpretable``, ``plan``: every way into the kernels), not
# with this module: the import costs 0.14 CPU-s (jax 0.10.2), which every process that imports the loss paid,
# and a run on a CPU or TPU never uses.
pl = plgpu = None
_API_ERROR: str | None = None   # None: not imported yet; '' once imported; else why this jax lacks it


def _api() -> str:
    """Imports the API into ``pl`` and ``plgpu``, once; '' when this jax has it, else why not."""
    global pl, plgpu, _API_ERROR
    if _API_ERROR is None:
        try:
            import jax.experimental.pallas as pallas  # noqa: PLC0415
            from jax.experimental.pallas import mosaic_gpu as pallas_mosaic_gpu  # noqa: PLC0415
        except ImportError as e:  # pragma: no cover (both supported stacks have it)
            _API_ERROR = f"jax {jax.__version__} has no Pallas Mosaic GPU API ({e})"
        else:
            pl, plgpu, _API_ERROR = pallas, pallas_mosaic_gpu, ""
    return _API_ERROR


def available() -> tuple[bool, str]:
    """Whether this jax can lower the kernels for a GPU, and why not."""
    why = _api()
    return not why, why


def interpretable() -> tuple[bool, str]:
    """Whether this jax can run the kernels on a CPU (the Mosaic GPU interpreter, jax >= 0.12)."""
    why = _api()
    if why:
        return False, why
    if not hasattr(plgpu, "InterpretGPUParams"):
        return False, (f"jax {jax.__version__} has no Mosaic GPU interpreter (jax >= 0.12 has "
                       f"InterpretGPUParams)")
    return True, ""


def supported(d: int, h_dtype) -> tuple[bool, str]:
    """Whether the kernels take this case, and why not: d in whole 64-column blocks (one 128-byte
    swizzled bf16 row per TMA block), bf16 or fp32 hidden states."""
    if d % 64:
        return False, f"d={d} is not a multiple of 64 (the kernels read 64-column bf16 blocks by TMA)"
    if jnp.dtype(h_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return False, f"hidden states are {jnp.dtype(h_dtype).name}; the kernels take bf16 or fp32"
    return True, ""


# Device kinds before Hopper that a CUDA device or a compile-only target may name (no wgmma there).
_PRE_HOPPER = ("a100", "a10", "a30", "a40", "a16", "a2 ", "l4", "l40", "v100", "t4", "p100", "rtx", "titan",
               "geforce", "quadro")


def before_hopper(device) -> str:
    """'' when ``device`` (a CUDA device, a compile-only target's device, or None: unknown) is Hopper or
    newer or unknown, else why the kernels do not fit it. The compute capability where the device has
    one, else its kind's name."""
    if device is None:
        return ""
    cc = getattr(device, "compute_capability", None)
    if cc:
        return "" if float(cc) >= 9.0 else f"{device.device_kind} is sm_{str(cc).replace('.', '')}: wgmma needs sm_90+"
    kind = str(getattr(device, "device_kind", "")).lower()
    if any(k in kind + " " for k in _PRE_HOPPER):
        return f"{device.device_kind} is older than Hopper: wgmma needs sm_90+"
    return ""


# ------------------------------------------------------------------------------------------ plan

@dataclasses.dataclass(frozen=True)
class Plan:
    sem: Semantics
    tiles: tiles.MosaicTiles
    interpret: object  # None: compiled for the GPU; else the interpreter's parameters


def plan(cfg: Cfg, interpret: bool) -> Plan:
    """The kernels' static plan for one call: semantics, tiles, compile or interpret."""
    _api()   # the kernels below use pl and plgpu
    return Plan(Semantics.of(cfg), cfg.mosaic, _interpret_params() if interpret else None)


def _interpret_params():
    ok, why = interpretable()
    if not ok:
        raise ValueError(f"impl='mosaic_gpu' on a CPU needs the Mosaic GPU interpreter: {why}; use the "
                         f"Python 3.12 stack (jax 0.12), or impl='xla'.")
    _per_device_barrier_check()
    return plgpu.InterpretGPUParams()


@functools.cache
def _per_device_barrier_check():
    """jax 0.12.1's interpreter checks, as each kernel ends, that no barrier is left allocated in its
    simulated memory, but that memory is shared by every device of a ``shard_map``: a device that ends
    first sees the barriers of the others, still running, and fails ("Barrier remains allocated"). The
    same check, restricted to the device that ends (what it means to check), is installed instead.
    Interpreter only; nothing compiled for a GPU passes here."""
    from jax._src import callback  # noqa: PLC0415
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret  # noqa: PLC0415

    def check(token, device_id):
        mem = gpu_callbacks._get_shared_memory().mem
        left = [k for k, a in list(mem.items()) if getattr(k, "device_id", None) == int(device_id)
                and type(a).__name__ in ("Barrier", "ClusterBarrier")]
        assert not left, f"barriers remain allocated: {left}"
        return token

    def call(token):
        device = jnp.int32(jaxpr_interpret.DeviceInfo().device_id)
        return callback.io_callback(check, gpu_callbacks.TOKEN_SHAPE_DTYPE, token, device)

    gpu_callbacks.call_assert_no_barriers_allocated = call


# ------------------------------------------------------------------------------------- tile math

def _load(ref, layout):
    """``plgpu.load`` of a whole ref: jax 0.10 takes an index argument, jax 0.12 does not."""
    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _rows(x, bt: int, bv: int):
    return lax.broadcast_in_dim(x, (bt, bv), [0])


def _cols(x, bt: int, bv: int):
    return lax.broadcast_in_dim(x, (bt, bv), [1])


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What one kernel call sees: ``n`` token rows (whole ``bt`` blocks), ``v`` vocabulary rows (whole
    ``bv`` blocks), ``d`` columns (whole ``dk`` blocks), ``splits`` CTAs per token block, each walking
    ``per`` vocabulary blocks, ``steps`` TMA stages."""
    n: int
    v: int
    d: int
    bt: int
    bv: int
    dk: int
    steps: int
    splits: int
    per: int


def _logit_tile(s: _Shape, h_ref, w_ref, i, j):
    """Raw logits ``H[i] . W[j]^T`` of tile (i, j), [bt, bv] fp32 in the WGMMA layout: the sum over d
    of [bt, dk] x [bv, dk] bf16 wgmma products, both operands brought by TMA ``steps`` blocks ahead."""
    swizzle = plgpu.find_swizzle(s.dk * 16)   # bits of one bf16 row of a block
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    def step(_, h_smem, w_smem, acc_ref):
        plgpu.wgmma(acc_ref, h_smem, w_smem.T)
        plgpu.wgmma_wait(0)   # the stage's buffers are released to TMA once the product is done

    def run(acc_ref):
        plgpu.emit_pipeline(
            lambda idx, h_smem, w_smem: step(idx, h_smem, w_smem, acc_ref), grid=(s.d // s.dk,),
            in_specs=[plgpu.BlockSpec((s.bt, s.dk), lambda k: (i, k), transforms=transforms),
                      plgpu.BlockSpec((s.bv, s.dk), lambda k: (j, k), transforms=transforms)],
            max_concurrent_steps=s.steps)(h_ref, w_ref)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC((s.bt, s.bv), jnp.float32))


def _logits(sem: Semantics, s: _Shape, h_ref, w_ref, c_ref, c_smem, bar, i, j):
    """(z, ok, cols) of tile (i, j): logits after scale, bias and soft-cap with masked columns at MASK;
    ``ok`` [bt, bv] bool, ``cols`` [bt, bv] int32 (the chunk's row index of each column)."""
    plgpu.copy_gmem_to_smem(c_ref.at[:, pl.ds(j * s.bv, s.bv)], c_smem, bar)
    plgpu.barrier_wait(bar)
    raw = _logit_tile(s, h_ref, w_ref, i, j)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    if sem.logit_scale != 1.0:
        raw = raw * sem.logit_scale
    raw = raw + _cols(_load(c_smem.at[0], col_layout), s.bt, s.bv)   # bias (0 without one)
    if sem.softcap is not None:
        raw = sem.softcap * jnp.tanh(raw / sem.softcap)
    ok = _cols(_load(c_smem.at[1], col_layout), s.bt, s.bv) > 0
    cols = plgpu.broadcasted_iota(jnp.int32, (s.bt, s.bv), 1, layout=plgpu.Layout.WGMMA) + j * s.bv
    return jnp.where(ok, raw, MASK), ok, cols


def _token_vector(ref, smem, bar, i, bt: int):
    """Rows ``i * bt : (i + 1) * bt`` of a [n] token vector, in the layout of a tile's rows."""
    plgpu.copy_gmem_to_smem(ref.at[pl.ds(i * bt, bt)], smem, bar)
    plgpu.barrier_wait(bar)
    return _load(smem, plgpu.Layout.WGMMA.reduce(1))


# ---------------------------------------------------------------------------------------- kernels

def _stats_body(sem: Semantics, s: _Shape, h_ref, w_ref, c_ref, y_ref, m_ref, se_ref, zy_ref, sz_ref,
                y_smem, c_smem, out_smem, bar):
    i, split = lax.axis_index("t"), lax.axis_index("s")
    y = _rows(_token_vector(y_ref, y_smem, bar.at[0], i, s.bt), s.bt, s.bv)

    def vocab_block(t, carry):
        m, se, zy, sz = carry
        j = jnp.minimum(split * s.per + t, s.v // s.bv - 1)
        z, ok, cols = _logits(sem, s, h_ref, w_ref, c_ref, c_smem, bar.at[1], i, j)
        # A run past the last block re-reads it: counted once, by the run that owns it.
        ok = ok & (split * s.per + t < s.v // s.bv)
        z = jnp.where(ok, z, MASK)
        m_new = jnp.maximum(m, z.max(axis=1))
        se = se * jnp.exp(m - m_new) + jnp.exp(z - _rows(m_new, s.bt, s.bv)).sum(axis=1)
        zy = zy + jnp.where((cols == y) & ok, z, 0.0).sum(axis=1)
        if sem.label_smoothing:
            sz = sz + jnp.where(ok, z, 0.0).sum(axis=1)
        return m_new, se, zy, sz

    def full(x):
        return plgpu.layout_cast(jnp.full((s.bt,), x, jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    out = lax.fori_loop(0, s.per, vocab_block, (full(MASK), full(0.0), full(0.0), full(0.0)))
    for k, val in enumerate(out):
        out_smem[k] = val
    plgpu.commit_smem()
    for k, ref in enumerate((m_ref, se_ref, zy_ref, sz_ref)):
        plgpu.copy_smem_to_gmem(out_smem.at[k], ref.at[split, pl.ds(i * s.bt, s.bt)])
    plgpu.wait_smem_to_gmem(0)


def _dz_body(sem: Semantics, s: _Shape, h_ref, w_ref, c_ref, y_ref, lse_ref, coef_ref, dz_ref,
             y_smem, f_smem, c_smem, dz_smem, bar):
    i, split = lax.axis_index("t"), lax.axis_index("s")
    y = _rows(_token_vector(y_ref, y_smem, bar.at[0], i, s.bt), s.bt, s.bv)
    lse = _rows(_token_vector(lse_ref, f_smem.at[0], bar.at[1], i, s.bt), s.bt, s.bv)
    coef = _rows(_token_vector(coef_ref, f_smem.at[1], bar.at[2], i, s.bt), s.bt, s.bv)
    eps = sem.label_smoothing

    @pl.loop(0, s.per)
    def _vocab_block(t):
        j = split * s.per + t

        @pl.when(j < s.v // s.bv)
        def _():
            z, ok, cols = _logits(sem, s, h_ref, w_ref, c_ref, c_smem, bar.at[3], i, j)
            p = jnp.exp(z - lse)
            dz = (1.0 + 2.0 * sem.z_loss * lse) * p if sem.z_loss else p
            dz = dz - jnp.where(cols == y, 1.0 - eps, 0.0)
            if eps:
                dz = dz - eps / sem.valid_vocab
            if sem.softcap is not None:
                dz = dz * (1.0 - jnp.square(z / sem.softcap))
            # Mask last: masked logits are -1e30, so tanh' there overflows and must not reach the product.
            dz = jnp.where(ok, dz * coef, 0.0)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's store has read dz_smem
            dz_smem[...] = dz.astype(dz_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dz_smem, dz_ref.at[pl.ds(i * s.bt, s.bt), pl.ds(j * s.bv, s.bv)])

    plgpu.wait_smem_to_gmem(0)


def _shape(p: Plan, n: int, v: int, d: int) -> _Shape:
    t = p.tiles
    nbt, nbv = n // t.token, v // t.vocab
    want = max(1, min(nbv, -(-t.programs // nbt)))    # enough CTAs to fill the GPU
    per = -(-nbv // want)
    return _Shape(n, v, d, t.token, t.vocab, t.depth, t.steps, -(-nbv // per), per)


def _kernel(p: Plan, body, s: _Shape, out_type, scratch):
    return plgpu.kernel(functools.partial(body, p.sem, s), out_type=out_type, grid=(s.n // s.bt, s.splits),
                        grid_names=("t", "s"), scratch_types=scratch, interpret=p.interpret)


def _smem_transforms(cols: int):
    swizzle = plgpu.find_swizzle(cols * 16)
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _stats_call(p: Plan, h, w, cvec, y):
    """h [n, d] bf16, w [v, d] bf16, cvec [2, v] fp32, y [n] int32 (chunk rows) -> 4 x [splits, n] fp32."""
    s = _shape(p, h.shape[0], w.shape[0], h.shape[1])
    part = jax.ShapeDtypeStruct((s.splits, s.n), jnp.float32)
    scratch = [plgpu.SMEM((s.bt,), jnp.int32), plgpu.SMEM((2, s.bv), jnp.float32),
               plgpu.SMEM((4, s.bt), jnp.float32), plgpu.Barrier(num_barriers=2)]
    return _kernel(p, _stats_body, s, (part,) * 4, scratch)(h, w, cvec, y)


def _dz_call(p: Plan, h, w, cvec, y, lse, coef):
    """dZ [n, v] bf16 of a chunk: h [n, d] bf16, w [v, d] bf16, cvec [2, v], y, lse, coef [n]."""
    s = _shape(p, h.shape[0], w.shape[0], h.shape[1])
    scratch = [plgpu.SMEM((s.bt,), jnp.int32), plgpu.SMEM((2, s.bt), jnp.float32),
               plgpu.SMEM((2, s.bv), jnp.float32),
               plgpu.SMEM((s.bt, s.bv), jnp.bfloat16, transforms=_smem_transforms(s.bv)),
               plgpu.Barrier(num_barriers=4)]
    return _kernel(p, _dz_body, s, jax.ShapeDtypeStruct((s.n, s.v), jnp.bfloat16), scratch)(
        h, w, cvec, y, lse, coef)


# ------------------------------------------------------------------------------------------- chunks

@dataclasses.dataclass(frozen=True)
class _Chunks:
    """Chunks of ``total`` rows: ``rows`` each (whole blocks, or ``total`` padded to whole blocks when
    smaller), ``count`` of them, the last shifted back to end at ``total``."""
    total: int
    rows: int
    padded: int
    count: int

    @classmethod
    def of(cls, total: int, block: int, cap: int) -> _Chunks:
        rows = max(block, min(cap, total) // block * block)
        if total <= rows:
            return cls(total, total, -(-total // block) * block, 1)
        return cls(total, rows, rows, -(-total // rows))

    def start(self, c):
        return 0 if self.count == 1 else block_start(c, self.rows, self.total)

    def fresh(self, c, start):
        """[padded] bool: rows of chunk c that are real and not already covered by chunk c - 1."""
        r = jnp.arange(self.padded)
        return (r < self.rows) & (start + r >= c * self.rows)

    def take(self, x, start, dtype=None):
        """The chunk's rows of x (leading axis), padded with zeros to ``padded`` rows."""
        blk = lax.dynamic_slice_in_dim(x, start, self.rows) if self.count > 1 else x
        blk = blk if dtype is None else blk.astype(dtype)
        pad = [(0, self.padded - self.rows)] + [(0, 0)] * (x.ndim - 1)
        return jnp.pad(blk, pad) if self.padded > self.rows else blk


def _token_chunks(p: Plan, n: int, d: int, grads: bool) -> _Chunks:
    # Statistics hold no [rows, d] buffer: one chunk of all whole blocks (two when N is ragged).
    cap = p.tiles.token_chunk_bytes // (4 * d) if grads else n
    return _Chunks.of(n, p.tiles.token, cap)


def _vocab_chunks(p: Plan, v: int, d: int, token_rows: int = 0) -> _Chunks:
    """Vocabulary chunks: a bf16 [rows, d] copy of W of about ``vocab_chunk_bytes``, and with
    ``token_rows`` (the backward) a bf16 [token_rows, rows] dZ of at most ``dz_chunk_bytes``."""
    cap = p.tiles.vocab_chunk_bytes // (2 * d)
    if token_rows:
        cap = min(cap, p.tiles.dz_chunk_bytes // (2 * token_rows))
    return _Chunks.of(v, p.tiles.vocab, cap)


def _column_operand(sem: Semantics, vc: _Chunks, k, v0, v_off, lo, b):
    """[2, padded] fp32 of vocabulary chunk k: the bias (0 without one) and 1 where the row is a real,
    fresh row of the shard (at or after ``lo``) below the global valid vocabulary."""
    r = jnp.arange(vc.padded)
    ok = vc.fresh(k, v0) & (v0 + r >= lo) & (v_off + v0 + r < sem.valid_vocab)
    bias = jnp.zeros((vc.padded,), jnp.float32) if b is None else vc.take(b, v0, jnp.float32)
    return jnp.stack([bias, ok.astype(jnp.float32)])


def local_stats(p: Plan, h, w, b, y, v_off, lo=0):
    """h [N, d], w [V, d], b [V] | None, y [N] int32 -> (max, sumexp, label logit, logit sum), 4 x [N]
    fp32, over the rows ``lo:`` of ``w`` (global rows from ``v_off``)."""
    n, d = h.shape
    tc, vc = _token_chunks(p, n, d, False), _vocab_chunks(p, w.shape[0], d)

    def token_step(c, out):
        t0 = tc.start(c)
        hc, yc = tc.take(h, t0, jnp.bfloat16), tc.take(y, t0)

        def vocab_step(k, carry):
            m, se, zy, sz = carry
            v0 = vc.start(k)
            parts = _stats_call(p, hc, vc.take(w, v0, jnp.bfloat16), _column_operand(p.sem, vc, k, v0, v_off, lo, b),
                                yc - (v_off + v0))
            cm, cse, czy, csz = parts
            cm_max = cm.max(axis=0)    # the runs' partials, merged as vocabulary shards are
            cse = (cse * jnp.exp(cm - cm_max)).sum(axis=0)
            m_new = jnp.maximum(m, cm_max)
            se = se * jnp.exp(m - m_new) + cse * jnp.exp(cm_max - m_new)
            return m_new, se, zy + czy.sum(axis=0), sz + csz.sum(axis=0)

        zero = jnp.zeros((tc.padded,), jnp.float32)
        blk = lax.fori_loop(0, vc.count, vocab_step, (jnp.full((tc.padded,), MASK, jnp.float32),) + (zero,) * 3)
        fresh = tc.fresh(c, t0)[:tc.rows]
        put = lambda o, r: lax.dynamic_update_slice_in_dim(  # noqa: E731
            o, jnp.where(fresh, r[:tc.rows], lax.dynamic_slice_in_dim(o, t0, tc.rows)), t0, 0)
        return tuple(put(o, r) for o, r in zip(out, blk, strict=True))

    out = tuple(jnp.zeros((n,), jnp.float32) for _ in range(4))
    return lax.fori_loop(0, tc.count, token_step, out)


def local_grads(p: Plan, h, w, b, y, lse, coef, v_off, dh_in, dw_dtype, lo=0):
    """(dh_in + dZ @ W [N, d] dh_in.dtype, dW [V, d] dw_dtype, db [V] fp32) over the rows ``lo:`` of
    ``w``; rows before ``lo`` get zero dW and db. One logit tile recomputation per (token, vocab) pair."""
    n, d = h.shape
    v = w.shape[0]
    tc = _token_chunks(p, n, d, True)
    vc = _vocab_chunks(p, v, d, tc.padded)
    scale = p.sem.logit_scale
    lse, coef = lse.astype(jnp.float32), coef.astype(jnp.float32)

    def token_step(c, carry):
        dh, dw, db = carry
        t0 = tc.start(c)
        fresh = tc.fresh(c, t0)
        hc, yc, lc = tc.take(h, t0, jnp.bfloat16), tc.take(y, t0), tc.take(lse, t0)
        cc = jnp.where(fresh, tc.take(coef, t0), 0.0)   # shared and padded rows: no gradient
        acc0 = tc.take(dh, t0, jnp.float32)

        def vocab_step(k, inner):
            acc, dw, db = inner
            v0 = vc.start(k)
            wc = vc.take(w, v0, jnp.bfloat16)
            dz = _dz_call(p, hc, wc, _column_operand(p.sem, vc, k, v0, v_off, lo, b), yc - (v_off + v0), lc, cc)
            acc = acc + scale * jnp.dot(dz, wc, preferred_element_type=jnp.float32)
            dwc = scale * lax.dot_general(dz, hc, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            old = lax.dynamic_slice_in_dim(dw, v0, vc.rows)
            dw = lax.dynamic_update_slice_in_dim(dw, (old.astype(jnp.float32) + dwc[:vc.rows]).astype(dw.dtype), v0, 0)
            if b is not None:
                dbc = dz.astype(jnp.float32).sum(axis=0)[:vc.rows]
                db = lax.dynamic_update_slice_in_dim(db, lax.dynamic_slice_in_dim(db, v0, vc.rows) + dbc, v0, 0)
            return acc, dw, db

        acc, dw, db = lax.fori_loop(0, vc.count, vocab_step, (acc0, dw, db))
        # Rows shared with the previous chunk got no gradient here: their sums are the previous chunk's.
        dh = lax.dynamic_update_slice_in_dim(dh, acc[:tc.rows].astype(dh.dtype), t0, 0)
        return dh, dw, db

    init = (dh_in, jnp.zeros(w.shape, dw_dtype), jnp.zeros((v,), jnp.float32))
    return lax.fori_loop(0, tc.count, token_step, init)
