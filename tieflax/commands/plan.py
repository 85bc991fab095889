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
USER_ERROR_CODE = 2  # exit codes: 0 fits, 1 does not fit, 2 bad input (config, topology, mesh, --xla-dump)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a config file, e.g. configs/models/llama3_8b.py")
    parser.add_argument("--topology", required=True,
                        help="v5e:2x4, v5p:4x4x4, v4:2x2x1, v6e:4x4 (TPU); h100:8, a100:8, a100_40gb:8 "
                             "(GPU); cpu (this machine's devices)")
    parser.add_argument("--tie", default="config", choices=("config", "tied", "untied", "both"),
                        help="plan the config as is, forced tied or untied, or both side by side")
    parser.add_argument("--no-eval", action="store_true", help="compile the train step only")
    parser.add_argument("--xla-dump", default=None, help="keep XLA's dump (HLO, buffer assignment) here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    # Compile only: JAX must not claim an attached accelerator, and libtpu may be loaded by others too.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tieflax import plan, targets  # noqa: PLC0415
    from tieflax.config import load_config  # noqa: PLC0415

    config = load_config(args.config, args.overrides)
    batch_given = any(o.removeprefix("--").removeprefix("config.").startswith("train.global_batch_size=")
                      for o in args.overrides)
    try:
        target = targets.resolve(args.topology)
    except targets.TargetError as e:
        print(f"tieflax plan: {e}", file=sys.stderr)
        return 2
    if args.xla_dump:
        _check_dump_dir(args.xla_dump)
    progress = None if args.json else (lambda text: print(text + " ...", file=sys.stderr, flush=True))
    name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
    plans = plan.plan_variants(config, target, tie=args.tie, name=name,
                               global_batch_size=config.train.global_batch_size if batch_given else None,
                               with_eval=not args.no_eval, dump_dir=args.xla_dump, progress=progress)
    if args.json:
        payload = [p.as_dict() for p in plans]
        print(json.dumps(payload if len(payload) > 1 else payload[0], indent=2))
    else:
        print(plan.format_report(plans))
    return 0 if all(p.fits for p in plans) else 1


def _check_dump_dir(folder: str) -> None:
    """Before compiling: XLA writes its dump with plain file calls and, when it cannot, logs an error per
    file and goes on (the largest-temporaries table, read from the dump, would be missing)."""
    from tieflax.plan import PlanError  # noqa: PLC0415

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
