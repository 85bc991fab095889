"""``tieflax analyze --workdir DIR``: embedding diagnostics of a run's checkpoint, as JSON and PNGs."""

from __future__ import annotations

import argparse

from tieflax.commands.flags import integer, location

HELP = "embedding diagnostics of a checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=location, required=True, help="a tieflax run folder (with checkpoints/)")
    parser.add_argument("--step", type=integer(0), default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--out", type=location, default=None, help="output folder (default: WORKDIR/analysis)")
    parser.add_argument("--val-batches", type=integer(0), default=2,
                        help="validation batches for the softmax statistics (default: 2)")
    parser.add_argument("--buckets", type=integer(1), default=4, help="frequency buckets, rarest first (default: 4)")
    parser.add_argument("--max-rows", type=integer(0, " (0 = every row)"), default=2048,
                        help="row sample for pairwise cosines and spectra; 0 = every row (default: 2048)")
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")


def run(args: argparse.Namespace) -> int:
    from tieflax import strict_json as jsonable  # noqa: PLC0415
    from tieflax.study.analyze import analyze_workdir, without_arrays  # noqa: PLC0415

    from tieflax.run.layout import canonical  # noqa: PLC0415
    from tieflax.run.run import Run  # noqa: PLC0415

    if args.overrides:
        raise SystemExit("tieflax analyze reads the run's own config.json; --config.* overrides do not apply")
    # Opened as every reader opens a run (resolved, its record verified, a broken one named with the
    # training command that mends it); the study's measures then read the resolved run folder.
    run = Run.read(args.workdir, command="analyze")
    run.verify()
    out = canonical(args.out) if args.out is not None else None  # as the run layer names a folder it writes
    result = analyze_workdir(run.dir, step=args.step, n_val_batches=args.val_batches,
                             n_buckets=args.buckets, max_rows=args.max_rows or None, out_dir=out,
                             plots=not args.no_plots)
    print(jsonable.dumps(summary_lines(without_arrays(result)), indent=1))
    for kind, path in result["paths"].items():
        print(f"{kind}: {path}")
    return 0


def summary_lines(result: dict) -> dict:
    """The headline numbers of one analysis (the JSON file holds everything)."""
    pick = {"spearman", "mean_cosine", "isotropy", "effective_rank", "mean_norm"}
    out = {"step": result["step"], "tied": result["tied"]}
    if result.get("config_history"):
        out["config_history"] = result["config_history"]
    for side in ("input", "output"):
        out[side] = {k: round(v, 4) for k, v in result[side].items() if k in pick}
    for key in ("in_out",):
        if key in result:
            out[key] = {k: round(v, 4) for k, v in result[key].items()}
    if "gradient" in result:
        g = result["gradient"]
        out["gradient"] = {k: round(g[k], 4) for k in ("rows_lookup", "rows_head", "cosine_mean",
                                                       "conflict_fraction", "head_share")}
    if "softmax" in result:
        s = result["softmax"]
        out["softmax"] = {"mean_lse": round(s["mean_lse"], 4),
                          "bucket_mass_ratio": [round(x, 3) for x in s["bucket_mass_ratio"]]}
    return out
