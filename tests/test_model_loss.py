"""The model's fused loss path: tied and untied share it, and it equals the dense loss from logits, with and
without jit (chex variants)."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from absl.testing import parameterized

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


@functools.cache
def tied_params():
    params = nn.unbox(TransformerLM(config(True)).init(jax.random.key(0), TOKENS))["params"]
    params["head_bias"] = 0.1 * jax.random.normal(jax.random.key(2), params["head_bias"].shape)
    return params


class FusedLossTest(chex.TestCase):
    """chex variants: the fused loss and its gradients, traced under jit and run op by op."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("tied_1dev", True, None), ("tied_2x1x4", True, (2, 1, 4)),
                                    ("untied_1dev", False, None), ("untied_2x1x4", False, (2, 1, 4)))
    def test_fused_loss_equals_dense_loss(self, tied, mesh_shape):
        c = config(tied)
        params = tied_params() if tied else untie(tied_params())
        mesh = make_mesh(*mesh_shape) if mesh_shape else None
        want, want_grads = jax.value_and_grad(dense_loss, argnums=1)(c, params)
        (got, aux), grads = self.variant(jax.value_and_grad(fused_loss, argnums=1, has_aux=True),
                                         static_argnums=(0, 2))(c, params, mesh)
        chex.assert_shape(got, ())
        chex.assert_trees_all_close(got, want, rtol=1e-5)
        assert int(aux["invalid_label_count"]) == 0
        chex.assert_trees_all_equal_structs(grads, want_grads)
        chex.assert_trees_all_close(grads, want_grads, rtol=2e-4, atol=2e-6)
        # Padded vocabulary rows get no gradient, whichever matrix they belong to.
        for name in ("embed",) + (() if tied else ("lm_head",)):
            assert float(jnp.abs(grads[name]["embedding"][V:]).max()) == 0.0
