"""tieflax.ops.embedding_lookup.vocab_parallel_embed: values and table gradients against NumPy, 1-8 devices,
with and without jit (chex variants)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from tieflax.ops.embedding_lookup import vocab_parallel_embed
from tieflax.sharding import make_mesh


V_PAD, D, B, T = 40, 6, 8, 5
# (data, fsdp, tensor); fsdp > 1 reads the table with its d split too (8 does not divide D = 6 and d
# stays whole there, the fallback).
MESHES = {"1dev": None, "2dev_1x2": (1, 1, 2), "4dev_2x2": (2, 1, 2), "8dev_1x8": (1, 1, 8),
          "8dev_2x4": (2, 1, 4), "8dev_8x1": (8, 1, 1), "8dev_fsdp_2x2x2": (2, 2, 2),
          "4dev_fsdp_1x2x2": (1, 2, 2), "8dev_fsdp_1x8x1": (1, 8, 1)}


def _data():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V_PAD, D)).astype(np.float32)
    ids = rng.integers(0, V_PAD, (B, T)).astype(np.int32)
    ids[0, :] = [0, V_PAD - 1, 5, 5, 19]  # both ends of the table, a repeat, a shard boundary
    cot = rng.normal(size=(B, T, D)).astype(np.float32)
    return table, ids, cot


class VocabParallelEmbedTest(chex.TestCase):
    """The lookup and its gradient under both chex variants (traced under jit and run op by op) on every
    mesh; the bf16 table op by op (the variants above cover jit), and the refusals."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*MESHES.items())
    def test_matches_take_and_scatter_add(self, shape):
        mesh = None if shape is None else make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
        table, ids, cot = _data()

        def f(tab, ids):
            out = vocab_parallel_embed(tab, ids, mesh=mesh)
            return jnp.sum(out * cot), out

        (_, out), grad = self.variant(jax.value_and_grad(f, has_aux=True))(table, ids)
        chex.assert_shape(out, (B, T, D))
        chex.assert_trees_all_equal(out, table[ids])  # a lookup is exact: no tolerance
        want = np.zeros((V_PAD, D), np.float64)
        np.add.at(want, ids.reshape(-1), cot.reshape(-1, D).astype(np.float64))
        chex.assert_trees_all_close(grad, want, rtol=1e-6, atol=1e-6)

    def test_bf16_table_keeps_dtype(self):
        table, ids, _ = _data()
        out = vocab_parallel_embed(jnp.asarray(table, jnp.bfloat16), ids, mesh=make_mesh(2, 1, 4))
        chex.assert_type(out, jnp.bfloat16)
        chex.assert_shape(out, (B, T, D))
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(jnp.asarray(table, jnp.bfloat16), np.float32)[ids])

    @parameterized.named_parameters(
        ("rows_not_a_multiple_of_tensor", dict(table=np.zeros((V_PAD + 4, D), np.float32), mesh=(1, 1, 8)),
         "multiple of the 'tensor'"),
        ("batch_not_split_by_the_batch_axes", dict(ids=np.zeros((3, T), np.int32), mesh=(8, 1, 1)),
         "divisible by the batch axes"),
        ("float_ids", dict(ids=np.zeros((B, T), np.float32)), "ids must be integers"),
        ("vocab_axis_not_in_the_mesh", dict(mesh=(1, 1, 8), vocab_axis="vocab"), "not in the mesh axes"),
    )
    def test_bad_arguments_name_the_field(self, kwargs, match):
        args = dict(table=np.zeros((V_PAD, D), np.float32), ids=np.zeros((B, T), np.int32))
        if "mesh" in kwargs:
            kwargs = dict(kwargs, mesh=make_mesh(*kwargs["mesh"]))
        args.update(kwargs)
        with self.assertRaisesRegex(ValueError, match):
            vocab_parallel_embed(**args)
