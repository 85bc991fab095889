"""Every remote call has a deadline, and the settings that set it.

Tensorstore retries a failed request with backoff (up to 32 times, 32 s apart: a quarter of an hour) and
waits on a stalled connection forever. Within the deadline its own retries and backoff run as usual; when
it passes, the call is cancelled and the command stops with one line naming the object (``no_answer``).
Remote work done by a library outside this layer (orbax's saves) is timed by a ``watchdog``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable

from tieflax.storage.failures import _gcs_credentials_configured, _why
from tieflax.storage.paths import StorageError, bucket_and_key, is_remote

DEADLINE_ENV = "TIEFLAX_STORAGE_DEADLINE_S"
DEFAULT_DEADLINE_S = 180.0
# The bound of one checkpoint save's end (orbax's background commit), at least the storage deadline: the same
# name as tieflax.run.checkpoints.SAVE_DEADLINE_ENV, which reads it through checkpoint_deadline_seconds.
CHECKPOINT_DEADLINE_ENV = "TIEFLAX_CHECKPOINT_DEADLINE_S"
DEFAULT_CHECKPOINT_DEADLINE_S = 1800.0
# How long a process of a multi-process job waits for the others at one point (tieflax.hardware.distributed), read
# here beside the other deadlines so that the console checks all three at a command's start without
# importing JAX (a bad argument or setting is refused in a fraction of a second).
COLLECTIVE_DEADLINE_ENV = "TIEFLAX_COLLECTIVE_DEADLINE_S"
DEFAULT_COLLECTIVE_DEADLINE_S = 900.0   # above a large model's first compile inside a step


def seconds_setting(env: str, default: float, what: str) -> float:
    """A duration set by the environment variable ``env``: seconds, a finite number above 0; ``default``
    when unset or empty. Anything else (0, -5, abc, nan, inf) is refused naming the variable, the value
    and what it takes (``what``: "the deadline of one storage call")."""
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise StorageError(f"{env}={text!r}: give {what} in seconds, a number above 0 such as {default:g} "
                           "(the default, when unset)")
    return value


def deadline_seconds() -> float:
    """The deadline of one remote call: ``TIEFLAX_STORAGE_DEADLINE_S`` (seconds), else 180."""
    return seconds_setting(DEADLINE_ENV, DEFAULT_DEADLINE_S, "the deadline of one storage call")


def checkpoint_deadline_seconds() -> float:
    """How long the end of one checkpoint save may take: ``TIEFLAX_CHECKPOINT_DEADLINE_S`` (seconds), else
    1800. Read here, beside the storage deadline, so that the console can check both at a command's start
    without importing orbax; ``tieflax.run.checkpoints.save_deadline_seconds`` applies it."""
    return seconds_setting(CHECKPOINT_DEADLINE_ENV, DEFAULT_CHECKPOINT_DEADLINE_S,
                           "the time one checkpoint save may take")


def collective_deadline_seconds() -> float:
    """How long a process waits for the others at one point: ``TIEFLAX_COLLECTIVE_DEADLINE_S``, else 900
    (``tieflax.hardware.distributed.waiting_for_others`` applies it)."""
    return seconds_setting(COLLECTIVE_DEADLINE_ENV, DEFAULT_COLLECTIVE_DEADLINE_S,
                           "how long a process may wait for the others at one step")


def check_deadline_settings() -> None:
    """The deadlines read once, before any work (``tieflax.cli``): a bad value is refused at a command's
    start, not at the first remote call, the second checkpoint or the first wait on another process."""
    deadline_seconds()
    checkpoint_deadline_seconds()
    collective_deadline_seconds()


_DEADLINE = threading.local()  # the monotonic deadline of the remote call this thread is in, if any


class _DeadlinePassed(Exception):
    pass


@contextlib.contextmanager
def deadline_within(seconds: float):
    """Remote calls in the block end within ``seconds`` (or their own deadline, if sooner): for clean-up
    after a failure (releasing a lease), which must not wait a whole deadline again."""
    outer = getattr(_DEADLINE, "at", None)
    at = time.monotonic() + seconds
    _DEADLINE.at = at if outer is None else min(outer, at)
    try:
        yield
    finally:
        _DEADLINE.at = outer


@contextlib.contextmanager
def watchdog(path: str, action: str, seconds: float | None = None, setting: str = DEADLINE_ENV,
             ran_out: Callable[[str, threading.Event], None] | None = None):
    """For remote work done by a library outside this layer, which no deadline can cancel (orbax's
    checkpoint saves, through gcsfs and its own tensorstore): when the block has not ended within
    ``seconds`` (default: the storage deadline), the process prints the one line of a passed deadline and
    exits 1 at once (``os._exit``: its threads may be stuck in the library). Nothing is committed by an
    unfinished block: a checkpoint without its commit marker is not a checkpoint; a rerun resumes from the
    last one. Local paths: no watchdog.

    ``ran_out(line, ended)``, if given, is called instead, in the watchdog's thread, with that line and the
    event set when the block ends: a process of a multi-process job first learns from the others whose
    storage stopped (``tieflax.run.save_start``); it stops the process itself, or returns when the block
    ended after all."""
    if not is_remote(path):
        yield
        return
    seconds = deadline_seconds() if seconds is None else seconds
    done = threading.Event()

    def expire():
        if done.wait(seconds):
            return
        line = no_answer(path, action, seconds, setting)
        if ran_out is not None:
            ran_out(line, done)
        else:
            stop_at_once(line)

    threading.Thread(target=expire, name="tieflax-storage-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def stop_at_once(line: str, before_exit: Callable[[], None] | None = None) -> None:
    """Prints ``line`` as the console prints a failure (``tieflax <command>: ...``) and exits 1 at once
    (``os._exit``: other threads may be stuck in a library); ``before_exit`` runs in between (a process of
    a multi-process job tells the coordinator it leaves)."""
    import sys  # noqa: PLC0415

    prefix = " ".join(["tieflax", *[a for a in sys.argv[1:2] if not a.startswith("-")]])  # as the console
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os.write(2, f"{prefix}: {line}\n".encode())
    if before_exit is not None:
        with contextlib.suppress(Exception):
            before_exit()
    os._exit(1)


def _wait(future):
    """A tensorstore future's result, within the deadline of the current remote call (cancelled at it)."""
    deadline = getattr(_DEADLINE, "at", None)
    if deadline is None:
        return future.result()
    try:
        return future.result(timeout=max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        future.cancel()
        raise _DeadlinePassed() from None


def _remote(path: str, action: str, fn):
    """Runs one remote operation within the deadline (``deadline_seconds``), turning the libraries'
    failures into a StorageError that names the path and the fix (no bucket, no credentials, no
    permission, no answer in time)."""
    if not is_remote(path):
        return fn()
    seconds = deadline_seconds()
    outer = getattr(_DEADLINE, "at", None)
    _DEADLINE.at = time.monotonic() + seconds if outer is None else min(outer, time.monotonic() + seconds)
    try:
        return fn()
    except _DeadlinePassed:
        raise StorageError(no_answer(path, action, seconds)) from None
    except StorageError:
        raise
    except FileNotFoundError:
        if action == "read" or not is_remote(path):
            raise
        raise StorageError(_why(path, action, "not found")) from None
    except Exception as e:  # noqa: BLE001 (gcsfs, s3fs, tensorstore and google-auth each raise their own)
        if not is_remote(path):
            raise
        raise StorageError(_why(path, action, f"{type(e).__name__}: {e}")) from e
    finally:
        _DEADLINE.at = outer


def no_answer(path: str, action: str, seconds: float, setting: str = DEADLINE_ENV) -> str:
    """The one line of a remote ``action`` on ``path`` that got no answer within ``seconds``, with the fix
    (also for callers that time a library's remote work themselves, such as checkpoint saves);
    ``setting``: the variable that set ``seconds`` (checkpoint saves have a deadline of their own)."""
    scheme, bucket, _ = bucket_and_key(path)
    if scheme == "gs" and not _gcs_credentials_configured():
        fix = ("no credentials are configured (no GOOGLE_APPLICATION_CREDENTIALS, no "
               "~/.config/gcloud/application_default_credentials.json) and no metadata server answered: run "
               "`gcloud auth application-default login`, or check the network")
    else:
        fix = f"check the network and that {scheme}://{bucket} is reachable"
    return (f"cannot {action} {path}: no answer from {scheme}://{bucket} within {seconds:g} s; {fix}, then rerun "
            f"the command (work done so far is kept; {setting} sets the deadline)")
