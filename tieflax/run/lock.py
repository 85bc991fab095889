"""The run's lock: one writer at a time in a workdir.

``workdir_lock(workdir, command)`` holds ``<workdir>/tieflax.lock`` (JSON: host, PID, command, start
time) while a command writes there. A second ``tieflax train``/``convert`` into the same folder refuses in
one line naming the holder. A lock whose process is gone (same host: the PID no longer runs, or runs a
different process since) is stale: it is taken over with a message. A lock held from another host is
never taken over automatically, since its process cannot be checked from here. On gs:// and s3:// the
lock is a lease object kept alive by a heartbeat (``tieflax.storage.lease``).
"""

from __future__ import annotations

import contextlib

from tieflax import storage
from tieflax.storage import lease
from tieflax.run.layout import LOCK_FILE, RunDir, WorkdirError, check_location

__all__ = ["Held", "WorkdirError", "hold", "workdir_lock", "workdir_lock_single"]


class Held:
    """What ``workdir_lock`` yields: ``check()`` raises WorkdirError once the lease was lost (another
    process took it over after missing heartbeats); a local lock cannot be lost, so it never raises."""

    def __init__(self, held: "lease.Lease | lease.LockFile | None" = None):
        self._lease = held

    def check(self) -> None:
        if self._lease is not None and self._lease.lost:
            raise WorkdirError(self._lease.lost)


@contextlib.contextmanager
def workdir_lock(where: RunDir | str, command: str, *, enabled: bool = True):
    """Holds the lock of the run folder ``where`` for the block; yields a ``Held``. Re-entrant within a
    process. ``where``: a ``RunDir``, or a path (a destination's, a test's) resolved and checked here, once
    (``RunDir.of``): a file, or a store orbax cannot write to, is refused before any work.

    A local workdir: ``<workdir>/tieflax.lock`` created with ``O_EXCL`` (host, PID, command, start time);
    a holder whose process is gone is taken over. A gs:// or s3:// workdir: a lease object written with a
    does-not-exist precondition and kept alive by a heartbeat (``tieflax.storage.lease.Lease``).

    Raises WorkdirError when another live process holds it. ``enabled=False`` (processes other than 0 of
    a multi-process job): process 0 takes the lock for the job, and in a multi-process job its decision
    reaches every process (all raise the same WorkdirError, or all go on).
    """
    with hold(RunDir.of(where), command, enabled=enabled) as held:
        yield held


@contextlib.contextmanager
def hold(where: RunDir, command: str, *, enabled: bool = True):
    """``workdir_lock`` for a run already resolved and checked (``tieflax.run.run.Run.open`` does both
    once). Process 0 (``enabled``) tries the lock; every process learns the outcome before any of them
    writes (``distributed.first_failure``; a job of one process just takes it)."""
    from tieflax.hardware import distributed  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        error = None
        held = Held()
        if enabled:
            try:
                held = stack.enter_context(_take(where, command))
            except WorkdirError as e:
                error = e
        failure = distributed.first_failure(None if error is None else str(error), "workdir-lock")
        if error is not None:
            raise error
        if failure is not None:
            raise WorkdirError(failure)
        yield held


def workdir_lock_single(folder: str, command: str):
    """The lock as one process takes it (no agreement with other processes). ``folder``: a destination,
    canonical (``storage.resolve``); a local one that is a file is refused (a remote destination here need
    not hold checkpoints, so s3:// is fine)."""
    if not storage.is_remote(folder):
        check_location(folder)
    return _take(RunDir(folder), command)


@contextlib.contextmanager
def _take(where: RunDir, command: str):
    """The lock of a resolved, checked workdir, taken in one place for both kinds of store: a lease object
    on gs:// and s3:// (``tieflax.storage.lease.Lease``, kept alive by a heartbeat), else a lock file
    (``tieflax.storage.lease.LockFile``). Both are acquired and released alike; ``acquire`` False means this
    process holds the lock already (a command calling another): the outer holder releases it."""
    me = _me(command)
    if where.is_remote:
        storage.check_writable(where.path)
        lock = lease.Lease(where.file(LOCK_FILE), me, owner=where.path, refuse=_refuse_lease(where))
    else:
        lock = lease.LockFile(where.path, LOCK_FILE, me, owner=where.path, refuse=_refuse_lock(where))
    try:  # acquire inside: a signal landing while it takes the lock still releases what it took
        yield Held(lock if lock.acquire() else None)
    finally:
        lock.release()  # only what this call took (nothing when an outer command holds the lock)


def _me(command: str) -> dict:
    return lease.holder_record(command=command)


def _refuse_lock(where: RunDir):
    def refuse(holder: dict | None, path: str) -> WorkdirError:
        if holder is None:
            return WorkdirError(f"could not take the lock {path}: another process keeps replacing it; delete it "
                                "once no tieflax command runs in that folder")
        return WorkdirError(_in_use(where, holder) + f"; if that process is gone, delete {path}")
    return refuse


def _refuse_lease(where: RunDir):
    def refuse(holder: dict, age: float) -> WorkdirError:
        return WorkdirError(_in_use(where, holder) + f" (its lease was renewed {age:.0f} s ago); if that "
                            f"process is gone, the lease expires {lease.LEASE_SECONDS:.0f} s after its last "
                            "renewal")
    return refuse


def _in_use(where: RunDir, holder: dict) -> str:
    return (f"{where.path} is in use by `tieflax {holder.get('command')}` (host {holder.get('host')}, "
            f"PID {holder.get('pid')}, since {holder.get('since')}): wait for it to finish or stop it")
