"""The loop: ``train_and_evaluate(config, workdir)`` opens the run and ``train_run(run)`` walks it: the
input, the compiled steps, the starting state (the newest readable checkpoint, imported parameters, or
fresh), then step after step with the hooks of ``tieflax.train.hooks`` around each, every process
stopping together."""

from __future__ import annotations

import dataclasses
import math
import signal
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from tieflax.hardware import flops
from tieflax.hardware import distributed
from tieflax import sharding as shd
from tieflax.data.store import StoreChanged
from tieflax.errors import Interrupted
from tieflax.model.params import param_report
from tieflax.run import checkpoints as ckpt
from tieflax.run.run import Run
from tieflax.train.hooks import At, Checkpoints, Evaluation, Hooks, IntervalLog, make_hooks
from tieflax.train.step import build, make_eval_step, make_train_step, setup_mesh
from tieflax.train.stop import StopSignal, settle_saves, stop_everywhere
from tieflax.train.val_loss import final_interval_loss, perplexity, run_eval


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
        return train_run(run)


@dataclasses.dataclass
class Progress:
    """Where the session is: the last step trained and its state; whether it stopped on a signal."""
    start: int
    step: int
    state: Any
    preempted: bool = False
    signum: int | None = None  # the signal that stopped it


def train_run(run: Run) -> dict[str, Any]:
    """Trains the open ``run`` to ``train.num_steps`` and returns the final figures (see
    ``train_and_evaluate``)."""
    from tieflax.data import make_loader, prepare_dataset  # noqa: PLC0415

    config, t, mc = run.config, run.config.train, run.model
    mesh = setup_mesh(config)
    prepared = prepare_dataset(config.data, run.path, vocab_size=mc.vocab_size)
    run.adopt_data(prepared.info, prepared.tokenizer.to_str() if prepared.tokenizer is not None else None)
    loader = make_loader(prepared, "train", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                         seed=config.seed)
    # The rules map the logical names of parameters and activations onto the mesh; inside the mesh
    # context the activations' `with_logical_constraint`s take effect.
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        eval_step = make_eval_step(config, s)
        evaluate = lambda params: run_eval(eval_step, params, prepared, config, mesh)  # noqa: E731
        run.open_checkpoints()
        progress = _starting_state(run, s, loader)
        run.record(progress.start)
        earlier = run.logged_train_rows()  # before this session writes: its last interval may span a restart
        run.open_writers(progress.start)
        step_flops = flops.step_flops(mc, t.global_batch_size, t.seq_len).train
        hooks = make_hooks(run, loader=loader, prepared=prepared, evaluate=evaluate, vocab_size=mc.vocab_size,
                           tasks=_tasks(run, mc, prepared, mesh), step_flops=step_flops)
        _walk(run, hooks, progress, make_train_step(config, s), loader, mesh)
        val = hooks.find(Evaluation).val
        if val is None and not progress.preempted:
            val = evaluate(progress.state["params"])
    return _final(run, progress, hooks, earlier, val, report=param_report(mc).as_dict())


def _tasks(run: Run, mc, prepared, mesh):
    """lm-eval on the live parameters (an unknown task fails here, before training), or None."""
    if not run.config.train.eval_tasks:
        return None
    from tieflax.eval.tasks import TrainingTasks  # noqa: PLC0415

    return TrainingTasks(run.config, mc, prepared.tokenizer, mesh, run.dir, write=run.is_main)


def _starting_state(run: Run, s, loader) -> Progress:
    """The newest readable checkpoint, else the run's initial parameters (imports, surgery) with a fresh
    optimizer, else a fresh state from ``config.seed``."""
    start, state = ckpt.restore_newest_readable(run.manager, run.dir, s.abstract_state, loader, say=run.say)
    if start is not None and start >= run.config.train.num_steps:  # a rerun of a finished run: nothing trains
        run.say(f"finished before, at step {start} ({ckpt.CHECKPOINT_DIR}/{start}): nothing to train")
    elif start is not None:
        run.say(f"resuming from step {start} ({ckpt.CHECKPOINT_DIR}/{start})")
    else:  # no checkpoint finished: one begun and never finished (killed mid-save) is said, not passed over
        unfinished = ckpt.unfinished_steps(run.dir)
        why = (f"checkpoint {unfinished[-1]} ({ckpt.CHECKPOINT_DIR}/{unfinished[-1]}) was never finished: the run "
               "was stopped while saving it") if unfinished else ""
        start = 0
        if ckpt.has_initial_params(run.dir):
            params = ckpt.load_initial_params(run.dir, s.abstract_state["params"])
            state = {"step": jax.device_put(jnp.zeros((), jnp.int32), s.state_shardings["step"]),
                     "params": params, "opt_state": s.init_opt_state(params)}
            run.say(f"starting from {ckpt.INITIAL_PARAMS_DIR}/ (imported or converted parameters) at step 0"
                    f"{f' ({why})' if why else ''}: a fresh optimizer state and schedule, and the data from its first batch")
        else:
            state = s.init_state(jax.random.key(run.config.seed))
            if why:
                run.say(f"starting from step 0: {why}")
    return Progress(start=start, step=start, state=state)


def _walk(run: Run, hooks: Hooks, progress: Progress, train_step, loader, mesh) -> None:
    """Step after step to ``train.num_steps``, the hooks around each; a signal (SIGTERM, Ctrl-C) ends the
    walk at a step every process agrees on, with a checkpoint. The Run's parts are closed on the way out."""
    from tieflax.data import to_global_batch  # noqa: PLC0415

    t = run.config.train
    stop = StopSignal(progress=lambda: progress.step)
    run.also_close(stop.close)
    try:
        while progress.step < t.num_steps:
            n = progress.step + 1
            hooks.before(n)
            with hooks.around(n):
                batch = to_global_batch(next(loader), mesh)
                with distributed.waiting_for_others("the train step", n):   # its collectives span the processes
                    progress.state, metrics = train_step(progress.state, batch)
            progress.step = n
            hooks.on_step(n, progress.state, metrics)
            at = _at(n, progress.state, t, stop)
            progress.preempted = at.preempted
            run.step = n
            hooks.after(at)
            if at.preempted:
                progress.signum = stop.signum
                run.say(f"{stop.name} received; checkpoint saved at step {n}; exiting.")
                break
        if jax.process_count() > 1:
            settle_saves(run.saves)  # the last save, ended (or failed) on every process
    except StoreChanged as e:  # the token store was deleted or replaced under the run: say at which step
        raise e.at_step(progress.step, run.manager.latest_step()) from None
    finally:
        run.close()  # saves.close waits for the last save and raises its error (the OS error last)
    hooks.find(Checkpoints).note_saved()


def _at(step: int, state, t: ml_collections.ConfigDict, stop: StopSignal) -> At:
    """Step ``step``'s boundaries, and whether any process was asked to stop (agreed at boundaries)."""
    at_log = step % t.log_every == 0 or step == t.num_steps
    at_ckpt = step % t.checkpoint_every == 0 or step == t.num_steps
    preempted = stop_everywhere(stop, step) if jax.process_count() == 1 or at_log or at_ckpt else False
    return At(step=step, state=state, log=at_log, checkpoint=at_ckpt, last=step == t.num_steps, preempted=preempted)


def _final(run: Run, progress: Progress, hooks: Hooks, earlier: list[dict], val: dict | None, *,
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
        loss = final_interval_loss(rows, progress.step, run.config.train.log_every, fallback=fallback)
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
        "metrics_path": run.writer.path,
        "workdir": run.path,
        "preempted": progress.preempted,
    }
