"""The loop: ``train_and_evaluate(config, workdir)`` opens the run and builds the session's compute, and
``train_run(run, session)`` brings the two together: the data checked against the run's record, the
compiled steps, the starting state (the run's newest readable checkpoint, its imported parameters, or
fresh), then step after step with the hooks of ``tieflax.train.hooks`` around each, every process stopping
together.

Two sides meet here. The ``Run`` (``tieflax.run.run``) is what the run really is: its record, checkpoints,
metrics, lock, closing. The ``Session`` (``tieflax.train.session``) is what trains: the mesh, the data, the
steps, evaluation, lm-eval tasks, built from the config and never handed the Run. The step walk itself
(``_walk``) takes the session, the state and the hooks, not the Run; the hooks write into the run."""

from __future__ import annotations

import dataclasses
import math
import signal
from typing import Any

import jax
import ml_collections

from tieflax.hardware import distributed
from tieflax.data.store import StoreChanged
from tieflax.errors import Interrupted
from tieflax.run.run import Run
from tieflax.train.hooks import At, Checkpoints, Evaluation, Hooks, IntervalLog, make_hooks
from tieflax.train.session import Session
from tieflax.train.stop import StopSignal, stop_everywhere
from tieflax.train.val_loss import final_interval_loss, perplexity


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       allow_change: tuple[str, ...] = ()) -> dict[str, Any]:
    """Trains ``config`` in ``workdir`` (resuming from its newest readable checkpoint) and evaluates.

    The config is validated before anything is written; the workdir is locked for the run (a second
    training there refuses) and a workdir whose import was interrupted is refused. A workdir that holds
    a run is continued only with the result fields and data it trained with (``tieflax.run.identity``):
    ``allow_change`` names the fields (or sections, e.g. ``"data"``) that may change on purpose, each
    change recorded as a config-history entry.

    Returns ``{'step', 'final_train_loss', 'final_train_perplexity', 'final_val_loss',
    'final_val_perplexity', 'params': {...counts...}, 'tokens_per_second', 'metrics_path', 'workdir',
    'preempted'}``. Raises ``ConfigError`` before compiling when the config does not fit the mesh, and
    ``TrainingError`` on a non-finite loss or invalid labels (the last good checkpoint is kept).
    """
    with Run.open(workdir, config, allow_change=allow_change) as run:
        return train_run(run, Session(config, run.model, run.dir))


@dataclasses.dataclass
class Progress:
    """Where the session is: the last step trained and its state; whether it stopped on a signal."""
    start: int
    step: int
    state: Any
    preempted: bool = False
    signum: int | None = None  # the signal that stopped it


def train_run(run: Run, session: Session) -> dict[str, Any]:
    """Trains the open ``run`` with ``session`` (built from the config the run was opened with) to
    ``train.num_steps`` and returns the final figures (see ``train_and_evaluate``)."""
    run.adopt_data(session.data.info, session.tokenizer_json)  # refused here when the data changed
    with session.on_mesh():
        session.compile()
        run.open_checkpoints()
        start, state, params = run.restore(session.setup.abstract_state, session.loader)
        if state is None:  # no checkpoint: the run's initial parameters with a fresh optimizer, or all fresh
            state = session.fresh_state(params)
        progress = Progress(start=start, step=start, state=state)
        run.record(start)
        run.open_writers(start)
        hooks = make_hooks(run, session)
        stop = StopSignal(progress=lambda: progress.step)
        run.also_close(stop.close)  # after the Run's parts: a second Ctrl-C while the last save ends is handled
        try:
            _walk(hooks, progress, session, stop)
            if progress.preempted:
                run.say(f"{stop.name} received; checkpoint saved at step {progress.step}; exiting.")
            hooks.end()  # multi-process: the last save, ended (or failed) on every process
        except StoreChanged as e:  # the token store was deleted or replaced under the run: say at which step
            raise e.at_step(progress.step, run.manager.latest_step()) from None
        finally:
            run.close()  # saves.close waits for the last save and raises its error (the OS error last)
        hooks.find(Checkpoints).note_saved()
        val = hooks.find(Evaluation).val
        if val is None and not progress.preempted:
            val = session.evaluate(progress.state["params"])
    return _final(progress, hooks, run.earlier, val, report=session.param_report()) | {
        "metrics_path": run.writer.path, "workdir": run.path, "preempted": progress.preempted}


def _walk(hooks: Hooks, progress: Progress, session: Session, stop: StopSignal) -> None:
    """Step after step to ``train.num_steps``, the hooks around each; a signal (SIGTERM, Ctrl-C) ends the
    walk at a step every process agrees on, with a checkpoint."""
    from tieflax.data import to_global_batch  # noqa: PLC0415

    t = session.config.train
    while progress.step < t.num_steps:
        n = progress.step + 1
        hooks.before(n)
        with hooks.around(n):
            batch = to_global_batch(next(session.loader), session.mesh)
            with distributed.waiting_for_others("the train step", n):   # its collectives span the processes
                progress.state, metrics = session.train_step(progress.state, batch)
        progress.step = n
        hooks.on_step(n, progress.state, metrics)
        at = _at(n, progress.state, t, stop)
        progress.preempted = at.preempted
        hooks.after(at)
        if at.preempted:
            progress.signum = stop.signum
            return


def _at(step: int, state, t: ml_collections.ConfigDict, stop: StopSignal) -> At:
    """Step ``step``'s boundaries, and whether any process was asked to stop (agreed at boundaries)."""
    at_log = step % t.log_every == 0 or step == t.num_steps
    at_ckpt = step % t.checkpoint_every == 0 or step == t.num_steps
    preempted = stop_everywhere(stop, step) if jax.process_count() == 1 or at_log or at_ckpt else False
    return At(step=step, state=state, log=at_log, checkpoint=at_ckpt, last=step == t.num_steps, preempted=preempted)


def _final(progress: Progress, hooks: Hooks, earlier: list[dict], val: dict | None, *,
           report: dict) -> dict[str, Any]:
    """The final figures from the session's own values (the last interval may span a restart: the rows
    logged before it count, read once at the start)."""
    if progress.preempted and progress.signum == signal.SIGINT:  # Ctrl-C: SIGTERM's twin, the shell's 130
        raise Interrupted(signal.SIGINT, f"stopped by SIGINT (Ctrl-C): checkpoint saved at step {progress.step}; "
                                         f"rerun the same command to resume from step {progress.step}")
    log = hooks.find(IntervalLog)
    loss = log.last["ce_loss"]
    rows = earlier + log.rows
    if rows:
        fallback = rows[-1]["ce_loss"] if progress.step == progress.start else loss
        loss = final_interval_loss(rows, progress.step, log.log_every, fallback=fallback)
    # A figure the run did not measure is null, with the reason beside it, never NaN.
    stopped_by = signal.Signals(progress.signum or signal.SIGTERM).name
    missing = {} if val else {"final_val_note": f"stopped by {stopped_by} at step {progress.step} before an "
                                                "evaluation; rerun the same command to finish the run and evaluate it"}
    tokens_per_second = hooks.clock.tokens_per_second()
    return {
        "step": progress.step,
        "final_train_loss": loss,
        "final_train_perplexity": perplexity(loss),
        "final_val_loss": val["loss"] if val else None,
        "final_val_perplexity": val["perplexity"] if val else None,
        **missing,
        "params": report,
        "tokens_per_second": tokens_per_second if math.isfinite(tokens_per_second) else None,
    }
