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
