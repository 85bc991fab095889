"""Kernels: the fused vocabulary-parallel cross-entropy and the vocabulary-parallel embedding lookup."""

from tieflax.ops.cross_entropy import cross_entropy
from tieflax.ops.embedding_lookup import vocab_parallel_embed

__all__ = ["cross_entropy", "vocab_parallel_embed"]
