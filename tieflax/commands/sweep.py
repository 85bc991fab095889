"""``tieflax sweep --config configs/experiments/tie_scaling.py --workdir DIR [--resume]``: tied vs untied
across model sizes, each variant at its own best learning rate, with the crossover estimate."""

from __future__ import annotations

import argparse

HELP = "tied vs untied across model sizes: loss-vs-parameters curves and the crossover estimate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/experiments/tie_scaling.py",
                        help="experiment config with a `sweep` section (default: %(default)s)")
    parser.add_argument("--workdir", required=True, help="output folder: runs, sweep_report.md, PNGs")
    parser.add_argument("--resume", action="store_true", help="continue a partial sweep in WORKDIR")


def run(args: argparse.Namespace) -> int:
    import os

    from tieflax.analysis.sweep import run_sweep
    from tieflax.commands.compare import _compilation_cache
    from tieflax.config import load_config

    config = load_config(args.config, args.overrides)
    _compilation_cache(os.path.join(os.path.abspath(args.workdir), "data", "jax_cache"))
    summary = run_sweep(config, args.workdir, resume=args.resume, log=lambda line: print(line, flush=True))
    print(f"sweep finished in {summary['wall_seconds'] / 60:.1f} min")
    print(f"report: {os.path.abspath(summary['report'])}")
    return 0
