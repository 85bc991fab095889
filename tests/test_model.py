"""TransformerLM: the tie contract, shapes and dtypes, causal masking and each study switch.

``chex.TestCase`` classes. Causal masking runs the model under both of chex's jit variants (traced under
``jax.jit`` and op by op) for two families; the other tests run it op by op, as before.
"""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from tieflax.model import ModelConfig, TransformerLM, embedding_matrices
from tieflax.model.surgery import tie, untie


V, D = 300, 32
FAMILIES = {
    "llama": dict(family="llama", n_kv_heads=2),
    "gpt2": dict(family="gpt2", norm="layernorm", mlp="gelu", position="learned", qkv_bias=True,
                 attn_out_bias=True, mlp_bias=True),
    "gemma": dict(family="gemma", mlp="geglu", norm_unit_offset=True, scale_input_embedding=True,
                  n_kv_heads=1, head_dim=16),
    "gemma2": dict(family="gemma2", mlp="geglu", norm_unit_offset=True, sandwich_norms=True,
                   attn_softcap=50.0, final_logit_softcap=30.0, query_pre_attn_scalar=16.0, sliding_window=3,
                   sliding_window_every=2, scale_input_embedding=True, n_kv_heads=2, head_dim=16),
    "qwen2": dict(family="qwen2", qkv_bias=True, n_kv_heads=2, rope_theta=1e6),
    "llama3_scaled_rope": dict(family="llama", rope_scaling_factor=8.0, rope_original_max_len=16),
}


def small(tie_embeddings=True, **kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=D, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16,
                tie_embeddings=tie_embeddings)
    base.update(kw)
    return ModelConfig(**base)


def init(config: ModelConfig, seed=0, rngs=None):
    """The parameters of ``config`` (a fresh tree of dicts each call; the arrays of one (config, seed) are
    made once per process: several tests start from the same model, and a test never changes an array)."""
    if rngs is not None:
        return _init(config, rngs)
    return jax.tree.map(lambda x: x, _init_once(config, seed))


def _init(config: ModelConfig, rngs):
    tokens = jnp.zeros((2, 8), jnp.int32)
    return nn.unbox(TransformerLM(config).init(rngs, tokens))["params"]


@functools.cache
def _init_once(config: ModelConfig, seed: int):
    return _init(config, jax.random.key(seed))


def _named(*values):
    """named_parameters for one string argument, named by it."""
    return [(v, v) for v in values]


TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, V)


def _mean_dense_loss(config, params, tokens, targets):
    """Mean cross-entropy [] from full logits (the one dense loss, tieflax.ops.reference)."""
    return TransformerLM(config).apply({"params": params}, tokens, targets, method="dense_loss")[0].mean()


class TransformerLMTest(chex.TestCase):
    """The tie contract, shapes and dtypes, masking, the residual stream and surgery, family by family."""

    @parameterized.named_parameters(*_named(*sorted(FAMILIES)))
    def test_tied_has_one_matrix_untied_two(self, family):
        tied, untied = small(True, **FAMILIES[family]), small(False, **FAMILIES[family])
        p_tied, p_untied = init(tied), init(untied)
        v_pad = tied.padded_vocab
        assert v_pad == 384  # 300 rounded up to a multiple of 128
        shapes = lambda p: [x.shape for x in jax.tree.leaves(p) if x.shape == (v_pad, D)]
        assert shapes(p_tied) == [(v_pad, D)]
        assert shapes(p_untied) == [(v_pad, D)] * 2
        assert "lm_head" not in p_tied
        chex.assert_shape(p_untied["lm_head"]["embedding"], (v_pad, D))
        # The tie switch changes nothing else: the shared parameters are identical at init.
        without_head = {k: v for k, v in p_untied.items() if k != "lm_head"}
        chex.assert_trees_all_equal(p_tied, without_head)

    @parameterized.named_parameters(*_named(*sorted(FAMILIES)))
    def test_logits_shapes_and_padding(self, family):
        config = small(False, **FAMILIES[family])
        params = init(config)
        logits = TransformerLM(config).apply({"params": params}, TOKENS)
        chex.assert_shape(logits, (2, 8, config.padded_vocab))
        chex.assert_type(logits, jnp.float32)
        chex.assert_trees_all_equal(logits[..., V:], jnp.full((2, 8, config.padded_vocab - V), -jnp.inf))
        chex.assert_tree_all_finite(logits[..., :V])

    def test_bf16_compute_with_fp32_params(self):
        config = small(True, dtype="bfloat16", param_dtype="float32", logits_fp32=False)
        params = init(config)
        chex.assert_trees_all_equal_dtypes(params, jax.tree.map(lambda x: x.astype(jnp.float32), params))
        hidden, weight, bias = TransformerLM(config).apply({"params": params}, TOKENS, method="features")
        chex.assert_type(hidden, jnp.bfloat16)
        chex.assert_type(weight, jnp.float32)
        assert bias is None
        logits = TransformerLM(config).apply({"params": params}, TOKENS)
        chex.assert_type(logits, jnp.bfloat16)
        logits32 = TransformerLM(config.replace(logits_fp32=True)).apply({"params": params}, TOKENS)
        chex.assert_type(logits32, jnp.float32)
        np.testing.assert_allclose(np.asarray(logits[..., :V], np.float32), np.asarray(logits32[..., :V]),
                                   atol=0.05)

    @parameterized.named_parameters(*_named("gpt2", "gemma2"))
    def test_tied_gradient_is_sum_of_lookup_and_head_gradients(self, family):
        """d/dW of the tied loss equals dL/dW_in + dL/dW_out evaluated with W_in = W_out = W."""
        config = small(True, **FAMILIES[family])
        params = init(config)
        targets = jnp.roll(TOKENS, -1, axis=1)
        g_tied = jax.grad(_mean_dense_loss, argnums=1)(config, params, TOKENS, targets)
        split = untie(params)  # the same values, passed as two separate arguments
        g_split = jax.grad(_mean_dense_loss, argnums=1)(config.replace(tie_embeddings=False), split, TOKENS,
                                                        targets)
        total = g_split["embed"]["embedding"] + g_split["lm_head"]["embedding"]
        np.testing.assert_allclose(g_tied["embed"]["embedding"], total, rtol=1e-5, atol=1e-7)
        # Both paths contribute: the head's gradient is dense, the lookup's only touches seen tokens.
        head_rows = np.abs(np.asarray(g_split["lm_head"]["embedding"][:V])).sum(-1) > 0
        lookup_rows = np.abs(np.asarray(g_split["embed"]["embedding"])).sum(-1) > 0
        assert head_rows.all()
        assert set(np.flatnonzero(lookup_rows)) == set(np.unique(np.asarray(TOKENS)))
        # Padded rows never receive gradient.
        assert float(jnp.abs(g_tied["embed"]["embedding"][V:]).max()) == 0.0

    def _assert_causal(self, family, variant):
        """Changing token t never changes the outputs at positions < t (the model run by ``variant``)."""
        config = small(True, **FAMILIES[family])
        params = init(config)
        model = TransformerLM(config)
        apply = variant(lambda p, tokens: model.apply({"params": p}, tokens))
        base = apply(params, TOKENS)
        changed_tokens = TOKENS.at[:, 5].set((TOKENS[:, 5] + 7) % V)
        changed = apply(params, changed_tokens)
        np.testing.assert_array_equal(base[:, :5], changed[:, :5])
        assert not np.allclose(base[:, 5:, :V], changed[:, 5:, :V])

    @parameterized.named_parameters(*_named(*sorted(set(FAMILIES) - {"llama", "gemma2"})))
    def test_causal_masking(self, family):
        """Op by op, as every family's other tests here run the model."""
        self._assert_causal(family, lambda fn: fn)

    # Under both chex variants for two families only: a whole-model compile per family (about 0.5 CPU-s)
    # is several times the op-by-op run's cost. Llama is plain causal attention (GQA); Gemma 2 adds the
    # sliding window on every other layer and soft-capped attention logits.
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*_named("gemma2", "llama"))
    def test_causal_masking_jit_variants(self, family):
        """Traced under jit and op by op."""
        self._assert_causal(family, self.variant)

    def test_segments_isolate_documents(self):
        config = small(True)
        params = init(config)
        model = TransformerLM(config)
        segments = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]] * 2)
        positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
        base = model.apply({"params": params}, TOKENS, positions, segments)
        changed = model.apply({"params": params}, TOKENS.at[:, 1].add(1) % V, positions, segments)
        np.testing.assert_array_equal(base[:, 4:], changed[:, 4:])  # the second document never sees the first
        alone = model.apply({"params": params}, TOKENS[:, 4:])  # and equals running it on its own
        np.testing.assert_allclose(base[:, 4:, :V], alone[..., :V], rtol=1e-5, atol=1e-5)

    @parameterized.named_parameters(*_named("llama", "gemma2", "gpt2"))
    def test_residual_stream_runs_from_the_embedding_to_before_the_final_norm(self, family):
        """Entry 0 is the lookup (plus learned positions), entry l block l-1's output, and the final norm of
        the last entry is ``hidden_states``; scanned layers give the same stream, in layer order."""
        from tieflax.model.layer_stacking import stack_layers

        config = small(False, n_layers=4, **FAMILIES[family])
        params = init(config)
        model, variables = TransformerLM(config), {"params": params}
        positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), TOKENS.shape)
        segments = jnp.zeros(TOKENS.shape, jnp.int32)
        xs = model.apply(variables, TOKENS, method="residual_stream")
        chex.assert_shape(xs, (config.n_layers + 1, 2, 8, D))
        embedded = model.apply(variables, TOKENS, method=lambda m, t: m.embed(t))
        if config.position == "learned":
            embedded = embedded + params["position_embedding"][:8]
        np.testing.assert_array_equal(xs[0], embedded)
        block_2 = model.apply(variables, xs[2], method=lambda m, x: m.blocks[2](x, positions, segments))
        np.testing.assert_array_equal(xs[3], block_2)
        hidden = model.apply(variables, TOKENS, method="hidden_states")
        np.testing.assert_array_equal(model.apply(variables, xs[-1], method=lambda m, x: m.final_norm(x)), hidden)
        assert not any(np.allclose(xs[i], xs[i + 1]) for i in range(config.n_layers))  # every block adds to it
        scanned = config.replace(scan_layers=True)  # gemma2: 2 steps of a (local, global) pair
        xs_scanned = TransformerLM(scanned).apply({"params": stack_layers(params, scanned)}, TOKENS,
                                                  method="residual_stream")
        # Scanned and unrolled layers may reassociate fp32 sums, an error of a few ulps of the stream's
        # values (large after Gemma's sqrt(d) input scale), so the bound is relative as well as absolute.
        # Compiled without backend optimisations on jax 0.12 (tests/conftest.py), one element of 2,560
        # differed by 2.2e-6 (at 0.152); a wrong layer order or a missing block differs by 1e-1.
        np.testing.assert_allclose(xs_scanned, xs, atol=1e-5, rtol=1e-6)

    def test_surgery_roundtrip(self):
        params = init(small(True))
        untied = untie(params)
        np.testing.assert_array_equal(untied["lm_head"]["embedding"], params["embed"]["embedding"])
        retied, report = tie(untied, "mean")
        chex.assert_trees_all_equal(retied, params)
        assert report["relative_distance_in_out"] == 0.0
        matrices = embedding_matrices(untied)
        assert matrices["input"] is untied["embed"]["embedding"]
        assert matrices["output"] is untied["lm_head"]["embedding"]
        with self.assertRaisesRegex(ValueError, "already untied"):
            untie(untied)
        with self.assertRaisesRegex(ValueError, "not one of"):
            tie(untied, "sideways")

    def test_rope_scaling_changes_only_low_frequencies(self):
        from tieflax.model.layers import rope_frequencies
        plain = small(True, rope_theta=500000.0)
        scaled = dataclasses.replace(plain, rope_scaling_factor=8.0, rope_original_max_len=8192)
        f0, f1 = np.asarray(rope_frequencies(plain)), np.asarray(rope_frequencies(scaled))
        assert f1[0] == f0[0]  # the highest frequency is kept
        np.testing.assert_allclose(f1[-1], f0[-1] / 8.0, rtol=1e-6)  # the lowest is divided by the factor

    @parameterized.named_parameters(("tied", True), ("untied", False))
    def test_every_parameter_carries_logical_axes(self, tied):
        config = small(tied, **FAMILIES["gpt2"], head_bias=True)
        boxed = TransformerLM(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
        leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
        assert all(len(x.names) == x.value.ndim for x in leaves)
        vocab_leaves = [x for x in leaves if "vocab" in x.names]
        # The head reads the matrix in the embedding's own layout: no re-layout when tied.
        assert [x.names for x in vocab_leaves if x.value.ndim == 2] == [("vocab", "embed")] * (1 if tied else 2)


# --- Study switches: each changes what it should, nothing else, identically tied or untied ------------

def _logits_both_sides(config: ModelConfig, params_tied: dict):
    """Logits of the tied model and of the untied model with W_out = W_in (same values)."""
    tied_logits = TransformerLM(config.replace(tie_embeddings=True)).apply({"params": params_tied}, TOKENS)
    untied_logits = TransformerLM(config.replace(tie_embeddings=False)).apply(
        {"params": untie(params_tied)}, TOKENS)
    return tied_logits[..., :V], untied_logits[..., :V]


class StudySwitchTest(chex.TestCase):
    """Each study switch against the base model (its config, parameters and logits, made once for the class)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.config = small(True)
        cls.params = init(cls.config)
        cls.logits = TransformerLM(cls.config).apply({"params": cls.params}, TOKENS)[..., :V]

    @parameterized.named_parameters(
        ("logit_scale", dict(logit_scale=0.5), lambda z: 0.5 * z),
        ("logit_scale_rsqrt_d", dict(logit_scale_rsqrt_d=True), lambda z: z / np.sqrt(D)),
        ("final_logit_softcap", dict(final_logit_softcap=2.0), lambda z: 2.0 * np.tanh(z / 2.0)),
    )
    def test_head_switches_transform_logits_identically_tied_or_untied(self, switch, expected):
        config, params, logits = self.config, self.params, self.logits
        switched = config.replace(**switch)
        # Parameters unchanged by the switch.
        chex.assert_trees_all_equal(init(switched), params)
        tied_logits, untied_logits = _logits_both_sides(switched, params)
        np.testing.assert_allclose(tied_logits, expected(np.asarray(logits)), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(tied_logits, untied_logits)

    def test_head_bias_is_its_own_parameter_either_way(self):
        config, params, logits = self.config, self.params, self.logits
        for tied in (True, False):
            with_bias = init(config.replace(head_bias=True, tie_embeddings=tied))
            without = init(config.replace(tie_embeddings=tied))
            assert set(with_bias) - set(without) == {"head_bias"}
            chex.assert_shape(with_bias["head_bias"], (config.padded_vocab,))
        bias = jax.random.normal(jax.random.key(3), (config.padded_vocab,))
        biased = dict(params, head_bias=bias)
        tied_logits, untied_logits = _logits_both_sides(config.replace(head_bias=True), biased)
        np.testing.assert_allclose(tied_logits, logits + bias[:V], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(tied_logits, untied_logits)

    def test_input_scale_multiplies_the_lookup_by_sqrt_d(self):
        config, params = self.config, self.params
        lookup = lambda c: TransformerLM(c).apply({"params": params}, TOKENS, method=lambda m, t: m.embed(t))
        np.testing.assert_allclose(lookup(config.replace(scale_input_embedding=True)),
                                   lookup(config) * np.sqrt(D), rtol=1e-6)
        untied = config.replace(tie_embeddings=False, scale_input_embedding=True)
        np.testing.assert_array_equal(
            TransformerLM(untied).apply({"params": untie(params)}, TOKENS, method=lambda m, t: m.embed(t)),
            lookup(config.replace(scale_input_embedding=True)))

    def test_untied_head_init_switches_touch_only_the_head(self):
        config = small(False)
        params = init(config)
        body = lambda p: {k: v for k, v in p.items() if k != "lm_head"}
        # head_init_std: only the head's scale changes.
        wide = init(config.replace(head_init_std=0.2))
        chex.assert_trees_all_equal(body(wide), body(params))
        ratio = float(jnp.std(wide["lm_head"]["embedding"]) / jnp.std(params["lm_head"]["embedding"]))
        assert abs(ratio - 10.0) < 0.5
        # Separate PRNG stream: reseeding the head's stream changes the head and nothing else.
        stream = config.replace(head_rng_stream="head")
        a = init(stream, rngs={"params": jax.random.key(0), "head": jax.random.key(1)})
        b = init(stream, rngs={"params": jax.random.key(0), "head": jax.random.key(2)})
        chex.assert_trees_all_equal(body(a), body(b), body(params))
        assert not np.allclose(a["lm_head"]["embedding"], b["lm_head"]["embedding"])
        # The default head draws from a different key than the embedding (the matrices are independent).
        corr = np.corrcoef(np.ravel(params["embed"]["embedding"]), np.ravel(params["lm_head"]["embedding"]))[0, 1]
        assert abs(corr) < 0.05
        # copy_embed starts the head equal to the embedding.
        copied = init(config.replace(head_init="copy_embed"))
        chex.assert_trees_all_equal(copied["lm_head"]["embedding"], copied["embed"]["embedding"])
        chex.assert_trees_all_equal(body(copied), body(params))

    def test_untied_only_switches_are_rejected_when_tied(self):
        with self.assertRaisesRegex(ValueError, "head_init_std"):
            small(True, head_init_std=0.1)
        with self.assertRaisesRegex(ValueError, "head_init"):
            small(True, head_init="copy_embed")
