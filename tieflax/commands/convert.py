"""``tieflax convert``: Hugging Face import/export, and tie/untie surgery on tieflax checkpoints.

    tieflax convert --from-hf DIR --workdir OUT           # HF folder -> a workdir `tieflax train` starts from
    tieflax convert --to-hf --workdir RUN --out DIR       # latest checkpoint -> an HF folder (transformers)
    tieflax convert --untie --workdir RUN --out NEW       # the head becomes its own copy of the embedding
    tieflax convert --tie mean --workdir RUN --out NEW    # keep input, output or their mean; reports the loss
    tieflax convert --unscan-layers --workdir RUN --out NEW   # stacked (scan_layers) -> per-layer params
    tieflax convert --scan-layers --workdir RUN --out NEW     # per-layer -> stacked

Surgery and import write ``NEW``/``OUT`` with ``save_initial_params``: training there starts from those
parameters at step 0 with a fresh optimizer. ``--config.a.b=value`` overrides set the new workdir's
training and data settings (``--config.train.learning_rate=1e-4``); model fields that the checkpoint
defines cannot be overridden (use --untie/--tie for the tie switch). The work is
``tieflax.interop.convert``'s.
"""

from __future__ import annotations

import argparse

from tieflax.commands.flags import location, positive_number, refuse_overrides

HELP = "Hugging Face import/export, tie/untie surgery and scanned/per-layer layouts of checkpoints"
FULL_DISK_FIX = "free space on that disk, or write to another one (nothing half-written is left)"
# A stop removes what the command wrote; the destination is published whole or not at all.
ON_INTERRUPT = ("the lock is released and nothing half-written is left: the destination holds what it held before (or the finished "
                "result, if the stop came as it finished; on a bucket, an export replacing an earlier one leaves "
                "the prefix marked incomplete, which the rerun clears); rerun the same command")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-hf", metavar="DIR", type=location, help="import a Hugging Face folder (config.json + safetensors)")
    mode.add_argument("--to-hf", action="store_true", help="export --workdir's latest parameters to --out")
    mode.add_argument("--untie", action="store_true", help="untie --workdir's model into --out")
    mode.add_argument("--tie", choices=("input", "output", "mean"),
                      help="tie --workdir's model into --out, keeping this matrix")
    mode.add_argument("--scan-layers", action="store_true", help="stack --workdir's layers (scan_layers) into --out")
    mode.add_argument("--unscan-layers", action="store_true", help="unstack --workdir's layers into --out")
    parser.add_argument("--workdir", type=location, required=True, help="the tieflax workdir to write (--from-hf) or read")
    parser.add_argument("--out", type=location, help="output folder: the HF folder (--to-hf) or the new workdir (surgery)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="--to-hf: tensor dtype to write (default: the parameters' own)")
    parser.add_argument("--max-shard-gb", type=positive_number, default=5.0, help="--to-hf: shard above this size")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what the destination folder holds (default: refuse a non-empty one)")


def run(args: argparse.Namespace) -> int:
    from tieflax import strict_json as jsonable  # noqa: PLC0415
    from tieflax.interop.convert import export_hf, import_hf, scan_run, tie_run, untie_run  # noqa: PLC0415
    from tieflax.run.run import Run  # noqa: PLC0415

    overrides = list(getattr(args, "overrides", []) or [])
    if args.to_hf:
        refuse_overrides(args, "convert --to-hf", "it exports the run's parameters with the run's own config")
    overwrite = getattr(args, "overwrite", False)
    if args.from_hf:
        from tieflax.run.layout import canonical  # noqa: PLC0415

        # The Hugging Face folder named as the run layer names a folder (the report and the import's record
        # name it so); the new workdir is resolved by the destination's checks.
        report = import_hf(canonical(args.from_hf), args.workdir, overrides, overwrite=overwrite)
    else:
        if not args.out:
            raise SystemExit("tieflax convert: --out is required with --to-hf, --untie, --tie and "
                             "--scan-layers/--unscan-layers")
        # The run read from: resolved here, verified once its config is read (after --out is checked).
        source = Run.read(args.workdir, command="convert")
        if args.to_hf:
            report = export_hf(source, args.out, dtype=args.dtype,
                               max_shard_bytes=int(args.max_shard_gb * 2**30), overwrite=overwrite)
        elif args.untie:
            report = untie_run(source, args.out, overrides, overwrite=overwrite)
        elif args.scan_layers or args.unscan_layers:
            report = scan_run(source, args.out, args.scan_layers, overrides, overwrite=overwrite)
        else:
            report = tie_run(source, args.out, args.tie, overrides, overwrite=overwrite)
    print(jsonable.dumps(report, indent=2))
    return 0
