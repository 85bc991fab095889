"""tieflax plan: the real train and eval steps compiled for abstract TPU chips from this CPU machine."""

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import pytest

from tieflax import cli, plan
from tieflax.plan import buffers as plan_buffers
from tieflax.plan import compile as plan_compile
from tieflax.hardware import flops, targets
from tieflax.config import load_config, model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "experiments", "tiny.py")
needs_libtpu = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install 'tieflax[tpu]'; the test extra brings it)")


@needs_libtpu
def test_tiny_config_fits_on_four_v5e_chips():
    target = targets.resolve("v5e:2x2")
    assert (target.num_devices, target.chip, target.usable_bytes) == (4, "v5e", int(15.75 * 2**30))
    p = plan.plan_config(load_config(TINY), target, name="tiny")

    assert p.global_batch_size == 4 and p.seq_len == 128   # one sequence per chip by default
    assert p.mesh == {"data": 4, "fsdp": 1, "tensor": 1}
    for step in (p.train, p.eval):
        assert 0 < step.arguments < target.usable_bytes
        assert 0 < step.total < target.usable_bytes
        assert step.compile_seconds > 0 and not step.out_of_memory
    assert 0 < p.train.temporaries < target.usable_bytes
    assert 0 <= p.eval.temporaries < p.train.temporaries   # tiny's forward fits in on-chip memory
    # The train step takes parameters + optimizer state + batch (the compiler pads TPU tiles: >=).
    assert p.train.arguments >= p.params + p.optimizer_state + p.batch
    assert p.eval.arguments < p.train.arguments
    assert p.fits and 0.99 < p.headroom < 1.0
    assert p.train.largest and all(b.bytes > 0 and b.count >= 1 for b in p.train.largest)

    d = json.loads(json.dumps(p.as_dict()))
    assert d["fits"] is True and d["target"]["name"] == "v5e:2x2" and d["target"]["num_devices"] == 4
    for key in ("arguments", "temporaries", "outputs", "total", "compile_seconds", "largest"):
        assert key in d["train"] and key in d["eval"]
    assert d["params"] == p.params and d["train"]["total"] == p.train.total
    text = plan.format_report([p])
    assert "tied: fits" in text and "usable memory (v5e)" in text and "15.75 GiB" in text

    # FLOPs: the model's count (tieflax/hardware/flops.py) for the step's 4 x 128 tokens, a lower bound on the step
    # time from v5e's peak, and no compiled count: the fused loss runs Pallas kernels XLA does not count.
    model = flops.step_flops(model_config(load_config(TINY)), 4, 128)
    assert d["model_tflops_per_step"] == pytest.approx(model.train / 1e12)
    assert d["model_tflops_per_device"] == pytest.approx(model.train / 4 / 1e12)
    assert d["step_time_lower_bound"] == pytest.approx(max(model.train / 4 / 197e12,
                                                           p.train.traffic / 819e9))
    assert d["recompute_factor"] is None and "Pallas" in p.train.compiled_flops_note   # splash, the loss
    assert "model TFLOPs per step (all devices)" in text and "compiled FLOPs not shown" in text
    assert "197 TFLOP/s and 819 GB/s per device" in text
    # The compiler's version travels with the figures; one that over-counts scanned steps says so.
    installed = importlib.metadata.version("libtpu")
    assert d["target"]["libtpu"] == installed
    assert ("counts more temporaries for scanned layers" in text) == (installed.startswith("0.0.4")
                                                                       or installed.startswith("0.0.50"))

    # The host's CPU devices are untouched: the rest of the suite still runs on them.
    assert jax.devices()[0].platform == "cpu" and len(jax.devices()) == 8


@needs_libtpu
def test_oversized_batch_does_not_fit_and_names_the_biggest_buffers(capsys):
    # 48 sequences of 2048 tokens per chip: the einsum attention's fp32 scores alone are 3 GiB a layer
    # (the reference attention, chosen explicitly: it fails to fit quickly and by a wide margin).
    code = cli.main(["plan", "--config", TINY, "--topology", "v5e:2x2", "--no-eval",
                     "--config.train.seq_len=2048", "--config.model.max_seq_len=2048",
                     "--config.train.global_batch_size=192", "--config.model.attention=xla"])
    out = capsys.readouterr().out
    assert code == 1
    assert "DOES NOT FIT in 15.75 GiB" in out and "RESOURCE_EXHAUSTED" in out
    biggest = out.split("largest temporaries of the train step (per device):")[1].splitlines()[1]
    assert "3.00 GiB" in biggest and "f32[48,4," in biggest and "attn" in biggest


def test_topology_errors_say_what_to_type_or_install():
    with pytest.raises(targets.TargetError, match="expected a TPU slice"):
        targets.resolve("tpu9:2x2")
    with pytest.raises(targets.TargetError, match="h100:8"):
        targets.resolve("h100:eight")
    if not any(__import__("importlib.util").util.find_spec(p) for p in targets.CUDA_PLUGINS):
        for gpu in ("h100:8", "h200:1", "h200:8", "h100_pcie:8"):
            with pytest.raises(targets.TargetError, match=r"pip install 'tieflax\[gpu\]'"):
                targets.resolve(gpu)
    cpu = targets.resolve("cpu")
    assert cpu.num_devices == 8 and cpu.usable_bytes > 0


@needs_libtpu
@pytest.mark.parametrize("version, library, noted", [("0.0.42.1", None, True), ("0.0.50.1", None, True),
                                                     ("0.0.52", None, False), ("0.0.60", None, False),
                                                     ("0.0.42.1", "own", True),   # set by libtpu on import
                                                     ("0.0.42.1", "/x/libtpu.so", False)])  # another one
def test_plans_compiled_by_a_libtpu_that_over_counts_say_so(monkeypatch, version, library, noted):
    monkeypatch.setattr(targets.importlib.metadata, "version", lambda name: version)
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    if library:
        own = os.path.join(importlib.util.find_spec("libtpu").submodule_search_locations[0], "libtpu.so")
        monkeypatch.setenv("TPU_LIBRARY_PATH", own if library == "own" else library)
    tpu = targets.Target("v5p:4x4x4", "tpu", "v5p", "TPU v5", (), 95 * 2**30, 95 * 2**30)
    note = targets.compiler_note(tpu)
    assert bool(note) == noted
    if noted:
        assert f"libtpu {version} counts more temporaries" in note and "pip install 'tieflax[tpu]'" in note
    assert targets.compiler_note(dataclasses.replace(tpu, platform="cpu")) == ""


def test_every_gpu_target_ships_a_config_with_its_memory_and_name():
    """The text protos are package data: each GPU topology has one, with the memory plans are judged
    against and the name its devices give (the device_kind MFU looks up)."""
    import re

    memory = {}
    for kind in targets.GPU_TARGETS:
        proto = targets.gpu_target_config(kind)
        memory[kind] = int(re.search(r"device_memory_size:\s*(\d+)", proto).group(1))
        name = re.search(r'device_description_str:\s*"([^"]+)"', proto).group(1)
        assert "cuda_compute_capability" in proto and targets.device_peak(name) is not None, kind
        assert targets.device_peak(name) == targets.CHIP_PEAKS[kind], (kind, name)
    assert memory["h200"] == 141 * targets.GIB                 # XLA's own H200 spec
    assert memory["h100"] < memory["h100_pcie"] < 80 * targets.GIB < memory["h200"]


@pytest.mark.skipif(not any(importlib.util.find_spec(p) for p in targets.CUDA_PLUGINS),
                    reason="no CUDA plugin of JAX: pip install 'tieflax[gpu]' (no GPU needed)")
def test_a_plan_for_h200s_compiles_here_and_judges_against_their_memory(capsys):
    """The H200 target is the H100's with the H200's memory and bandwidth: compiled deviceless."""
    code = cli.main(["plan", "--config", TINY, "--topology", "h200:8", "--no-eval", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    d = json.loads(captured.out)
    assert d["target"]["device_kind"] == "NVIDIA H200" and d["target"]["num_devices"] == 8
    assert d["target"]["usable_bytes"] == 141 * targets.GIB and d["fits"]
    assert d["step_time_lower_bound"] == pytest.approx(max(d["model_tflops_per_device"] * 1e12 / 989e12,
                                                           d["train"]["arguments"] / 4.8e12
                                                           + d["train"]["all_outputs"] / 4.8e12), rel=1e-6)


def test_unknown_tpu_slice_is_refused_with_an_example():
    with pytest.raises(targets.TargetError, match="v5e slices are 2-D AxB: 1x1, 2x2, 2x4"):
        targets.resolve("v5e:3x3")


# libtpu aborts the process (SIGABRT) on the first four when compiling, or compiles shapes no Google slice
# has; each is refused before libtpu is loaded, in one line, exit 2.
BAD_TOPOLOGIES = {
    "v5e:16x16x2": "3-D, but v5e slices are 2-D AxB",
    "v5p:3x3x3": "no v5p slice has this shape; v5p slices are 3-D AxBxC",
    "v6e:2x2x2": "3-D, but v6e slices are 2-D AxB",
    "v4:1x1x1": "no v4 slice has this shape",
    "v5e:16x32": "no v5e slice has this shape",           # libtpu: Check failed: chip_bounds().y <= 16
    "v5p:2x2": "2-D, but v5p slices are 3-D AxBxC",
    "v5p:4x8x4": "no v5p slice has this shape",           # A <= B <= C
    "v4:32x32x32": "up to 16x16x16",
    "v5e:2xx2": "not a chip grid",
    "v6e:0x0": "no v6e slice has this shape",
    "v5p-192": "not a Cloud TPU accelerator type",        # 96 chips: no slice of whole 4x4x4 cubes
    "v3-8": "tieflax plans v4, v5e (v5litepod-N), v5p and v6e",
}


@pytest.mark.parametrize("topology", sorted(BAD_TOPOLOGIES))
def test_a_topology_no_google_slice_has_is_one_line_and_exit_2(topology, capsys, monkeypatch):
    loads = []
    monkeypatch.setattr(targets, "_tpu_target", lambda *a: loads.append(a))   # libtpu must never be asked
    code = cli.main(["plan", "--config", TINY, "--topology", topology])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and not loads
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"tieflax plan: --topology {topology!r}: ")
    assert BAD_TOPOLOGIES[topology] in captured.err, captured.err


def test_the_console_refuses_an_aborting_topology_in_its_own_process():
    """The whole command, as a user runs it: exit 2 and one line, no libtpu abort (134), no core dump."""
    proc = subprocess.run([sys.executable, "-m", "tieflax.cli", "plan", "--config", TINY, "--topology",
                           "v5e:16x16x2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("tieflax plan: --topology 'v5e:16x16x2': 3-D, but v5e slices are 2-D AxB: 1x1, "
                           "2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16\n")


def test_gcloud_names_map_to_google_slices():
    # Google's tables (tieflax/hardware/targets.py cites them): v5p and v4 names count TensorCores, 2 per chip.
    expected = {"v5p-128": ("v5p:4x4x4", 64), "v5litepod-16": ("v5e:4x4", 16), "v6e-256": ("v6e:16x16", 256),
                "v4-64": ("v4:2x4x4", 32), "v5p-8": ("v5p:2x2x1", 4), "v5p-16": ("v5p:2x2x2", 8),
                "v5p-256": ("v5p:4x4x8", 128), "v5p-512": ("v5p:4x8x8", 256), "v5p-1024": ("v5p:8x8x8", 512),
                "v5p-17920": ("v5p:16x20x28", 8960), "v4-8": ("v4:2x2x1", 4), "v4-4096": ("v4:8x16x16", 2048),
                "v5litepod-1": ("v5e:1x1", 1), "v5litepod-8": ("v5e:2x4", 8), "v6e-4": ("v6e:2x2", 4)}
    for name, (topology, chips) in expected.items():
        canonical, line = targets.canonical_topology(name)
        assert canonical == topology and line.startswith(f"{name} is {topology}, {chips} chip"), (name, line)
        assert ("count TensorCores, 2 per chip" in line) == name.startswith(("v5p", "v4"))
    assert targets.canonical_topology(" V5P:4x4x4 ") == ("v5p:4x4x4", "")
    for shape in [(2, 2, 1), (2, 4, 4), (4, 4, 4), (4, 4, 12), (8, 16, 16), (16, 20, 28)]:
        targets.check_tpu_shape("v5p:" + "x".join(map(str, shape)))
    for bad in ("v5p:20x20x20", "v5p:2x2x3", "v4:16x16x20", "v5e:4x2", "v6e:32x32"):
        with pytest.raises(targets.TargetError):
            targets.check_tpu_shape(bad)


@needs_libtpu
def test_a_gcloud_name_says_how_it_was_read_and_compiles(capsys, monkeypatch):
    # One v5e chip (a one-chip host). In this process, as the suite has JAX loaded already (a child would
    # load it again: +3 s here); the oversized-batch test above goes through the child.
    from tieflax.plan import child

    monkeypatch.setenv(child.IN_PROCESS_ENV, "1")
    # One of tiny's 4 layers: what is checked is how the name is read and that the plan compiles and fits on
    # the one chip it names, which the number of layers does not change (the whole 4-layer tiny compiles for
    # TPU in test_tiny_config_fits_on_four_v5e_chips); about 3 CPU-s here instead of 5 (2026-12-07).
    code = cli.main(["plan", "--config", TINY, "--topology", "v5litepod-1", "--no-eval", "--json",
                     "--config.model.n_layers=1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err.splitlines()[0] == "tieflax plan: v5litepod-1 is v5e:1x1, 1 chip"
    d = json.loads(captured.out)
    assert d["target"]["name"] == "v5e:1x1" and d["target"]["num_devices"] == 1 and d["fits"]


ABORT = """
from tieflax.plan.child import no_core_file; no_core_file()
import sys, jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
print("compiling the train step of probe for v5e:16x16x2 ...", file=sys.stderr, flush=True)
topology = topologies.get_topology_desc(topology_name="v5e:16x16x2", platform="tpu")
mesh = Mesh(np.array(topology.devices), ("d",))
x = jax.ShapeDtypeStruct((len(topology.devices), 128), jnp.float32, sharding=NamedSharding(mesh, P("d")))
jax.jit(lambda x: x.sum()).lower(x).compile()   # libtpu: Check failed: Topology()->chip_bounds().z == 1
"""


@needs_libtpu
def test_a_libtpu_abort_in_the_child_is_one_line_with_its_reason(capsys, monkeypatch):
    """Were a shape the checks let through to abort libtpu, the console reports it and lives: the child
    here compiles for the 3-D v5e grid that libtpu really aborts on."""
    from tieflax.commands import plan as command
    from tieflax.plan import child

    monkeypatch.setattr(command, "child_command", lambda args, topology: [sys.executable, "-c", ABORT])
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    monkeypatch.delenv(child.IN_PROCESS_ENV, raising=False)
    code = cli.main(["plan", "--config", TINY, "--topology", "v5e:2x2", "--no-eval"])
    err = capsys.readouterr().err.splitlines()
    assert code == child.DID_NOT_COMPILE_CODE == 1
    assert len(err) == 2 and err[0] == "compiling the train step of probe for v5e:16x16x2 ...", err
    # libtpu 0.0.42.1: "... chip_bounds().z == 1 (2 vs. 1) (target.cc:1735)"; the source line moves by release.
    assert re.fullmatch(r"tieflax plan: libtpu stopped the compile with SIGABRT while compiling the train step "
                        r"of probe for v5e:16x16x2: Check failed: Topology\(\)->chip_bounds\(\)\.z == 1 "
                        r"\(2 vs\. 1\) \(\w+\.cc:\d+\); nothing was planned for v5e:2x2 \(the reason is "
                        r"libtpu's; --debug shows its log\)", err[1]), err


def test_largest_temporaries_follow_fusions_to_the_jax_op(tmp_path):
    (tmp_path / "m.jit_step.after_optimizations-buffer-assignment.txt").write_text(
        "allocation 0: size 1024, parameter 0, shape |f32[256]| at ShapeIndex {}:\n"
        " value: <1 p.0 @0> (size=1024,offset=0): f32[256]{0}\n"
        "allocation 1: size 4096, color 1, preallocated-temp:\n"
        " value: <2 v.1 @0> (size=4096,offset=0): f32[1024]{0}\n"
        "allocation 2: size 9000, preallocated-temp:\n"
        " value: <3 fusion.7{1} @0> (size=4096,offset=0): f32[32,32]{1,0:T(8,128)}\n"
        " value: <4 fusion.8{1} @0> (size=4096,offset=4096): f32[32,32]{1,0:T(8,128)}\n"
        " value: <5 add.2 @0> (size=512,offset=8192): f32[128]{0}\n"
        " value: <6 tuple.3 @0> (size=64,offset=8704): (f32[128]{0}, f32[128]{0})\n"
        # One place written twice (a loop's buffer and its result): counted once, named after its writer.
        " value: <7 dus.4 @0> (size=256,offset=8768): f32[64]{0}\n"
        " value: <8 zeros.5 @0> (size=256,offset=8768): f32[64]{0}\n"
        " value: <9 dus.4.1 @0> (size=256,offset=8768): f32[64]{0}\n")
    (tmp_path / "m.jit_step.after_optimizations.txt").write_text(
        "HloModule jit_step\n\n"
        "%fused_computation.1 (param_0: f32[32,32]) -> (f32[32], f32[32,32]) {\n"
        '  %exp.1 = f32[32,32]{1,0} exponential(%param_0), metadata={op_name="jit(step)/jvp(M.loss)/'
        'M.features/block_3/attn/exp"}\n'
        '  %r.1 = f32[32]{0} reduce(%exp.1), metadata={op_name="jit(step)/sum"}\n'
        "  ROOT %tuple.1 = (f32[32]{0}, f32[32,32]{1,0}) tuple(%r.1, /*index=1*/%exp.1)\n}\n\n"
        "ENTRY %main (p.0: f32[256]) -> f32[128] {\n"
        '  %fusion.7 = (f32[32], f32[32,32]) fusion(%x), kind=kLoop, calls=%fused_computation.1, '
        'metadata={op_name="jit(step)/sum"}\n'
        '  %fusion.8 = (f32[32], f32[32,32]) fusion(%y), kind=kLoop, calls=%fused_computation.1\n'
        '  %zeros.5 = f32[64]{0} broadcast(%c), metadata={op_name="jit(step)/broadcast_in_dim"}\n'
        '  %dus.4 = f32[64]{0} dynamic-update-slice(%zeros.5, %u, %i), metadata={op_name="jit(step)/dus"}\n'
        '  %dus.4.1 = f32[64]{0} dynamic-update-slice(%dus.4, %u, %j), metadata={op_name="jit(step)/dus"}\n'
        '  ROOT %add.2 = f32[128]{0} add(%a, %b), metadata={op_name="jit(step)/add"}\n}\n')
    buffers = plan_buffers.largest_temporaries(str(tmp_path))
    assert [(b.bytes, b.shape, b.op, b.count) for b in buffers] == [
        (4096, "f32[32,32]", "jvp(M.loss)/block_*/attn/exp", 2), (512, "f32[128]", "add", 1),
        (256, "f32[64]", "dus", 1)]
    assert plan_buffers.largest_temporaries(str(tmp_path / "empty")) == []


def test_out_of_memory_message_gives_the_bytes_needed():
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
               "temporaries (21.72G) exceeds available HBM (15.75G).")
    assert plan_compile._needed_bytes(message) == int(21.72 * 2**30)
    assert plan_compile._needed_bytes("no figure") is None
    vmem = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem. "
            "Used 270.51M of 128.00M vmem. Exceeded vmem capacity by 142.51M.")
    assert plan_compile._needed_bytes(vmem) is None   # a kernel's on-chip scratch, not the step's HBM


# The recompute factors of the test below, in a process of their own: with XLA's own CPU emitters, not the
# suite's older ones (tests/conftest.py), which expand the embedding gradient's scatter into a loop whose
# body XLA's cost analysis counts once (the plan then rightly reports no whole-step count).
_RECOMPUTE_FACTORS = """
import dataclasses, json, sys
import jax
from tieflax import plan
from tieflax.config import load_config, model_config
from tieflax.hardware import flops, targets
target = dataclasses.replace(targets.resolve("cpu"), devices=tuple(jax.devices()[:1]))   # one: quick
factors = {}
for remat in ("none", "full"):
    config = load_config(sys.argv[1], sys.argv[2:] + [f"--config.model.remat={remat}"])
    p = plan.plan_config(config, target, name="tiny", global_batch_size=1, with_eval=False)
    assert p.flops.train == flops.step_flops(model_config(config), p.global_batch_size, 128).train
    factors[remat] = p.recompute_factor
print(json.dumps(factors))
"""


def test_compiled_flops_give_the_recompute_factor_where_xla_counts_the_whole_step():
    """On this machine's CPU, a step without loops or kernels (unscanned, dense loss, einsum attention):
    XLA's count is the model's plus what the model count leaves out (the einsum attention computes the
    whole T x T square, RoPE's permutation matmul, ...); with remat 'full' the forward runs again."""
    from train_support import suite_xla_flags  # noqa: PLC0415

    overrides = ["--config.train.loss_impl=dense", "--config.model.attention=xla", "--config.model.n_layers=2"]
    proc = subprocess.run([sys.executable, "-c", _RECOMPUTE_FACTORS, TINY, *overrides], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "XLA_FLAGS": suite_xla_flags(1, xla_emitters=True)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    factors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert factors["none"] is not None and 1.0 < factors["none"] < 1.3, factors
    # 'full' recomputes each block's forward in the backward: up to 4/3 of the block's matmuls more.
    assert factors["none"] * 1.05 < factors["full"] < factors["none"] * 4 / 3 + 0.05, factors
