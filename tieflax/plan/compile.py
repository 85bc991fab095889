"""Will a config fit? Compile the real train and eval steps for a TPU pod or GPU server from any machine.

    tieflax plan --config configs/models/llama3_8b.py --topology v5p:4x4x4 --config.train.seq_len=8192
    tieflax plan --config configs/models/gemma_2b.py --topology v5e:4x4 --tie both --json

``plan_config`` builds the step exactly as ``tieflax train`` does (``train.build`` +
``make_train_step`` / ``make_eval_step``) on the abstract devices of a ``tieflax.hardware.targets.Target``, lowers
it with the train state as ``ShapeDtypeStruct``s carrying their shardings (nothing is initialised or
allocated) and compiles. The compiler's ``memory_analysis()`` gives the per-device figures: arguments
(parameters, optimizer state and the batch, as laid out in memory), temporaries (activations, gradients,
workspace: what the program needs on top of its inputs), outputs not aliased to donated inputs, and
their total against the device's memory. A TPU compile that does not fit fails with
``RESOURCE_EXHAUSTED``; that is reported as "does not fit" with the memory it needed, and in every case
the largest temporaries are named from the compiler's buffer assignment (``tieflax.plan.buffers``).

FLOPs: the model's count for the step (``tieflax.hardware.flops``), per step and per device; the compiled
program's FLOPs over it where XLA's cost analysis covers the whole step (no loops, no Pallas kernels);
and a lower bound on the step time per device from the target's peak FLOP/s and HBM bandwidth
(``Target.peak``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
import time
from typing import Any, Sequence

import ml_collections

from tieflax.errors import UserError
from tieflax.hardware.targets import Target

class PlanError(UserError, ValueError):
    """The config cannot be planned on this target; the message names the field and the fix."""


@dataclasses.dataclass
class StepMemory:
    """Per-device memory of one compiled step, in bytes (None where the compile failed for lack of it)."""
    arguments: int | None
    temporaries: int | None
    outputs: int | None           # outputs that are not aliased to donated arguments
    generated_code: int | None
    compile_seconds: float        # wall clock of lowering + compiling
    cpu_seconds: float            # CPU time of this process meanwhile (all threads): load-independent
    largest: list                 # tieflax.plan.buffers.Buffer, biggest temporaries first
    out_of_memory: str = ""       # the compiler's message when it refused
    all_outputs: int | None = None  # every output, aliased or not (what the step writes back)
    # FLOPs per device of the compiled program (XLA's cost_analysis), None where it cannot be read as
    # the whole step: XLA counts the body of a loop (a scan over layers, a chunked MLP) once.
    compiled_flops: float | None = None
    compiled_flops_note: str = ""
    peak: Any = None              # tieflax.plan.peak.PeakAccounting with --explain, else None

    @property
    def total(self) -> int | None:
        if self.arguments is None or self.temporaries is None:
            return None
        return self.arguments + self.temporaries + (self.outputs or 0)

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (f.name for f in dataclasses.fields(self)) if k not in ("largest", "peak")}
        d["total"] = self.total
        d["largest"] = [b.as_dict() for b in self.largest]
        if self.peak is not None:
            d["peak"] = self.peak.as_dict()
        return d

    @property
    def traffic(self) -> int | None:
        """HBM bytes the step must move at the least: read every argument once, write every output once."""
        if self.arguments is None:
            return None
        return self.arguments + (self.all_outputs if self.all_outputs is not None else self.outputs or 0)


@dataclasses.dataclass
class Plan:
    """What one variant of a config needs per device on one target."""
    name: str
    tied: bool
    target: Target
    mesh: dict[str, int]
    global_batch_size: int
    seq_len: int
    params: int                   # bytes per device of the parameters, as sharded (unpadded)
    optimizer_state: int          # bytes per device of the optimizer state, as sharded (unpadded)
    batch: int                    # bytes per device of one batch
    train: StepMemory
    eval: StepMemory | None
    flops: Any = None             # tieflax.hardware.flops.StepFlops of the train step (the whole batch)

    @property
    def usable(self) -> int:
        return self.target.usable_bytes

    @property
    def fits(self) -> bool:
        steps = [self.train] + ([self.eval] if self.eval else [])
        return all(s.total is not None and s.total <= self.usable for s in steps)

    @property
    def headroom(self) -> float | None:
        """Fraction of the device's usable memory the train step leaves free (negative: over)."""
        total = self.train.total
        return None if total is None else 1.0 - total / self.usable

    @property
    def model_flops_per_device(self) -> float:
        return self.flops.per_device(self.target.num_devices)

    @property
    def recompute_factor(self) -> float | None:
        """Compiled FLOPs over model FLOPs per device (remat, RoPE's permutation, the loss's recomputed
        tiles...), where XLA reports the whole step's FLOPs (no loops, no kernels); else None."""
        compiled = self.train.compiled_flops
        return None if compiled is None else compiled / self.model_flops_per_device

    @property
    def step_time_lower_bound(self) -> float | None:
        """Seconds per step at the least on one device: model FLOPs at peak FLOP/s, or the step's minimum
        HBM traffic (read the arguments, write the outputs) at peak bandwidth. None without a peak."""
        from tieflax.hardware.flops import step_time_lower_bound  # noqa: PLC0415

        return step_time_lower_bound(self.model_flops_per_device, self.train.traffic or 0, self.target.peak)

    def as_dict(self) -> dict[str, Any]:
        return dict(name=self.name, tied=self.tied, target=self.target.as_dict(), mesh=self.mesh,
                    global_batch_size=self.global_batch_size, seq_len=self.seq_len, params=self.params,
                    optimizer_state=self.optimizer_state, batch=self.batch, fits=self.fits,
                    headroom=self.headroom, train=self.train.as_dict(),
                    eval=self.eval.as_dict() if self.eval else None,
                    model_tflops_per_step=self.flops.train / 1e12,
                    model_tflops_per_device=self.model_flops_per_device / 1e12,
                    model_tflops_terms={k: 3 * v / 1e12 for k, v in
                                        {**self.flops.weights, "attention": self.flops.attention}.items()},
                    recompute_factor=self.recompute_factor,
                    step_time_lower_bound=self.step_time_lower_bound)


# ================================================================================================ planning

def plan_config(config: ml_collections.ConfigDict, target: Target, *, name: str = "config",
                global_batch_size: int | None = None, with_eval: bool = True,
                dump_dir: str | None = None, progress=None, explain: bool = False) -> Plan:
    """Compiles ``config``'s train (and eval) step for ``target``; returns the per-device figures.

    ``global_batch_size`` None means one sequence per device. ``config.mesh`` is resolved over the
    target's devices (-1 = the rest). ``dump_dir`` keeps XLA's dump there (default: a temporary folder).
    ``progress(str)`` is called before each compile. ``explain``: also account for what is live at the
    train step's peak, by origin (``tieflax.plan.peak``).
    """
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from tieflax import sharding as shd  # noqa: PLC0415
    from tieflax import train  # noqa: PLC0415
    from tieflax.hardware.flops import step_flops  # noqa: PLC0415
    from tieflax.config import model_config  # noqa: PLC0415
    from tieflax.ops.attention import check_platform  # noqa: PLC0415

    config = config.copy_and_resolve_references()  # the caller's config stays as given
    if global_batch_size is None:
        global_batch_size = target.num_devices
    config.train.global_batch_size = int(global_batch_size)
    try:
        sizes = shd.mesh_shape(config.mesh, target.num_devices)
    except ValueError as e:
        raise PlanError(f"{e} ({target.name} has {target.num_devices} devices)") from None
    mc = model_config(config)
    check_platform(mc.attention, target.platform)  # before tracing: init traces without the target's mesh
    train.check_fits_mesh(config, mc, dict(zip(shd.MESH_AXES, sizes)), process_count=1)
    mesh = shd.make_mesh(*sizes, devices=list(target.devices))

    t = config.train
    batch = {k: jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len), np.int32,
                                     sharding=shd.batch_sharding(mesh)) for k in train.BATCH_KEYS}
    note = progress or (lambda _: None)
    s = train.build(config, mesh)
    # As in training (tieflax.train.train), the rules and the mesh make the model's logical sharding
    # constraints (the activations' layouts) part of the traced program; without them they are
    # no-ops and the compiler would be judging another program.
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        note(f"compiling the train step of {name} ({'tied' if mc.tie_embeddings else 'untied'}) for "
             f"{target.name}")
        train_memory = _compile(train.make_train_step(config, s), (s.abstract_state, batch), target,
                                dump_dir, "train", explain=explain)
        eval_memory = None
        if with_eval:
            note(f"compiling the eval step of {name} for {target.name}")
            eval_memory = _compile(train.make_eval_step(config, s), (s.abstract_state["params"], batch),
                                   target, dump_dir, "eval")
    return Plan(name=name, tied=mc.tie_embeddings, target=target, mesh=dict(zip(shd.MESH_AXES, sizes)),
                global_batch_size=t.global_batch_size, seq_len=t.seq_len,
                params=_shard_bytes(s.abstract_state["params"]),
                optimizer_state=_shard_bytes(s.abstract_state["opt_state"]) + _shard_bytes(
                    s.abstract_state["step"]),
                batch=_shard_bytes(batch), train=train_memory, eval=eval_memory,
                flops=step_flops(mc, t.global_batch_size, t.seq_len))


def plan_variants(config: ml_collections.ConfigDict, target: Target, tie: str = "config",
                  **kwargs) -> list[Plan]:
    """``tie``: 'config' (as configured), 'tied', 'untied' or 'both' (tied first)."""
    choices = {"config": [None], "tied": [True], "untied": [False], "both": [True, False]}
    if tie not in choices:
        raise PlanError(f"--tie {tie!r}: use one of {sorted(choices)}")
    plans = []
    for tied in choices[tie]:
        variant = config.copy_and_resolve_references()
        if tied is not None:
            variant.model.tie_embeddings = tied
        plans.append(plan_config(variant, target, **kwargs))
    return plans


def plan_config_file(path: str, overrides: list[str], target: Target, *, tie: str = "config",
                     with_eval: bool = True, dump_dir: str | None = None, progress=None,
                     explain: bool = False) -> list[Plan]:
    """``tieflax plan``'s work: the config file ``path`` with its ``--config.*`` ``overrides``, planned on
    ``target`` per ``tie`` variant. The batch is one sequence per device unless the overrides give
    ``train.global_batch_size``."""
    from tieflax.config import load_config  # noqa: PLC0415

    config = load_config(path, overrides)
    batch_given = any(o.removeprefix("--").removeprefix("config.").startswith("train.global_batch_size=")
                      for o in overrides)
    if dump_dir:
        check_dump_dir(dump_dir)
    name = os.path.splitext(os.path.basename(path.partition(":")[0]))[0]
    return plan_variants(config, target, tie=tie, name=name,
                         global_batch_size=config.train.global_batch_size if batch_given else None,
                         with_eval=with_eval, dump_dir=dump_dir, progress=progress, explain=explain)


def check_dump_dir(folder: str) -> None:
    """Before compiling: XLA writes its dump with plain file calls and, when it cannot, logs an error per
    file and goes on (the largest-temporaries table, read from the dump, would be missing)."""
    if "://" in folder:
        raise PlanError(f"--xla-dump {folder}: XLA writes its dump to a local folder only; give a local path")
    probe = os.path.join(folder, f".tieflax-probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        raise PlanError(f"--xla-dump {folder} is not a writable folder ({e.strerror or e}): choose a folder "
                        "you can write, or leave --xla-dump out") from None


def _shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (no layout padding)."""
    import jax  # noqa: PLC0415

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _compile(jitted, args: Sequence[Any], target: Target, dump_dir: str | None, label: str,
             explain: bool = False) -> StepMemory:
    """Lowers and compiles one step; on the compiler's out-of-memory error, returns what it needed."""
    from tieflax.plan.buffers import largest_temporaries  # noqa: PLC0415
    from tieflax.plan.peak import peak_accounting  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="tieflax-plan-") as tmp:
        folder = f"{dump_dir}/{label}" if dump_dir else tmp
        options = {"xla_dump_to": folder}
        if target.platform == "cuda":
            options["xla_gpu_dump_llvmir"] = False
        start, cpu_start = time.perf_counter(), time.process_time()
        lowered = jitted.lower(*args)
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as e:  # noqa: BLE001 (JaxRuntimeError / XlaRuntimeError by JAX version)
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            return StepMemory(arguments=None, temporaries=_needed_bytes(str(e)), outputs=None,
                              generated_code=None, compile_seconds=seconds, cpu_seconds=cpu,
                              largest=largest_temporaries(folder), out_of_memory=_first_line(str(e)),
                              peak=peak_accounting(folder) if explain else None)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        m = compiled.memory_analysis()
        flops, note = _compiled_flops(compiled)
        return StepMemory(arguments=m.argument_size_in_bytes, temporaries=m.temp_size_in_bytes,
                          outputs=max(m.output_size_in_bytes - m.alias_size_in_bytes, 0),
                          generated_code=m.generated_code_size_in_bytes, compile_seconds=seconds,
                          cpu_seconds=cpu, largest=largest_temporaries(folder),
                          all_outputs=m.output_size_in_bytes, compiled_flops=flops, compiled_flops_note=note,
                          peak=peak_accounting(folder) if explain else None)


def _compiled_flops(compiled) -> tuple[float | None, str]:
    """(FLOPs per device, '') from XLA's cost analysis, or (None, why not).

    XLA's cost analysis counts the body of a while loop once, whatever its trip count, so a program with
    loops (scanned layers, the chunked MLP, the fused loss's blocks) reports a fraction of its work; a
    custom call (a Pallas kernel: splash attention, the loss on TPU) counts nothing. Only a program with
    neither is read as the whole step.
    """
    try:
        text = compiled.as_text()
        cost = compiled.cost_analysis()
    except Exception as e:  # noqa: BLE001 (not every backend implements both)
        return None, f"no cost analysis ({type(e).__name__})"
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    if not cost or "flops" not in cost:
        return None, "no cost analysis"
    if re.search(r"\bwhile\(", text):
        return None, "loops: XLA counts a loop body once"
    if "custom_call_target=\"tpu_custom_call\"" in text or "__gpu$xla.gpu.triton" in text:
        return None, "Pallas kernels: XLA does not count them"
    return float(cost["flops"]), ""


def _needed_bytes(message: str) -> int | None:
    """'... HLO temporaries (21.72G) exceeds available HBM (15.75G)' -> bytes of the first figure.

    None for anything but HBM: 'Ran out of memory in memory space vmem' is a kernel's on-chip scratch
    (its block sizes), not the program's memory, and says nothing about whether the step fits.
    """
    if re.search(r"memory space (?!hbm)\w+", message):
        return None
    m = re.search(r"\(([\d.]+)([KMGT])\)", message) or re.search(r"Used ([\d.]+)([KMGT])", message)
    if not m:
        return None
    return int(float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024)


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0][:300]
