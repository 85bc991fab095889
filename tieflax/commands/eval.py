"""``tieflax eval --workdir DIR``: validation loss and perplexity of the workdir's latest checkpoint.

The config is read back from ``DIR/config.json``; ``--config.a.b=v`` overrides may change how it is
evaluated (``--config.mesh.tensor=4``, ``--config.train.eval_batches=0`` for the whole split), not the
model. Prints one JSON object: ``{"step", "loss", "perplexity", "accuracy", "tokens"}``.
"""

from __future__ import annotations

import argparse
import json

HELP = "validation loss and perplexity of a workdir's latest checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", required=True, help="a run folder written by `tieflax train`")


def run(args: argparse.Namespace) -> int:
    from tieflax import distributed  # noqa: PLC0415

    distributed.initialize()

    import jax  # noqa: PLC0415

    from tieflax.checkpoint import load_workdir_config  # noqa: PLC0415
    from tieflax.config import apply_override, model_config  # noqa: PLC0415
    from tieflax.train import evaluate  # noqa: PLC0415

    config = load_workdir_config(args.workdir)
    for item in args.overrides:
        apply_override(config, item)
    model_config(config)
    result = evaluate(config, args.workdir)
    if jax.process_index() == 0:
        print(json.dumps(result, default=float))
    return 0
