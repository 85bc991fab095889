"""Attention kernels: splash (Pallas interpret mode) and cuDNN against the einsum reference, and `auto`.

Shapes are tiny: Pallas interpret mode runs the TPU kernel step by step on the CPU.

``chex.TestCase`` classes; segment-id handling runs under both of chex's jit variants (``auto`` picks its
kernel when tracing). The splash kernel's tests run under jit only (interpret mode op by op would cost
several times more), and the TPU compile-only test stays a plain function: tests/conftest.py's slow tier
names it (``SLOW_TESTS``), and tests/test_tiers.py looks for it as a module-level ``def``.
"""

import importlib.util
import os
import re
import unittest

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from tieflax import sharding as shd
from tieflax.model import ModelConfig, TransformerLM
from tieflax.model.config import ConfigError
from tieflax.model.layers import Attention
from tieflax.ops.attention import attention, xla_attention
from tieflax.ops.splash_attention import splash_attention


def qkv(b, t, h, kh, dh, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, h, dh)), jax.random.normal(kk, (b, t, kh, dh)),
            jax.random.normal(kv, (b, t, kh, dh)))


def two_documents(b, t, first):
    """[B, T] segment ids: document 0 for the first `first` tokens, then document 1 (packed data)."""
    return jnp.broadcast_to((jnp.arange(t) >= first).astype(jnp.int32), (b, t))


# Every mask kind the model families use, in two cases (each case is one slow interpret-mode compile).
# (heads, kv heads): GQA 4/2 and MQA 2/1 (MHA is the GQA code path with one query head per group).
SPLASH_CASES = {
    # Llama / Qwen2 / Mistral global layers: causal + packed documents, GQA; T = 200 is padded to two
    # 128-tiles, so the kernel also skips the masked upper tile.
    "gqa_causal_segments_padded": dict(t=200, heads=(4, 2), first=90, block=128),
    # Gemma 2 local layers (Mistral's window too): a 64-token sliding window, soft-capped logits, the
    # query_pre_attn_scalar scale; MQA as in Gemma; one 256-tile, documents split inside it.
    "mqa_window_softcap_query_scalar": dict(t=256, heads=(2, 1), first=150, window=64, softcap=5.0,
                                            scale=24.0 ** -0.5),
}


def _lm_config(**kw) -> ModelConfig:
    # One sliding-window layer with soft-capped logits; 4 query heads over 2 key/value heads.
    base = dict(vocab_size=128, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128,
                sliding_window=48, attn_softcap=20.0)
    return ModelConfig(**dict(base, **kw))


class SplashAttentionTest(chex.TestCase):
    """The splash kernel (Pallas, interpret mode) against the einsum, under jit only."""

    @parameterized.named_parameters(*[(case, case) for case in sorted(SPLASH_CASES)])
    def test_splash_matches_xla_values_and_gradients(self, case):
        """Values and the gradients w.r.t. q, k and v (a random cotangent), splash (interpret) vs einsum."""
        p = SPLASH_CASES[case]
        (h, kh), dh = p["heads"], 64
        q, k, v = qkv(1, p["t"], h, kh, dh)
        seg = two_documents(1, p["t"], p["first"])
        opts = dict(scale=p.get("scale", dh ** -0.5), softcap=p.get("softcap", 0.0), window=p.get("window", 0))
        cotangent = jax.random.normal(jax.random.key(7), q.shape)

        def vjp(fn):
            # The arrays are arguments, not closed-over constants, which XLA would fold at compile time.
            @jax.jit
            def run(q, k, v, seg, cotangent):
                out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, seg, **opts), q, k, v)
                return out, pullback(cotangent)
            return run(q, k, v, seg, cotangent)

        out, grads = vjp(lambda *a, **kw: splash_attention(*a, **kw, interpret=True, block=p.get("block", 512)))
        ref_out, ref_grads = vjp(xla_attention)
        np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
        for name, g, ref in zip("qkv", grads, ref_grads):
            assert float(jnp.abs(ref).max()) > 1e-2, name  # the check below is not vacuous
            np.testing.assert_allclose(g, ref, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")

    def test_splash_in_the_model_on_a_mesh_matches_xla(self):
        """TransformerLM on a (data, fsdp, tensor) = (1, 2, 4) CPU mesh: batch over fsdp, heads over tensor
        (2 key/value heads on 4 tensor shards are repeated), splash in interpret mode; logits as the einsum's."""
        mesh = shd.make_mesh(1, 2, 4, devices=jax.devices()[:8])
        c = _lm_config()
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, c.vocab_size, (2, 128), dtype=np.int32)
        segments = two_documents(2, 128, 70)
        # Random parameters in numpy: cheaper than an init (no compile), and any values test the kernel.
        shapes = jax.eval_shape(TransformerLM(c).init, jax.random.key(0), tokens[:, :8])["params"]
        params = jax.tree.map(lambda a: rng.normal(0.0, 0.3, a.shape).astype(np.float32), nn.unbox(shapes))

        def logits(attention_name):
            model = TransformerLM(c.replace(attention=attention_name), mesh=mesh)
            with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
                fn = jax.jit(lambda p, x, s: model.apply({"params": p}, x, segment_ids=s),
                             in_shardings=(None, shd.batch_sharding(mesh), shd.batch_sharding(mesh)))
                lowered = fn.lower(params, tokens, segments)
                return lowered.compile()(params, tokens, segments), lowered.as_text()

        splash_logits, splash_hlo = logits("splash")
        xla_logits, _ = logits("xla")
        assert "shard_map" in splash_hlo or "sdy.manual_computation" in splash_hlo
        np.testing.assert_allclose(splash_logits[..., :c.vocab_size], xla_logits[..., :c.vocab_size],
                                   atol=2e-4, rtol=2e-4)


def _layer_lowered(c: ModelConfig, device, mesh_or_none, packed: bool = True):
    """One Attention layer's forward + backward (T = 256) lowered for `device`, with the layer given
    the one-device mesh or no mesh; segment ids [1, 256] when `packed`, else None (one segment)."""
    layer = Attention(c, layer=0, mesh=mesh_or_none)
    x = jnp.zeros((1, 256, c.d_model), jnp.dtype(c.dtype))
    ids = jnp.zeros((1, 256), jnp.int32)
    seg = ids if packed else None
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), x, ids, seg))
    loss = lambda p, x, pos, seg: layer.apply(p, x, pos, seg).astype(jnp.float32).sum()  # noqa: E731
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), (params, x, ids, seg))
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args)


_NEEDS_CUDA_PLUGIN = unittest.skipIf(importlib.util.find_spec("jax_cuda12_plugin") is None,
                                     "needs the CUDA plugin (pip install 'jax[cuda12]') to compile for an H100")


class KernelChoiceTest(chex.TestCase):
    """Which kernel a layer's forward and backward compile to (read from the lowered or compiled program:
    no jit variants).
    """

    def test_auto_picks_xla_on_cpu(self):
        c = _lm_config(n_layers=1, sliding_window=0, attn_softcap=0.0)
        mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        for m in (mesh, None):
            hlo = _layer_lowered(c, jax.devices()[0], m).as_text()
            assert "custom_call" not in hlo  # neither Pallas nor cuDNN
            assert "tensor<1x2x2x256x256xf32>" in hlo  # the einsum's fp32 scores [B, K, g, T, T]

    @_NEEDS_CUDA_PLUGIN
    def test_cudnn_compiles_for_an_h100_and_auto_picks_it_when_supported(self):
        h100 = _h100()
        mesh = shd.make_mesh(1, 1, 1, devices=[h100])
        c = _lm_config(n_layers=1, sliding_window=64, attn_softcap=0.0, dtype="bfloat16")
        for name in ("cudnn", "auto"):
            compiled = _layer_lowered(c.replace(attention=name), h100, mesh).compile()
            assert "__cudnn$fmha" in compiled.as_text(), name
        assert "__cudnn$fmha" in _layer_lowered(c, h100, None).as_text()  # auto via platform_dependent
        # No soft-cap in cuDNN: auto falls back to the einsum for Gemma 2's capped logits.
        assert "__cudnn$fmha" not in _layer_lowered(c.replace(attn_softcap=50.0), h100, mesh).as_text()

    @_NEEDS_CUDA_PLUGIN
    def test_cudnn_gets_the_causal_flag_and_a_mask_only_for_packed_rows(self):
        """One segment per row (segment_ids None): cuDNN's causal flag alone, no [B, 1, T, T] bias operand
        in the forward or the backward call (and no bias gradient); packed rows keep the bias."""
        h100 = _h100()
        mesh = shd.make_mesh(1, 1, 1, devices=[h100])
        c = _lm_config(n_layers=1, sliding_window=0, attn_softcap=0.0, dtype="bfloat16", attention="cudnn")
        for m in (mesh, None):
            hlo = _layer_lowered(c, h100, m, packed=False).compile().as_text()
            calls = _cudnn_calls(hlo)
            assert [target for target, _ in calls] == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], calls
            assert all("1,256,256]" not in operands for _, operands in calls), calls
            assert all('"mask_type": "CAUSAL"' in line for line in _cudnn_lines(hlo))
        packed = _cudnn_calls(_layer_lowered(c, h100, mesh).compile().as_text())
        assert [target for target, _ in packed] == ["__cudnn$fmhaScaleBiasSoftmax",
                                                    "__cudnn$fmhaScaleBiasSoftmaxBackward"], packed
        assert all("bf16[1,1,256,256]" in operands for _, operands in packed), packed


def test_auto_picks_splash_when_compiled_for_a_tpu():
    """Compiled for one chip of a v5e:2x2 topology from this CPU process: `auto` is splash, with a mesh
    (its devices' platform) or without (platform_dependent), and no [T, T] scores are stored."""
    pytest.importorskip("libtpu", reason="needs libtpu (the 'tpu' extra) to compile for a TPU topology")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock
    from jax.experimental import topologies

    chip = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices[0]
    c = _lm_config(n_layers=1, sliding_window=0, attn_softcap=0.0, dtype="bfloat16")
    for m in (shd.make_mesh(1, 1, 1, devices=[chip]), None):
        compiled = _layer_lowered(c, chip, m).compile()
        assert "tpu_custom_call" in compiled.as_text()  # the Pallas (Mosaic) kernel
        assert "256,256]" not in compiled.as_text()  # no [.., T, T] buffer anywhere
        # 748,032 B with libtpu 0.0.42.1; 0 with 0.0.52, which keeps this layer's temporaries on chip.
        assert 0 <= compiled.memory_analysis().temp_size_in_bytes < 2 * 2**20


def _h100():
    from jax.experimental import topologies

    from tieflax.hardware.targets import gpu_target_config

    return topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"),
                                        topology="1x1x1").devices[0]


def _cudnn_lines(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if 'custom_call_target="__cudnn$fmha' in line]


def _cudnn_calls(hlo: str) -> list[tuple[str, str]]:
    """(custom-call target, its operand shapes) of each cuDNN attention call in compiled HLO text."""
    calls = []
    for line in _cudnn_lines(hlo):
        target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", line)
        calls.append((target, operands.group(1) if operands else line))
    return calls


class SegmentIdsTest(chex.TestCase):
    """Rows without segment ids: one segment, exactly. The kernel-level check runs under both chex variants;
    the model's loss and gradients (a 2-layer model's value_and_grad, twice) op by op only.
    """

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_segment_ids_is_one_segment(self):
        """segment_ids=None (rows that are not packed documents) gives exactly what ids of one segment give."""
        q, k, v = qkv(2, 16, 4, 2, 8)
        ones = jnp.zeros((2, 16), jnp.int32)
        for window in (0, 5):
            xla = self.variant(lambda q, k, v, seg: xla_attention(q, k, v, seg, scale=0.3, window=window))
            auto = self.variant(lambda q, k, v, seg: attention(q, k, v, seg, scale=0.3, window=window,
                                                               implementation="auto"))
            np.testing.assert_array_equal(xla(q, k, v, None), xla(q, k, v, ones))
            np.testing.assert_array_equal(auto(q, k, v, None), auto(q, k, v, ones))

    def test_unpacked_rows_lose_nothing_without_segment_ids(self):
        """Rows without document masking (segment 1, then 0 for the last row's padding, targets -1 there):
        the train step passes no segment ids (``tieflax.train.step.attention_segments``), and the loss and
        its gradients are exactly those the segment ids give, since causality already keeps the padding at
        the end away from every real token."""
        c = _lm_config(sliding_window=0, attn_softcap=0.0, n_layers=2)
        model = TransformerLM(c)
        rng = np.random.default_rng(0)
        tokens = jnp.asarray(rng.integers(0, c.vocab_size, (2, 32)), jnp.int32)
        valid = jnp.arange(32)[None, :] < jnp.asarray([[32], [20]])
        segments = valid.astype(jnp.int32)
        targets = jnp.where(valid, jnp.roll(tokens, -1, axis=1), -1)
        # Random parameters in numpy, as above: no init run op by op (a program compiled per operation),
        # and the equality below holds for any values.
        shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])
        params = jax.tree.map(lambda a: rng.normal(0.0, 0.3, a.shape).astype(a.dtype), shapes)

        def loss(p, seg):
            per_token, _ = model.apply({"params": p}, tokens, targets, None, seg, method="loss")
            return jnp.where(valid, per_token, 0.0).sum()

        with_ids, without = jax.value_and_grad(loss)(params, segments), jax.value_and_grad(loss)(params, None)
        chex.assert_trees_all_equal(with_ids, without)


class ConfigRefusalTest(chex.TestCase):

    def test_explicit_kernels_refuse_what_they_cannot_run(self):
        with self.assertRaisesRegex(ConfigError, "config.model.attention"):
            _lm_config(attention="flash")
        with self.assertRaisesRegex(ConfigError, r"config.model.attention.*soft-cap.*config.model.attn_softcap"):
            _lm_config(attention="cudnn", dtype="bfloat16")  # attn_softcap=20
        with self.assertRaisesRegex(ConfigError, r"config.model.attention.*config.model.dtype"):
            _lm_config(attention="cudnn", attn_softcap=0.0)  # float32
        x = np.zeros((1, 8, 2, 8), jnp.bfloat16)
        mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        with self.assertRaisesRegex(ValueError, "runs on 'cpu'.*use 'auto' or 'xla'"):
            attention(x, x, x, np.zeros((1, 8), np.int32), scale=1.0, implementation="cudnn", mesh=mesh)
