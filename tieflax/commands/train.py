"""``tieflax train``: train a config in a workdir; rerunning the same command resumes.

    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny
    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny_untied \\
        --config.model.tie_embeddings=False
    tieflax train --workdir /tmp/tiny          # resume with the workdir's saved config.json

Multi-process launches (``launch/``) set ``TIEFLAX_COORDINATOR`` / ``TIEFLAX_NUM_PROCESSES`` /
``TIEFLAX_PROCESS_ID`` or ``TIEFLAX_DISTRIBUTED=1``; every process runs this same command. SIGTERM
finishes the current step, saves a checkpoint and exits 0.
"""

from __future__ import annotations

import argparse
import os

HELP = "train a model (resumes from the workdir's latest checkpoint)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="experiment config file[:arg], e.g. configs/experiments/tiny.py; "
                                         "default: <workdir>/config.json")
    parser.add_argument("--workdir", required=True, help="run folder: config, checkpoints, metrics")
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (multi-process)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)


def load_run_config(config_path, workdir: str, overrides):
    """The config file with overrides, or the workdir's saved config (overrides applied) when none."""
    from tieflax.run.layout import CONFIG_FILE  # noqa: PLC0415
    from tieflax.run.identity import load_workdir_config  # noqa: PLC0415
    from tieflax.config import apply_override, load_config, validate_config  # noqa: PLC0415

    if config_path:
        return load_config(config_path, overrides)
    if not os.path.isfile(os.path.join(workdir, CONFIG_FILE)):
        raise SystemExit(f"tieflax train: no --config given and {workdir}/{CONFIG_FILE} does not exist; "
                         "pass --config configs/experiments/tiny.py")
    config = load_workdir_config(workdir)
    for item in overrides:
        apply_override(config, item)
    validate_config(config)
    return config


def run(args: argparse.Namespace) -> int:
    from tieflax import distributed  # noqa: PLC0415

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    import jax  # noqa: PLC0415

    from tieflax.strict_json import dumps as strict_json  # noqa: PLC0415
    from tieflax.train import train_and_evaluate  # noqa: PLC0415

    from tieflax.train import ProcessesStopped  # noqa: PLC0415

    config = load_run_config(args.config, args.workdir, args.overrides)
    try:
        result = train_and_evaluate(config, args.workdir)
    except ProcessesStopped as e:
        # Every process stops with this line; orbax's save thread of a healthy process still waits for the
        # failed one at its commit barrier, and joining it at exit would hang: leave without it.
        import sys  # noqa: PLC0415

        print(f"tieflax train: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    if jax.process_index() == 0:
        print(strict_json(result))  # NaN (a run stopped before its first evaluation) as "NaN": strict JSON
    return 0
