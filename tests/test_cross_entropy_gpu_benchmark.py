"""benchmarks/gpu.py in SMOKE mode: tiny shapes on this CPU, every JAX variant measured, peers reported."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a process of its own with six compiles: about a minute on a busy 2-core machine
def test_gpu_benchmark_smoke_runs_every_jax_variant_on_a_cpu():
    env = dict(os.environ, SMOKE="1", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["smoke"] and result["platform"] == "cpu"
    rows = result["rows"]
    assert not [r for r in rows if "error" in r], rows
    names = {(r["head"], r["variant"]) for r in rows}
    from tieflax.ops.cross_entropy import mosaic_gpu
    mosaic = ("tieflax mosaic_gpu",) if mosaic_gpu.interpretable()[0] else ()  # jax 0.10: no interpreter
    for head in ("smoke", "smoke W fp32"):
        for variant in ("naive JAX (fp32 logits, optax)", "tieflax xla", "tieflax auto (ran xla)") + mosaic:
            assert (head, variant) in names, (head, variant, names)
    for r in rows:
        # bf16 hidden states: dH itself is bf16, so even the naive loss is ~2e-3 off the fp32 reference.
        assert r["grad_err"] < 1e-2 and r["loss_err"] < 1e-3, r
        assert r["ms"] > 0 and r["extra_mib"] >= 0
    # No GPU here: the torch peers are named as skipped, never given numbers.
    assert result["missing"] and not [r for r in rows if "Liger" in r["variant"] or "cut-cross" in r["variant"]]
    assert any(line.startswith("# ") and "skipped" in line for line in lines)
