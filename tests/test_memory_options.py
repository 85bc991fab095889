"""Memory options of the model: the chunked MLP, layer inputs offloaded to host memory, RoPE's own VJP, and
what remat 'none' keeps of the norms and the MLP activation.

Each must leave the function unchanged (same loss and gradients as the plain model) and do what it is
for (the offloaded input is moved to host memory, which the TPU compiler keeps; chunking lowers the
compiled step's temporaries).
"""

from __future__ import annotations

import importlib.util
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from tieflax.model import ConfigError, ModelConfig, TransformerLM
from tieflax.model import layers
from tieflax.model.layer_stacking import to_layout

V, B, T = 64, 2, 12
BASE = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=48, remat="full")
FAMILIES = {
    "llama": ModelConfig(family="llama", **BASE),                       # SwiGLU, RoPE
    "gemma2": ModelConfig(family="gemma2", mlp="geglu", sandwich_norms=True, norm_unit_offset=True,
                          sliding_window=4, sliding_window_every=2, **BASE),
    "gpt2": ModelConfig(family="gpt2", mlp="gelu", mlp_bias=True, norm="layernorm", position="learned",
                        **BASE),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (B, T)), jnp.int32)
TARGETS = jnp.roll(TOKENS, -1, axis=1)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _loss_fn(c: ModelConfig):
    model = TransformerLM(c)
    return lambda p: model.apply({"params": p}, TOKENS, TARGETS, method="loss")[0].mean()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_mlp_and_offloaded_inputs_keep_loss_and_gradients(family):
    """Chunks of 4 positions (T = 12: three), of 5 (a shorter last chunk), offloading, both; scanned and
    unrolled; ``mlp_chunk`` counts the tokens of all B rows (``mlp_chunk_length``), 4 positions = 4 * B."""
    base = FAMILIES[family]
    params = nn.unbox(TransformerLM(base).init(jax.random.key(0), TOKENS)["params"])
    variants = [dict(mlp_chunk=4 * B), dict(mlp_chunk=5 * B), dict(offload_layer_inputs=True),
                dict(mlp_chunk=4 * B, offload_layer_inputs=True, scan_layers=True), dict(mlp_chunk=T * B)]
    configs = [base] + [base.replace(**v) for v in variants]
    everything = jax.jit(
        lambda p: [jax.value_and_grad(_loss_fn(c))(to_layout(p, c)) for c in configs],
        compiler_options=FAST_COMPILE)
    (loss, grads), *others = everything(params)
    assert 2.0 < float(loss) < 6.0
    for v, c, (loss_v, grads_v) in zip(variants, configs[1:], others):
        np.testing.assert_allclose(loss_v, loss, rtol=1e-6, err_msg=str(v))
        grads_v = to_layout(grads_v, base)   # scanned variants: back to per-layer
        for path, (a, b) in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                zip(jax.tree.leaves(grads), jax.tree.leaves(grads_v))):
            np.testing.assert_allclose(b, a, atol=3e-6, rtol=1e-5, err_msg=f"{v} {path[0]}")


def test_offloaded_layer_input_goes_to_host_memory():
    """The gradient program moves each block's input to pinned host memory and back; without the
    option it does not."""
    c = FAMILIES["llama"]
    # Shapes and dtypes are all a jaxpr needs: no values computed.
    params = jax.eval_shape(lambda: nn.unbox(TransformerLM(c).init(jax.random.key(0), TOKENS)["params"]))

    def program(config):
        return str(jax.make_jaxpr(jax.grad(_loss_fn(config)))(params))

    offloaded = program(c.replace(offload_layer_inputs=True))
    # device_put to MemorySpace.Host in the forward pass; the saved [B, T, d] values typed f32<host>.
    assert "MemorySpace.Host" in offloaded and f"f32<host>[{B},{T},16]" in offloaded
    assert "MemorySpace.Host" not in program(c)


def test_mlp_chunk_counts_tokens_per_device():
    """``mlp_chunk`` tokens per device: positions per row = tokens / the rows a device holds (the batch
    over the mesh's 'data' and 'fsdp' axes when they divide it, else whole on each device)."""
    assert layers.mlp_chunk_length(0, 8, None) == 0
    assert layers.mlp_chunk_length(1024, 8, None) == 128      # one device, 8 rows (one H100, 8 x 2048)
    assert layers.mlp_chunk_length(1024, 1, None) == 1024
    assert layers.mlp_chunk_length(4, 8, None) == 1
    mesh = AbstractMesh((2, 4, 1), ("data", "fsdp", "tensor"))
    assert layers.mlp_chunk_length(1024, 8, mesh) == 1024     # one row per device: the pod configs
    assert layers.mlp_chunk_length(1024, 16, mesh) == 512
    assert layers.mlp_chunk_length(1024, 12, mesh) == 85      # 12 rows do not shard 8 ways: all on each


def test_kernel_cast_is_astype_bit_for_bit():
    """``cast_kernel`` (fp32 -> bf16 by integer operations, so that XLA:TPU keeps it in the layer loop)
    rounds as ``astype`` does for every kind of fp32 value, and its gradient is ``astype``'s."""
    rng = np.random.default_rng(5)
    values = np.concatenate([
        (rng.normal(size=4096) * np.exp(rng.normal(size=4096) * 20)).astype(np.float32),   # every exponent
        rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bits
        np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, 3.4e38, 1.00390625, 1.01171875], np.float32)])  # ties
    x = jnp.asarray(values)
    want, got = x.astype(jnp.bfloat16), layers.cast_kernel(x, jnp.bfloat16)
    nan = np.isnan(values)
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))  # noqa: E731
    np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan])
    assert nan.any() and np.isnan(np.asarray(got, np.float32)[nan]).all()
    w = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    loss = lambda cast: lambda w: (cast(w).astype(jnp.float32) ** 3).sum()  # noqa: E731
    np.testing.assert_array_equal(jax.grad(loss(lambda w: layers.cast_kernel(w, jnp.bfloat16)))(w),
                                  jax.grad(loss(lambda w: w.astype(jnp.bfloat16)))(w))
    assert layers.cast_kernel(w, jnp.float32) is w


def test_memory_options_are_validated_by_name():
    with pytest.raises(ConfigError, match=r"config.model.offload_layer_inputs: .*needs rematerialisation"):
        FAMILIES["llama"].replace(remat="none", offload_layer_inputs=True)
    with pytest.raises(ConfigError, match=r"config.model.mlp_chunk = -1 is out of range \[0, inf\]"):
        FAMILIES["llama"].replace(mlp_chunk=-1)


def test_rope_gradient_is_the_inverse_rotation():
    """apply_rope's VJP equals automatic differentiation of the same rotation, and undoes it."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 6, 3, 8)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 500, (2, 6)), jnp.int32)
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, 8, 2, dtype=jnp.float32) / 8))
    y, vjp = jax.vjp(lambda v: layers.apply_rope(v, positions, inv_freq), x)
    y_auto, vjp_auto = jax.vjp(lambda v: layers._rotate(v, positions, inv_freq, 1.0), x)
    np.testing.assert_allclose(y, y_auto, rtol=1e-6)
    np.testing.assert_allclose(vjp(cotangent)[0], vjp_auto(cotangent)[0], atol=1e-6)
    np.testing.assert_allclose(vjp(y)[0], x, atol=1e-5)   # a rotation's transpose is its inverse


def _random_params(module: nn.Module, *args):
    """``module``'s parameters drawn in NumPy from a fixed seed (the same values at every call), in their
    shapes and dtypes: no init run op by op, which compiled a program per operation. The remat tests
    compare two backwards of the same values and count residuals by shape: any values do."""
    shapes = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), *args))
    rng = np.random.default_rng(6)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype), shapes)


def _saved_and_gradients(module_cls, c: ModelConfig, x, capsys):
    """(what the backward of ``module_cls(c)`` keeps, as jax prints it; its gradients wrt params and x)."""
    module = module_cls(c)
    params = _random_params(module, x)
    loss = lambda p, x: module.apply(p, x).astype(jnp.float32).sum()  # noqa: E731
    jax.ad_checkpoint.print_saved_residuals(loss, params, x)  # one line per residual: 'f32[2,12,16] ...'
    return capsys.readouterr().out, jax.grad(loss, argnums=(0, 1))(params, x)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_remat_none_keeps_no_fp32_copy_of_a_norms_input(norm, capsys):
    """Under remat 'none' a norm's backward keeps its bf16 input, not fp32 copies of it (autodiff kept
    x, 2x and x * rsqrt in fp32: six fp32 [layers, B, T, d] stacks a scanned Llama step), and its
    gradients are exactly those of plain autodiff (the norm outside any remat)."""
    c = ModelConfig(family="llama", vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=48, norm=norm,
                    dtype="bfloat16", remat="none")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, 16)), jnp.bfloat16)
    saved, grads = _saved_and_gradients(layers.Norm, c, x, capsys)
    assert f"bf16[{B},{T},16]" in saved and f"f32[{B},{T},16]" not in saved, saved
    _, plain = _saved_and_gradients(layers.Norm, c.replace(remat="full"), x, capsys)
    jax.tree.map(np.testing.assert_array_equal, grads, plain)


@pytest.mark.parametrize("mlp", ["swiglu", "geglu", "gelu"])
def test_remat_none_keeps_the_mlp_activation_inputs_not_its_insides(mlp, capsys):
    """Under remat 'none' the MLP's backward keeps the matmul outputs and the activation's result
    ([B, T, d_ff] each: up, gate, hidden; gelu: up, hidden), not the activation's inner values
    (autodiff of SwiGLU kept six [B, T, d_ff] arrays); gradients exactly those of plain autodiff."""
    c = ModelConfig(family="llama", vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=48, mlp=mlp,
                    dtype="bfloat16", remat="none")
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, 16)), jnp.bfloat16)
    saved, grads = _saved_and_gradients(layers.Mlp, c, x, capsys)
    assert saved.count(f"[{B},{T},48]") == (2 if mlp == "gelu" else 3), saved
    _, plain = _saved_and_gradients(layers.Mlp, c.replace(remat="full"), x, capsys)
    jax.tree.map(np.testing.assert_array_equal, grads, plain)


def test_remat_none_keeps_no_normalised_copy_of_the_block_input(capsys):
    """Under remat 'none' a block's backward keeps its input and the attention's residual sum, not the
    pre-norms' outputs (each norm runs inside the checkpoint of the matmuls it feeds, so the backward
    normalises again): two bf16 [B, T, d] residuals, where keeping the normalised copies made four (two
    1 GiB [layers, B, T, d] stacks for Llama-3.2-1B at 8 x 2048). Gradients exactly those of plain
    autodiff (the block outside any remat, as a 'full' block runs inside its checkpoint)."""
    c = ModelConfig(family="llama", vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=48,
                    dtype="bfloat16", remat="none", attention="xla")
    x = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, 16)), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def saved_and_gradients(config):
        block = layers.Block(config, layer=0)
        params = _random_params(block, x, positions, None)
        loss = lambda p, x: block.apply(p, x, positions, None).astype(jnp.float32).sum()  # noqa: E731
        jax.ad_checkpoint.print_saved_residuals(loss, params, x)
        return capsys.readouterr().out, jax.grad(loss, argnums=(0, 1))(params, x)

    saved, grads = saved_and_gradients(c)
    assert saved.count(f"bf16[{B},{T},16]") == 2, saved
    _, full = saved_and_gradients(c.replace(remat="full"))
    jax.tree.map(np.testing.assert_array_equal, grads, full)


def _grad_compiled(config: ModelConfig, tokens, params, **jit_kwargs):
    """The compiled gradient program; the loss on its XLA path (the MLP's buffers are what is measured,
    and the Pallas loss kernels would add TPU compile time)."""
    model = TransformerLM(config)
    f = jax.grad(lambda p, t: model.apply({"params": p}, t, t, method="loss", impl="xla")[0].mean())
    return jax.jit(f, **jit_kwargs).lower(params, tokens).compile()


def _grad_memory(config: ModelConfig, tokens, params, **jit_kwargs):
    return _grad_compiled(config, tokens, params, **jit_kwargs).memory_analysis()


def test_chunking_takes_the_whole_mlp_activation_out_of_the_compiled_step():
    """T = 1024, d_ff = 2048, fp32, the CPU compiler: the plain step holds [T, d_ff] activations (8 MiB
    each), the chunked one none, only 128-token chunks, and its temporaries are lower by at least one such
    activation (measured: 122.7 -> 78.2 MiB on jax 0.10, 90.6 -> 75.7 on jax 0.12, whose buffer assignment
    reuses more of the plain step's buffers). The TPU figures of the published configs are in
    benchmarks/README.md ("After the memory options")."""
    c = ModelConfig(family="llama", vocab_size=1024, d_model=128, n_layers=2, n_heads=4, d_ff=2048,
                    max_seq_len=1024, remat="full", scan_layers=True)
    tokens = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(TransformerLM(c).init(jax.random.key(0), TOKENS)["params"]))
    plain, chunked = _grad_compiled(c, tokens, params), _grad_compiled(c.replace(mlp_chunk=128), tokens, params)
    whole_activation = re.compile(r"f32\[(1,)?1024,2048\]")
    assert whole_activation.search(plain.as_text()) and not whole_activation.search(chunked.as_text())
    saved = plain.memory_analysis().temp_size_in_bytes - chunked.memory_analysis().temp_size_in_bytes
    assert saved >= 1024 * 2048 * 4, saved


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'tieflax[tpu]'; the test extra brings it)")
def test_the_tpu_compiler_keeps_offloaded_layer_inputs_in_host_memory():
    """One v5e chip: the compiled step holds the stacked layer inputs, [2, 1, 256, 128] bf16 = 128 KiB, as
    host temporaries (measured: 128 KiB, as [2, 1, 2048, 256] made 2.0 MiB; none without the option). On the
    CPU there is no host memory space to check, and a compiler that dropped the request would only show
    here. T = 256 and d = 128 (a whole TPU lane tile; the MLP still in 4 chunks of 64 tokens) keep every
    part of the offloaded program at a fifth of the libtpu compile time of T = 2048, d = 256 (measured:
    13.1 -> 2.7 CPU-s on jax 0.10, 11.0 -> 2.5 on jax 0.12)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices[0]
    replicated = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    t, d = 256, 128
    c = ModelConfig(family="llama", vocab_size=1024, d_model=d, n_layers=2, n_heads=4, d_ff=1024,
                    max_seq_len=t, dtype="bfloat16", remat="full", scan_layers=True, mlp_chunk=t // 4,
                    offload_layer_inputs=True)
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=replicated)
    params = jax.eval_shape(lambda: nn.unbox(TransformerLM(c).init(jax.random.key(0), TOKENS)["params"]))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), params)
    offloaded = _grad_memory(c, tokens, params, out_shardings=replicated)
    assert offloaded.host_temp_size_in_bytes >= 2 * t * d * 2
