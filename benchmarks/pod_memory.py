"""Per-chip memory and compile time at pod scale, tieflax beside MaxText, compiled on this CPU machine.

    python benchmarks/pod_memory.py                                   # MaxText: figures recorded in README
    python benchmarks/pod_memory.py --maxtext /path/to/venv/bin/python  # MaxText: recompiled now
    python benchmarks/pod_memory.py --models gemma_2b --seq-len 2048
    python benchmarks/pod_memory.py --flops                           # FLOPs term by term, no compile
    python benchmarks/pod_memory.py --libtpu /path/to/libtpu.so       # tieflax compiled by that TPU compiler

Cases: Gemma-2B on v5e:4x4 (16 chips) and Llama-3-8B on v5p:4x4x4 (64 chips), one sequence of
``--seq-len`` (8192) tokens per chip, bf16 compute, fp32 parameters, all chips on one FSDP axis (the
mesh MaxText picks: ``ici_fsdp_parallelism=-1``, every other axis 1).

- tieflax: ``tieflax plan --no-eval --json`` (the real train step), tied and untied, each in its own
  process; the published config as it is (its own defaults: bf16 compute, FSDP over all chips, scanned
  layers, remat 'full', ``mlp_chunk=1024``), and with ``offload_layer_inputs=True`` (each layer's saved
  input in host memory; ``--variants`` picks).
- MaxText: ``python -m maxtext.trainers.pre_train.train_compile base.yml compile_topology=...
  per_device_batch_size=1 max_target_length=...`` with its defaults (scanned layers, remat 'full',
  attention chosen by MaxText) and with ``num_vocab_tiling=16``; its log's ``Memory analysis`` line gives
  the compiler's figures. Without ``--maxtext`` the figures recorded between the ``maxtext:begin`` /
  ``maxtext:end`` markers of ``benchmarks/README.md`` are used (they state the command and versions).
- The TPU compiler: MaxText's venv brings libtpu 0.0.52, and so does tieflax's ``tpu`` / ``test`` extra on
  Python 3.12+ (jax 0.12). On Python 3.11 jax 0.10 pins libtpu 0.0.42.1, which reports more
  temporaries for a scanned step than its own buffer assignment holds (about the saved layer-input
  stack; ``benchmarks/scan_temp_accounting.py``). ``--libtpu`` compiles tieflax with a given
  ``libtpu.so`` (``TPU_LIBRARY_PATH``), e.g. MaxText's, so both columns come from one compiler.

Per chip: arguments (parameters + optimizer state + batch), temporaries (``temp_size_in_bytes``), and
compile time of the whole process (wall; CPU time of the process and its threads, which a loaded
machine distorts less); model TFLOPs per step per chip, tieflax's (``tieflax/hardware/flops.py``) beside
MaxText's own count (``calculate_tflops_training_per_device``, re-derived in ``tieflax.hardware.flops`` with
MaxText's model config, e.g. its gemma-2b vocabulary of 256,128). Prints a Markdown table and one JSON
line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "benchmarks", "README.md")
GIB = 1 << 30
# The published configs carry the pod defaults (bf16 compute, FSDP over all chips, scanned layers, remat
# 'full'; attention auto = splash on TPU): only the sequence length is given.
TIEFLAX_OVERRIDES: list[str] = []
MESH: list[str] = []
MAXTEXT_VARIANTS = {
    "default": [],
    "num_vocab_tiling=16": ["num_vocab_tiling=16"],
    # MaxText's own offload of each decoder layer's input (its 'custom' remat policy, the rest recomputed):
    # the counterpart of tieflax's offload_layer_inputs.
    "num_vocab_tiling=16, decoder_layer_input=offload": ["num_vocab_tiling=16", "remat_policy=custom",
                                                         "decoder_layer_input=offload"],
}
TIEFLAX_VARIANTS = {"config": [], "offload": ["--config.model.offload_layer_inputs=True"]}


@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    topology: str            # tieflax's name
    maxtext_model: str
    maxtext_topology: str    # MaxText's name for the same slice
    maxtext_vocab: int       # its model config's vocab_size (what its FLOPs count uses)


CASES = {
    "gemma_2b": Case("configs/models/gemma_2b.py", "v5e:4x4", "gemma-2b", "v5e-16", 256128),
    "llama3_8b": Case("configs/models/llama3_8b.py", "v5p:4x4x4", "llama3-8b", "v5p-128", 128256),
}


@dataclasses.dataclass
class Figures:
    tool: str                # 'tieflax tied', 'MaxText default', ...
    arguments: int | None
    temporaries: int | None
    wall_seconds: float
    cpu_seconds: float
    mesh: str = ""
    note: str = ""
    tflops: float | None = None   # model TFLOPs per step per chip, by the tool's own count


def _timed(cmd: list[str], env: dict, log_path: str | None = None) -> tuple[subprocess.CompletedProcess,
                                                                               float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if log_path:
        with open(log_path, "w") as f:
            f.write(proc.stdout + proc.stderr)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, wall, cpu


def run_tieflax(case: Case, seq_len: int, tied: bool, extra: list[str], variant: str = "config",
                libtpu: str | None = None) -> Figures:
    cmd = [sys.executable, "-m", "tieflax.cli", "plan", "--config", case.config, "--topology", case.topology,
           "--tie", "tied" if tied else "untied", "--no-eval", "--json",
           f"--config.train.seq_len={seq_len}", *MESH, *TIEFLAX_OVERRIDES, *TIEFLAX_VARIANTS[variant], *extra]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if libtpu:   # JAX loads the TPU compiler from this file instead of the installed libtpu package
        env.update(TPU_LIBRARY_PATH=libtpu, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc, wall, cpu = _timed(cmd, env)
    try:
        d = json.loads(proc.stdout)   # exit 1 with JSON: it does not fit; without: an error
    except json.JSONDecodeError:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}") from None
    train = d["train"]
    mesh = " ".join(f"{k}={v}" for k, v in d["mesh"].items() if v > 1)
    note = "" if d["fits"] else "does not fit"
    label = f"tieflax {'tied' if tied else 'untied'}" + ("" if variant == "config" else f", {variant}")
    return Figures(label, train["arguments"], train["temporaries"],
                   wall, cpu, mesh, note, d.get("model_tflops_per_device"))


def run_maxtext(python: str, case: Case, seq_len: int, variant: str, log_dir: str) -> Figures:
    site = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    cmd = [python, "-m", "maxtext.trainers.pre_train.train_compile", os.path.join(site, "configs", "base.yml"),
           f"compile_topology={case.maxtext_topology}", "compile_topology_num_slices=1",
           f"model_name={case.maxtext_model}", "per_device_batch_size=1", f"max_target_length={seq_len}",
           "dataset_type=synthetic", f"base_output_directory={log_dir}", "run_name=pod_memory",
           *MAXTEXT_VARIANTS[variant]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    log = os.path.join(log_dir, f"{case.maxtext_model}_{re.sub(r'[^A-Za-z0-9_]+', '_', variant)}.log")
    proc, wall, cpu = _timed(cmd, env, log)
    text = proc.stdout + proc.stderr
    stats = dict(re.findall(r"(\w+_size_in_bytes)=(\d+)", text))
    if proc.returncode != 0 or "temp_size_in_bytes" not in stats:
        raise RuntimeError(f"MaxText train_compile failed (log: {log}):\n{text[-3000:]}")
    return Figures(f"MaxText {variant}", int(stats["argument_size_in_bytes"]), int(stats["temp_size_in_bytes"]),
                   wall, cpu, maxtext_mesh(text), "")


def maxtext_mesh(log: str) -> str:
    """'fsdp=16' from MaxText's 'Num_devices: 16, shape (1, 1, 1, 16, ...)' and its mesh_axes."""
    shape = re.search(r"Num_devices: \d+, shape \(([\d, ]+)\)", log)
    axes = re.search(r"Config param mesh_axes: \[([^\]]*)\]", log)
    if not (shape and axes):
        return "?"
    sizes = [int(x) for x in shape.group(1).split(",") if x.strip()]
    names = [a.strip().strip("'\"") for a in axes.group(1).split(",")]
    return " ".join(f"{n}={s}" for n, s in zip(names, sizes) if s > 1) or "one device"


def maxtext_versions(python: str) -> str:
    code = ("import importlib.metadata as m; print(' '.join(f'{p} {m.version(p)}' for p in "
            "('maxtext', 'jax', 'libtpu')))")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def read_recorded(path: str = README) -> dict[tuple[str, str, str], Figures]:
    """(model, seq_len, variant) -> MaxText figures from the README table between the markers."""
    with open(path) as f:
        text = f.read()
    m = re.search(r"<!-- maxtext:begin -->(.*?)<!-- maxtext:end -->", text, re.S)
    if not m:
        return {}
    out = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 8 or not cells[3].replace(",", "").isdigit():
            continue
        model, seq_len, variant, args, temp, wall, cpu, mesh = cells[:8]
        out[(model, seq_len, variant)] = Figures(
            f"MaxText {variant}", int(args.replace(",", "")), int(temp.replace(",", "")),
            float(wall.rstrip(" s")), float(cpu.rstrip(" s")), mesh, "recorded")
    return out


def recorded_row(model: str, seq_len: int, variant: str, f: Figures) -> str:
    return (f"| {model} | {seq_len} | {variant} | {f.arguments:,} | {f.temporaries:,} | {f.wall_seconds:.0f} s "
            f"| {f.cpu_seconds:.0f} s | {f.mesh} |")


def maxtext_tflops(case: Case, seq_len: int) -> float:
    """MaxText's count for its model, one sequence per chip (what its training log prints)."""
    from tieflax.config import load_config, model_config
    from tieflax.hardware.flops import maxtext_tflops_per_device

    c = model_config(load_config(os.path.join(ROOT, case.config)))
    return maxtext_tflops_per_device(c, 1, seq_len, vocab_size=case.maxtext_vocab)["total"]


def flops_terms(case: Case, seq_len: int) -> dict[str, tuple[float, float]]:
    """term -> (tieflax, MaxText) model TFLOPs per step per chip, one sequence per chip; MaxText's terms
    as its calculate_tflops_training_per_device forms them (x3 for training), with its vocabulary."""
    from tieflax.config import load_config, model_config
    from tieflax.hardware.flops import step_flops

    c = model_config(load_config(os.path.join(ROOT, case.config)))
    f = step_flops(c, 1, seq_len)
    t, d, h, layers = seq_len, c.d_model, c.dim_per_head, c.n_layers
    theirs = {"qkv": 2 * t * d * (c.n_heads + 2 * c.kv_heads) * h * layers,
              "attn_out": 2 * t * d * c.n_heads * h * layers,
              "mlp": 2 * t * c.d_ff * d * (2 if c.mlp == "gelu" else 3) * layers,
              "head": 2 * t * d * case.maxtext_vocab,
              "attention": 4 * t * t * c.n_heads * h / 2 * layers}
    ours = {**f.weights, "attention": f.attention}
    return {k: (3 * ours[k] / 1e12, 3 * theirs[k] / 1e12) for k in theirs}


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of {sorted(CASES)}")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--maxtext", default=None, help="a Python with maxtext[tpu] installed: recompile")
    parser.add_argument("--maxtext-logs", default="/tmp/pod_memory_maxtext")
    parser.add_argument("--skip-tieflax", action="store_true", help="MaxText figures only")
    parser.add_argument("--maxtext-variants", default=None,
                        help=f"with --maxtext: which to compile, separated by ';' (default all: "
                             f"{'; '.join(MAXTEXT_VARIANTS)})")
    parser.add_argument("--variants", default=",".join(TIEFLAX_VARIANTS),
                        help=f"tieflax variants, comma-separated, of {sorted(TIEFLAX_VARIANTS)}")
    parser.add_argument("--flops", action="store_true", help="only the FLOPs table, term by term (no compile)")
    parser.add_argument("--tieflax-override", action="append", default=[],
                        help="extra --config.a.b=v for tieflax plan (repeatable)")
    parser.add_argument("--libtpu", default=None,
                        help="compile tieflax with this libtpu.so (TPU_LIBRARY_PATH), e.g. the one MaxText's venv "
                             "holds, so that both tools' figures come from the same TPU compiler")
    args = parser.parse_args()

    if args.flops:
        print(f"Model TFLOPs per step per chip, T = {args.seq_len}, one sequence per chip: tieflax / MaxText\n")
        terms = ["qkv", "attn_out", "mlp", "head", "attention"]
        print("| model | " + " | ".join(terms) + " | total |")
        print("|---|" + "---:|" * (len(terms) + 1))
        for model in args.models.split(","):
            t = flops_terms(CASES[model], args.seq_len)
            total = [sum(v[i] for v in t.values()) for i in (0, 1)]
            print(f"| {model} | " + " | ".join(f"{t[k][0]:.3f} / {t[k][1]:.3f}" for k in terms)
                  + f" | {total[0]:.3f} / {total[1]:.3f} |")
        return
    recorded = {} if args.maxtext else read_recorded()
    rows, record_lines, results = [], [], []
    for model in args.models.split(","):
        case = CASES[model]
        figures = []
        if not args.skip_tieflax:
            for variant in args.variants.split(","):
                if variant not in TIEFLAX_VARIANTS:
                    parser.error(f"--variants: unknown {variant!r}; choose from {sorted(TIEFLAX_VARIANTS)}")
                for tied in (True, False):
                    figures.append(run_tieflax(case, args.seq_len, tied, args.tieflax_override, variant,
                                               args.libtpu))
                    print(f"[{model}] {figures[-1]}", file=sys.stderr, flush=True)
        maxtext_variants = (args.maxtext_variants.split(";") if args.maxtext and args.maxtext_variants
                            else list(MAXTEXT_VARIANTS))
        for variant in maxtext_variants:
            if variant not in MAXTEXT_VARIANTS:
                parser.error(f"--maxtext-variants: unknown {variant!r}; choose from {list(MAXTEXT_VARIANTS)}")
            if args.maxtext:
                os.makedirs(args.maxtext_logs, exist_ok=True)
                f = run_maxtext(args.maxtext, case, args.seq_len, variant, args.maxtext_logs)
                record_lines.append(recorded_row(model, args.seq_len, variant, f))
                print(f"[{model}] {f}", file=sys.stderr, flush=True)
            else:
                f = recorded.get((model, str(args.seq_len), variant))
            if f:
                f.tflops = maxtext_tflops(case, args.seq_len)
                figures.append(f)
        for f in figures:
            tflops = "-" if f.tflops is None else f"{f.tflops:.1f}"
            rows.append(f"| {model} | {case.topology} | {f.tool} | {gib(f.temporaries)} | {gib(f.arguments)} | "
                        f"{tflops} | {f.wall_seconds:.0f} s | {f.cpu_seconds:.0f} s | {f.mesh} | {f.note} |")
            results.append(dict(model=model, topology=case.topology, seq_len=args.seq_len,
                                **dataclasses.asdict(f)))
    print(f"Per chip, T = {args.seq_len}, one sequence per chip (GiB; compile = the whole process)\n")
    print("| model | topology | tool | temporaries | arguments | model TFLOPs | compile wall | compile CPU | mesh | |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|---|")
    print("\n".join(rows))
    if record_lines:
        print(f"\nMaxText rows for benchmarks/README.md ({maxtext_versions(args.maxtext)}):")
        print("\n".join(record_lines))
    print(json.dumps({"seq_len": args.seq_len, "results": results}))


if __name__ == "__main__":
    main()
