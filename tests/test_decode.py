"""KV-cache generation (tieflax.eval.decode): token for token the same as recomputing the whole prefix."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tieflax import sharding as shd
from tieflax.eval.decode import EvalError, Generator
from tieflax.model import ModelConfig, TransformerLM
from tieflax.model.layer_stacking import stack_layers


V = 300
FAMILIES = {
    "llama": dict(family="llama", n_kv_heads=2),
    "gemma2": dict(family="gemma2", mlp="geglu", norm_unit_offset=True, sandwich_norms=True, attn_softcap=50.0,
                   final_logit_softcap=30.0, query_pre_attn_scalar=16.0, sliding_window=4, sliding_window_every=2,
                   scale_input_embedding=True, n_kv_heads=2, head_dim=16,
                   embed_init_std=0.03),   # its input is x sqrt(d): a smaller table keeps tokens varied
    "gpt2": dict(family="gpt2", norm="layernorm", mlp="gelu", position="learned", qkv_bias=True,
                 attn_out_bias=True, mlp_bias=True),
}
# Prompts of different lengths (left-padded in one batch); one longer than gemma2's window of 4.
PROMPTS = [[5, 17, 33], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 201], [42], [100, 3, 250, 9, 66]]
NEW = 64


def config(family: str, tied: bool, **kw) -> ModelConfig:
    # Large init scales: a random tiny model then generates varied tokens (not one token repeated), so
    # agreement over 64 tokens means something.
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=96, tie_embeddings=tied,
                init_std=0.3, embed_init_std=1.0)
    return ModelConfig(**{**base, **FAMILIES[family], **kw})


def init(c: ModelConfig, seed=0):
    return nn.unbox(TransformerLM(c).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))["params"]


# Tied and untied differ only in the head matrix; both are checked on llama, one each elsewhere (test time).
@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("gemma2", True), ("gpt2", False)])
def test_cached_greedy_equals_recomputing_the_prefix(family, tied):
    c = config(family, tied)
    params = init(c)
    gen = Generator(c)
    cached = gen.generate(params, PROMPTS, max_new_tokens=NEW)
    recomputed = gen.generate(params, PROMPTS, max_new_tokens=NEW, cached=False)
    assert cached.tokens.shape == (len(PROMPTS), NEW)
    assert len({tuple(row) for row in cached.tokens}) == len(PROMPTS)
    assert all(len(set(row)) > 4 for row in cached.tokens), "degenerate generations prove little"
    np.testing.assert_array_equal(cached.tokens, recomputed.tokens)


def test_rows_do_not_depend_on_the_batch():
    c = config("llama", tied=True)
    params = init(c)
    gen = Generator(c)
    batch = gen.generate(params, PROMPTS, max_new_tokens=NEW)
    for i, prompt in enumerate(PROMPTS):   # each prompt alone, no padding at all
        alone = gen.generate(params, [prompt], max_new_tokens=NEW)
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[i])


def test_scanned_params_decode_the_same():
    c = config("gemma2", tied=False)
    params = init(c)
    scanned = c.replace(scan_layers=True)
    a = Generator(c).generate(params, PROMPTS, max_new_tokens=16)
    b = Generator(scanned).generate(stack_layers(params, c), PROMPTS, max_new_tokens=16)
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_on_a_2x4_mesh_equals_one_device(family):
    c = config(family, tied=family == "llama", n_kv_heads=4)
    params = init(c)
    mesh = shd.make_mesh(data=1, fsdp=2, tensor=4, devices=jax.devices()[:8])
    abstract = jax.eval_shape(lambda: TransformerLM(c).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    shardings = shd.logical_shardings(abstract, mesh)["params"]
    sharded = jax.tree.map(jax.device_put, params, shardings)
    on_mesh = Generator(c, mesh=mesh).generate(sharded, PROMPTS, max_new_tokens=NEW)
    one = Generator(c).generate(params, PROMPTS, max_new_tokens=NEW, cached=False)
    np.testing.assert_array_equal(on_mesh.tokens, one.tokens)


def test_per_row_stop_and_sampling():
    c = config("llama", tied=True)
    params = init(c)
    gen = Generator(c)
    # NEW tokens: the greedy program is test_cached_greedy_equals_recomputing_the_prefix[llama-True]'s
    # (the same model and shapes), which the suite's compilation cache already holds.
    greedy = gen.generate(params, PROMPTS, max_new_tokens=NEW)
    stop = int(greedy.tokens[0, 5])                      # row 0 stops at its 6th token (or earlier)
    stopped = gen.generate(params, PROMPTS, max_new_tokens=NEW, stop_ids=(stop,))
    first = list(greedy.tokens[0]).index(stop)
    assert stopped.lengths[0] == first + 1
    np.testing.assert_array_equal(stopped.tokens[0, :first + 1], greedy.tokens[0, :first + 1])
    assert (stopped.tokens[0, first + 1:] == 0).all()
    for i in range(len(PROMPTS)):                        # rows stop by themselves, the others go on
        row = list(greedy.tokens[i])
        n = row.index(stop) + 1 if stop in row else NEW
        assert stopped.lengths[i] == n
        np.testing.assert_array_equal(stopped.tokens[i, :n], greedy.tokens[i, :n])
    hot = gen.generate(params, PROMPTS, max_new_tokens=16, temperature=1.0, seed=3)
    again = gen.generate(params, PROMPTS, max_new_tokens=16, temperature=1.0, seed=3)
    other = gen.generate(params, PROMPTS, max_new_tokens=16, temperature=1.0, seed=4)
    np.testing.assert_array_equal(hot.tokens, again.tokens)
    assert (hot.tokens != other.tokens).any() and (hot.tokens != greedy.tokens[:, :16]).any()
    recomputed = gen.generate(params, PROMPTS, max_new_tokens=16, temperature=1.0, seed=3, cached=False)
    np.testing.assert_array_equal(hot.tokens, recomputed.tokens)


def test_bad_input_is_one_clear_error():
    c = config("llama", tied=True)
    params = init(c)
    with pytest.raises(EvalError, match="exceeds the model's context of 96 tokens"):
        Generator(c).generate(params, [[1] * 90], max_new_tokens=10)
    mesh = shd.make_mesh(data=1, fsdp=2, tensor=4, devices=jax.devices()[:8])
    with pytest.raises(EvalError, match="does not divide over the mesh's 2 data x fsdp shards"):
        Generator(c, mesh=mesh).generate(params, PROMPTS[:3], max_new_tokens=4)
