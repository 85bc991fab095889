"""The model's fused loss path: tied and untied share it, and it equals the dense loss from logits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tieflax.model import ModelConfig, TransformerLM
from tieflax.model.surgery import untie
from tieflax.sharding import make_mesh

V, D = 1000, 32  # V_pad = 1024: 24 padded rows, and V is not a multiple of any block or shard count


def config(tied, **kw):
    return ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=4, d_ff=64, tie_embeddings=tied,
                       final_logit_softcap=5.0, logit_scale_rsqrt_d=True, head_bias=True, **kw)


TOKENS = jax.random.randint(jax.random.key(1), (8, 16), 0, V)
TARGETS = jnp.roll(TOKENS, -1, axis=1).at[:, -1].set(-1)  # the last position has no target


def dense_loss(c, params):
    logits = TransformerLM(c).apply({"params": params}, TOKENS)[..., :V]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, jnp.maximum(TARGETS, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(TARGETS >= 0, nll, 0.0).sum()


def fused_loss(c, params, mesh=None):
    loss, aux = TransformerLM(c, mesh=mesh).apply({"params": params}, TOKENS, TARGETS, method="loss",
                                                  token_block=32, vocab_block=256)
    return loss.sum(), aux


@pytest.fixture(scope="module")
def tied_params():
    params = nn.unbox(TransformerLM(config(True)).init(jax.random.key(0), TOKENS))["params"]
    params["head_bias"] = 0.1 * jax.random.normal(jax.random.key(2), params["head_bias"].shape)
    return params


@pytest.mark.parametrize("mesh_shape", [None, (2, 1, 4)])
@pytest.mark.parametrize("tied", [True, False])
def test_fused_loss_equals_dense_loss(tied_params, tied, mesh_shape):
    c = config(tied)
    params = tied_params if tied else untie(tied_params)
    mesh = make_mesh(*mesh_shape) if mesh_shape else None
    want, want_grads = jax.value_and_grad(dense_loss, argnums=1)(c, params)
    (got, aux), grads = jax.jit(jax.value_and_grad(fused_loss, argnums=1, has_aux=True),
                                static_argnums=(0, 2))(c, params, mesh)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(aux["invalid_label_count"]) == 0
    flat_want, flat_got = jax.tree.leaves(want_grads), jax.tree.leaves(grads)
    for w, g in zip(flat_want, flat_got):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6)
    # Padded vocabulary rows get no gradient, whichever matrix they belong to.
    for name in ("embed",) + (() if tied else ("lm_head",)):
        assert float(jnp.abs(grads[name]["embedding"][V:]).max()) == 0.0
