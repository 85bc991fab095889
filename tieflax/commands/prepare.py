"""``tieflax prepare``: tokenise a config's corpus into a token store (local, gs:// or s3://).

    tieflax prepare --config configs/experiments/tie_vs_untie.py --out /data/kjv_store --workers 2
    tieflax prepare --config configs/experiments/tie_vs_untie_pod.py --out gs://BUCKET/corpus \
        --config.data.source=files --config.data.files.paths='gs://BUCKET/text/*.jsonl' \
        --config.data.tokenizer.path=/path/to/llama3/tokenizer.json --workers 16
    # several machines: each runs its share, then any one finalizes (with the settings the shares
    # recorded in build.json: no tokenising flag needs repeating; one given that differs is refused)
    tieflax prepare --config ... --out gs://BUCKET/corpus --shard 3/8
    tieflax prepare --config ... --out gs://BUCKET/corpus --finalize
    # a Ray cluster (pip install 'tieflax[ray]'): one task per input shard, scheduled, retried, finalized
    tieflax prepare --config ... --out gs://BUCKET/corpus --ray 10.0.0.2:6379
    tieflax prepare --config ... --out /data/kjv_store --ray --workers 2     # a local Ray of 2 CPUs

Rerunning the same command resumes a killed prepare (its ledger lists the finished input shards); a
finished store is never rewritten. Train from it with ``--config.data.source=tokens
--config.data.tokens.path=STORE``.
"""

from __future__ import annotations

import argparse

from tieflax.commands.flags import location

HELP = "tokenise a config's corpus into a token store (parallel, resumable, local or gs://)"
FULL_DISK_FIX = ("free space on that disk, or choose another --out; rerun the same command to resume (the "
                 "input shards already tokenised are kept)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a config file; its data section says what to tokenise")
    parser.add_argument("--out", required=True, type=location, help="the store: a folder, gs://bucket/prefix or s3://...")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizer processes, one core each (at most the cores this process may use)")
    parser.add_argument("--shard", default="0/1", help="i/N: tokenise only every N-th input shard from i "
                        "(one machine's share); finalize with --finalize when all are done")
    parser.add_argument("--finalize", action="store_true", help="only write the arrays and the manifest "
                        "from the finished shares")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="tokenise as tasks on the Ray cluster at ADDRESS (HOST:PORT of its head, ray://..., "
                        "auto), or on a local Ray of --workers CPUs started for the command when no ADDRESS is "
                        "given; the same store as without (pip install 'tieflax[ray]')")
    parser.add_argument("--shard-mb", type=float, default=None, help="text per input shard (MiB): the unit "
                        "of work and of resuming (default 8; a resume or --finalize takes the store's)")


def check_arguments(args: argparse.Namespace) -> tuple[int, int]:
    """Every flag, before the config is read or anything written: -> the parsed ``--shard``. A run folder
    (or a folder inside one) is refused as ``--out``: a store needs a folder of its own."""
    import math  # noqa: PLC0415

    from tieflax import storage  # noqa: PLC0415
    from tieflax.data.config import DataError, data_location  # noqa: PLC0415
    from tieflax.data.store_build import parse_shard  # noqa: PLC0415
    from tieflax.run.destinations import check_destination  # noqa: PLC0415
    from tieflax.run.layout import CONFIG_FILE, RUN_CONTENT, holds_a_run, is_run  # noqa: PLC0415

    shard = parse_shard(args.shard)
    if args.ray is not None:
        from tieflax.data.prepare_ray import import_ray  # noqa: PLC0415

        if shard != (0, 1) or args.finalize:
            raise DataError("--ray schedules every input shard over the cluster and finalizes: drop --shard and "
                            "--finalize (they are for building without Ray, one share per machine)")
        import_ray()   # not installed: one line naming the extra, before anything is read
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: use at least 1 (one tokenizer process per core)")
    if args.shard_mb is not None and not (math.isfinite(args.shard_mb) and args.shard_mb > 0):
        raise DataError(f"--shard-mb {args.shard_mb:g}: give the MiB of text per input shard, a number > 0 "
                        "(default 8)")
    # The store's name, resolved where it enters the data layer (a malformed URL refused in one line): the
    # checks below, the build and the last line all name it so.
    out = args.out = data_location(args.out)
    if is_run(out):
        raise DataError(f"--out {out} is a tieflax run folder (its config with checkpoints, parameters, metrics "
                        "or a lock): a token store needs a folder of its own; choose another --out")
    if holds_a_run(out):
        held = [n for n in (CONFIG_FILE, *RUN_CONTENT) if storage.exists(storage.join(out, n))]
        raise DataError(f"--out {out} holds {', '.join(held)}, as a run or a checkpoint does: a token store "
                        "needs a folder of its own; choose another --out")
    check_destination(out, overwrite=False)   # nor inside a run
    return shard


def run(args: argparse.Namespace) -> int:
    from tieflax.config import load_config  # noqa: PLC0415
    from tieflax.data.store_build import build_store, print_progress  # noqa: PLC0415
    from tieflax.data.workers import capped_workers  # noqa: PLC0415

    shard = check_arguments(args)
    config = load_config(args.config, args.overrides)
    workers = args.workers if args.finalize else capped_workers(args.workers, say=print_progress)
    # The config keys set on the command line: a --finalize checks only these against the settings the
    # shard builds recorded (build.json), so it needs none of the tokenising flags repeated.
    flags = {item.removeprefix("--").removeprefix("config.").partition("=")[0] for item in args.overrides}
    with _executor(args, workers):
        manifest = build_store(config.data, args.out, workers=workers, shard=shard,
                               finalize_only=args.finalize,
                               shard_bytes=None if args.shard_mb is None else int(args.shard_mb * (1 << 20)),
                               progress=print_progress,
                               model_vocab_size=(config.model.vocab_size if not args.finalize
                                                 or "model.vocab_size" in flags else None),
                               flags=[k.removeprefix("data.") for k in flags if k.startswith("data.")],
                               executor=_ray_tasks() if args.ray is not None else None)
    if manifest is not None:
        s = manifest["splits"]
        print(f"token store {args.out}: {s['train']['tokens']:,} train / {s['val']['tokens']:,} val tokens, "
              f"vocabulary {manifest['vocab_size']:,}, digest {manifest['digest'][:16]}")
    return 0


def _executor(args: argparse.Namespace, workers: int):
    """With ``--ray``: connected to its cluster (or a local Ray of ``workers`` CPUs) before the corpus is
    read, so an address where nothing answers is one line at once; else nothing to set up (the pool)."""
    import contextlib  # noqa: PLC0415

    if args.ray is None:
        return contextlib.nullcontext()
    from tieflax.data.prepare_ray import ray_session  # noqa: PLC0415
    from tieflax.data.store_build import print_progress  # noqa: PLC0415

    return ray_session(args.ray or None, cpus=workers, say=print_progress)


def _ray_tasks():
    from tieflax.data.prepare_ray import RayTasks  # noqa: PLC0415

    return RayTasks()
