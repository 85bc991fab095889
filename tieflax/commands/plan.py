"""``tieflax plan``: per-device memory and compile time of a config's train and eval steps on a TPU pod,
GPU server or this machine, compiled here without the hardware. Exits 1 when it does not fit.

    tieflax plan --config configs/models/llama3_8b.py --topology v5p:4x4x4 --config.train.seq_len=8192
    tieflax plan --config configs/models/gemma_2b.py --topology v5e:4x4 --tie both --json
    tieflax plan --config configs/experiments/tiny.py --topology h100:8     # needs the gpu extra

The batch is one sequence per device unless ``--config.train.global_batch_size`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HELP = "per-device memory of a config's train step on a TPU pod or GPU server, compiled here"
USER_ERROR_CODE = 2  # exit codes: 0 fits, 1 does not fit or did not compile (tieflax.plan.child), 2 bad input


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a config file, e.g. configs/models/llama3_8b.py")
    parser.add_argument("--topology", required=True,
                        help="v5e:2x4, v5p:4x4x4, v4:2x2x1, v6e:4x4 (TPU chip grids) or gcloud's names "
                             "(v5litepod-16, v5p-128, v6e-256, v4-64); h100:8, h100_pcie:8, h200:8, a100:8, "
                             "a100_40gb:8 (GPU); "
                             "cpu (this machine's devices)")
    parser.add_argument("--tie", default="config", choices=("config", "tied", "untied", "both"),
                        help="plan the config as is, forced tied or untied, or both side by side")
    parser.add_argument("--no-eval", action="store_true", help="compile the train step only")
    parser.add_argument("--xla-dump", default=None, help="keep XLA's dump (HLO, buffer assignment) here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--explain", action="store_true",
                        help="account for what is live at the train step's peak, by origin (residual stack, "
                             "a layer's working set, weight gradients, loss, optimizer, copies)")


def run(args: argparse.Namespace) -> int:
    # Compile only: JAX must not claim an attached accelerator, and libtpu may be loaded by others too.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tieflax.hardware import targets  # noqa: PLC0415
    from tieflax.plan import child  # noqa: PLC0415 (light: nothing of JAX is imported by it)

    try:   # the shape is checked here, before libtpu is loaded: it aborts the process on some
        topology, mapped = targets.canonical_topology(args.topology)
        if mapped:
            print(f"tieflax plan: {mapped}", file=sys.stderr, flush=True)
        if child.compiles_in_child(topology):
            return child.plan_in_child(child_command(args, topology), topology, getattr(args, "debug", False))
        if child.is_child():
            child.no_core_file()
        target = targets.resolve(topology)
    except targets.TargetError as e:
        print(f"tieflax plan: {e}", file=sys.stderr)
        return USER_ERROR_CODE
    from tieflax import plan  # noqa: PLC0415

    progress = None if args.json else (lambda text: print(text + " ...", file=sys.stderr, flush=True))
    plans = plan.plan_config_file(args.config, args.overrides, target, tie=args.tie, with_eval=not args.no_eval,
                                  dump_dir=args.xla_dump, progress=progress,
                                  explain=getattr(args, "explain", False))
    if args.json:
        payload = [p.as_dict() for p in plans]
        print(json.dumps(payload if len(payload) > 1 else payload[0], indent=2))
    else:
        print(plan.format_report(plans))
    return 0 if all(p.fits for p in plans) else 1


def child_command(args: argparse.Namespace, topology: str) -> list[str]:
    """The command line of the child that compiles: this same ``tieflax plan``, for the canonical name."""
    argv = [sys.executable, "-m", "tieflax.cli", "plan", "--config", args.config, "--topology", topology,
            "--tie", args.tie]
    argv += ["--no-eval"] * bool(args.no_eval) + ["--json"] * bool(args.json)
    argv += ["--explain"] * bool(getattr(args, "explain", False))
    argv += ["--xla-dump", args.xla_dump] if args.xla_dump else []
    argv += ["--debug"] * bool(getattr(args, "debug", False))
    return argv + list(args.overrides)
