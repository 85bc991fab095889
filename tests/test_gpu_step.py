"""benchmarks/gpu_step.py under SMOKE=1 (a tiny model on the CPU) and tools/profile_table.py on its profiles;
the GPU XLA flags (tieflax/hardware/gpu_flags.py) known to this XLA and reaching a deviceless H100 compile."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from train_support import suite_xla_flags
from tieflax.hardware.gpu_flags import flags_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def _run(args, **env):
    # One device, as on the one GPU the benchmark is for (the suite's XLA_FLAGS ask for 8 CPU devices).
    env = {"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": suite_xla_flags(None), **env}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_smoke_step_and_profile_table(tmp_path):
    variants = "tieflax-tied,tieflax-tied-xla-flags,tieflax-untied" + (",hf" if HAVE_TORCH else "")
    # OMP_NUM_THREADS=1: the HF peer's torch on one thread (its idle OpenMP workers spin on a loaded machine:
    # tests/train_support.py's torch_one_thread); on a CPU its step time means nothing here.
    done = _run(["benchmarks/gpu_step.py", "--variants", variants, "--profile", str(tmp_path)], SMOKE="1",
                TIEFLAX_GPU_XLA_FLAGS="recommended",  # the parent's choice: each variant's process sets its own
                OMP_NUM_THREADS="1")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(variants.split(","))
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and 0 < r["loss"] < 20
        assert r["mfu"] is None  # a CPU has no peak in tieflax's targets: no invented MFU
    assert rows["tieflax-untied"]["argument_bytes"] > rows["tieflax-tied"]["argument_bytes"]  # a second table
    # The flags variant asked for the GPU XLA flags, the others not; on a CPU none were added to XLA_FLAGS.
    assert rows["tieflax-tied-xla-flags"]["gpu_xla_flags"] == "recommended"
    assert rows["tieflax-tied"]["gpu_xla_flags"] == rows["tieflax-untied"]["gpu_xla_flags"] == "off"
    assert all("xla_gpu_" not in r["xla_flags"] for r in rows.values() if "xla_flags" in r)
    assert "GPU XLA flags: not added (no GPU here, or the jaxlib was not checked)" in done.stdout

    profiles = [str(tmp_path / "tieflax-tied")] + ([str(tmp_path / "hf-liger.trace.json")] if HAVE_TORCH else [])
    out = _run(["tools/profile_table.py", *profiles, "--hlo", str(tmp_path / "tieflax-tied.hlo.txt"), "--json"])
    report = json.loads(out.stdout)
    jax_split = report["splits"][0]
    assert jax_split["kind"] == "jax-cpu" and jax_split["wall_ns"] > 0
    assert jax_split["by_category"].get("matmul", 0) > 0 and jax_split["by_category"].get("attention", 0) > 0
    assert report["hlo_counts"]["tie"]  # the tied-gradient fold is found by its named scope
    assert report["hlo_counts"]["loss"] and report["hlo_counts"]["optimizer"]
    if HAVE_TORCH:
        torch_split = report["splits"][1]
        assert torch_split["kind"] == "torch-cpu"
        assert torch_split["by_category"].get("matmul", 0) > 0 and torch_split["by_category"].get("attention", 0) > 0
    else:
        pytest.skip("torch/transformers not installed: the HF peer and its trace were not checked")


def test_a_spent_budget_starts_no_variant_and_says_so():
    done = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--budget-s", "20"], cwd=ROOT, text=True,
                          capture_output=True, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", SMOKE="1"),
                          timeout=300)
    assert done.returncode != 0 and "no tieflax variant ran" in done.stderr
    assert "tieflax-tied: not started, 20 s of the 20 s budget left" in done.stderr


def test_the_flags_verdict_compares_the_two_tied_rows():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_step import flags_verdict

    tied = {"variant": "tieflax-tied", "step_s": 0.5, "loss": 10.0, "xla_flags": ""}
    flagged = {**tied, "variant": "tieflax-tied-xla-flags", "step_s": 0.45, "xla_flags": flags_text()}
    assert "500.0 -> 450.0 ms/step (-10.0%)" in flags_verdict([tied, flagged])
    assert "not added" in flags_verdict([tied, {**flagged, "xla_flags": ""}])
    assert flags_verdict([tied]) is None


def test_categories():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_table import categorise

    assert categorise("__cudnn$fmhaScaleBiasSoftmax") == "attention"
    assert categorise("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert categorise("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "collectives"
    assert categorise("gemm_fusion_dot_7", "jit(step)/jvp(TransformerLM.loss)/cond/branch_0_fun/while/body/dot") == "loss"
    assert categorise("gemm_fusion_dot_7", "jit(step)/jvp(TransformerLM.loss)/TransformerLM.features/x/dot") == "matmul"
    loss_backward = "jit(step)/transpose(jvp(TransformerLM.loss))/cond/branch_0_fun/ce_dw/pallas_call"
    assert categorise("pallas_call", loss_backward) == "loss"
    assert categorise("loop_add_fusion", "jit(step)/tie_fold/add") == "tie"
    assert categorise("loop_multiply_fusion", "jit(step)/mul") == "optimizer"
    assert categorise("_rms_norm_forward_kernel") == "norms/RoPE/elementwise"
    assert categorise("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"


# A scanned 4-layer stack's gradient, compiled for an H100 from this CPU: the scan's while loops and their trip
# counts ("known_trip_count") in the optimized HLO.
H100_SCAN = """
import re, jax, jax.numpy as jnp
from jax.experimental import topologies
from tieflax.hardware.targets import gpu_target_config
h100 = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"),
                                    topology="1x1x1").devices[0]
def loss(w, x):
    return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0].sum()
on = jax.sharding.SingleDeviceSharding(h100)
args = (jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=on))
text = jax.jit(jax.grad(loss)).lower(*args).compile().as_text()
print(sorted(set(re.findall(r'"known_trip_count":\\{"n":"(\\d+)"\\}', text))))
"""


def test_xla_knows_every_recommended_gpu_flag():
    # XLA stops the process at start on a flag it does not know ("Unknown flag in XLA_FLAGS"); its CPU client
    # parses the same flag list as the GPU one, so this runs on any stack, with or without the CUDA plugin.
    done = _run(["-c", "import jax; print(jax.jit(lambda x: x * 2)(jax.numpy.ones(3)).sum())"],
                XLA_FLAGS=flags_text())
    assert done.stdout.strip() == "6.0"


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                    reason="needs the CUDA plugin (pip install 'jax[cuda12]') to compile for an H100")
def test_recommended_gpu_flags_reach_a_deviceless_h100_compile():
    default = _run(["-c", H100_SCAN], CUDA_VISIBLE_DEVICES="-1")
    flagged = _run(["-c", H100_SCAN], CUDA_VISIBLE_DEVICES="-1", XLA_FLAGS=flags_text())
    assert default.stdout.split("\n")[-2] == "['4']"  # forward and backward loops: 4 layers a trip
    assert flagged.stdout.split("\n")[-2] == "['2']"  # double buffered: two layers per trip
