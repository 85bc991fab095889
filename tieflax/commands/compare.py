"""``tieflax compare --config configs/experiments/tie_vs_untie.py --workdir DIR``: the tied-vs-untied study.

Trains the tied, untied and parameter-matched untied variants on the same data, seeds and token budget,
analyses their checkpoints and writes ``DIR/report.md`` with plots. Rerunning resumes finished and
unfinished runs; ``--report-only`` rewrites the report from ``DIR/summary.json``.
"""

from __future__ import annotations

import argparse

from tieflax.commands.flags import location

HELP = "the tied-vs-untied study: train the variants and write a report with plots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/experiments/tie_vs_untie.py",
                        help="experiment config with a `compare` section (default: %(default)s)")
    parser.add_argument("--workdir", type=location, required=True, help="output folder (or gs:// / s3:// prefix): runs, "
                                                         "report.md, PNGs")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite report.md and the plots from WORKDIR/summary.json without training")
    parser.add_argument("--retrain-changed", action="store_true",
                        help="runs in WORKDIR trained with a different config are trained again (default: refuse, "
                             "naming the fields that differ)")


def run(args: argparse.Namespace) -> int:
    from tieflax import storage  # noqa: PLC0415
    from tieflax.study.report import load_summary, write_report  # noqa: PLC0415

    if args.report_only:
        from tieflax.run.layout import canonical  # noqa: PLC0415

        where = canonical(args.workdir)  # the run layer's name for the compare's folder
        path = write_report(load_summary(where), where)
    else:
        from tieflax.hardware import distributed  # noqa: PLC0415
        from tieflax.study.compare import run_compare  # noqa: PLC0415
        from tieflax.config import load_config  # noqa: PLC0415

        # A multi-process launch (TIEFLAX_DISTRIBUTED=1 from launch/tpu_pod.sh, or TIEFLAX_COORDINATOR...)
        # joins one job, as `tieflax train` does; without this every host ran its own single-process study.
        distributed.initialize()
        from tieflax.study.compilation_cache import compilation_cache  # noqa: PLC0415
        from tieflax.run.layout import RunDir  # noqa: PLC0415

        config = load_config(args.config, args.overrides)
        study = RunDir.at(args.workdir)  # the compare's folder, resolved and checked once: what every part takes
        compilation_cache(study)
        command = " ".join(["tieflax compare --config", args.config, "--workdir", study.path, *args.overrides])
        summary = run_compare(config, study, log=lambda line: print(line, flush=True),
                              retrain_changed=args.retrain_changed, command=command)
        path = summary["report"]
        if path is None:  # not process 0 of a multi-process run: process 0 writes the report
            return 0
        print(f"compare finished in {summary['wall_seconds'] / 60:.1f} min")
    print(f"report: {path}")
    html = path[: -len(".md")] + ".html" if path.endswith(".md") else path + ".html"
    if storage.exists(html):
        print(f"html:   {html}")
    return 0
