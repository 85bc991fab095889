"""Where a train step's time goes: a JAX profile or a torch Chrome trace, split into categories.

    python tools/profile_table.py PROFILE [PROFILE ...] [--hlo STEP_HLO.txt] [--json]
    python tools/profile_table.py --hlo STEP_HLO.txt     # the compiled step's op counts alone (no profile)

``PROFILE``: a JAX profile (a ``.xplane.pb``, or a folder searched for one: ``jax.profiler.trace``'s
``<dir>/plugins/profile/<time>/<host>.xplane.pb``), or a torch profiler Chrome trace (``.json`` or
``.json.gz``, ``prof.export_chrome_trace``). ``--hlo``: the step's optimized HLO text (XLA's
``*after_optimizations.txt`` dump, or ``compiled.as_text()``); it maps the profile's HLO instruction names
to their JAX source path (``op_name``) where the profile's events carry none (XLA:CPU's), and it adds a
count of the compiled step's fusions and custom calls by the same categories.

Categories, by rules on the kernel / op name and, for JAX, the ``op_name`` path (first rule that matches;
the order matters: the loss's own matmuls count as loss, cuDNN attention's GEMMs as attention):
collectives, attention, loss, tie (the tied-gradient fold and the untied view), optimizer (and clipping,
the metrics' norms: JAX's ops outside the forward and backward), casts (dtype conversions), matmul, and
norms/RoPE/elementwise (the rest). ``idle`` is the traced steps' wall time (the ``train`` step markers of
``StepTraceAnnotation`` / ``record_function('train_step')``; the span of all ops without them) not covered
by any op: launch gaps, host waits. Times are exclusive (a while loop's or an autograd node's children
count once, in their own category) and summed over streams and threads, so the column can exceed the
wall time where they overlap; ``% of wall`` is against the traced steps' wall time.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys

CATEGORIES = ("collectives", "attention", "loss", "tie", "optimizer", "casts", "matmul",
              "norms/RoPE/elementwise")
# Matched against '<kernel or op name> <op_name path>', lower case. Checked on CPU profiles of tieflax
# (XLA:CPU instruction names + --hlo op_name paths) and of HF Llama (torch aten:: ops); the GPU kernel names
# (cuBLAS nvjet/xmma/cutlass, cuDNN fmha, Triton gemm fusions, NCCL, Liger's Triton kernels, torch's
# multi_tensor_apply) come from their libraries' naming and are not yet checked against a GPU profile.
RULES = (
    ("collectives", r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|nccl|allreduce"),
    # ... and tieflax's XLA attention (CPU, or attention='xla'): its two einsums and softmax inside attn/.
    ("attention", r"fmha|flash|cudnn|sdpa|scaled_dot_product|dot_product_attention|efficient_attention"
                  r"|/attn/(btkgd,bskd->bkgts|bkgts,bskd->btkgd|exp|reduce_max|.*softmax)"),
    ("loss", r"cross_entropy|crossentropy|nll_loss|log_softmax|\bce_(stats|dh|dw)\b"
             r"|transformerlm\.loss\)+/(?!transformerlm\.features)"),
    ("tie", r"tie_fold|untied_view|fold_tied"),
    ("optimizer", r"adam|optax|multi_tensor_apply|_foreach_|clip_grad|optimizer|lpnorm"),
    ("casts", r"convert_element_type|\bconvert[._]|_convert_fusion|aten::_to_copy|aten::to\b|aten::copy_"),
    ("matmul", r"gemm|\bdot|dot_general|matmul|cublas|nvjet|xmma|cutlass|wgmma|ynn_fusion|aten::mm|aten::addmm"
               r"|aten::bmm|aten::linear"),
)
# JAX ops of the step outside jvp(...)/transpose(jvp(...)): AdamW, clipping, the metrics' norms.
OUTSIDE_GRAD = re.compile(r"^jit\([^)]*\)/(?!.*jvp\()(?!.*transpose\()")


def categorise(name: str, op_name: str = "") -> str:
    """The category of one kernel/op (``name``) with its JAX source path (``op_name``, may be empty)."""
    text = f"{name} {op_name}".lower()
    for category, pattern in RULES:
        if re.search(pattern, text):
            if category in ("casts", "matmul") and op_name and OUTSIDE_GRAD.match(op_name):
                return "optimizer"
            return category
    if op_name and OUTSIDE_GRAD.match(op_name):
        return "optimizer"
    return "norms/RoPE/elementwise"


@dataclasses.dataclass
class Split:
    """A profile's time by category (ns, exclusive, summed over streams), its steps and wall/idle time."""
    source: str
    kind: str                         # 'jax-gpu', 'jax-cpu', 'torch-gpu', 'torch-cpu'
    steps: int
    wall_ns: float
    idle_ns: float
    by_category: dict = dataclasses.field(default_factory=dict)
    top: list = dataclasses.field(default_factory=list)   # (ns, category, name) of the largest ops


# -------------------------------------------------------------------------------------------- helpers


def exclusive(events: list[tuple[float, float, str, str]]) -> list[tuple[float, float, float, str, str]]:
    """(start, dur, name, op_name) of one thread/stream -> (start, dur, exclusive dur, name, op_name)."""
    out, stack = [], []   # stack of indices into out whose span may hold the next event
    for start, dur, name, op in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and out[stack[-1]][0] + out[stack[-1]][1] <= start:
            stack.pop()
        if stack:
            parent = out[stack[-1]]
            out[stack[-1]] = (parent[0], parent[1], parent[2] - min(dur, parent[0] + parent[1] - start),
                              parent[3], parent[4])
        out.append((start, dur, dur, name, op))
        stack.append(len(out) - 1)
    return out


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of (start, end) intervals inside [lo, hi]."""
    total, end = 0.0, lo
    for s, e in sorted(intervals):
        s, e = max(s, end), min(e, hi)
        if e > s:
            total += e - s
            end = e
    return total


def summarise(source: str, kind: str, threads: dict, windows: list[tuple[float, float]]) -> Split:
    """``threads``: thread/stream -> [(start, dur, name, op_name)]; ``windows``: the steps' (start, end)."""
    rows = [r for events in threads.values() for r in exclusive(events)]
    if not windows and rows:
        windows = [(min(r[0] for r in rows), max(r[0] + r[1] for r in rows))]
    spans = [(r[0], r[0] + r[1]) for r in rows]
    wall = sum(e - s for s, e in windows)
    busy = sum(covered(spans, s, e) for s, e in windows)
    by_category = collections.Counter()
    by_name = collections.Counter()
    for start, dur, excl, name, op in rows:
        if windows and not any(s <= start < e for s, e in windows):
            continue
        category = categorise(name, op)
        by_category[category] += excl
        by_name[(category, name)] += excl
    top = [(ns, cat, name) for (cat, name), ns in by_name.most_common(12)]
    return Split(source, kind, max(len(windows), 1), wall, max(wall - busy, 0.0), dict(by_category), top)


# ------------------------------------------------------------------------------------------------ JAX


def hlo_op_names(path: str | None) -> dict[str, str]:
    """Instruction name -> op_name metadata, from an HLO text (both 'fusion.3' and 'fusion_3' spellings)."""
    if not path:
        return {}
    names = {}
    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"")
    with open(path) as f:
        for line in f:
            m = pattern.match(line)
            if m:
                names[m.group(1)] = m.group(2)
                names[m.group(1).replace(".", "_")] = m.group(2)
    return names


def find_xplane(path: str) -> str:
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True))
        if not found:
            sys.exit(f"profile_table: no .xplane.pb under {path}; give jax.profiler.trace's folder or the file")
        return found[-1]
    return path


def load_profile_data(path: str):
    try:
        from jax.profiler import ProfileData
    except ImportError:  # older JAX keeps it private
        from jax._src.profiler import ProfileData
    return ProfileData.from_file(path)


def jax_split(path: str, hlo: dict[str, str]) -> Split:
    """GPU: kernels on the device planes' streams; CPU: XLA's thunks on the host's XLA threads."""
    path = find_xplane(path)
    data = load_profile_data(path)
    threads, windows, gpu = collections.defaultdict(list), [], False
    skip_lines = {"xla modules", "xla ops", "steps", "xla tracemes", "framework ops", "framework name scope",
                  "source code", "launch stats", "sparsecore"}
    for plane in data.planes:
        device = plane.name.startswith("/device:GPU") or plane.name.startswith("/device:TPU")
        gpu |= device
        for line in plane.lines:
            if plane.name == "/host:CPU" and line.name == "python":
                windows += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events if e.name == "train"]
            xla_thread = plane.name == "/host:CPU" and line.name.startswith("tf_XLA")
            if not (device and line.name.lower() not in skip_lines) and not xla_thread:
                continue
            for e in line.events:
                if e.name.startswith(("ThreadpoolListener", "ThunkExecutor")):
                    continue
                stats = dict(e.stats)
                hlo_op = str(stats.get("hlo_op", e.name))
                op = str(stats.get("tf_op") or stats.get("long_name") or hlo.get(hlo_op) or hlo.get(e.name, ""))
                threads[(plane.name, line.name)].append((e.start_ns, e.duration_ns, e.name, op))
    if gpu:  # the host's XLA threads only launch kernels there
        threads = {k: v for k, v in threads.items() if not k[0].startswith("/host")}
    return summarise(path, "jax-gpu" if gpu else "jax-cpu", threads, windows)


def hlo_counts(path: str) -> dict[str, collections.Counter]:
    """The optimized HLO's fusions, custom calls, while loops by category: {category: Counter(kind)}."""
    counts = collections.defaultdict(collections.Counter)
    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\s(fusion|custom-call|while|all-reduce|all-gather|"
                         r"reduce-scatter|copy|convert|dot)\(")
    with open(path) as f:
        for line in f:
            m = pattern.match(line)
            if not m:
                continue
            kind = m.group(2)
            target = re.search(r'custom_call_target="([^"]*)"', line)
            fusion_kind = re.search(r'"kind":"([^"]*)"', line) or re.search(r"kind=(k\w+)", line)
            label = target.group(1) if target else f"{kind} {fusion_kind.group(1)}" if fusion_kind else kind
            op = re.search(r'op_name="([^"]*)"', line)
            counts[categorise(f"{m.group(1)} {label}", op.group(1) if op else "")][label] += 1
    return counts


# ---------------------------------------------------------------------------------------------- torch


def torch_split(path: str) -> Split:
    """GPU kernels (cat 'kernel', memcpy, memset) where the trace has them, else the CPU's aten ops."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu = bool(kernels)
    chosen = kernels if gpu else [e for e in events if e.get("cat") == "cpu_op"]
    marks = [e for e in events if e.get("name") == "train_step"
             and e.get("cat") == ("gpu_user_annotation" if gpu else "user_annotation")]
    if gpu and not marks:
        marks = [e for e in events if e.get("name") == "train_step" and e.get("cat") == "user_annotation"]
    threads = collections.defaultdict(list)
    for e in chosen:  # chrome trace times are microseconds
        threads[(e.get("pid"), e.get("tid"))].append((e["ts"] * 1e3, e["dur"] * 1e3, e["name"], ""))
    windows = [(e["ts"] * 1e3, (e["ts"] + e["dur"]) * 1e3) for e in marks]
    return summarise(path, "torch-gpu" if gpu else "torch-cpu", threads, windows)


# ------------------------------------------------------------------------------------------------ output


def table(splits: list[Split]) -> str:
    head = "| category | " + " | ".join(f"{os.path.basename(s.source)} ({s.kind}) ms/step | % of wall"
                                        for s in splits) + " |"
    out = [head, "|---|" + "---:|---:|" * len(splits)]
    for category in CATEGORIES + ("idle",):
        cells = []
        for s in splits:
            ns = s.idle_ns if category == "idle" else s.by_category.get(category, 0.0)
            cells += [f"{ns / s.steps / 1e6:.2f}", f"{100 * ns / max(s.wall_ns, 1):.1f}"]
        out.append(f"| {category} | " + " | ".join(cells) + " |")
    out.append("| **wall (traced steps)** | " + " | ".join(f"**{s.wall_ns / s.steps / 1e6:.2f}** | 100.0"
                                                         for s in splits) + " |")
    for s in splits:
        out.append(f"\nLargest ops of {s.source} ({s.steps} steps):\n")
        out += [f"- {ns / s.steps / 1e6:.3f} ms/step  {cat:24s} {name[:110]}" for ns, cat, name in s.top]
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="*", help="a JAX .xplane.pb (or its folder) or a torch .json(.gz) trace")
    ap.add_argument("--hlo", help="the step's optimized HLO text: op_name paths for the JAX profile, op counts")
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = ap.parse_args(argv)
    if not args.profiles and not args.hlo:
        sys.exit("profile_table: nothing to read; give a profile (folder, .xplane.pb or .json(.gz) trace) "
                 "and/or --hlo STEP_HLO.txt")
    for p in args.profiles + ([args.hlo] if args.hlo else []):
        if not os.path.exists(p):
            sys.exit(f"profile_table: {p} does not exist; give a profile folder, .xplane.pb or .json(.gz) trace")
    hlo = hlo_op_names(args.hlo)
    splits = [torch_split(p) if re.search(r"\.json(\.gz)?$", p) else jax_split(p, hlo) for p in args.profiles]
    counts = {k: dict(v) for k, v in hlo_counts(args.hlo).items()} if args.hlo else {}
    if args.json:
        print(json.dumps({"splits": [dataclasses.asdict(s) for s in splits], "hlo_counts": counts}))
        return
    if splits:
        print(table(splits))
    if counts:
        print(f"\nCompiled step's ops by category ({os.path.basename(args.hlo)}):\n")
        for category in CATEGORIES:
            if category in counts:
                items = ", ".join(f"{n} {k}" for k, n in sorted(counts[category].items(), key=lambda kv: -kv[1]))
                print(f"- {category}: {items}")


if __name__ == "__main__":
    main()
