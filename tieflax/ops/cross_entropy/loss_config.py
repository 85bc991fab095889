"""The loss's static configuration and the block arithmetic every implementation shares.

``Cfg`` is hashable (it keys the cache of built custom-VJP functions); ``MASK`` is the value masked
logits take. Blocks: ``split_blocks`` sizes a loop, ``block_start`` shifts the last block back to end at
the array's end (no padding copy), ``fresh_rows`` marks the rows a shifted block shares with the previous.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from tieflax.ops.cross_entropy import tiles

# Large finite negative used for masked logits: exp(MASK - m) == 0 for any real max m, and unlike -inf it
# never makes (m_old - m_new) a NaN when a whole tile or shard is masked.
MASK = -1e30

MODES = ("recompute", "fused")
IMPLS = ("auto", "xla", "pallas", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Cfg:
    valid_vocab: int
    z_loss: float
    label_smoothing: float
    logit_scale: float
    softcap: float | None
    token_block: int  # XLA path; 0: the platform's default (``on``)
    vocab_block: int
    mode: str
    mesh: Mesh | None
    vocab_axis: str
    batch_axes: tuple[str, ...]
    impl: str = "xla"
    embed_axis: str | None = None  # mesh axis sharding W's d (dW is reduce-scattered over it)
    pallas: tiles.TpuBlocks = tiles.TpuBlocks(512, 512, 28)
    chunk: int = 0  # Pallas path, W's d sharded: vocab rows gathered per step
    rows_whole: bool = False  # W's rows not sharded in its layout: each device reads its shard in place
    mosaic: tiles.MosaicTiles = tiles.MosaicTiles()
    mosaic_ok: str = "unknown"  # '' when the Mosaic GPU kernels take this case, else why not
    platform: str = ""  # the platform lowered for, once known (``on``)

    def on(self, platform: str) -> Cfg:
        """This configuration as lowered for ``platform`` ('cpu', 'gpu' (CUDA or ROCm), 'tpu'): the XLA
        path's default blocks are that platform's (``tiles.xla_blocks``)."""
        bt, bv = tiles.xla_blocks(platform, self.mode, self.token_block, self.vocab_block)
        return dataclasses.replace(self, token_block=bt, vocab_block=bv, platform=platform)


# ----------------------------------------------------------------------------------------- tile math

def acc_dtype(*dtypes) -> Any:
    """fp32 accumulation, or fp64 when the inputs are fp64 (used by gradient checks)."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)



def split_blocks(n: int, block: int) -> tuple[int, int]:
    b = max(1, min(block, n))
    return b, -(-n // b)


def block_start(i, b: int, n: int):
    # The last block is shifted back to end at n (no padding copy of the operand); rows it shares with
    # the previous block are masked by `fresh_rows`.
    return jnp.minimum(i * b, n - b)


def fresh_rows(start, i, b: int):
    return start + jnp.arange(b) >= i * b



@dataclasses.dataclass(frozen=True)
class Semantics:
    """The loss's static switches, as the Pallas kernels see them."""
    valid_vocab: int
    z_loss: float
    label_smoothing: float
    logit_scale: float
    softcap: float | None

    @classmethod
    def of(cls, cfg: Cfg) -> Semantics:
        return cls(cfg.valid_vocab, cfg.z_loss, cfg.label_smoothing, cfg.logit_scale, cfg.softcap)
