"""``tieflax train``: train a config in a workdir; rerunning the same command resumes.

    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny
    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny_untied \\
        --config.model.tie_embeddings=False
    tieflax train --workdir /tmp/tiny          # resume with the config the run trains with
    tieflax train --workdir /tmp/tiny --config.train.num_steps=2000 --allow-change train.num_steps

A rerun, with or without ``--config``, is the same run: a field that changes results and differs from
the run's record is refused (naming it) unless ``--allow-change`` names it; the change is then recorded
in ``config_history/`` (``tieflax.run.identity``), never by rewriting config.json.

Multi-process launches (``launch/``) set ``TIEFLAX_COORDINATOR`` / ``TIEFLAX_NUM_PROCESSES`` /
``TIEFLAX_PROCESS_ID`` or ``TIEFLAX_DISTRIBUTED=1``; every process runs this same command. SIGTERM
finishes the current step, saves a checkpoint and exits 0; a first Ctrl-C (SIGINT) does the same and exits
130; a second one stops at once and says which steps are lost.
"""

from __future__ import annotations

import argparse

import os

from tieflax.commands.flags import integer, location

HELP = "train a model (resumes from the workdir's latest checkpoint)"
FULL_DISK_FIX = ("free space on that disk, or point --workdir at another one; rerun the same command to "
                 "resume from the last checkpoint")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="experiment config file[:arg], e.g. configs/experiments/tiny.py; "
                                         "default: <workdir>/config.json")
    parser.add_argument("--workdir", type=location, required=True, help="run folder: config, checkpoints, metrics")
    parser.add_argument("--allow-change", action="append", default=[], metavar="FIELD[,FIELD]",
                        help="continue this run with these result fields changed on purpose (e.g. "
                             "train.num_steps, train.learning_rate, data): recorded in config_history/")
    parser.add_argument("--quiet", action="store_true",
                        help="print only the final line (and resume/preemption/failure lines): "
                             "--config.train.console=quiet")
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (multi-process)")
    parser.add_argument("--num-processes", type=integer(1), default=None)
    parser.add_argument("--process-id", type=integer(0), default=None)


def load_run_config(args: argparse.Namespace):
    """The --config file with overrides, or the config the run in --workdir trains with (overrides
    applied) when none: a workdir without one is a NotARun error (one line). Not validated here:
    ``Run.open`` validates it once, before anything is read or written."""
    from tieflax.config import apply_override, load_config  # noqa: PLC0415
    from tieflax.run.saved_config import load_workdir_config  # noqa: PLC0415
    from tieflax.run.record import NotARun  # noqa: PLC0415

    if args.config:
        return load_config(args.config, args.overrides, validate=False)
    try:
        config = load_workdir_config(args.workdir)
    except NotARun as e:
        raise NotARun(2, f"{e}; or pass --config, e.g. --config configs/experiments/tiny.py", e.filename) from None
    for item in args.overrides:
        apply_override(config, item)
    return config


def second_stop_line(where, at_step: int) -> str:
    """What a second Ctrl-C lost, read after the stop (the save in flight then has ended or failed).
    ``where``: the run (``Run.dir``; a path is resolved and checked)."""
    from tieflax.run.checkpoints import latest_step  # noqa: PLC0415

    try:
        saved = latest_step(where)
    except Exception:  # noqa: BLE001 (the line must come out even if the checkpoints cannot be listed)
        saved = None
    head = f"stopped at once by a second SIGINT at step {at_step}: "
    if saved is not None and saved >= at_step:
        return head + f"nothing is lost (checkpoint {saved} is saved); rerun the same command to continue"
    if saved is None:
        return head + ("no checkpoint was saved, so its steps are lost; rerun the same command to start again "
                       "(from initial_params/ if the run has them)")
    lost = f"step {at_step} is" if at_step == saved + 1 else f"steps {saved + 1}-{at_step} are"
    return head + (f"{lost} lost (the last checkpoint is step {saved}); rerun the same command to resume from "
                   f"step {saved}")


def run(args: argparse.Namespace) -> int:
    from tieflax.hardware import distributed  # noqa: PLC0415

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    import jax  # noqa: PLC0415

    from tieflax.strict_json import dumps as strict_json  # noqa: PLC0415
    from tieflax.run.run import Run  # noqa: PLC0415
    from tieflax.train import Session, train_run  # noqa: PLC0415

    from tieflax.errors import Interrupted  # noqa: PLC0415
    from tieflax.train import ProcessesStopped  # noqa: PLC0415

    from tieflax.run.checkpoint_errors import quiet_abandoned_reads  # noqa: PLC0415

    # A failed save or write (a full disk) leaves orbax's and tensorstore's pending writes to end on a
    # closed event loop: their "Event loop is closed" tracebacks would bury the one line that says why.
    quiet_abandoned_reads()
    config = load_run_config(args)
    if args.quiet:
        config.train.console = "quiet"
    allow = tuple(f.strip() for item in args.allow_change for f in item.split(",") if f.strip())
    run = None
    try:
        with Run.open(args.workdir, config, allow_change=allow) as run:
            result = train_run(run, Session(config, run.model, run.dir))
    except Interrupted as e:
        if getattr(e, "at_step", None) is None or run is None:
            raise
        raise Interrupted(e.signum, second_stop_line(run.dir, e.at_step)) from None
    except ProcessesStopped as e:
        # Every process stops with this line; orbax's save thread of a healthy process still waits for the
        # failed one at its commit barrier, and joining it at exit would hang: leave without it.
        import sys  # noqa: PLC0415

        print(f"tieflax train: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        distributed.leave_coordinator_last()
        os._exit(1)
    if jax.process_index() == 0:
        print(strict_json(result))  # strict JSON: a figure not measured is null, with its reason
    return 0
