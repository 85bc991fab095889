"""Evaluation beyond validation loss: generation with a KV cache (``decode``) and the
lm-evaluation-harness backend (``harness``)."""
