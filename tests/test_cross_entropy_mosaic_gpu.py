"""impl='mosaic_gpu' (the Pallas Mosaic GPU kernels) against the float64 oracle under jax 0.12's Mosaic GPU
interpreter (shared memory, barriers, TMA and wgmma simulated on this CPU), and lowered for a CUDA GPU.

The kernels' tile matmuls are bf16 wgmma and dZ is rounded to bf16 before the gradient GEMMs, so the oracle
is fed the bf16-rounded inputs and the tolerances are those of bf16 (module docstring of
``tieflax/ops/cross_entropy/mosaic_gpu.py``): the loss and lse to 2e-3 of the largest reference value,
the gradients to 1e-2. Small tiles (64 x 64, 64-column blocks of d = 128, 2 TMA stages) and chunks
(64 token rows, 128 vocabulary rows) make every loop take several steps: 2 blocks of d, 2 runs of vocab
blocks per token block, 3 token chunks and 3 vocabulary chunks on one device, the last of each shifted
back (N = 150 and V_pad = 330 divide by nothing).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cross_entropy_support import ALL, PLAIN, close, mesh_named

from tieflax.ops.cross_entropy import cross_entropy, mosaic_gpu, tiles
from tieflax.ops.reference import numpy_cross_entropy

N, D, V_PAD, VV = 150, 128, 330, 321
# 8 devices: V_pad must divide over the vocab axis (8 x 48 rows: one padded 64-row block per shard).
V_PAD8, VV8 = 384, 379
SMALL = tiles.MosaicTiles(token=64, vocab=64, depth=64, steps=2, programs=4,
                          token_chunk_bytes=4 * D * 64, vocab_chunk_bytes=2 * D * 128)
LOSS_TOL, GRAD_TOL = 2e-3, 1e-2

INTERPRETER, WHY_NOT = mosaic_gpu.interpretable()
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason=f"no Mosaic GPU interpreter: {WHY_NOT}")


def _data(v_pad=V_PAD, vv=VV, h_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, vv, N)
    y[:3] = -1              # ignored
    y[3], y[4] = vv + 2, 999  # invalid: inside the padding, and beyond V_pad
    y[5] = vv - 1           # last valid row, in the shifted last vocabulary chunk
    return dict(h=jnp.asarray(rng.normal(size=(N, D)) * scale, h_dtype),
                w=jnp.asarray(rng.normal(size=(v_pad, D)) * 0.3, w_dtype),
                b=(rng.normal(size=v_pad) * 0.1).astype(np.float32), wt=rng.uniform(0.5, 1.5, N).astype(np.float32),
                y=y.astype(np.int32), g=rng.normal(size=N).astype(np.float32))


@functools.lru_cache(maxsize=None)
def _fn(mesh_name, vv, feats, extra):
    mesh = mesh_named(mesh_name)

    def weighted(h, w, b, wt, y, g):
        l, aux = cross_entropy(h, w, y, valid_vocab=vv, weights=wt, bias=b, impl="mosaic_gpu", mesh=mesh,
                               **dict(feats), **dict(extra))
        return jnp.sum(g * l), (l, aux)

    return jax.jit(jax.value_and_grad(weighted, argnums=(0, 1, 2, 3), has_aux=True))


def _check(d, mesh_name="1dev", feats=ALL, vv=VV, **extra):
    with pytest.MonkeyPatch.context() as mp:   # tiles are read when the call is traced
        mp.setattr(tiles, "MOSAIC_TILES", SMALL)
        (_, (l, aux)), grads = _fn(mesh_name, vv, tuple(sorted(feats.items())), tuple(sorted(extra.items())))(
            d["h"], d["w"], d["b"], d["wt"], d["y"], d["g"])
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    ref = numpy_cross_entropy(f64(d["h"]), f64(d["w"]), d["y"], valid_vocab=vv, weights=d["wt"], bias=d["b"],
                              cotangent=d["g"], **feats)
    assert int(aux["invalid_label_count"]) == ref["invalid_label_count"]
    close(l, ref["loss"], LOSS_TOL)
    close(aux["z_loss"], ref["z_loss"], LOSS_TOL)
    valid = (d["y"] >= 0) & (d["y"] < vv)
    close(np.asarray(aux["lse"])[valid], ref["lse"][valid], LOSS_TOL)
    # The largest logit is at most the log-sum-exp and within log(V) of it.
    gap = np.asarray(aux["lse"] - aux["max_logit"])[valid]
    assert (gap >= -1e-3).all() and (gap <= np.log(vv) + 1e-3).all(), gap
    np.testing.assert_array_equal(np.asarray(aux["correct"])[valid], ref["correct"][valid])
    for got, want, key in zip(grads, (d["h"], d["w"], d["b"], d["wt"]), ("d_hidden", "d_weight", "d_bias", "d_weights")):
        assert got.shape == want.shape and got.dtype == jnp.asarray(want).dtype, (key, got.dtype)
        close(np.asarray(got, np.float32), ref[key], GRAD_TOL if key != "d_weights" else LOSS_TOL)
    # Padding rows (>= valid_vocab) get exactly zero gradient.
    assert not np.asarray(grads[1], np.float32)[vv:].any() and not np.asarray(grads[2])[vv:].any()
    return l, aux, grads


@needs_interpreter
def test_one_device_matches_float64_oracle_every_option():
    """bf16 inputs, z-loss, label smoothing, logit scale, soft-cap, bias, per-token weights, ignored and
    invalid labels, padded vocabulary rows, ragged N and V: loss, aux and all four gradients."""
    _check(_data())


@needs_interpreter
def test_fp32_head_accumulates_dw_in_the_gradient_itself():
    """W fp32 (as training holds it): the chunks of W are rounded to bf16 for the tile matmuls only, dW is
    fp32 and sums the token chunks exactly; fp32 hidden states are rounded the same way."""
    _check(_data(h_dtype=jnp.float32, w_dtype=jnp.float32))


# Vocabulary-parallel over 8 devices, and fsdp 2 x tensor 4 with W in the model's layout P('tensor', 'fsdp')
# (W's d gathered, dW reduce-scattered, chunk by chunk through the shared driver).
@needs_interpreter
@pytest.mark.parametrize("mesh_name", ["8dev_1x8", "8dev_f2x4"])
def test_eight_devices_match_float64_oracle(mesh_name):
    _check(_data(V_PAD8, VV8), mesh_name, vv=VV8, vocab_chunk=64)


@needs_interpreter
def test_every_label_ignored_gives_zero_loss_and_gradient():
    d = _data()
    d["y"][:] = -1
    d["y"][::7] = VV + 2
    l, aux, grads = _check(d)
    assert not np.asarray(l).any() and not np.asarray(grads[0], np.float32).any()
    assert not np.asarray(grads[1], np.float32).any() and int(aux["invalid_label_count"]) == 22


@needs_interpreter
def test_logits_in_the_thousands_do_not_overflow():
    """exp overflows fp32 past 88: the running max keeps every exponent at most 0."""
    l, aux, _ = _check(_data(scale=300.0), feats=PLAIN)
    assert np.abs(np.asarray(aux["lse"])).max() > 2e3 and np.isfinite(np.asarray(l)).all()


# -------------------------------------------------------------------------- refusals, one line each

def test_mosaic_gpu_refuses_a_d_that_is_not_whole_64_column_blocks():
    h, w = jnp.zeros((64, 48), jnp.bfloat16), jnp.zeros((128, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"impl='mosaic_gpu'.*d=48 is not a multiple of 64.*impl='auto'"):
        cross_entropy(h, w, jnp.zeros((64,), jnp.int32), valid_vocab=128, impl="mosaic_gpu")


@pytest.mark.skipif(INTERPRETER, reason="this stack has the interpreter; the refusal is for jax < 0.12")
def test_without_the_interpreter_a_cpu_run_names_the_stack_to_use():
    h, w = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((128, 64), jnp.bfloat16)
    # Refused when it runs (a deviceless compile for a GPU traces this branch too, and must not fail).
    with pytest.raises(Exception, match=r"needs the Mosaic GPU interpreter.*Python 3.12 stack.*impl='xla'"):
        jax.block_until_ready(cross_entropy(h, w, jnp.zeros((64,), jnp.int32), valid_vocab=128, impl="mosaic_gpu"))


def test_the_removed_triton_impl_names_its_replacement():
    h, w = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"impl='pallas_gpu'.*removed.*impl='mosaic_gpu'"):
        cross_entropy(h, w, jnp.zeros((64,), jnp.int32), valid_vocab=128, impl="pallas_gpu")


# ------------------------------------------------------------------------ lowered for a CUDA GPU

def _lowered_for_cuda(n=256, d=256, v=1024, h_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, impl="auto", mesh=None):
    args = (jax.ShapeDtypeStruct((n, d), h_dtype), jax.ShapeDtypeStruct((v, d), w_dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    f = jax.value_and_grad(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v - 3, impl=impl, mesh=mesh,
                                                         z_loss=1e-4, softcap=30.0)[0].sum(), argnums=(0, 1))
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_auto_lowers_to_the_two_mosaic_kernels_for_cuda_with_bf16_hidden_states():
    """No GPU and no CUDA plugin needed: the statistics kernel (forward) and the dZ kernel (backward) are
    Mosaic GPU custom calls; fp32 hidden states stay on XLA under 'auto'; a CPU compile never has them."""
    assert _lowered_for_cuda().count("stablehlo.custom_call @mosaic_gpu_v2") == 2
    assert "@mosaic_gpu_v2" not in _lowered_for_cuda(h_dtype=jnp.float32)
    cpu = jax.jit(lambda h, w, y: cross_entropy(h, w, y, valid_vocab=1000)[0]).lower(
        jnp.zeros((256, 256), jnp.bfloat16), jnp.zeros((1024, 256), jnp.bfloat16), jnp.zeros((256,), jnp.int32))
    assert "mosaic_gpu_v2" not in cpu.compile().as_text()


def test_default_tiles_fit_sm90_shared_memory_by_lowering(monkeypatch):
    """The default tiles and pipeline depth at the Llama-3-8B head's d = 4096 lower for sm_90 (Mosaic GPU
    checks each kernel's shared memory against the 227 KiB of sm_90 when it lowers without a device), and
    a pipeline twice as deep on 256 x 256 tiles is refused by that same check: the check is real."""
    assert _lowered_for_cuda(n=512, d=4096, v=2048).count("@mosaic_gpu_v2") == 2
    monkeypatch.setattr(tiles, "MOSAIC_TILES", tiles.MosaicTiles(token=256, vocab=256, steps=8))
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        _lowered_for_cuda(n=512, d=4096, v=2048, impl="mosaic_gpu")
