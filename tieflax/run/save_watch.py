"""The save watch: a run's asynchronous checkpoint saves started, and a failed one turned into an error.

``SaveWatch.start`` saves a step (``save``: orbax's blocking part; the arrays are written in the
background) and the watch surfaces a failed save at the first step after orbax reports it ended, in one
line ending with the OS error (a full disk, a lost mount), instead of training on without saving. A bucket
that stops answering is ridden out within the checkpoint deadline (``save_deadline_seconds``); past it,
every process stops with the same line (``SaveDeadlinePassed``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from tieflax import storage
from tieflax.run import record, save_start
from tieflax.run.checkpoint_errors import CheckpointError, why
from tieflax.run.orbax_handlers import OWN_SHARE

log = logging.getLogger(__name__)


def save(manager: ocp.CheckpointManager, step: int, state: Any, loader) -> None:
    """Saves the train state and the data iterator in the same step (asynchronously). The step's metadata
    names the run's record entry in force (``record.in_force``), so that a deleted or edited entry is
    found on resume."""
    import grain  # noqa: PLC0415

    manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                               data=grain.checkpoint.CheckpointSave(loader)), force=True,
                 custom_metadata=_record_in_force(manager))


def _record_in_force(manager: ocp.CheckpointManager) -> dict:
    """``{record.RECORD_KEY: ...}``, read once per manager: the record is written before the first save
    and does not change while the manager saves."""
    named = getattr(manager, "_tieflax_record", None)
    if named is None:
        workdir = str(manager.directory).rstrip("/").rsplit("/", 1)[0]  # <workdir>/checkpoints
        named = {record.RECORD_KEY: record.in_force(workdir)} if jax.process_index() == 0 else {}
        manager._tieflax_record = named
    return named


SAVE_DEADLINE_ENV = storage.CHECKPOINT_DEADLINE_ENV


def save_deadline_seconds() -> float:
    """How long the end of one asynchronous save may be waited for: ``TIEFLAX_CHECKPOINT_DEADLINE_S``,
    else 1800 s (and never less than the storage deadline). Read by the path layer
    (``storage.checkpoint_deadline_seconds``), which the console asks at a command's start: a bad value is
    refused there, before the first step, not here at a save."""
    try:
        value = storage.checkpoint_deadline_seconds()
    except storage.StorageError as e:
        raise CheckpointError(str(e)) from None
    return max(value, storage.deadline_seconds())


class SaveDeadlinePassed(CheckpointError):
    """A save on a bucket still running past the checkpoint deadline (multi-process: every process polls)."""

    def __init__(self, step: int, where: str, seconds: float):
        super().__init__(storage.no_answer(where, f"finish checkpoint {step} in", seconds, SAVE_DEADLINE_ENV))
        self.step, self.where, self.seconds = step, where, seconds


class SaveWatch:
    """Starts asynchronous saves and surfaces a failed one at the first step after orbax reports it ended
    (and at the latest when the next save would start), as a CheckpointError whose
    message ends with the OS error (a full disk, a lost mount), instead of training on without saving."""

    def __init__(self, manager: ocp.CheckpointManager):
        self.manager = manager
        self.pending: int | None = None
        self.last_started: int | None = None  # the step of the last save started, pending or not (messages)
        self.starting: save_start.SaveStart | None = None  # the last start (several processes)
        self._started = 0.0  # when the pending save started (monotonic)
        # A bucket that stops answering for less than the checkpoint deadline is ridden out: the save it broke
        # is said in one line, training goes on, the next save tries again (the last one is retried here);
        # _outage_since: when the first save of such an outage started.
        self._outage_since: float | None = None
        self._saving: tuple | None = None  # (step, state, loader) of the pending save
        self._quiet = _QuietOrbaxSaveErrors()
        logging.getLogger("absl").addFilter(self._quiet)

    def start(self, step: int, state: Any, loader) -> None:
        """Starts saving ``step`` (orbax's blocking part; the writes go on in the background). With several
        processes, ``starting`` then holds this start, for every process to agree on how it ended
        (``tieflax.train.stop.agree_on_start``)."""
        self.starting = self._save_start(step) if jax.process_count() > 1 else None
        self._raise_if_failed(wait=True)  # orbax waits for the previous save anyway
        # A bucket that stops answering would hold orbax's start of a save (gcsfs, tensorstore) forever:
        # past the storage deadline the process says so in one line and exits 1 (the step not committed);
        # with several processes, the line every process stops with (save_start.SaveStart.ran_out), at once
        # for a process waiting at orbax's barrier for one whose start failed (SaveStart.listening).
        self._started = time.monotonic()
        OWN_SHARE.begin()
        listening = self.starting.listening() if self.starting is not None else contextlib.nullcontext()
        with storage.watchdog(self._where(), f"save checkpoint {step} to",
                              ran_out=self.starting.ran_out if self.starting is not None else None), listening:
            try:
                save(self.manager, step, state, loader)
            except Exception as e:  # noqa: BLE001
                if self._ride_out(step, e):
                    self._saving = (step, state, loader)
                    return
                raise self._error(step, e) from e
        self.pending = self.last_started = step
        self._started = time.monotonic()
        self._saving = (step, state, loader)

    def _save_start(self, step: int) -> save_start.SaveStart:
        """This start, as the processes agree on it, with the bound of that agreement (each process's wait
        for the others' words once its own start ended): on a bucket twice the storage deadline (every
        process's start ends within that deadline, on its watchdog at the latest; the second one leaves
        room for the skew between the processes' starts and for their words); on a local disk, where no
        watchdog ends a start, the checkpoint deadline."""
        if storage.is_remote(self._where()):
            return save_start.SaveStart(step, self._where(), 2 * storage.deadline_seconds(), storage.DEADLINE_ENV)
        return save_start.SaveStart(step, self._where(), save_deadline_seconds(), SAVE_DEADLINE_ENV)

    def _where(self) -> str:
        return str(getattr(self.manager, "directory", "")) or "checkpoints"

    where = property(_where, doc="The checkpoints' folder (for messages).")

    def check(self, step: int) -> None:
        """Cheap: only asks orbax whether the pending save has ended, and if so whether it failed."""
        if self.pending is not None and not self.manager.is_saving_in_progress():
            self._raise_if_failed(wait=True)

    def failure(self, wait: bool) -> "CheckpointError | None":
        """The pending save's failure, or None (still running when ``wait`` is False, or it succeeded).
        Multi-process training calls this on every process, then agrees (``distributed.first_failure``),
        so that a save failing on one process stops all of them at the same step."""
        if self.pending is None:
            return None
        # This process's own share failed? (`is_saving_in_progress` cannot say: with several processes it
        # stays True until every process has finished, a failed one included.)
        failed, self._quiet.commit_error = self._quiet.commit_error, None
        if failed is None:
            try:
                self.manager.check_for_errors()
            except Exception as e:  # noqa: BLE001
                failed = e
        if failed is not None:
            step, self.pending = self.pending, None
            return self._error(step, failed)
        if not wait and self.manager.is_saving_in_progress():
            # Multi-process training polls this, all processes together (never a blocking wait, which has
            # the watchdog below): a save that has not ended within the checkpoint deadline is a failure
            # every process agrees on, instead of polling a bucket that stopped answering forever.
            seconds = save_deadline_seconds()
            if storage.is_remote(self._where()) and time.monotonic() - self._started > seconds:
                step, self.pending = self.pending, None
                return SaveDeadlinePassed(step, self._where(), seconds)
            return None
        try:
            self._raise_if_failed(wait=True)
        except CheckpointError as e:
            return e
        return None

    def _raise_if_failed(self, wait: bool) -> bool:
        """Waits for the pending save; raises CheckpointError if it failed, except for a bucket that stopped
        answering within the checkpoint deadline: then True (ridden out, said in one line)."""
        if self.pending is None:
            return False
        step, self.pending = self.pending, None
        # The rest of a save (its arrays, its commit marker) may take long on a large model, but not
        # forever: TIEFLAX_CHECKPOINT_DEADLINE_S (default 30 min), then one line and exit 1.
        with storage.watchdog(self._where(), f"finish checkpoint {step} in", save_deadline_seconds(),
                              SAVE_DEADLINE_ENV):
            try:
                self.manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                if self._ride_out(step, e):
                    return True
                raise self._error(step, e) from e
        self._outage_since = None  # a save went through: any outage is over
        return False

    def _ride_out(self, step: int, e: BaseException) -> bool:
        """True when ``e`` is a bucket that did not answer and the outage (since the first save it broke
        started) is still within the checkpoint deadline; past it, CheckpointError naming the object,
        the bucket and the deadline. One process only: several must agree (``failure``), and stop."""
        where = self._where()
        if jax.process_count() > 1 or not storage.is_remote(where) or not storage.is_no_answer(e):
            return False
        since = self._started if self._outage_since is None else self._outage_since
        seconds = save_deadline_seconds()
        if time.monotonic() - since >= seconds:
            raise CheckpointError(self._no_answer_line(step, e, seconds)) from e
        self._outage_since = since
        log.warning("checkpoint %d was not saved: no answer from %s (%s); training goes on and the next save "
                    "tries again, within the %g s checkpoint deadline (%s)", step, _bucket_of(where),
                    storage.object_named_in(e, where) or where, seconds, SAVE_DEADLINE_ENV)
        return True

    def _no_answer_line(self, step: int, e: BaseException, seconds: float) -> str:
        where = self._where()
        return (f"saving checkpoint {step} failed, training stopped: no answer from {_bucket_of(where)} within "
                f"the {seconds:g} s checkpoint deadline ({SAVE_DEADLINE_ENV}) for "
                f"{storage.object_named_in(e, where) or where}; check the network and that the bucket is reachable, "
                "then rerun to resume from the last checkpoint")

    def _retry_last(self) -> None:
        """The last save broken by a bucket that stopped answering: saved again (its partial objects first
        deleted) until it goes through or the checkpoint deadline since the outage began has passed."""
        step, state, loader = self._saving
        pause = 1.0
        while True:
            time.sleep(pause)
            pause = min(2 * pause, 15.0)
            with contextlib.suppress(Exception):  # the bucket may still be silent: the save says so itself
                with storage.deadline_within(pause):
                    storage.rmtree(storage.join(checkpoint_dir_of(self.manager), str(step)))
            self.start(step, state, loader)  # rides out (nothing pending) or raises past the deadline
            if self.pending is not None and not self._raise_if_failed(wait=True):
                return

    def abandon(self) -> None:
        """After a failure every process agreed on: the pending save is not waited for (on the healthy
        processes it waits at orbax's commit barrier for the failed one, forever), nor is the manager
        closed. The process must then exit without joining orbax's save thread (``os._exit``)."""
        self.pending = None
        self._abandoned = True

    def close(self) -> None:
        """Waits for the last save and closes the manager; a failure is raised after the manager closed."""
        if getattr(self, "_abandoned", False):
            # The filter stays: orbax's threads, still running, may log the failed save's tracebacks until
            # the process exits (os._exit, ``abandon``); removed, they reached the console once in 4 runs.
            return
        error = None
        try:
            if self._raise_if_failed(wait=True):
                self._retry_last()
        except CheckpointError as e:
            error = e
        try:
            self.manager.close()
        except Exception as e:  # noqa: BLE001 (closing after a failed save may fail the same way)
            error = error or self._error(-1, e)
        finally:
            logging.getLogger("absl").removeFilter(self._quiet)
        if error is not None:
            raise error

    def _error(self, step: int, e: BaseException) -> CheckpointError:
        where = f"saving checkpoint {step}" if step >= 0 else "finishing the last checkpoint"
        if storage.is_remote(self._where()) and storage.is_no_answer(e):  # never a disk's advice for a bucket
            return CheckpointError(self._no_answer_line(step, e, save_deadline_seconds()))
        os_error = _os_error_of(e)
        if os_error is not None and not (storage.is_remote(self._where()) and _is_network(e)):
            fix = "free space on that disk (or fix the mount), then rerun to resume from the last checkpoint"
            return CheckpointError(f"{where} failed, training stopped ({fix}): {os_error}")
        reason = why(e)
        if re.search(r"\b403\b|forbidden|permission_denied|access denied", reason, re.IGNORECASE):
            return CheckpointError(f"{where} failed, training stopped (this account may not write there: grant "
                                   f"it write access, e.g. roles/storage.objectAdmin on the bucket, then rerun "
                                   f"to resume from the last checkpoint): {reason}")
        return CheckpointError(f"{where} failed, training stopped (rerun to resume from the last checkpoint): "
                               f"{reason}")


def _bucket_of(where: str) -> str:
    scheme, bucket, _ = storage.bucket_and_key(where)
    return f"{scheme}://{bucket}"


def _is_network(e: BaseException) -> bool:
    return not any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in storage.causes(e))


def checkpoint_dir_of(manager: ocp.CheckpointManager) -> str:
    return str(manager.directory).rstrip("/")


# tensorstore reports an OS failure inside a ValueError: '... "<file>": Failed writing: ... <strerror>
# [os_error_code='28']'.
_TENSORSTORE_OS_ERROR = re.compile(r'"([^"]+)"[^"]*?:\s*([^:\[]+?)\s*\[os_error_code=\'(\d+)\'\]')


def _os_error_of(e: BaseException) -> str | None:
    """``[Errno N] strerror: file`` of the OS failure behind ``e`` (Python's or tensorstore's), or None;
    one that names its file is preferred."""
    found, seen, todo = [], set(), [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            found.append((e.errno, e.strerror, e.filename))
        match = _TENSORSTORE_OS_ERROR.search(str(e))
        if match:
            path, text, code = match.groups()
            found.append((code, text.strip(), path.removesuffix(".__lock")))
        todo += [e.__cause__, e.__context__]
    if not found:
        return None
    code, text, path = sorted(found, key=lambda f: f[2] is None)[0]
    return f"[Errno {code}] {text}" + (f": {path}" if path else "")


# orbax's CheckpointManager.save, when the wait before it took over a second (orbax 0.11 and 0.12).
_ORBAX_WAIT_WARNING = "Waiting for previous save to complete took"


class _QuietOrbaxSaveErrors(logging.Filter):
    """Drops orbax's own ERROR logs (tracebacks) of a failed background save: ``SaveWatch`` reports the
    failure itself, in one line that ends with the OS error.

    It also keeps the first failure orbax's save thread reports (``commit_error``). With several
    processes that report is how a process learns, at once, that its own share of a save failed: orbax
    hands the exception to its finalize thread, which then waits at a barrier for the other processes
    before anything public (``is_saving_in_progress``, ``check_for_errors``) says so.

    It drops orbax's "Waiting for previous save to complete took N seconds" too: the wait it times is
    ``SaveWatch``'s own (``start`` waits for the pending save, to say how it ended, before orbax's save),
    so on a loaded machine every save after the first printed it, a foreign line in the console."""

    commit_error: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        if record.levelno < logging.ERROR:
            return not str(record.msg).startswith(_ORBAX_WAIT_WARNING)
        if record.exc_info and record.exc_info[1] is not None and self.commit_error is None:
            self.commit_error = record.exc_info[1]
        return False

