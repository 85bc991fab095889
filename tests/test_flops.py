"""Model FLOPs (tieflax/hardware/flops.py): the 6N convention against the real parameter tree, causal attention,
MaxText's count for the published configs, the chips' peaks, and a training log's TFLOP/s per device."""

from __future__ import annotations

import glob
import os
import types

import flax.linen as nn
import jax
import pytest

from tieflax.hardware import flops, targets
from tieflax.config import load_config, model_config
from tieflax.model.config import ModelConfig
from tieflax.model.params import abstract_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name: str) -> ModelConfig:
    return model_config(load_config(os.path.join(ROOT, "configs", "models", f"{name}.py")))


def _matmul_weights(c: ModelConfig) -> int:
    """Weights that multiply token vectors, from the real parameter tree: every `kernel` (the layers'
    projections), plus the head's V x d once (published V). Norm scales, biases and the input table are not."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params(c),
                                                  is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    kernels = sum(nn.unbox(leaf).size for path, leaf in leaves if path[-1].key == "kernel")
    return kernels + c.vocab_size * c.d_model


@pytest.mark.parametrize("name", ["llama3_2_1b", "gemma_2b", "gpt2", "qwen2_5_0_5b"])
@pytest.mark.parametrize("tied", [True, False])
def test_weight_flops_are_six_per_weight_per_token(name, tied):
    c = _config(name).replace(n_layers=2, tie_embeddings=tied)
    f = flops.step_flops(c, batch=3, seq_len=512)
    assert f.tokens == 3 * 512
    assert f.train_weights == pytest.approx(6 * f.tokens * _matmul_weights(c), rel=1e-12)


def test_tied_and_untied_cost_the_same_and_the_lookup_is_no_matmul():
    c = _config("gemma_2b")
    tied, untied = (flops.step_flops(c.replace(tie_embeddings=t), 1, 8192) for t in (True, False))
    assert tied.train == untied.train
    assert tied.weights["head"] == 2 * 8192 * 2048 * 256_000   # published V, not the padded one


def test_causal_attention_counts_half_the_square_and_windows_their_band():
    assert flops.causal_pairs(8192) == 8192 ** 2 / 2
    assert flops.causal_pairs(8192, window=4096) == 8192 * 4096 - 4096 ** 2 / 2
    assert flops.causal_pairs(1024, window=4096) == 1024 ** 2 / 2    # a window wider than T is full
    c = _config("llama3_8b")
    f = flops.step_flops(c, batch=2, seq_len=8192)
    # 4 H h per visible pair forward (Q K^T and P V): 6 L H h T per token for training.
    assert f.train_attention == pytest.approx(6 * 32 * 32 * 128 * 8192 * f.tokens, rel=1e-12)
    g2 = _config("gemma2_9b")   # local layers (even) see a 4,096-token band
    f2 = flops.step_flops(g2, batch=1, seq_len=8192)
    per_pair = 4 * g2.n_heads * g2.dim_per_head
    assert f2.attention == per_pair * 21 * (flops.causal_pairs(8192) + flops.causal_pairs(8192, 4096))


def test_decoupled_embedding_width_counts_its_projections():
    c = _config("llama3_2_1b").replace(n_layers=1, embed_dim=256)
    f = flops.step_flops(c, batch=1, seq_len=64)
    assert f.weights["head"] == 2 * 64 * 256 * c.vocab_size
    assert f.weights["embed_proj"] == 2 * 64 * 256 * 2048 + 2 * c.vocab_size * 256 * 2048


def test_llama3_8b_equals_maxtexts_count_and_gemma_2b_differs_by_its_padded_vocabulary():
    """Per device, one 8,192-token sequence per device (MaxText's per_device_batch_size=1)."""
    c = _config("llama3_8b")
    ours = flops.step_flops(c, batch=64, seq_len=8192).per_device(64) / 1e12
    theirs = flops.maxtext_tflops_per_device(c, 1, 8192)
    assert ours == pytest.approx(theirs["total"], rel=1e-12)
    assert 420 < ours < 430      # ~6 x 8.03e9 x 8192 / 1e12 = 395, + attention 26, - the lookup's share

    g = _config("gemma_2b")
    ours = flops.step_flops(g, batch=16, seq_len=8192).per_device(16) / 1e12
    theirs = flops.maxtext_tflops_per_device(g, 1, 8192, vocab_size=256_128)   # MaxText's gemma-2b.yml
    assert theirs["total"] - ours == pytest.approx(6 * 8192 * 2048 * 128 / 1e12, rel=1e-9)
    assert abs(theirs["total"] / ours - 1) < 1e-3


def test_every_published_config_has_a_count():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.py"))):
        c = model_config(load_config(path))
        f = flops.step_flops(c, 1, 2048)
        assert f.train > 0 and f.attention > 0, path


def test_peaks_by_device_kind_and_none_on_a_cpu():
    assert targets.device_peak("TPU v5 lite").flops == 197e12
    assert targets.device_peak("TPU v5p").flops == targets.device_peak("TPU v5").flops == 459e12
    assert targets.device_peak("TPU v6 lite").flops == 918e12
    assert targets.device_peak("NVIDIA H100 80GB HBM3").hbm_bytes_per_second == 3350e9
    assert targets.device_peak("NVIDIA A100-SXM4-40GB").hbm_bytes_per_second == 1555e9
    # Hopper parts by the names their devices give (NVIDIA's sparse figures halved: dense bf16)
    assert targets.device_peak("NVIDIA H200") == targets.Peak(989e12, 4800e9)
    assert targets.device_peak("NVIDIA H200 141GB HBM3e") == targets.Peak(989e12, 4800e9)
    assert targets.device_peak("NVIDIA H100 PCIe") == targets.Peak(756.5e12, 2000e9)
    assert targets.device_peak("NVIDIA H100 NVL") == targets.Peak(835.5e12, 3900e9)
    assert targets.device_peak("NVIDIA H200 NVL").flops == 835.5e12
    assert targets.device_peak("NVIDIA GH200 480GB") is None     # another part: not taken for an H200
    assert targets.device_peak("cpu") is None
    assert targets.device_peak(jax.devices()[0].device_kind) is None


def test_throughput_and_mfu():
    tpu = [types.SimpleNamespace(device_kind="TPU v5 lite")] * 4
    out = flops.throughput(4 * 98.5e12, 0.5, tpu)      # 197 TFLOP/s per chip: all of v5e's peak
    assert out["tflops_per_device"] == pytest.approx(197.0)
    assert out["mfu"] == pytest.approx(1.0)
    cpu = flops.throughput(1e12, 2.0, jax.devices())
    assert cpu["tflops_per_device"] == pytest.approx(0.5 / len(jax.devices())) and "mfu" not in cpu
    assert flops.step_time_lower_bound(459e12, 0, targets.CHIP_PEAKS["v5p"]) == pytest.approx(1.0)
    assert flops.step_time_lower_bound(1.0, 2765e9, targets.CHIP_PEAKS["v5p"]) == pytest.approx(1.0)
    assert flops.step_time_lower_bound(1.0, 1.0, None) is None


def test_a_training_log_carries_tflops_per_device(tmp_path):
    """A tiny CPU run: the metrics (read back as one stream) and TensorBoard have tflops_per_device (no
    peak on a CPU: no mfu)."""
    from train_support import micro_config, prepare_shared_data

    from tieflax.run.metrics import read_metrics
    from tieflax.train import train_and_evaluate

    data = str(tmp_path / "data")
    prepare_shared_data(data)
    config = micro_config(data, tied=True, num_steps=4)
    config.train.log_every, config.train.checkpoint_every = 2, 4   # the second row is timed
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir)
    rows = read_metrics(workdir, "train")
    timed = [r for r in rows if "tokens_per_second" in r]   # the first interval includes compilation
    assert timed and all(r["tflops_per_device"] > 0 and "mfu" not in r for r in timed)
    c = model_config(config)
    expected = (flops.step_flops(c, config.train.global_batch_size, config.train.seq_len).train
                * timed[-1]["tokens_per_second"] / (config.train.global_batch_size * config.train.seq_len)
                / len(jax.devices()) / 1e12)
    assert timed[-1]["tflops_per_device"] == pytest.approx(expected, rel=1e-6)
    events = glob.glob(os.path.join(workdir, "**", "events.out.tfevents.*"), recursive=True)
    assert events and any(b"train/tflops_per_device" in open(p, "rb").read() for p in events)
