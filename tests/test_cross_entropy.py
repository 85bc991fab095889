"""tieflax.ops.cross_entropy against a float64 NumPy oracle, on 1-8 devices, plus HLO and memory checks.

Tolerances: fp32 inputs match the float64 oracle to 2e-5 x max|reference| (max abs error, per array);
bf16 inputs (oracle fed the same bf16-rounded values) to 2e-2 x max|reference|; float64 inputs
(``check_grads``) to the JAX defaults for float64.

The unit tests are ``chex.TestCase`` classes; the one-device oracle check runs under both of chex's jit
variants (the custom VJP traced under ``jax.jit`` and run op by op). The TPU compile-only tests stay plain
functions: tests/conftest.py's slow tier names them (``SLOW_TESTS``), and tests/test_tiers.py looks for
them as module-level ``def``s.
"""

import functools
import os
import re
import sys
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tieflax.ops.cross_entropy import cross_entropy
from tieflax.ops.reference import dense_cross_entropy, naive_cross_entropy, numpy_cross_entropy
from tieflax.sharding import make_mesh

from cross_entropy_support import ALL, MESHES, PLAIN, close, mesh_named


# Shapes chosen so nothing divides evenly: 147 valid rows in 152 padded ones, blocks of 5 tokens x 7 rows.
N, D, V_PAD, VV = 48, 16, 152, 147
TB, VB = 5, 7
MODES = ("recompute", "fused")
# 'pallas': mode='recompute' with impl='pallas', interpreted on CPU (TPU kernels run as JAX ops).
# Its chunk of 14 vocab rows (2 blocks of 7) makes the fsdp mesh's 19 local rows take 2 chunks.
# The Mosaic GPU kernels (impl='mosaic_gpu') need d in 64-column blocks: tests/test_cross_entropy_mosaic_gpu.py.
KERNEL = {"recompute": dict(mode="recompute", impl="xla"), "fused": dict(mode="fused"),
          "pallas": dict(mode="recompute", impl="pallas", vocab_chunk=14)}
# The same with a replicated head declared as such (weight_rows_sharded=False): rows read in place.
KERNEL.update({f"{k}_rows_whole": dict(v, weight_rows_sharded=False) for k, v in list(KERNEL.items())})

def _data(dtype=np.float32, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, VV, N)
    y[:3] = -1            # ignored
    y[3], y[4] = 150, 999  # invalid: inside the padding, and beyond V_pad
    y[5] = VV - 1          # last valid row, in the shifted last vocab block
    return dict(h=(rng.normal(size=(N, D)) * scale).astype(dtype),
                w=(rng.normal(size=(V_PAD, D)) * 0.5).astype(dtype),
                b=(rng.normal(size=V_PAD) * 0.1).astype(np.float32),
                wt=rng.uniform(0.5, 1.5, N).astype(np.float32), y=y.astype(np.int32),
                g=rng.normal(size=N).astype(np.float32))


@functools.lru_cache(maxsize=None)
def _fn(mode, mesh_name, feats):
    """One loss+grad function per (mode, mesh, features), reused for every label set of that shape: the
    same function object, so ``jax.jit`` of it (each test's, or chex's with_jit variant) compiles it once.

    Returns (loss, aux, grads of sum(g * loss), grads of 0.5 * sum(loss)); the second, uniform
    cotangent exercises the fused mode's stored weight gradient, the first its exact fallback."""
    mesh, kw = mesh_named(mesh_name), dict(feats)

    def loss(h, w, b, wt, y):
        return cross_entropy(h, w, y, valid_vocab=VV, weights=wt, bias=b, token_block=TB, vocab_block=VB,
                             mesh=mesh, **KERNEL[mode], **kw)

    def weighted(*a, y, g):
        l, aux = loss(*a, y)
        return jnp.sum(g * l), (l, aux)

    def f(h, w, b, wt, y, g):
        (_, (l, aux)), gr = jax.value_and_grad(weighted, argnums=(0, 1, 2, 3), has_aux=True)(
            h, w, b, wt, y=y, g=g)
        # Only the fused mode treats a uniform cotangent differently; skip the second compile otherwise.
        gu = None if not mode.startswith("fused") else jax.grad(
            lambda *a: 0.5 * jnp.sum(loss(*a, y)[0]), argnums=(0, 1, 2, 3))(h, w, b, wt)
        return l, aux, gr, gu

    return f



def _run(mode, mesh_name, feats, d, variant=jax.jit):
    fn = variant(_fn(mode, mesh_name, tuple(sorted(feats.items()))))
    return fn(d["h"], d["w"], d["b"], d["wt"], d["y"], d["g"])


def _check_against_oracle(d, mode, mesh_name, feats, rel, variant=jax.jit):
    """``variant``: how the loss and its gradients run (``jax.jit``, or a chex variant's wrapper)."""
    l, aux, gr, gu = _run(mode, mesh_name, feats, d, variant)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731 (bf16 -> exact f64)
    kw = dict(valid_vocab=VV, weights=d["wt"], bias=d["b"], **feats)
    ref = numpy_cross_entropy(f64(d["h"]), f64(d["w"]), d["y"], cotangent=d["g"], **kw)
    refu = numpy_cross_entropy(f64(d["h"]), f64(d["w"]), d["y"], cotangent=np.full(N, 0.5), **kw)
    chex.assert_shape((l, aux["lse"], aux["z_loss"], aux["correct"]), (N,))
    chex.assert_type((l, aux["correct"]), (jnp.float32, jnp.bool_))
    assert int(aux["invalid_label_count"]) == ref["invalid_label_count"]
    close(l, ref["loss"], rel)
    close(aux["z_loss"], ref["z_loss"], rel)
    valid = (d["y"] >= 0) & (d["y"] < VV)
    close(np.asarray(aux["lse"])[valid], ref["lse"][valid], rel)
    np.testing.assert_array_equal(np.asarray(aux["correct"]), ref["correct"])
    for got, r in ((gr, ref), (gu, refu)) if gu is not None else ((gr, ref),):
        chex.assert_trees_all_equal_shapes_and_dtypes(got, (d["h"], d["w"], d["b"], d["wt"]))
        for gg, key in zip(got, ("d_hidden", "d_weight", "d_bias", "d_weights")):
            close(gg, r[key], rel)
        # Padding rows (>= valid_vocab) get exactly zero gradient.
        assert not np.asarray(got[1], np.float32)[VV:].any() and not np.asarray(got[2])[VV:].any()
    return l, aux, gr


def _named(*cases):
    """named_parameters for (mode, mesh) cases: 'recompute_8dev_2x4' -> ('recompute', '8dev_2x4')."""
    return [("_".join(c), *c) for c in cases]


class OracleTest(chex.TestCase):
    """The loss ops (XLA recompute and fused, Pallas TPU interpreted) against the float64 oracle."""

    # One device, every feature, under both chex variants: the custom VJP (the fused mode's stored dW and
    # its lax.cond fallback included) traced under jit and run op by op. The with_jit variant compiles the
    # function the other one-device tests reuse; the Pallas kernels (slow to interpret, and slower still
    # op by op) run under jit only, below.
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("recompute", "recompute"), ("fused", "fused"))
    def test_matches_float64_oracle_on_one_device(self, mode):
        _check_against_oracle(_data(), mode, "1dev", ALL, 2e-5, variant=self.variant)

    # Recompute on every mesh (but 1x8 and 2x2, whose layouts 1x2 and 2x4 repeat); fused (same statistics
    # code, plus its own gradient loop) on the meshes that shard batch and vocab at once, to keep the
    # suite's compile time down; the Pallas kernels (slow to interpret) on one device and on the mesh that
    # also shards W's d. On one device, recompute and fused are the test above.
    @parameterized.named_parameters(*_named(*[("recompute", m) for m in MESHES if m not in ("1dev", "8dev_1x8", "4dev_2x2")],
                                            ("fused", "8dev_2x4"), ("fused", "8dev_f2x4"),
                                            ("pallas", "1dev"), ("pallas", "8dev_f2x4")))
    def test_matches_float64_oracle_all_features(self, mode, mesh_name):
        _check_against_oracle(_data(), mode, mesh_name, ALL, 2e-5)

    # A replicated head (W's rows whole on every device): the vocabulary shard is read in place and dW comes
    # back whole; on a mesh that shards tokens and vocabulary, and on one that also shards W's d.
    @parameterized.named_parameters(*_named(("recompute_rows_whole", "8dev_2x4"), ("recompute_rows_whole", "8dev_f2x4"),
                                            ("fused_rows_whole", "8dev_2x4"), ("pallas_rows_whole", "8dev_f2x4")))
    def test_replicated_head_matches_float64_oracle(self, mode, mesh_name):
        _check_against_oracle(_data(), mode, mesh_name, ALL, 2e-5)

    @parameterized.named_parameters(*_named(*[(m,) for m in MODES]))
    def test_every_label_ignored_gives_zero_loss_and_gradient(self, mode):
        d = _data()
        d["y"][:] = -1
        d["y"][::7] = VV + 2  # invalid labels are inactive too
        l, aux, gr = _check_against_oracle(d, mode, "1dev", ALL, 2e-5)
        chex.assert_trees_all_equal(l, np.zeros(N, np.float32))
        chex.assert_tree_all_finite(gr)
        chex.assert_trees_all_equal(gr[:2], (np.zeros((N, D), np.float32), np.zeros((V_PAD, D), np.float32)))
        assert int(aux["invalid_label_count"]) == 7

    @parameterized.named_parameters(*_named(*[(m,) for m in MODES]))
    def test_logits_of_magnitude_1e4_do_not_overflow(self, mode):
        d = _data(scale=3000.0)  # |logits| ~ 1e4: exp would overflow without the running max
        l, aux, _ = _check_against_oracle(d, mode, "8dev_2x4", PLAIN, 2e-5)
        assert np.abs(np.asarray(aux["lse"])).max() > 5e3

    @parameterized.named_parameters(*_named(*[(m,) for m in MODES + ("pallas",)]))
    def test_bf16_inputs(self, mode):
        d = _data(dtype=jnp.bfloat16)
        _check_against_oracle(d, mode, "1dev", ALL, 2e-2)

    def test_oracle_gradients_match_jax_autodiff_in_float64(self):
        """The oracle's analytic gradient formula, checked independently against autodiff of dense logits."""
        d = _data()
        kw = dict(valid_vocab=VV, **ALL)
        ref = numpy_cross_entropy(d["h"], d["w"], d["y"], weights=d["wt"], bias=d["b"], cotangent=d["g"], **kw)
        with jax.enable_x64(True):
            args = [jnp.asarray(d[k], jnp.float64) for k in ("h", "w", "b", "wt")]
            f = lambda h, w, b, wt: jnp.sum(d["g"] * dense_cross_entropy(h, w, d["y"], weights=wt, bias=b, **kw))  # noqa: E731
            grads = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(*args)
            loss = dense_cross_entropy(*args[:2], d["y"], weights=args[3], bias=args[2], **kw)
        chex.assert_trees_all_close(np.asarray(loss), ref["loss"], rtol=1e-12, atol=1e-12)
        chex.assert_trees_all_close(tuple(np.asarray(g) for g in grads),
                                    tuple(ref[k] for k in ("d_hidden", "d_weight", "d_bias", "d_weights")),
                                    rtol=1e-10, atol=1e-12)

    # Under jit only: check_grads evaluates the function dozens of times.
    @parameterized.named_parameters(*_named(*[(m,) for m in MODES]))
    def test_check_grads_float64(self, mode):
        d = _data()
        with jax.enable_x64(True):
            y = jnp.asarray(d["y"])
            g = jnp.asarray(d["g"], jnp.float64)

            @jax.jit
            def f(h, w, b, wt):
                l, _ = cross_entropy(h, w, y, valid_vocab=VV, weights=wt, bias=b, token_block=TB, vocab_block=VB,
                                     mode=mode, **ALL)
                return jnp.sum(g * l)

            args = [jnp.asarray(d[k], jnp.float64) for k in ("h", "w", "b", "wt")]
            jax.test_util.check_grads(f, args, order=1, modes=("rev",))


# ----------------------------------------------------------------------- compiled HLO and memory

_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_SHAPE = re.compile(r"[a-z][a-z0-9]*\[([0-9,]*)\]")


def _collectives(hlo_text):
    """[(op, elements)] for every collective in an HLO module; a tuple-shaped (combined) collective
    counts the elements of all its results together."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            sizes = [int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
                     for dims in _SHAPE.findall(m.group(1))]
            out.append((m.group(2), sum(sizes)))
    return out


def _lossgrad_hlo(fn, n, d, v, mesh, w_spec=P("tensor", None)):
    sh = (NamedSharding(mesh, P(("data", "fsdp"), None)), NamedSharding(mesh, w_spec),
          NamedSharding(mesh, P(("data", "fsdp"))))
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((v, d), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    f = jax.grad(lambda h, w, y: fn(h, w, y).sum(), argnums=(0, 1))
    return jax.jit(f, in_shardings=sh).lower(*args).compile().as_text()


def _temp_mb(f, *shapes):
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


class CompiledLossTest(chex.TestCase):
    """What the loss compiles to on a mesh of CPUs: the collectives it moves and its temporaries. No jit
    variants: these read compiled programs.
    """

    def test_collective_detector_flags_a_logits_sized_all_gather(self):
        mesh = make_mesh(2, 1, 4)

        def bad(h, w, y):  # gathers the per-shard logits over vocab: what the fused loss must never do
            def body(h, w, y):
                z = lax.all_gather(h @ w.T, "tensor", axis=1, tiled=True)
                return jax.nn.logsumexp(z, axis=1) - jnp.take_along_axis(z, y[:, None], axis=1)[:, 0]
            return jax.shard_map(body, mesh=mesh, in_specs=(P(("data", "fsdp")), P("tensor"), P(("data", "fsdp"))),
                                 out_specs=P(("data", "fsdp")), check_vma=False)(h, w, y)

        sizes = [e for _, e in _collectives(_lossgrad_hlo(bad, 128, 16, 512, mesh))]
        assert max(sizes) >= 64 * 512

    @parameterized.named_parameters(*_named(*[(m,) for m in MODES]))
    def test_no_collective_moves_a_logits_tile(self, mode):
        """On (data, tensor) = (2, 4): N_local = 64, V_local = 128, d = 16, token block 32. Logits-sized means
        token_block x V_local = 4096 elements; dH is 64 x 16 = 1024 and the dW reduction 128 x 16 = 2048."""
        mesh, n, d, v, bt = make_mesh(2, 1, 4), 128, 16, 512, 32
        fn = lambda h, w, y: cross_entropy(h, w, y, valid_vocab=500, token_block=bt, vocab_block=48,  # noqa: E731
                                           mode=mode, mesh=mesh)[0]
        coll = _collectives(_lossgrad_hlo(fn, n, d, v, mesh))
        assert coll, "expected the [N] statistics and dH reductions in the HLO"
        assert not [c for c in coll if c[0] == "all-gather"], coll  # the weight is never gathered over vocab
        assert max(e for _, e in coll) < bt * (v // 4), coll

    # The Pallas path shares this plumbing (_take_w, _reduce_dw); its values on this mesh are checked above.
    @parameterized.named_parameters(("recompute", "recompute"))
    def test_fsdp_sharded_head_is_gathered_and_reduce_scattered_by_block(self, mode):
        """W in the model's layout P('tensor', 'fsdp') on (fsdp, tensor) = (2, 4): V_local = 128, d = 16 split
        in 2, vocab block 48 (the Pallas path: chunks of 48 rows). W arrives and dW leaves in that layout:
        all-gathers and reduce-scatters of one [48, 16] block (768 elements) at a time, never the [128, 16]
        shard (2048) nor a logits tile (32 x 128 = 4096), and dW is never all-reduced whole."""
        mesh, n, d, v, bt = make_mesh(1, 2, 4), 128, 16, 512, 32
        fn = lambda h, w, y: cross_entropy(h, w, y, valid_vocab=500, token_block=bt, vocab_block=48,  # noqa: E731
                                           mesh=mesh, **dict(KERNEL[mode], vocab_chunk=48))[0]
        hlo = _lossgrad_hlo(fn, n, d, v, mesh, P("tensor", "fsdp"))
        coll = _collectives(hlo)
        by_op = {op: [e for o, e in coll if o == op] for op in ("all-gather", "reduce-scatter", "all-reduce")}
        assert by_op["reduce-scatter"] and max(by_op["reduce-scatter"]) <= 48 * 16, coll
        assert by_op["all-gather"] and max(by_op["all-gather"]) <= 48 * 16, coll
        assert max(by_op["all-reduce"]) < 128 * 16, coll  # [N] statistics, dH [64, 16], the bias block
        # The gradient leaves in the parameter's layout: no resharding collective after the loss.
        assert not [c for c in coll if c[0] in ("all-to-all", "collective-permute")], coll

    def test_compiled_temp_memory_is_bounded(self):
        """fp32, one device, N=2048, d=256, V=32768, blocks 2048 x 256: naive temp holds [N, V] logits
        (256 MiB each); ours may hold a few [2048, 256] tiles (2 MiB each), never logits."""
        n, d, v = 2048, 256, 32768
        shapes = ((n, d), jnp.float32), ((v, d), jnp.float32), ((n,), jnp.int32)
        ours = lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v, token_block=2048, vocab_block=256)[0]  # noqa: E731
        grad = lambda fn: jax.grad(lambda h, w, y: fn(h, w, y).sum(), argnums=(0, 1))  # noqa: E731
        naive = _temp_mb(grad(lambda h, w, y: naive_cross_entropy(h, w, y, valid_vocab=v)), *shapes)
        lossgrad = _temp_mb(grad(ours), *shapes)
        loss_only = _temp_mb(lambda h, w, y: ours(h, w, y).sum(), *shapes)
        assert naive > 256, naive
        assert lossgrad < 8 and lossgrad < 0.02 * naive, (lossgrad, naive)  # measured 4.3 MiB
        assert loss_only < 6, loss_only  # measured 4.0 MiB


# ------------------------------------------------------------------------------------ validation

class ValidationTest(chex.TestCase):

    @parameterized.named_parameters(
        ("transposed_weight", dict(weight=np.zeros((D, V_PAD), np.float32)), "weight must be"),
        ("float_labels", dict(labels=np.zeros((N,), np.float32)), "labels must be integers"),
        ("valid_vocab_beyond_the_rows", dict(valid_vocab=V_PAD + 1), "valid_vocab"),
        ("unknown_mode", dict(mode="fast"), "mode="),
        ("rows_not_a_multiple_of_tensor", dict(mesh=(1, 1, 8), weight=np.zeros((V_PAD + 4, D), np.float32)),
         "multiple of the 'tensor'"),
        ("vocab_axis_not_in_the_mesh", dict(mesh=(1, 1, 8), vocab_axis="vocab"), "not in the mesh axes"),
        ("tokens_not_split_by_the_batch_axes",
         dict(mesh=(8, 1, 1), labels=np.zeros((N - 2,), np.int32), hidden=np.zeros((N - 2, D), np.float32)),
         "cannot be split"),
    )
    def test_bad_arguments_name_the_field(self, kwargs, match):
        args = dict(hidden=np.zeros((N, D), np.float32), weight=np.zeros((V_PAD, D), np.float32),
                    labels=np.zeros((N,), np.int32), valid_vocab=VV)
        if "mesh" in kwargs:
            kwargs = dict(kwargs, mesh=make_mesh(*kwargs["mesh"]))
        args.update(kwargs)
        with self.assertRaisesRegex(ValueError, match):
            cross_entropy(**args)


# ------------------------------------------------------------------- compiled for a TPU (from a CPU)

@functools.lru_cache(maxsize=None)
def _tpu_devices(topology):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock
    try:
        from jax.experimental import topologies
        return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    except Exception as e:  # noqa: BLE001 (no libtpu, or it cannot start here)
        pytest.skip(f"TPU compile-only topology {topology} unavailable: {e}")


class XlaPathTest(chex.TestCase):

    def test_integer_bf16_rounding_equals_convert(self):
        """The XLA path's per-block fp32 -> bf16 rounding (used on TPU instead of a hoisted convert of W)."""
        from tieflax.ops.cross_entropy.xla import _bf16_round
        rng = np.random.default_rng(0)
        bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
        bits[:4] = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000]  # ties (both ways), overflow, denormal
        x = bits.view(np.float32)
        x = np.concatenate([x[~np.isnan(x)], np.array([np.inf, -np.inf, 0.0, -0.0], np.float32)])
        got = np.asarray(jax.jit(_bf16_round)(x)).view(np.uint16)
        np.testing.assert_array_equal(got, np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16))
        assert np.isnan(np.asarray(_bf16_round(jnp.float32(np.nan)), np.float32))


@pytest.mark.parametrize("meshed", [False, True])
def test_auto_compiles_the_pallas_kernels_for_a_tpu_with_small_temporaries(meshed):
    """impl='auto' (the default), compiled for v5e chips from this CPU process: the loss and its gradient
    are three Mosaic kernels, and with an fp32 head and bf16 hidden states no converted copy of W
    (V x d x 2 bytes = 8 MiB here; what XLA:TPU adds) nor any [N, V] buffer appears. The mesh is
    fsdp 2 x tensor 4 with W in the model's layout P('tensor', 'fsdp'); its dW leaves reduce-scattered."""
    devices = _tpu_devices("v5e:2x4")
    n, d, v = 1024, 256, 16384
    if meshed:
        mesh = make_mesh(1, 2, 4, devices=devices)
        specs = (P(("data", "fsdp"), None), P("tensor", "fsdp"), P(("data", "fsdp")))
        sh = [NamedSharding(mesh, s) for s in specs]
    else:
        mesh, sh = None, [jax.sharding.SingleDeviceSharding(devices[0])] * 3
    args = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=sh[0]),
            jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=sh[1]),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sh[2])]
    f = jax.value_and_grad(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v - 5, mesh=mesh, z_loss=1e-4,
                                                         softcap=30.0)[0].sum(), argnums=(0, 1))
    compiled = jax.jit(f).lower(*args).compile()
    hlo, temp = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes / 2**20
    assert hlo.count("custom_call_target=\"tpu_custom_call\"") == 3, "expected the stats, dH and dW kernels"
    if meshed:  # per chip: the fp32 dH partial [N/2, d] (0.5 MiB) and a few [rows, d] chunks
        assert "reduce-scatter" in hlo
        assert temp < 2, temp
    else:
        assert temp < 0.5, temp


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_replicated_head_is_read_in_place_on_a_tpu(impl):
    """W replicated (P(None, None)), declared with weight_rows_sharded=False, on v5e fsdp 2 x tensor 4: the
    vocabulary shard is read in place and dW leaves whole, block by block. Before, dW was all-gathered
    whole after the loss: 562.8 MiB of temporaries at the Gemma-2-2B head with V = 64,000, W fp32
    (benchmarks/README.md)."""
    devices = _tpu_devices("v5e:2x4")
    n, d, v = 1024, 256, 8192
    mesh = make_mesh(1, 2, 4, devices=devices)
    sh = [NamedSharding(mesh, s) for s in (P(("data", "fsdp"), None), P(None, None), P(("data", "fsdp")))]
    args = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=sh[0]),
            jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=sh[1]),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sh[2])]
    f = jax.value_and_grad(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v - 5, mesh=mesh, impl=impl,
                                                         weight_embed_axis=None,
                                                         weight_rows_sharded=False)[0].sum(), argnums=(0, 1))
    compiled = jax.jit(f, out_shardings=(None, (sh[0], sh[1]))).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    assert temp < 2, temp   # the fp32 dH partial [N/2, d] (0.25 MiB) and a few blocks


def test_xla_path_compiled_for_a_tpu_makes_no_bf16_copy_of_an_fp32_head():
    """impl='xla' on one v5e chip, W fp32, hidden bf16: the W blocks are rounded to bf16 inside the loop,
    so the 128 MiB converted copy of W that XLA:TPU hoists out of the loop (measured: 128.3 MiB when the
    fp32 blocks are used as they are; it only does so past some size, hence this shape) is absent."""
    device = _tpu_devices("v5e:2x4")[0]
    n, d, v = 1024, 1024, 65536
    sh = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=sh), jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sh)]
    f = jax.value_and_grad(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v, impl="xla")[0].sum(),
                           argnums=(0, 1))
    temp = jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
    assert temp < 16, temp  # measured 0.0


@pytest.mark.parametrize("impl, block", [("xla", {}), ("pallas", dict(vocab_chunk=512))])
def test_dw_is_reduced_block_by_block_on_a_tpu(impl, block):
    """A tensor-only head (Megatron's P('tensor', None)) on v5e fsdp 2 x tensor 4: each finished dW block
    (XLA path) or chunk (Pallas) is written, not added, so its psum over fsdp stays in the vocab loop.
    Added, XLA moved it out as one all-reduce of the whole local dW: on the XLA path (libtpu 0.0.42.1) the
    TPU compiler then evicted the fp32 dH accumulator at the Gemma-2-2B head with V = 256,000 (36.4 MiB of
    temporaries against 0.0 at 64,000); on the Pallas path (libtpu 0.0.52) the whole fp32 local dW became
    a temporary (565.0 MiB at 256,000; benchmarks/README.md, --layouts)."""
    devices = _tpu_devices("v5e:2x4")
    n, d, v = 1024, 256, 8192
    mesh = make_mesh(1, 2, 4, devices=devices)
    sh = [NamedSharding(mesh, s) for s in (P(("data", "fsdp"), None), P("tensor", None), P(("data", "fsdp")))]
    args = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=sh[0]),
            jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=sh[1]),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sh[2])]
    f = jax.value_and_grad(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v - 5, mesh=mesh, impl=impl,
                                                         weight_embed_axis=None, **block)[0].sum(),
                           argnums=(0, 1))
    hlo = jax.jit(f, out_shardings=(None, (sh[0], sh[1]))).lower(*args).compile().as_text()
    reduced = re.findall(r"= (f32\[[\d,]+\])\S* all-reduce\(", hlo)
    rows = block.get("vocab_chunk", 256)
    assert f"f32[{v // 4},{d}]" not in reduced, reduced   # the whole local dW, after the loop
    assert f"f32[{rows},{d}]" in reduced, reduced         # one block or chunk, in the loop


# ------------------------------------------------------------------ compiled for a GPU (from a CPU)

@functools.lru_cache(maxsize=None)
def _gpu_devices(kind):
    try:
        from jax.experimental import topologies

        from tieflax.hardware.targets import gpu_target_config
        return topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(kind),
                                            topology="1x1x1").devices
    except Exception as e:  # noqa: BLE001 (no CUDA plugin here: jax[cuda12] compiles for a GPU without one)
        pytest.skip(f"CUDA compile-only target {kind} unavailable: {e}")


def _lowered_for(platform, impl, w_dtype, n=256, d=64, v=1024):
    """Loss + gradients lowered for ``platform`` from this CPU process (no plugin needed): StableHLO for
    'cuda'; for 'cpu' the compiled HLO (the lowering keeps every platform's branch of a
    ``platform_dependent``, the compiler drops the others)."""
    args = (jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((v, d), w_dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    f = jax.jit(jax.value_and_grad(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v, impl=impl)[0].sum(),
                                   argnums=(0, 1)))
    if platform == "cpu":
        return f.lower(*args).compile().as_text()
    return f.trace(*args).lower(lowering_platforms=(platform,)).as_text()


class PlatformBranchTest(chex.TestCase):
    """The loss compiled or lowered for a GPU from this CPU process (the H100 compile needs the CUDA plugin,
    skipped without it), and the CPU branch a mesh of CPUs takes when tracing. No jit variants: these read
    lowered and compiled programs.
    """

    @parameterized.named_parameters(("bf16_head", jnp.bfloat16), ("fp32_head", jnp.float32))
    def test_auto_compiles_the_mosaic_gpu_kernels_for_an_h100_with_small_temporaries(self, w_dtype):
        """impl='auto' compiled for an H100 from this CPU process (needs the CUDA plugin, skipped without it):
        the loss and its gradient are the two Mosaic GPU kernels (statistics, dZ) and two GEMMs per chunk,
        and the temporaries are the bounded chunks, the same for an fp32 and a bf16 head (no converted copy
        of the whole W, no [N, V] buffer)."""
        devices = _gpu_devices("h100")
        n, d, v = 2048, 512, 32768
        sh = jax.sharding.SingleDeviceSharding(devices[0])
        args = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=sh), jax.ShapeDtypeStruct((v, d), w_dtype, sharding=sh),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sh)]
        f = jax.value_and_grad(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v - 5, z_loss=1e-4, softcap=30.0,
                                                             label_smoothing=0.1)[0].sum(), argnums=(0, 1))
        compiled = jax.jit(f).lower(*args).compile()
        hlo, temp = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes / 2**20
        assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 2, "expected the statistics and dZ kernels"
        # dH: one fp32 [2048, 512] chunk (4 MiB); bf16 chunks of W [8192, 512] (8 MiB) and of dZ [2048, 8192]
        # (32 MiB: tiles.MosaicTiles.dz_chunk_bytes), the bf16 hidden states [2048, 512] (2 MiB).
        assert temp < 64, temp

    @parameterized.named_parameters(("auto_bf16", "auto_bf16"), ("fused", "fused"))
    def test_a_mesh_of_cpus_takes_the_cpu_branch_bit_for_bit(self, kernel):
        """On a mesh of CPUs the loss calls its CPU branch when tracing instead of ``lax.platform_dependent``
        (which traced the TPU and Mosaic GPU kernels for the lowering to drop): loss, aux and gradients must
        be the same bits as through ``platform_dependent``."""
        ce_module = sys.modules["tieflax.ops.cross_entropy"]
        mesh = mesh_named("8dev_2x4")
        rng = np.random.default_rng(0)
        dtype = jnp.bfloat16 if kernel == "auto_bf16" else jnp.float32
        h, w = jnp.asarray(rng.normal(size=(64, 64)), dtype), jnp.asarray(rng.normal(size=(256, 64)) * 0.3, dtype)
        y = jnp.asarray(rng.integers(-1, 250, 64), jnp.int32)
        options = dict(valid_vocab=250, mesh=mesh, z_loss=1e-4, label_smoothing=0.1,
                       mode="fused" if kernel == "fused" else "recompute")

        def total(h, w):
            loss, aux = cross_entropy(h, w, y, **options)
            return loss.sum(), aux

        def loss_and_grads():
            return jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(total, (0, 1), has_aux=True))(h, w))

        def every_platform(cfg, args, branches):
            return lax.platform_dependent(*args, **branches)

        shortcut = loss_and_grads()
        with mock.patch.object(ce_module, "_by_platform", every_platform):
            ce_module._build.cache_clear()  # the custom VJPs built with the shortcut
            try:
                traced_for_every_platform = loss_and_grads()
            finally:
                ce_module._build.cache_clear()
        chex.assert_trees_all_equal_shapes_and_dtypes(shortcut, traced_for_every_platform)
        for a, b in zip(jax.tree.leaves(shortcut), jax.tree.leaves(traced_for_every_platform)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()

    def test_auto_lowers_to_the_gpu_kernels_for_cuda_and_to_xla_for_a_cpu(self):
        """Both stacks lower Mosaic GPU kernels without a GPU (the Triton ones needed one on jax 0.12)."""
        assert "mosaic_gpu_v2" not in _lowered_for("cpu", "auto", jnp.bfloat16)
        assert _lowered_for("cuda", "auto", jnp.bfloat16).count("stablehlo.custom_call @mosaic_gpu_v2") == 2  # stats, dZ

    def test_xla_path_takes_the_platforms_tiles_and_casts_an_fp32_head_once_per_call_on_gpu(self):
        """Lowered for CUDA the XLA path's tile is [N, 2048] (here the whole [256, 1024]; a CPU keeps 256-row
        vocab blocks), and an fp32 W meets bf16 hidden states as one bf16 copy per call (forward and
        backward: 2 converts of the whole matrix), so every tile matmul is a bf16 one; a CPU keeps W fp32."""
        cuda, cpu = _lowered_for("cuda", "xla", jnp.float32), _lowered_for("cpu", "xla", jnp.float32)
        assert "tensor<256x1024xf32>" in cuda
        assert "f32[256,256]" in cpu and "f32[256,1024]" not in cpu
        assert cuda.count("tensor<1024x64xf32>) -> tensor<1024x64xbf16>") == 2
        assert "bf16[1024,64]" not in cpu
