"""Tile defaults per platform: the XLA path's blocks, the Pallas TPU kernels' blocks per generation.

One file so that a tuning run changes numbers here and nothing else.
"""

from __future__ import annotations

import dataclasses

# XLA path, recompute mode: the token block usually covers all local tokens (one pass over vocab blocks,
# no slice of the hidden states copied). Chosen by a CPU sweep (benchmarks/cross_entropy.py --sweep).
DEFAULT_TOKEN_BLOCK = 8192
DEFAULT_VOCAB_BLOCK = 256
DEFAULT_FUSED_TOKEN_BLOCK = 512
# Pallas TPU path on a mesh: rows of W gathered over the axis that shards d, and of dW reduced over the
# batch axes, one chunk at a time (an XLA loop around the kernels); one fp32 [rows, d] chunk is about
# this many bytes. Larger chunks re-read the fp32 dH accumulator fewer times at the cost of memory.
PALLAS_CHUNK_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class TpuBlocks:
    """Tile sizes and the scoped VMEM limit for one TPU generation."""
    token: int
    vocab: int
    vmem_limit_mib: int




# Per generation: VMEM per core is 16 MiB (v2-v4; libtpu reports 16 MiB for v4), 128 MiB (v5e, v6e),
# 95 MiB (v5p), 64 MiB (v7). A [1024, d] fp32 W block double-buffered plus the [bv, d] fp32 accumulator
# is 3 * 1024 * d * 4 bytes = 27 MiB at d = 2304; `tpu_blocks` halves the blocks until they fit.
_GENERATIONS = {
    "TPU v2": TpuBlocks(256, 256, 14), "TPU v3": TpuBlocks(256, 256, 14),
    "TPU v4": TpuBlocks(256, 512, 14), "TPU v4 lite": TpuBlocks(256, 512, 14),
    "TPU v5 lite": TpuBlocks(512, 1024, 100), "TPU v5e": TpuBlocks(512, 1024, 100),
    "TPU v5": TpuBlocks(512, 1024, 80), "TPU v5p": TpuBlocks(512, 1024, 80),
    "TPU v6 lite": TpuBlocks(512, 1024, 100), "TPU v6e": TpuBlocks(512, 1024, 100),
    "TPU7x": TpuBlocks(512, 1024, 56), "TPU7": TpuBlocks(512, 1024, 56),
}
_DEFAULT = TpuBlocks(256, 512, 14)  # unknown kind (no mesh to read it from): fits every generation


def tpu_blocks(device_kind: str, d: int, w_bytes: int) -> TpuBlocks:
    """Generation table, with the larger block halved until the biggest kernel's buffers fit in 3/4 of
    the VMEM limit: double-buffered W and hidden blocks, a few [bt, bv] fp32 tiles, and either the fp32
    [bv, d] accumulator with its double-buffered output (dW) or the [bt, d] accumulator, input and
    output blocks (dH)."""
    b = _GENERATIONS.get(device_kind, _DEFAULT)
    bt, bv = b.token, b.vocab

    def need(bt, bv):
        common = 2 * bv * d * w_bytes + 2 * bt * d * 4 + 6 * bt * bv * 4
        return common + max(3 * bv * d * 4, 5 * bt * d * 4)

    while need(bt, bv) > 0.75 * b.vmem_limit_mib * 2**20 and max(bt, bv) > 128:
        if bv >= bt:
            bv //= 2
        else:
            bt //= 2
    return TpuBlocks(bt, bv, b.vmem_limit_mib)


# ---------------------------------------------------------------------------- XLA path, per platform

# XLA:GPU (measured on one H200, loss + gradients at the Llama-3-8B head, N=16384, d=4096, V=128256):
# 8192 x 256 tiles took 302 ms, 16384 x 2048 took 120 ms (one pass over 63 vocab blocks: cuBLAS gets
# matmuls large enough to fill the chip; the [bt, bv] fp32 tile is 128 MiB). Fused mode, token block
# 2048: 88 ms against 112 ms at 512.
XLA_GPU_TOKEN_BLOCK = 16384
XLA_GPU_VOCAB_BLOCK = 2048
XLA_GPU_FUSED_TOKEN_BLOCK = 2048


def xla_blocks(platform: str, mode: str, token_block: int, vocab_block: int) -> tuple[int, int]:
    """(token block, vocab block) of the XLA path when lowered for ``platform`` ('cpu', 'gpu', 'tpu'); a
    block given (> 0) is kept, the others take this platform's default."""
    gpu = platform == "gpu"
    if mode == "fused":
        default_t = XLA_GPU_FUSED_TOKEN_BLOCK if gpu else DEFAULT_FUSED_TOKEN_BLOCK
    else:
        default_t = XLA_GPU_TOKEN_BLOCK if gpu else DEFAULT_TOKEN_BLOCK
    default_v = XLA_GPU_VOCAB_BLOCK if gpu else DEFAULT_VOCAB_BLOCK
    return token_block or default_t, vocab_block or default_v


# ------------------------------------------------------------------------------ Pallas Mosaic GPU kernels

@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tiles of the Mosaic GPU kernels (``mosaic_gpu.py``): ``[token, vocab]`` logit tiles (``token`` a
    multiple of 64, one wgmma M per 64 rows), each the sum over d of ``depth``-wide column blocks
    (64 bf16 = one 128-byte swizzled row) that TMA brings ``steps`` blocks ahead; ``programs``: how many
    CTAs a kernel should have (two per SM of an H100/H200, 132 SMs) before a token block's vocabulary
    loop is split over several. Shared memory per CTA: ``steps * (token + vocab) * depth * 2`` bytes of
    pipeline buffers (128 KiB at the defaults) plus a bf16 ``[token, vocab]`` dZ tile (32 KiB), under
    sm_90's 227 KiB (checked by lowering: ``benchmarks/gpu.py --lower``).

    The backward's chunks bound its temporaries: an fp32 ``[rows, d]`` dH buffer of about
    ``token_chunk_bytes``, a bf16 ``[rows, d]`` copy of W's rows of about ``vocab_chunk_bytes``, and the
    bf16 dZ chunk between them, ``token rows x vocab rows x 2`` bytes, at most ``dz_chunk_bytes`` (the
    vocabulary chunk shrinks to keep it there). None of this has been timed on
    a GPU yet (no GPU at hand when written)."""
    token: int = 128
    vocab: int = 128
    depth: int = 64
    steps: int = 4
    programs: int = 264
    token_chunk_bytes: int = 32 * 2**20
    vocab_chunk_bytes: int = 16 * 2**20
    dz_chunk_bytes: int = 32 * 2**20


MOSAIC_TILES = MosaicTiles()


def mosaic_tiles(token_block: int | None, vocab_block: int | None) -> MosaicTiles:
    """The Mosaic GPU kernels' tiles (``MOSAIC_TILES``, read at call time so tests can shrink them), with
    the token and vocabulary blocks the caller gave rounded down to multiples of 64 (at least 64)."""
    t = MOSAIC_TILES
    fit = lambda b, default: max(64, b // 64 * 64) if b else default  # noqa: E731
    return dataclasses.replace(t, token=fit(token_block, t.token), vocab=fit(vocab_block, t.vocab))
