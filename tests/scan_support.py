"""Helpers shared by the tests of scanned layers (a helper module, not a test file): two small model
families (``FAMILIES``: Llama, and Gemma 2 with alternating local and global layers), a batch of tokens
and its targets, and ``init_params`` (a model's parameters, initialised on that batch from key 0, unboxed).

Used by tests/test_scan.py and tests/test_layer_loop.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tieflax.model import ModelConfig, TransformerLM

V, B, T = 100, 2, 8
BASE = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32)
FAMILIES = {
    "llama": ModelConfig(family="llama", **BASE),
    # Gemma 2: local (window 3) and global layers alternate, so the scan steps over pairs of layers.
    "gemma2": ModelConfig(family="gemma2", sliding_window=3, sliding_window_every=2, sandwich_norms=True,
                          attn_softcap=5.0, final_logit_softcap=3.0, norm_unit_offset=True, mlp="geglu", **BASE),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (B, T)), jnp.int32)
TARGETS = jnp.roll(TOKENS, -1, axis=1)


def init_params(c: ModelConfig) -> dict:
    import flax.linen as nn

    return nn.unbox(TransformerLM(c).init(jax.random.key(0), TOKENS)["params"])
