"""``tieflax compare --config configs/experiments/tie_vs_untie.py --workdir DIR``: the tied-vs-untied study.

Trains the tied, untied and parameter-matched untied variants on the same data, seeds and token budget,
analyses their checkpoints and writes ``DIR/report.md`` with plots. Rerunning resumes finished and
unfinished runs; ``--report-only`` rewrites the report from ``DIR/summary.json``.
"""

from __future__ import annotations

import argparse

HELP = "the tied-vs-untied study: train the variants and write a report with plots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/experiments/tie_vs_untie.py",
                        help="experiment config with a `compare` section (default: %(default)s)")
    parser.add_argument("--workdir", required=True, help="output folder: runs, report.md, PNGs")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite report.md and the plots from WORKDIR/summary.json without training")


def _compilation_cache(path: str) -> None:
    """Seeds of one variant compile the same programs: a persistent cache (unless the user set one) turns
    the later seeds' compiles into reads."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def run(args: argparse.Namespace) -> int:
    import os

    from tieflax.analysis.report import load_summary, write_report

    if args.report_only:
        path = write_report(load_summary(args.workdir), args.workdir)
    else:
        from tieflax.analysis.study import run_compare
        from tieflax.config import load_config

        config = load_config(args.config, args.overrides)
        _compilation_cache(os.path.join(os.path.abspath(args.workdir), "data", "jax_cache"))
        summary = run_compare(config, args.workdir, log=lambda line: print(line, flush=True))
        path = summary["report"]
        if path is None:  # not process 0 of a multi-process run: process 0 writes the report
            return 0
        print(f"compare finished in {summary['wall_seconds'] / 60:.1f} min")
    print(f"report: {os.path.abspath(path)}")
    html = os.path.splitext(path)[0] + ".html"
    if os.path.exists(html):
        print(f"html:   {os.path.abspath(html)}")
    return 0
