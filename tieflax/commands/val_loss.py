"""``tieflax val-loss --workdir DIR``: validation loss and perplexity of the workdir's latest checkpoint.

(Named ``tieflax eval`` until this release, which still answers to that name and says the new one;
``tieflax evaluate`` is another command: lm-eval tasks.)

The config is read back from ``DIR/config.json``; ``--config.a.b=v`` overrides may change how it is
evaluated (``--config.mesh.tensor=4``, ``--config.train.eval_batches=0`` for the whole split), not the
model. Prints one JSON object: ``{"step", "loss", "perplexity", "accuracy", "tokens"}``.
"""

from __future__ import annotations

import argparse

from tieflax.commands.flags import location

HELP = "validation loss and perplexity of a workdir's latest checkpoint"
ON_INTERRUPT = "nothing was written: rerun the same command"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=location, required=True, help="a run folder written by `tieflax train`")


def run(args: argparse.Namespace) -> int:
    from tieflax.hardware import distributed  # noqa: PLC0415

    distributed.initialize()

    import jax  # noqa: PLC0415

    from tieflax import strict_json  # noqa: PLC0415
    from tieflax.config import apply_override, model_config, validate_config  # noqa: PLC0415
    from tieflax.errors import ConfigError  # noqa: PLC0415
    from tieflax.run.run import Run  # noqa: PLC0415
    from tieflax.train import evaluate_run  # noqa: PLC0415

    run = Run.read(args.workdir, command="val-loss")
    config = run.config
    trained = model_config(config)
    for item in args.overrides:
        apply_override(config, item)
    validate_config(config)
    changed = sorted(k for k, v in model_config(config).__dict__.items() if trained.__dict__[k] != v)
    if changed:
        raise ConfigError(f"--config.model overrides would evaluate another model than the one trained "
                          f"(config.model.{changed[0]}{' and more' if len(changed) > 1 else ''}): val-loss "
                          "overrides may change how the run is evaluated (mesh, batches), not the model")
    result = evaluate_run(config, run.dir)
    if jax.process_index() == 0:
        print(strict_json.dumps(result))  # a NaN loss as "NaN": strict JSON
    return 0
