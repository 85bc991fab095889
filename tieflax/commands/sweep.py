"""``tieflax sweep --config configs/experiments/tie_scaling.py --workdir DIR [--resume]``: tied vs untied
across model sizes, each variant at its own best learning rate, with the crossover estimate."""

from __future__ import annotations

import argparse

from tieflax.commands.flags import location

HELP = "tied vs untied across model sizes: loss-vs-parameters curves and the crossover estimate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/experiments/tie_scaling.py",
                        help="experiment config with a `sweep` section (default: %(default)s)")
    parser.add_argument("--workdir", type=location, required=True, help="output folder (or gs:// / s3:// prefix): runs, "
                                                         "sweep_report.md, PNGs")
    parser.add_argument("--resume", action="store_true", help="continue a partial sweep in WORKDIR")
    parser.add_argument("--retrain-changed", action="store_true",
                        help="with --resume: runs trained with a different config are trained again (default: "
                             "refuse, naming the fields that differ)")


def run(args: argparse.Namespace) -> int:
    from tieflax.study.sweep import run_sweep  # noqa: PLC0415
    from tieflax.study.compilation_cache import compilation_cache  # noqa: PLC0415
    from tieflax.config import load_config  # noqa: PLC0415
    from tieflax.hardware import distributed  # noqa: PLC0415
    from tieflax.run.layout import RunDir  # noqa: PLC0415

    distributed.initialize()  # a multi-process launch joins one job (as compare and train do)
    config = load_config(args.config, args.overrides)
    study = RunDir.at(args.workdir)  # the sweep's folder, resolved and checked once: what every part takes
    compilation_cache(study)
    summary = run_sweep(config, study, resume=args.resume, retrain_changed=args.retrain_changed,
                        log=lambda line: print(line, flush=True))
    if summary["report"] is None:  # not process 0 of a multi-process run: process 0 writes the report
        return 0
    print(f"sweep finished in {summary['wall_seconds'] / 60:.1f} min")
    print(f"report: {summary['report']}")
    return 0
