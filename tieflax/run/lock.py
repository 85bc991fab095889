"""The run's lock: one writer at a time in a workdir.

``workdir_lock(workdir, command)`` holds ``<workdir>/tieflax.lock`` (JSON: host, PID, command, start
time) while a command writes there. A second ``tieflax train``/``convert`` into the same folder refuses in
one line naming the holder. A lock whose process is gone (same host: the PID no longer runs, or runs a
different process since) is stale: it is taken over with a message. A lock held from another host is
never taken over automatically, since its process cannot be checked from here. On gs:// and s3:// the
lock is a lease object kept alive by a heartbeat (``tieflax.lease``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from tieflax import lease, storage
from tieflax.run.layout import LOCK_FILE, WorkdirError, check_location

__all__ = ["Held", "WorkdirError", "hold", "workdir_lock", "workdir_lock_single"]


def _read_lock(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Held:
    """What ``workdir_lock`` yields: ``check()`` raises WorkdirError once the lease was lost (another
    process took it over after missing heartbeats); a local lock cannot be lost, so it never raises."""

    def __init__(self, held: "lease.Lease | None" = None):
        self._lease = held

    def check(self) -> None:
        if self._lease is not None and self._lease.lost:
            raise WorkdirError(self._lease.lost)


@contextlib.contextmanager
def workdir_lock(workdir: str, command: str, *, enabled: bool = True):
    """Holds the workdir's lock for the block; yields a ``Held``. Re-entrant within a process.

    A local workdir: ``<workdir>/tieflax.lock`` created with ``O_EXCL`` (host, PID, command, start time);
    a holder whose process is gone is taken over. A gs:// or s3:// workdir: a lease object written with a
    does-not-exist precondition and kept alive by a heartbeat (``tieflax.lease.Lease``).

    Raises WorkdirError when another live process holds it. ``enabled=False`` (processes other than 0 of
    a multi-process job): process 0 takes the lock for the job, and in a multi-process job its decision
    reaches every process (all raise the same WorkdirError, or all go on).
    """
    workdir = check_location(workdir)  # before any work: a file, or a store orbax cannot write to, is refused
    with hold(workdir, command, enabled=enabled) as held:
        yield held


@contextlib.contextmanager
def hold(workdir: str, command: str, *, enabled: bool = True):
    """``workdir_lock`` for a workdir already resolved and checked (``tieflax.run.run.Run.open`` does
    both once)."""
    import jax  # noqa: PLC0415

    if jax.process_count() > 1:
        with _agreed_lock(workdir, command, enabled) as held:
            yield held
    elif not enabled:
        yield Held()
    else:
        with _take(workdir, command) as held:
            yield held


@contextlib.contextmanager
def _agreed_lock(workdir: str, command: str, enabled: bool):
    """Process 0 tries the lock; every process learns the outcome before any of them writes."""
    from tieflax import distributed  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        error = None
        held = Held()
        if enabled:
            try:
                held = stack.enter_context(_take(workdir, command))
            except WorkdirError as e:
                error = str(e)
        error = distributed.first_failure(error, "workdir-lock")
        if error is not None:
            raise WorkdirError(error)
        yield held


def workdir_lock_single(workdir: str, command: str):
    """The lock as one process takes it (no agreement with other processes)."""
    if not storage.is_remote(workdir):
        check_location(workdir)  # a file is refused (a remote destination here need not hold checkpoints)
    return _take(workdir, command)


def _take(workdir: str, command: str):
    """The lock of a resolved, checked workdir: a lease object on gs:// and s3://, else a lock file."""
    return _remote_lock(workdir, command) if storage.is_remote(workdir) else _local_lock_held(workdir, command)


@contextlib.contextmanager
def _local_lock_held(workdir: str, command: str):
    with _local_lock(workdir, command):
        yield Held()


@contextlib.contextmanager
def _local_lock(workdir: str, command: str):
    created = not os.path.exists(workdir)
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    me = _me(command)
    owned = False
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:  # being written this instant, or left empty by a crash
                if time.time() - _mtime(path) < 5:
                    time.sleep(0.5)
                    continue
            elif holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                break  # this process holds it already (a command calling another)
            elif lease.alive(holder):
                raise WorkdirError(_in_use(workdir, holder) + f"; if that process is gone, delete {path}") from None
            what = "an unreadable lock" if holder is None else (
                f"the stale lock of PID {holder.get('pid')} (`tieflax {holder.get('command')}`, no longer "
                "running)")
            print(f"tieflax: {workdir}: taking over {what}", file=sys.stderr, flush=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(me, f)
        owned = True
        break
    else:
        raise WorkdirError(f"could not take the lock {path}: another process keeps replacing it; delete it "
                           "once no tieflax command runs in that folder")
    try:
        yield
    finally:
        if owned:
            holder = _read_lock(path)
            if holder and holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            if created:  # a refused or failed command leaves no empty folder behind
                with contextlib.suppress(OSError):
                    os.rmdir(workdir)


def _me(command: str) -> dict:
    return lease.holder_record(command=command)


def _refuse_lease(workdir: str):
    def refuse(holder: dict, age: float) -> WorkdirError:
        return WorkdirError(_in_use(workdir, holder) + f" (its lease was renewed {age:.0f} s ago); if that "
                            f"process is gone, the lease expires {lease.LEASE_SECONDS:.0f} s after its last "
                            "renewal")
    return refuse


def _in_use(workdir: str, holder: dict) -> str:
    return (f"{workdir} is in use by `tieflax {holder.get('command')}` (host {holder.get('host')}, "
            f"PID {holder.get('pid')}, since {holder.get('since')}): wait for it to finish or stop it")


@contextlib.contextmanager
def _remote_lock(workdir: str, command: str):
    me, refuse = _me(command), _refuse_lease(workdir)
    storage.check_writable(workdir)
    held = lease.Lease(storage.join(workdir, LOCK_FILE), me, owner=workdir, refuse=refuse)
    owned = held.acquire()
    try:
        yield Held(held if owned else None)
    finally:
        if owned:
            held.release()


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
