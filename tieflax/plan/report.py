"""The plan as people read it: a per-device table, one column per variant, and a verdict per variant."""

from __future__ import annotations

from tieflax.hardware.targets import GIB, compiler_note
from tieflax.plan.compile import Plan

MIN_HEADROOM = 0.2    # the fraction of memory a pod run should keep free (fragmentation, runtime, eval)


def gib(n: int | None) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def format_report(plans: list[Plan]) -> str:
    """A per-device table, one column per plan (+ the difference when tied and untied are both there)."""
    p0 = plans[0]
    head = (f"{p0.name} on {p0.target.name}: {p0.target.num_devices} x {p0.target.device_kind}, mesh "
            + " ".join(f"{k}={v}" for k, v in p0.mesh.items())
            + f", batch {p0.global_batch_size} x {p0.seq_len} tokens; memory per device")
    columns = ["tied" if p.tied else "untied" for p in plans]
    diff = len(plans) == 2 and plans[0].tied != plans[1].tied
    if diff:
        columns.append("untying costs")

    def row(label, values, fmt=gib):
        cells = [fmt(v) for v in values]
        if diff:
            a, b = values
            cells.append(fmt(b - a) if a is not None and b is not None and fmt is gib else "")
        return f"  {label:<34}" + "".join(f"{c:>16}" for c in cells)

    usable = p0.usable
    lines = [head, f"  {'':<34}" + "".join(f"{c:>16}" for c in columns)]
    lines.append(row("parameters (as sharded)", [p.params for p in plans]))
    lines.append(row("optimizer state (as sharded)", [p.optimizer_state for p in plans]))
    lines.append(row("train step: arguments", [p.train.arguments for p in plans]))
    lines.append(row("train step: temporaries", [p.train.temporaries for p in plans]))
    lines.append(row("train step: outputs (not aliased)", [p.train.outputs for p in plans]))
    lines.append(row("train step: total", [p.train.total for p in plans]))
    if all(p.eval for p in plans):
        lines.append(row("eval step: total", [p.eval.total for p in plans]))
    lines.append(row(f"usable memory ({p0.target.chip})", [usable for _ in plans]))
    lines.append(row("left for the train step", [p.headroom for p in plans],
                     fmt=lambda h: "-" if h is None else f"{h:.0%}"))
    lines.append(row("model TFLOPs per step (all devices)", [p.flops.train / 1e12 for p in plans], fmt=_tflops))
    lines.append(row("model TFLOPs per device", [p.model_flops_per_device / 1e12 for p in plans], fmt=_tflops))
    lines.append(row("compiled / model FLOPs", [p.recompute_factor for p in plans],
                     fmt=lambda v: "-" if v is None else f"{v:.2f}x"))
    peak = p0.target.peak
    lines.append(row("step time, lower bound per device", [p.step_time_lower_bound for p in plans],
                     fmt=lambda v: "-" if v is None else (f"{v:.3f} s" if v >= 0.1 else f"{v * 1e3:.2f} ms")))
    steps = lambda p: [p.train] + ([p.eval] if p.eval else [])  # noqa: E731
    lines.append(row("compile time, wall (CPU)", [
        (sum(s.compile_seconds for s in steps(p)), sum(s.cpu_seconds for s in steps(p))) for p in plans],
        fmt=lambda t: f"{t[0]:.0f} s ({t[1]:.0f} s)"))
    lines.append("  model FLOPs: 6 x weights x tokens (head included, the input lookup not: tied = untied) + "
                 "causal attention, tieflax/hardware/flops.py" + ("" if peak is None else
                 f"; lower bound at {peak.flops / 1e12:.0f} TFLOP/s and {peak.hbm_bytes_per_second / 1e9:,.0f}"
                 " GB/s per device"))
    notes = {p.train.compiled_flops_note for p in plans if p.recompute_factor is None and
             p.train.compiled_flops_note}
    if notes:
        lines.append("  compiled FLOPs not shown: " + "; ".join(sorted(notes)))
    if compiler := compiler_note(p0.target):
        lines.append("  compiler: " + compiler)
    for p in plans:
        label = "tied" if p.tied else "untied"
        verdict = _verdict(p)
        lines.append(f"{label}: {verdict}")
        if p.train.largest:
            lines.append("  largest temporaries of the train step (per device):")
            for b in p.train.largest[:5 if not p.fits else 3]:
                lines.append(f"    {gib(b.bytes):>10} {b.shape} x{b.count}  {b.op}")
        if p.train.peak is not None:
            from tieflax.plan.peak import format_accounting  # noqa: PLC0415
            lines += format_accounting(p.train.peak, gib)
    return "\n".join(lines)


def _tflops(v: float) -> str:
    return f"{v:,.1f}" if v >= 1 else f"{v:.2e}"


def _verdict(p: Plan) -> str:
    if p.fits:
        h = p.headroom
        warn = "" if h >= MIN_HEADROOM else f" (less than the {MIN_HEADROOM:.0%} a pod run should keep free)"
        return f"fits, {h:.0%} of {gib(p.usable)} left{warn}"
    parts = []
    for label, step in (("train", p.train), ("eval", p.eval)):
        if step is None:
            continue
        if step.out_of_memory and step.temporaries is None:
            parts.append(f"{label} step did not compile (compiler: {step.out_of_memory})")
        elif step.out_of_memory:
            parts.append(f"{label} step needs {gib(step.temporaries)} of temporaries alone "
                         f"(compiler: {step.out_of_memory})")
        elif step.total is not None and step.total > p.usable:
            parts.append(f"{label} step needs {gib(step.total)}")
    if all("did not compile" in part for part in parts):
        return "DID NOT COMPILE: " + "; ".join(parts)
    return f"DOES NOT FIT in {gib(p.usable)}: " + "; ".join(parts)
