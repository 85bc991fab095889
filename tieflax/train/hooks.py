"""What the loop does around a step besides training it, one hook per concern (as Levanter's Trainer hooks).

Each hook has up to four moments, all optional, called by ``Hooks`` in the order the hooks were added:

    before(n)                      ahead of step n (the profiler starts its window)
    on_step(step, state, metrics)  right after step ``step`` was dispatched (metrics: device arrays)
    after(at)                      once every process agreed whether to stop (``At``): logging, saves,
                                   diagnostics, evaluation, the metrics segment, lm-eval tasks
    end()                          once the walk ended (every process settles the last save)

The hooks write into the run (``tieflax.run.run.Run``: its console, metric writer, saves, lease, profiler);
what they compute with comes from the session (``tieflax.train.session.Session``) as plain values: the
loader, the evaluation, the tasks, the step's tokens and FLOPs, the config's intervals.

The order in ``make_hooks`` matters: the log interval's health check runs before a save starts (a bad
state is never checkpointed), and lm-eval tasks score after the metrics segment is written (a run killed
while scoring has logged its step). Slow hooks pause the ``Clock`` so step times are training alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from tieflax import storage
from tieflax.hardware import flops
from tieflax.run import checkpoints as ckpt
from tieflax.run.console import device_memory
from tieflax.run.run import Run
from tieflax.train.session import Session
from tieflax.train.step import TrainingError
from tieflax.train.stop import agree_on_saves, agree_on_start, raise_if_any_failed, settle_saves
from tieflax.train.val_loss import perplexity

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class At:
    """Where step ``step`` stands: a log boundary, a checkpoint boundary, the last step, a stop."""
    step: int
    state: Any
    log: bool
    checkpoint: bool
    last: bool
    preempted: bool

    @property
    def boundary(self) -> bool:
        return self.log or self.checkpoint or self.preempted


class Clock:
    """Step time: the wall time between two log intervals' device syncs, less the time spent in slow hooks
    in between (``paused``); the first interval after a start includes compilation and is no throughput."""

    def __init__(self):
        self.t0: float | None = None
        self.tokens = self.seconds = self.paused_for = 0.0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.paused_for += time.perf_counter() - began

    def restart(self) -> None:
        self.t0, self.paused_for = time.perf_counter(), 0.0

    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def _summarise(buffer: list[dict]) -> dict[str, float]:
    """Means of a log interval's per-step metrics (counts summed); fetched from device in one transfer."""
    rows = jax.device_get(buffer)
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    out["invalid_labels"] = float(sum(r["invalid_labels"] for r in rows))
    out["nonfinite"] = float(sum(r["nonfinite"] for r in rows))
    out["perplexity"] = perplexity(out["ce_loss"])
    return out


class IntervalLog:
    """Console: the progress bar and one line per log interval; the interval's row to the metric writer;
    the health check (invalid labels, a non-finite loss). ``rows`` keeps this session's rows and ``last``
    the last interval's means: the final figures come from them, not from reading the metrics back."""

    def __init__(self, run: Run, clock: Clock, *, vocab_size: int, step_flops: float, step_tokens: int,
                 log_every: int):
        self.run, self.clock, self.vocab_size, self.step_flops = run, clock, vocab_size, step_flops
        self.step_tokens, self.log_every = step_tokens, log_every
        self.buffer: list[dict] = []
        self.rows: list[dict] = []
        self.last = {"loss": float("nan"), "ce_loss": float("nan")}

    def on_step(self, step: int, state: Any, metrics: dict) -> None:
        self.buffer.append(metrics)
        self.run.console.update(1)

    def after(self, at: At) -> None:
        if at.boundary:
            self.last = self.flush(at.step)  # also the health check: never checkpoint a bad state

    def flush(self, at_step: int) -> dict:
        rows, self.buffer = self.buffer, []
        summary = _summarise(rows)  # waits for the interval's last step
        first = self._throughput(summary, len(rows))
        summary.update(device_memory(jax.local_devices()))  # where the backend reports it
        self._health_check(summary, at_step)
        # `interval_steps`: how many steps the row averages, so the final loss can span a restart
        row = {**{k: v for k, v in summary.items() if k != "tokens"}, "interval_steps": len(rows)}
        self.run.writer.write(at_step, row)
        self.rows.append({**row, "step": at_step})
        self.run.console.interval(at_step, summary, first_seconds=first, steps=len(rows))
        return summary

    def _throughput(self, summary: dict, steps: int) -> float | None:
        """Adds step time, tokens/s and model TFLOP/s (MFU where the peak is known) to ``summary``; returns
        the seconds since the start instead for the first interval (it includes compilation)."""
        now, c = time.perf_counter(), self.clock
        if c.t0 is None:
            return now - c.started
        tokens = steps * self.step_tokens
        seconds = max(now - c.t0 - c.paused_for, 1e-9)
        c.seconds += seconds
        c.tokens += tokens
        summary["step_time"] = seconds / steps
        summary["tokens_per_second"] = tokens / seconds
        summary["tokens_per_second_per_device"] = tokens / seconds / jax.device_count()
        summary.update(flops.throughput(self.step_flops, seconds / steps, jax.devices()))
        return None

    def _health_check(self, summary: dict, at_step: int) -> None:
        kept = self.run.manager.latest_step()
        if summary["invalid_labels"]:
            raise TrainingError(
                f"step {at_step}: {int(summary['invalid_labels'])} target labels are >= config.model."
                f"vocab_size={self.vocab_size}; the data's tokenizer and the model disagree. Last good "
                f"checkpoint: {kept}.")
        if summary["nonfinite"]:
            raise TrainingError(
                f"step {at_step}: the loss or gradient became NaN/Inf (last logged loss "
                f"{summary['loss']}). Training stopped; the last good checkpoint is step "
                f"{kept}. Lower config.train.learning_rate, raise warmup_steps or "
                "set config.train.z_loss.")


class Checkpoints:
    """Background saves at checkpoint boundaries and on a stop; a failed save stops the run at the next
    step (with several processes: every process at the same step). Checks the lease every step."""

    def __init__(self, run: Run, loader):
        self.run, self.loader = run, loader
        self.announced: int | None = None  # the save whose end is still to be reported

    def note_saved(self) -> None:
        """One line once the save in flight has ended (a failed one raised before this)."""
        if self.announced is not None and self.run.saves.pending != self.announced:
            self.run.console.progress(f"checkpoint of step {self.announced} saved: "
                                      f"{ckpt.CHECKPOINT_DIR}/{self.announced}")
            self.announced = None

    def after(self, at: At) -> None:
        saves, single = self.run.saves, jax.process_count() == 1
        save_now = at.checkpoint or at.preempted
        # A failed background save stops the run here, not hundreds of steps on.
        if single:
            saves.check(at.step)
        elif save_now:
            settle_saves(saves)  # before orbax starts the next save (it would wait for this one)
        elif at.log:
            agree_on_saves(saves)  # a failed or stalled save on any process stops every one here
        self.note_saved()
        self.run.held.check()  # the workdir's lease (object stores) is still this run's
        if not save_now:
            return
        if single:
            saves.start(at.step, at.state, self.loader)
        else:  # a save refused, or stalled, at its start on any process stops every one
            try:
                saves.start(at.step, at.state, self.loader)
                refused = None
            except ckpt.CheckpointError as e:
                refused = e
            agree_on_start(refused, saves)
        self.note_saved()  # starting this save waited for the one before
        self.announced = at.step

    def end(self) -> None:
        """Multi-process: the last save, ended (or failed) on every process (a single process waits for it
        when the Run closes its saves)."""
        if jax.process_count() > 1:
            settle_saves(self.run.saves)  # the last save, ended (or failed) on every process


def _diagnostics_fn():
    """``tieflax.analysis.training_diagnostics`` when that module provides it, else None."""
    try:
        from tieflax import analysis  # noqa: PLC0415

        return getattr(analysis, "training_diagnostics", None)
    except ImportError:
        return None


class Diagnostics:
    """Every ``analyze_every`` steps: the embedding/head geometry scalars of ``tieflax.analysis``."""

    def __init__(self, run: Run, clock: Clock, fn: Callable, token_counts, *, every: int):
        self.run, self.clock, self.fn, self.token_counts, self.every = run, clock, fn, token_counts, every

    def after(self, at: At) -> None:
        if at.step % self.every == 0:
            with self.clock.paused():
                scalars = self.fn(at.state["params"], self.token_counts)
            self.run.writer.write(at.step, {k.removeprefix("diag/"): v for k, v in scalars.items()}, split="diag")


class Evaluation:
    """The validation loss every ``eval_every`` steps and at the last; ``val`` holds the latest."""

    def __init__(self, run: Run, clock: Clock, evaluate: Callable[[Any], dict], *, every: int):
        self.run, self.clock, self.evaluate, self.every = run, clock, evaluate, every
        self.val: dict | None = None

    def after(self, at: At) -> None:
        if at.step % self.every == 0 or at.last:
            with self.clock.paused():
                self.val = self.evaluate(at.state["params"])
            self.run.writer.write(at.step, self.val, split="val")


class MetricsSegment:
    """One metrics segment per log period (and on a stop)."""

    def __init__(self, run: Run):
        self.run = run

    def after(self, at: At) -> None:
        if not (at.log or at.preempted):
            return
        if jax.process_count() == 1:
            self.run.writer.flush()
            return
        # A bucket that stops answering fails process 0's metrics write (at the storage deadline) while
        # the others go on to the next collective and wait there (until JAX's heartbeat timeout, then a
        # crash): one agreement here stops every process at this log step, each with the same line
        # (tests/test_storage_deadline.py).
        try:
            self.run.writer.flush()
            lost = None
        except storage.StorageError as e:
            lost = e
        raise_if_any_failed(lost, self.run.saves)


class Tasks:
    """lm-eval tasks (``train.eval_tasks``) scored on the live parameters at the last step and every
    ``eval_tasks_every`` steps; skipped on a stop."""

    def __init__(self, run: Run, clock: Clock, tasks, *, every: int):
        self.run, self.clock, self.tasks, self.every = run, clock, tasks, every

    def after(self, at: At) -> None:
        every = self.every
        if at.preempted or not (at.last or (every and at.step % every == 0)):
            return
        with self.clock.paused():
            scores = self.tasks.score(at.state["params"], at.step)
        self.run.writer.write(at.step, scores, split="tasks")
        self.run.writer.flush()
        self.run.say(f"tasks at step {at.step}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in scores.items() if not k.endswith("_stderr")))


class Profiler:
    """The profiler's window (``train.profile_steps``): started ahead of its first step, each step
    annotated, the trace written once its last step ended on the device (not counted as step time). The run
    keeps the last step trained: its window, if still open, closes there."""

    def __init__(self, run: Run, clock: Clock):
        self.run, self.clock = run, clock

    def before(self, n: int) -> None:
        self.run.profiler.before(n)

    def around(self, n: int):
        return self.run.profiler.step(n)

    def on_step(self, step: int, state: Any, metrics: dict) -> None:
        self.run.step = step
        if self.run.profiler.ends_at(step):
            jax.block_until_ready(state)
            with self.clock.paused():
                self.run.profiler.after(step, state)


class Hooks:
    """The hooks of one training session, called in the order they were added."""

    def __init__(self, clock: Clock, *hooks):
        self.clock, self.hooks = clock, [h for h in hooks if h is not None]

    def find(self, kind: type):
        return next(h for h in self.hooks if isinstance(h, kind))

    def before(self, n: int) -> None:
        for h in self.hooks:
            getattr(h, "before", _nothing)(n)

    def around(self, n: int):
        return self.find(Profiler).around(n)

    def on_step(self, step: int, state: Any, metrics: dict) -> None:
        for h in self.hooks:
            getattr(h, "on_step", _nothing)(step, state, metrics)

    def after(self, at: At) -> None:
        for h in self.hooks:
            getattr(h, "after", _nothing)(at)
        if at.boundary:  # the next interval's time starts after this bookkeeping
            self.clock.restart()

    def end(self) -> None:
        for h in self.hooks:
            getattr(h, "end", _nothing)()


def _nothing(*args) -> None:
    return None


def make_hooks(run: Run, session: Session) -> Hooks:
    """The session's hooks in their order (see the module's docstring for why this order): each writes into
    ``run`` what it takes from ``session``."""
    t, clock = session.config.train, Clock()
    diagnostics = _diagnostics_fn() if t.analyze_every else None
    if diagnostics is not None and jax.process_count() > 1:
        # The diagnostics read whole matrices on the host, which one process of many does not hold.
        log.warning("config.train.analyze_every is ignored in multi-process runs; analyse checkpoints "
                    "with `tieflax analyze` instead")
        diagnostics = None
    return Hooks(
        clock,
        Profiler(run, clock),
        IntervalLog(run, clock, vocab_size=session.model.vocab_size, step_flops=session.step_flops(),
                    step_tokens=t.global_batch_size * t.seq_len, log_every=t.log_every),
        Checkpoints(run, session.loader),
        Diagnostics(run, clock, diagnostics, session.data.token_counts, every=t.analyze_every)
        if diagnostics is not None else None,
        Evaluation(run, clock, session.evaluate, every=t.eval_every),
        MetricsSegment(run),
        Tasks(run, clock, session.tasks, every=t.eval_tasks_every) if session.tasks is not None else None,
    )
