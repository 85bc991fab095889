"""``tieflax prepare``: tokenise a config's corpus into a token store (local, gs:// or s3://).

    tieflax prepare --config configs/experiments/tie_vs_untie.py --out /data/kjv_store --workers 2
    tieflax prepare --config configs/experiments/tie_vs_untie_pod.py --out gs://BUCKET/corpus \
        --config.data.source=files --config.data.files.paths='gs://BUCKET/text/*.jsonl' \
        --config.data.tokenizer.path=/path/to/llama3/tokenizer.json --workers 16
    # several machines: each runs its share, then any one finalizes
    tieflax prepare --config ... --out gs://BUCKET/corpus --shard 3/8
    tieflax prepare --config ... --out gs://BUCKET/corpus --finalize

Rerunning the same command resumes a killed prepare (its ledger lists the finished input shards); a
finished store is never rewritten. Train from it with ``--config.data.source=tokens
--config.data.tokens.path=STORE``.
"""

from __future__ import annotations

import argparse

HELP = "tokenise a config's corpus into a token store (parallel, resumable, local or gs://)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a config file; its data section says what to tokenise")
    parser.add_argument("--out", required=True, help="the store: a folder, gs://bucket/prefix or s3://...")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (one core each)")
    parser.add_argument("--shard", default="0/1", help="i/N: tokenise only every N-th input shard from i "
                        "(one machine's share); finalize with --finalize when all are done")
    parser.add_argument("--finalize", action="store_true", help="only write the arrays and the manifest "
                        "from the finished shares")
    parser.add_argument("--shard-mb", type=float, default=8.0, help="text per input shard (MiB): the unit "
                        "of work and of resuming")


def run(args: argparse.Namespace) -> int:
    from tieflax.config import load_config  # noqa: PLC0415
    from tieflax.data.store_build import build_store, parse_shard, print_progress  # noqa: PLC0415

    config = load_config(args.config, args.overrides)
    manifest = build_store(config.data, args.out, workers=args.workers, shard=parse_shard(args.shard),
                           finalize_only=args.finalize, shard_bytes=int(args.shard_mb * (1 << 20)),
                           progress=print_progress, model_vocab_size=config.model.vocab_size)
    if manifest is not None:
        s = manifest["splits"]
        print(f"token store {args.out}: {s['train']['tokens']:,} train / {s['val']['tokens']:,} val tokens, "
              f"vocabulary {manifest['vocab_size']:,}, digest {manifest['digest'][:16]}")
    return 0
