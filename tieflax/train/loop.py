"""The loop: ``train_and_evaluate(config, workdir)`` trains (resuming from the newest readable checkpoint),
logs, checkpoints, evaluates and stops together on every process."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tieflax.hardware import flops
from tieflax import sharding as shd
from tieflax import storage
from tieflax.config import model_config, validate_config
from tieflax.data.store import StoreChanged
from tieflax.errors import Interrupted
from tieflax.model.params import param_report
from tieflax.run import checkpoints as ckpt
from tieflax.run import identity, layout
from tieflax.run.console import Console, device_memory
from tieflax.run.layout import TOKENIZER_FILE
from tieflax.run.metrics import MetricWriter, metric_files, read_metrics
from tieflax.run.profiler import ProfileWindow
from tieflax.run.trackers import check_installed, open_trackers
from tieflax.train.step import TrainingError, build, make_eval_step, make_train_step, setup_mesh
from tieflax.train.stop import (StopSignal, close_all, raise_if_any_failed, settle_saves,
                                stop_everywhere)
from tieflax.train.validation import final_interval_loss, perplexity, run_eval

log = logging.getLogger(__name__)


def _summarise(buffer: list[dict]) -> dict[str, float]:
    """Means of a log interval's per-step metrics (counts summed); fetched from device in one transfer."""
    rows = jax.device_get(buffer)
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    out["invalid_labels"] = float(sum(r["invalid_labels"] for r in rows))
    out["nonfinite"] = float(sum(r["nonfinite"] for r in rows))
    out["perplexity"] = perplexity(out["ce_loss"])
    return out


def _diagnostics_fn():
    """``tieflax.analysis.training_diagnostics`` when that module provides it, else None."""
    try:
        from tieflax import analysis  # noqa: PLC0415

        return getattr(analysis, "training_diagnostics", None)
    except ImportError:
        return None


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
    from tieflax.run.destinations import check_no_partial_import  # noqa: PLC0415
    from tieflax.run.lock import workdir_lock  # noqa: PLC0415

    workdir = storage.resolve(workdir)  # a malformed URL is refused here, before any work
    validate_config(config)
    check_no_partial_import(workdir)
    with workdir_lock(workdir, "train", enabled=jax.process_index() == 0) as held:
        return _train_and_evaluate(config, workdir, held, tuple(allow_change))


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, held,
                        allow_change: tuple[str, ...]) -> dict[str, Any]:
    from tieflax.data import make_loader, prepare_dataset, to_global_batch  # noqa: PLC0415

    t = config.train
    is_main = jax.process_index() == 0
    check_installed(t.trackers)  # a missing tracker package fails before any work, on every process

    # ---------------------------------------------------------------------------------------- mesh
    mc = model_config(config)
    report = param_report(mc).as_dict()
    mesh = setup_mesh(config)
    resume = identity.check_resume(workdir, config, allow_change=allow_change, data_next=True)  # before any write

    # ---------------------------------------------------------------------------------------- input
    prepared = prepare_dataset(config.data, workdir, vocab_size=mc.vocab_size)
    tokenizer_json = prepared.tokenizer.to_str() if prepared.tokenizer is not None else None
    data = identity.data_record(prepared.info, tokenizer_json)
    identity.check_data(workdir, data, resume)
    tokenizer_path = layout.path(workdir, TOKENIZER_FILE)
    if is_main and tokenizer_json is not None and not storage.is_file(tokenizer_path):
        storage.write_text(tokenizer_path, tokenizer_json)
    train_loader = make_loader(prepared, "train", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                               seed=config.seed)

    # ------------------------------------------------------------------------- model, sharding, update
    # The rules map the logical names of parameters and activations onto the mesh; inside the mesh
    # context the activations' `with_logical_constraint`s take effect.
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        train_step = make_train_step(config, s)
        eval_step = make_eval_step(config, s)

        # ------------------------------------------------------------------------------ checkpoint
        manager = ckpt.make_manager(workdir, keep=t.keep_checkpoints)
        say = (lambda line: print(f"tieflax: {line}", flush=True)) if is_main else (lambda line: None)
        start, state = ckpt.restore_newest_readable(manager, workdir, s.abstract_state, train_loader, say=say)
        if start is not None:
            say(f"resuming from step {start} ({ckpt.CHECKPOINT_DIR}/{start})")
        elif ckpt.has_initial_params(workdir):
            params = ckpt.load_initial_params(workdir, s.abstract_state["params"])
            state = {"step": jax.device_put(jnp.zeros((), jnp.int32), s.state_shardings["step"]),
                     "params": params, "opt_state": s.init_opt_state(params)}
            start = 0
            say(f"starting from {ckpt.INITIAL_PARAMS_DIR}/ (imported or converted parameters) at step 0: a fresh "
                "optimizer state and schedule, and the data from its first batch")
        else:
            state = s.init_state(jax.random.key(config.seed))
            start = 0
        identity.record(workdir, config, data, resume, start)  # config.json once; a change as a history entry
        if resume.changed and not resume.before_first_step:
            say(f"changed on purpose from step {start} on ({identity.CONFIG_HISTORY_DIR}/): "
                + "; ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in resume.changed.items()))

        # ------------------------------------------------------------------- console, trackers, profiler
        console = Console(t.console, t.num_steps, start, enabled=is_main)
        say = console.event
        writer = MetricWriter(workdir, enabled=is_main, trackers=open_trackers(
            t.trackers, workdir, config, enabled=is_main, say=say))
        profiler = ProfileWindow(t.profile_steps, workdir, enabled=is_main, say=say)
        tasks = None
        if t.eval_tasks:  # lm-eval on the live parameters (an unknown task fails here, before training)
            from tieflax.eval.tasks import TrainingTasks  # noqa: PLC0415

            tasks = TrainingTasks(config, mc, prepared.tokenizer, mesh, workdir, write=is_main)
        step_model_flops = flops.step_flops(mc, t.global_batch_size, t.seq_len).train
        stop = StopSignal(progress=lambda: step)
        diagnostics = _diagnostics_fn() if t.analyze_every else None
        if diagnostics is not None and jax.process_count() > 1:
            # The diagnostics read whole matrices on the host, which one process of many does not hold.
            log.warning("config.train.analyze_every is ignored in multi-process runs; analyse checkpoints "
                        "with `tieflax analyze` instead")
            diagnostics = None
        if is_main and start == 0:
            writer.write_text("config", "```\n" + config.to_json_best_effort(indent=2) + "\n```")

        # ------------------------------------------------------------------------------------ loop
        buffer: list[dict] = []
        last = {"loss": float("nan"), "ce_loss": float("nan")}
        val = None
        preempted = False
        # Step time is the wall time between two log intervals' device syncs, less the time spent on
        # evaluations, scoring and diagnostics in between (``paused``); the first interval after a start
        # includes compilation and is not a throughput.
        timing = {"t0": None, "tokens": 0.0, "seconds": 0.0, "paused": 0.0, "started": time.perf_counter()}
        step = start
        saves = ckpt.SaveWatch(manager)
        announced = {"step": None}  # the save whose end is still to be reported

        @contextlib.contextmanager
        def paused():
            began = time.perf_counter()
            try:
                yield
            finally:
                timing["paused"] += time.perf_counter() - began

        def note_saved():
            """One line once the save in flight has ended (a failed one raised before this)."""
            if announced["step"] is not None and saves.pending != announced["step"]:
                console.progress(f"checkpoint of step {announced['step']} saved: "
                                 f"{ckpt.CHECKPOINT_DIR}/{announced['step']}")
                announced["step"] = None

        def health_check(summary: dict, at_step: int):
            if summary["invalid_labels"]:
                raise TrainingError(
                    f"step {at_step}: {int(summary['invalid_labels'])} target labels are >= config.model."
                    f"vocab_size={mc.vocab_size}; the data's tokenizer and the model disagree. Last good "
                    f"checkpoint: {manager.latest_step()}.")
            if summary["nonfinite"]:
                raise TrainingError(
                    f"step {at_step}: the loss or gradient became NaN/Inf (last logged loss "
                    f"{summary['loss']}). Training stopped; the last good checkpoint is step "
                    f"{manager.latest_step()}. Lower config.train.learning_rate, raise warmup_steps or "
                    "set config.train.z_loss.")

        def flush(at_step: int) -> dict:
            nonlocal buffer
            rows = buffer
            summary = _summarise(buffer)  # waits for the interval's last step
            now = time.perf_counter()
            first = None
            if timing["t0"] is not None:  # the first interval includes compilation: not a throughput
                tokens = len(buffer) * t.global_batch_size * t.seq_len
                seconds = max(now - timing["t0"] - timing["paused"], 1e-9)
                timing["seconds"] += seconds
                timing["tokens"] += tokens
                summary["step_time"] = seconds / len(buffer)
                summary["tokens_per_second"] = tokens / seconds
                summary["tokens_per_second_per_device"] = tokens / seconds / jax.device_count()
                # model TFLOP/s per device, and MFU where the devices' peak is known (tieflax/hardware/flops.py)
                summary.update(flops.throughput(step_model_flops, seconds / len(buffer), jax.devices()))
            else:
                first = now - timing["started"]
            summary.update(device_memory(jax.local_devices()))  # where the backend reports it
            buffer = []
            health_check(summary, at_step)
            # `interval_steps`: how many steps the row averages, so the final loss can span a restart
            row = {k: v for k, v in summary.items() if k != "tokens"}
            writer.write(at_step, {**row, "interval_steps": len(rows)})
            console.interval(at_step, summary, first_seconds=first, steps=len(rows))
            return summary

        try:
            while step < t.num_steps:
                profiler.before(step + 1)
                with profiler.step(step + 1):
                    batch = to_global_batch(next(train_loader), mesh)
                    state, metrics = train_step(state, batch)
                buffer.append(metrics)
                step += 1
                if profiler.ends_at(step):  # the traced steps end on the device; writing the trace is no step
                    jax.block_until_ready(state)
                    with paused():
                        profiler.after(step, state)
                console.update(1)
                at_log = step % t.log_every == 0 or step == t.num_steps
                at_ckpt = step % t.checkpoint_every == 0 or step == t.num_steps
                if jax.process_count() == 1 or at_log or at_ckpt:
                    preempted = stop_everywhere(stop.requested)
                if at_log or at_ckpt or preempted:
                    last = flush(step)  # also the health check: never checkpoint a bad state
                # A failed background save stops the run here, not hundreds of steps on; with several
                # processes, a save that failed on any one of them stops every one at the same step.
                if jax.process_count() == 1:
                    saves.check(step)
                elif at_ckpt or preempted:
                    settle_saves(saves)  # before orbax starts the next save (it would wait for this one)
                elif at_log:
                    raise_if_any_failed(saves.failure(wait=False), saves)
                note_saved()
                held.check()  # the workdir's lease (object stores) is still this run's
                if (at_ckpt or preempted) and jax.process_count() == 1:
                    saves.start(step, state, train_loader)
                elif at_ckpt or preempted:  # a save refused at its start on any process stops every one
                    try:
                        saves.start(step, state, train_loader)
                        refused = None
                    except ckpt.CheckpointError as e:
                        refused = e
                    raise_if_any_failed(refused, saves)
                if at_ckpt or preempted:
                    note_saved()  # starting this save waited for the one before
                    announced["step"] = step
                if diagnostics is not None and step % t.analyze_every == 0:
                    with paused():
                        scalars = diagnostics(state["params"], prepared.token_counts)
                    writer.write(step, {k.removeprefix("diag/"): v for k, v in scalars.items()}, split="diag")
                if step % t.eval_every == 0 or step == t.num_steps:
                    with paused():
                        val = run_eval(eval_step, state["params"], prepared, config, mesh)
                    writer.write(step, val, split="val")
                if (at_log or preempted) and jax.process_count() == 1:
                    writer.flush()  # one metrics segment per log period
                elif at_log or preempted:
                    # A bucket that stops answering fails process 0's metrics write (at the storage deadline)
                    # while the others go on to the next collective and wait there (until JAX's heartbeat
                    # timeout, then a crash): one agreement here stops every process at this log step, each
                    # with the same line (tests/test_storage_deadline.py).
                    try:
                        writer.flush()
                        lost = None
                    except storage.StorageError as e:
                        lost = e
                    raise_if_any_failed(lost, saves)
                if tasks is not None and not preempted and (
                        step == t.num_steps or (t.eval_tasks_every and step % t.eval_tasks_every == 0)):
                    with paused():  # after the flush: a run killed while scoring has logged this step
                        scores = tasks.score(state["params"], step)
                    writer.write(step, scores, split="tasks")
                    writer.flush()
                    say(f"tasks at step {step}: " + ", ".join(
                        f"{k} {v:.4f}" for k, v in scores.items() if not k.endswith("_stderr")))
                if at_log or at_ckpt or preempted:  # the next interval's time starts after this bookkeeping
                    timing["t0"], timing["paused"] = time.perf_counter(), 0.0
                if preempted:
                    if is_main:
                        print(f"tieflax: {stop.name} received; checkpoint saved at step {step}; exiting.",
                              flush=True)
                    break
            if jax.process_count() > 1:
                settle_saves(saves)  # the last save, ended (or failed) on every process
        except StoreChanged as e:  # the token store was deleted or replaced under the run: say at which step
            raise e.at_step(step, manager.latest_step()) from None
        finally:
            # Every resource is closed; the first failure is raised unless one is already on its way
            # (a full disk also fails the metric files' close: the failed save is the error to report).
            close_all(lambda: profiler.close(step), console.close, writer.close, saves.close,
                       stop.close)  # saves.close waits for the last save, raises its error (the OS error last)
        note_saved()

        if val is None and not preempted:
            val = run_eval(eval_step, state["params"], prepared, config, mesh)

    if preempted and stop.signum == signal.SIGINT:  # Ctrl-C: SIGTERM's twin, ending as the shell's 130
        raise Interrupted(signal.SIGINT, f"stopped by SIGINT (Ctrl-C): checkpoint saved at step {step}; rerun "
                                         f"the same command to resume from step {step}")
    if metric_files(workdir):  # the last interval's loss across restarts, from the logged rows
        logged = read_metrics(workdir, "train")
        fallback = logged[-1]["ce_loss"] if step == start and logged else last["ce_loss"]
        last = {**last, "ce_loss": final_interval_loss(logged, step, t.log_every, fallback=fallback)}
    tokens_per_second = timing["tokens"] / timing["seconds"] if timing["seconds"] else float("nan")
    return {
        "step": step,
        "final_train_loss": last["ce_loss"],
        "final_train_perplexity": perplexity(last["ce_loss"]),
        "final_val_loss": val["loss"] if val else float("nan"),
        "final_val_perplexity": val["perplexity"] if val else float("nan"),
        "params": report,
        "tokens_per_second": tokens_per_second,
        "metrics_path": writer.path,
        "workdir": workdir,
        "preempted": preempted,
    }
