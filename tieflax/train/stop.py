"""Stopping: signals (SIGTERM, Ctrl-C), every process stopping at the same step, saves settling on every
process. (Closing every resource on the way out is the Run's: ``tieflax.run.run.Run.close``.)"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np

from tieflax import storage
from tieflax.errors import Interrupted
from tieflax.run import checkpoints as ckpt


class StopSignal:
    """SIGTERM, or a first SIGINT (Ctrl-C), is recorded so the loop can finish the step, checkpoint and
    exit (SIGTERM: 0, SIGINT: 130 by :class:`Interrupted`); a second SIGINT stops at once, raising
    :class:`Interrupted` where the program is (``at_step``: the last step trained). ``progress()`` gives
    the step reached. Restores the previous handlers on close."""

    def __init__(self, progress: Callable[[], int] | None = None):
        self.requested = False
        self.signum: int | None = None
        self._progress = progress
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            for s in self._previous:  # once: the clean-up on the way out (lock, last save) runs whole
                signal.signal(s, signal.SIG_IGN)
            try:
                step = self._progress() if self._progress else None
            except NameError:  # before the loop's first step
                step = None
            e = Interrupted(signal.SIGINT, "stopped at once by a second SIGINT"
                            + (f" at step {step}" if step is not None else "")
                            + ": the steps after the last finished checkpoint are lost; rerun the same "
                            "command to resume from that checkpoint")
            e.at_step = step
            raise e
        if not self.requested:
            self.signum = signum
        self.requested = True
        if signum == signal.SIGINT:
            print("tieflax: SIGINT (Ctrl-C): saving a checkpoint after this step, then exiting; Ctrl-C again "
                  "stops at once, losing the steps since the last checkpoint", file=sys.stderr, flush=True)

    def close(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


_SIGNALS = (None, signal.SIGTERM, signal.SIGINT)   # agreed by index: a SIGINT anywhere outranks a SIGTERM


def stop_everywhere(stop: StopSignal, step: int | None = None) -> bool:
    """True on every process if any process saw SIGTERM or SIGINT: all stop at this step, and all take
    the signal as theirs (a SIGINT reaching one process ends every one with 130, as there). The wait for
    the others is bounded (``tieflax.hardware.distributed.waiting_for_others``)."""
    if jax.process_count() == 1:
        return stop.requested
    from jax.experimental import multihost_utils  # noqa: PLC0415

    from tieflax.hardware import distributed  # noqa: PLC0415

    local = _SIGNALS.index(stop.signum if stop.requested and stop.signum in _SIGNALS else None)
    with distributed.waiting_for_others("the stop check", step):
        agreed = int(np.max(multihost_utils.process_allgather(np.int32(local))))
    if agreed:
        stop.requested, stop.signum = True, _SIGNALS[agreed]
    return bool(agreed)


class ProcessesStopped(ckpt.CheckpointError):
    """A save failed on some process and every process stopped at the same step. Orbax's save thread may
    still wait for the failed process at its commit barrier: the command exits without joining it."""


def settle_saves(saves: ckpt.SaveWatch) -> None:
    """Multi-process: waits until the pending save has ended on every process, all processes polling
    together, and raises on all of them as soon as it failed on any. (A blocking wait would hang: the
    healthy processes' saves wait for the failed one at orbax's commit barrier.)"""
    while agree_on_saves(saves):
        time.sleep(0.05)


# What each process tells the others about the pending save, in one collective (bits of an int32).
PENDING, UNWRITTEN, FAILED, LATE = 1, 2, 4, 8


def agree_on_saves(saves: ckpt.SaveWatch) -> bool:
    """Every process calls this at the same point (one collective): True while the pending save still runs
    on some process; raises ProcessesStopped on every process, with the same line, when it failed on any,
    or ran past the checkpoint deadline on any. That line names the processes whose own share of the save
    is not written (their storage stopped answering; the others only wait for them at orbax's barrier),
    unless it is every process (the bucket itself stopped answering)."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    unwritten = saves.pending is not None and not ckpt.OWN_SHARE.written
    error = saves.failure(wait=False)
    late = isinstance(error, ckpt.SaveDeadlinePassed)
    code = ((PENDING if saves.pending is not None else 0) | (UNWRITTEN if unwritten else 0)
            | (LATE if late else 0) | (FAILED if error is not None and not late else 0))
    from tieflax.hardware import distributed  # noqa: PLC0415

    with distributed.waiting_for_others(f"the check of checkpoint {saves.pending}"
                                        if saves.pending is not None else "the check of the last save"):
        codes = [int(c) for c in np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1)]
    if any(c & FAILED for c in codes):
        raise_if_any_failed(None if late else error, saves)
    if any(c & LATE for c in codes):
        saves.abandon()
        raise ProcessesStopped(late_line(saves, error if late else None, codes)) from error
    return any(c & PENDING for c in codes)


def late_line(saves: ckpt.SaveWatch, error: "ckpt.SaveDeadlinePassed | None", codes: list[int]) -> str:
    """The same line on every process: the checkpoint deadline passed, naming the processes still writing
    their share when some are and some are not, or process 0 when every share is written (what is left of
    a save then, its commit marker and the removal of checkpoints past ``keep_checkpoints``, is orbax's
    primary process's alone; the others wait for it). A process not late itself builds the line from its
    own save: the same step and place, and the deadline every process reads from the same setting. Its save
    may have ended meanwhile (nothing pending): the step is then the last one it started, the same save."""
    if error is not None:
        text = str(error)
    else:
        step = saves.pending if saves.pending is not None else saves.last_started
        text = storage.no_answer(saves.where, f"finish checkpoint {step} in", ckpt.save_deadline_seconds(),
                                 ckpt.SAVE_DEADLINE_ENV)
    stalled = [i for i, c in enumerate(codes) if c & UNWRITTEN]
    if len(stalled) == len(codes):
        return text
    if not stalled:
        return f"process 0 (finishing the save: its commit marker, old checkpoints' removal): {text}"
    return f"process{'es' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}: {text}"


def raise_if_any_failed(error: Exception | None, saves: ckpt.SaveWatch) -> None:
    """Every process calls this at the same step: all raise the first failing process's error, or none."""
    from tieflax.hardware import distributed  # noqa: PLC0415

    message = distributed.first_failure(str(error) if error is not None else None, "save", name_process_0=True)
    if message is not None:
        saves.abandon()
        raise ProcessesStopped(message) from error


def agree_on_start(refused: ckpt.CheckpointError | None, saves: ckpt.SaveWatch) -> None:
    """Every process calls this right after its start of a save (``refused``: the error it raised): all
    go on, or all raise ProcessesStopped with the same line. Through the coordinator's key-value store,
    within a deadline (``tieflax.run.save_start``), not a device collective: a process whose storage
    stalled inside its start never reaches a collective, and the others would wait there until JAX's
    heartbeat timeout, then crash without a line."""
    line = saves.starting.agree(refused)
    if line is not None:
        saves.abandon()
        raise ProcessesStopped(line) from refused
