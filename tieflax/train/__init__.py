"""Training: ``train_and_evaluate(config, workdir)``, the step apart from the loop.

    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny     # rerun to resume
    tieflax val-loss --workdir /tmp/tiny

or from Python / a notebook::

    from tieflax.config import load_config
    from tieflax.train import train_and_evaluate
    result = train_and_evaluate(load_config("configs/experiments/tiny.py"), "/tmp/tiny")

The same code runs one CPU process or a pod: parameters, optimizer state and batches are laid out on a
``(data, fsdp, tensor)`` mesh by the logical-axis rules of ``tieflax.sharding``.

Rooms: ``step`` (``build``, ``make_train_step``, ``make_eval_step``, the loss options, the mesh check),
``session`` (``Session``: the compute side, built from the config: mesh, data, steps, evaluation, tasks),
``loop`` (``train_and_evaluate``; ``train_run(run, session)`` trains a ``tieflax.run.run.Run`` opened by the
caller with a ``Session`` of the config it was opened with),
``hooks`` (logging, checkpoints, diagnostics, evaluation, lm-eval tasks, profiler around each step),
``validation`` (``run_eval``, ``evaluate_run``, the final interval's loss), ``stop`` (signals, every
process stopping at the same step, saves settling).
"""

from tieflax.train.loop import train_and_evaluate, train_run
from tieflax.train.session import Session
from tieflax.train.step import (BATCH_KEYS, Setup, TrainingError, build, check_fits_mesh, loss_options,
                                make_eval_step, make_train_step, setup_mesh)
from tieflax.train.stop import ProcessesStopped
from tieflax.train.val_loss import evaluate_run, final_interval_loss, perplexity, run_eval

evaluate = evaluate_run  # the name before train/ (a run's validation loss; lm-eval is tieflax.eval)

__all__ = ["BATCH_KEYS", "ProcessesStopped", "Session", "Setup", "TrainingError", "build", "check_fits_mesh", "evaluate",
           "evaluate_run", "final_interval_loss", "loss_options", "make_eval_step", "make_train_step", "perplexity",
           "run_eval", "setup_mesh", "train_and_evaluate", "train_run"]
