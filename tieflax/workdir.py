"""The workdir as a guarded unit: one writer at a time, and no half-written imports.

``workdir_lock(workdir, command)`` holds ``<workdir>/tieflax.lock`` (JSON: host, PID, command, start
time) while a command writes there. A second ``tieflax train``/``convert`` into the same folder refuses in
one line naming the holder. A lock whose process is gone (same host: the PID no longer runs, or runs a
different process since) is stale: it is taken over with a message. A lock held from another host is
never taken over automatically, since its process cannot be checked from here.

Imports and surgery write into ``<parent>/.<name>.partial-<pid>`` and rename it to the workdir when
complete (``partial_folder``); a leftover partial folder means an interrupted import, and
``check_no_partial_import`` makes training refuse, naming it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import sys
import threading
import time

from tieflax import storage
from tieflax.errors import UserError

LOCK_FILE = "tieflax.lock"
PARTIAL_TAG = ".partial-"
INCOMPLETE_MARKER = "tieflax.incomplete"  # a gs:// / s3:// import or surgery in progress (see tieflax.destinations)


class WorkdirError(UserError, RuntimeError):
    """The workdir cannot be used as asked; the message names it and what to do."""


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused PID from the holder."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """False only when the holder is certainly gone: same host and its PID is not (or no longer) it."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, ValueError, OverflowError):
        return False
    start = holder.get("start")
    return start is None or _process_start(pid) in (None, start)


def _read_lock(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _check_folder(workdir: str) -> None:
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir} is a file, not a folder: choose another path")


class Held:
    """What ``workdir_lock`` yields: ``check()`` raises WorkdirError once the lease was lost (another
    process took it over after missing heartbeats); a local lock cannot be lost, so it never raises."""

    def __init__(self, lease: "_Lease | None" = None):
        self._lease = lease

    def check(self) -> None:
        if self._lease is not None and self._lease.lost:
            raise WorkdirError(self._lease.lost)


@contextlib.contextmanager
def workdir_lock(workdir: str, command: str, *, enabled: bool = True):
    """Holds the workdir's lock for the block; yields a ``Held``. Re-entrant within a process.

    A local workdir: ``<workdir>/tieflax.lock`` created with ``O_EXCL`` (host, PID, command, start time);
    a holder whose process is gone is taken over. A gs:// or s3:// workdir: a lease object written with a
    does-not-exist precondition and kept alive by a heartbeat (``_Lease``).

    Raises WorkdirError when another live process holds it. ``enabled=False`` (processes other than 0 of
    a multi-process job): process 0 takes the lock for the job, and in a multi-process job its decision
    reaches every process (all raise the same WorkdirError, or all go on).
    """
    import jax  # noqa: PLC0415

    from tieflax.checkpoint import check_checkpoint_location  # noqa: PLC0415

    workdir = storage.resolve(workdir)
    check_checkpoint_location(workdir)  # before any work: a workdir holds checkpoints
    if jax.process_count() > 1:
        with _agreed_lock(workdir, command, enabled) as held:
            yield held
        return
    if not enabled:
        yield Held()
        return
    if storage.is_remote(workdir):
        with _remote_lock(workdir, command) as held:
            yield held
        return
    with _local_lock(workdir, command):
        yield Held()


@contextlib.contextmanager
def _agreed_lock(workdir: str, command: str, enabled: bool):
    """Process 0 tries the lock; every process learns the outcome before any of them writes."""
    from tieflax import distributed  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        error = None
        held = Held()
        if enabled:
            try:
                held = stack.enter_context(workdir_lock_single(workdir, command))
            except WorkdirError as e:
                error = str(e)
        error = distributed.first_failure(error, "workdir-lock")
        if error is not None:
            raise WorkdirError(error)
        yield held


def workdir_lock_single(workdir: str, command: str):
    """The lock as one process takes it (no agreement with other processes)."""
    return _remote_lock(workdir, command) if storage.is_remote(workdir) else _local_lock_held(workdir, command)


@contextlib.contextmanager
def _local_lock_held(workdir: str, command: str):
    with _local_lock(workdir, command):
        yield Held()


@contextlib.contextmanager
def _local_lock(workdir: str, command: str):
    _check_folder(workdir)
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
            elif _alive(holder):
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
    return {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "start": _process_start(os.getpid())}


def _in_use(workdir: str, holder: dict) -> str:
    return (f"{workdir} is in use by `tieflax {holder.get('command')}` (host {holder.get('host')}, "
            f"PID {holder.get('pid')}, since {holder.get('since')}): wait for it to finish or stop it")


# ------------------------------------------------------------------------------------- remote lease
# On an object store there is no O_EXCL and no PID to check from another host. The lock is a lease:
# created only if absent (a generation precondition), rewritten every HEARTBEAT_SECONDS by its holder
# (again conditional on the generation it last wrote, so two holders can never both renew), and free
# to take over once nobody renewed it for LEASE_SECONDS. Hosts' clocks are compared (NTP-synchronised
# on cloud VMs); the margin is four heartbeats.
HEARTBEAT_SECONDS = 15.0
LEASE_SECONDS = 60.0


class _Lease:
    def __init__(self, workdir: str, command: str):
        self.path = storage.join(workdir, LOCK_FILE)
        self.workdir = workdir
        self.me = _me(command)
        self.stamp: storage.ObjectStamp | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _content(self) -> bytes:
        return json.dumps({**self.me, "heartbeat": time.time()}).encode()

    def acquire(self) -> bool:
        """Takes the lease; False when this process holds it already (re-entrant). Raises WorkdirError."""
        for _ in range(3):
            data, stamp = storage.read_with_stamp(self.path)
            holder = None
            if data is not None:
                try:
                    holder = json.loads(data)
                except ValueError:
                    holder = None
                if holder and holder.get("host") == self.me["host"] and holder.get("pid") == self.me["pid"]:
                    return False
                age = time.time() - float((holder or {}).get("heartbeat", 0.0))
                # A holder on this host whose process is gone (kill -9) is stale at once; one on another
                # host only once its lease expired.
                if holder and age < LEASE_SECONDS and _alive(holder):
                    raise WorkdirError(_in_use(self.workdir, holder) + f" (its lease was renewed {age:.0f} s "
                                       f"ago); if that process is gone, the lease expires {LEASE_SECONDS:.0f} "
                                       "s after its last renewal")
                what = "an unreadable lease" if holder is None else (
                    f"the stale lease of `tieflax {holder.get('command')}` (host {holder.get('host')}, PID "
                    f"{holder.get('pid')}, " + ("no longer running)" if age < LEASE_SECONDS else
                                                f"not renewed for {age:.0f} s)"))
                print(f"tieflax: {self.workdir}: taking over {what}", file=sys.stderr, flush=True)
            self.stamp = storage.compare_and_set(self.path, self._content(), stamp)
            if self.stamp is not None:
                self._thread = threading.Thread(target=self._heartbeat, name="tieflax-lease", daemon=True)
                self._thread.start()
                return True
            # another process wrote it between our read and our write: look again
        raise WorkdirError(f"could not take the lease {self.path}: other processes keep taking it; stop "
                           "them first")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                stamp = storage.compare_and_set(self.path, self._content(), self.stamp)
            except storage.StorageError:
                continue  # a transient failure: the next heartbeat retries well within the lease
            if stamp is None:
                data, _ = storage.read_with_stamp(self.path)
                self.lost = (f"the lease on {self.workdir} was taken over by another process "
                             f"({(data or b'').decode(errors='replace')[:200]}); this run stopped: check that "
                             "only one run writes there")
                return
            self.stamp = stamp

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and self.stamp is not None:
            with contextlib.suppress(storage.StorageError):
                storage.compare_and_set(self.path, None, self.stamp)


@contextlib.contextmanager
def _remote_lock(workdir: str, command: str):
    storage.check_writable(workdir)
    lease = _Lease(workdir, command)
    owned = lease.acquire()
    try:
        yield Held(lease if owned else None)
    finally:
        if owned:
            lease.release()


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


# ------------------------------------------------------------------------------------------ imports
def partial_folder(workdir: str) -> str:
    """Where an import or surgery into ``workdir`` is written before the rename that completes it."""
    workdir = os.path.abspath(workdir)
    return os.path.join(os.path.dirname(workdir), f".{os.path.basename(workdir)}{PARTIAL_TAG}{os.getpid()}")


def fresh_partial_folder(workdir: str) -> str:
    """An empty ``partial_folder``, after removing what interrupted imports into ``workdir`` left (call it
    holding the workdir's lock, so no other import is writing one)."""
    import shutil  # noqa: PLC0415

    for leftover in partial_imports(workdir):
        if PARTIAL_TAG in os.path.basename(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
    path = partial_folder(workdir)
    os.makedirs(path)
    return path


def partial_imports(workdir: str) -> list[str]:
    workdir = storage.resolve(workdir)
    if storage.is_remote(workdir):  # no rename there: convert writes in place behind a marker object
        marker = storage.join(workdir, INCOMPLETE_MARKER)
        return [marker] if storage.is_file(marker) else []
    pattern = os.path.join(os.path.dirname(workdir), f".{glob.escape(os.path.basename(workdir))}{PARTIAL_TAG}*")
    found = glob.glob(pattern)
    # orbax writes initial_params/ under a temporary name first: a kill during that write leaves it
    found += [p for p in glob.glob(os.path.join(glob.escape(workdir), "initial_params*"))
              if os.path.basename(p) != "initial_params"]
    return sorted(found)


def check_no_partial_import(workdir: str) -> None:
    """Refuses a workdir whose import or surgery was interrupted (it would train from random weights)."""
    found = partial_imports(workdir)
    if found:
        raise WorkdirError(f"an import into {storage.resolve(workdir)} did not finish ({found[0]} is "
                           "incomplete): rerun the `tieflax convert` command that writes it, or delete "
                           f"{found[0]} to train without it")


def holds_a_run(folder: str) -> bool:
    """True when ``folder`` holds anything a run left (config, checkpoints, parameters, metrics)."""
    return any(os.path.exists(os.path.join(folder, n))
               for n in ("config.json", "checkpoints", "initial_params", "metrics.jsonl", "metrics"))


def publish(partial: str, workdir: str, *, overwrite: bool) -> None:
    """Renames a complete ``partial`` folder to ``workdir``. An existing ``workdir`` must be empty (this
    process's lock aside), or be replaced because ``overwrite`` was given."""
    import shutil  # noqa: PLC0415

    workdir = os.path.abspath(workdir)
    if os.path.isdir(workdir) and set(os.listdir(workdir)) - {LOCK_FILE}:
        if not overwrite:
            raise WorkdirError(f"{workdir} is not empty{' and holds a run' if holds_a_run(workdir) else ''}: "
                               "pass --overwrite to replace it, or write to a new folder")
        old = partial.replace(PARTIAL_TAG, ".replaced-")
        os.replace(workdir, old)
        os.replace(partial, workdir)
        shutil.rmtree(old, ignore_errors=True)
        return
    if os.path.isdir(workdir):
        shutil.rmtree(workdir)  # empty but for our own lock, released with it
    os.replace(partial, workdir)


def check_destination(workdir: str, *, overwrite: bool) -> None:
    """Before any work: refuse a destination that is a file, or holds something, unless ``overwrite``."""
    _check_folder(workdir)
    if not overwrite and os.path.isdir(workdir) and set(os.listdir(workdir)) - {LOCK_FILE}:
        what = "holds a run" if holds_a_run(workdir) else "is not empty"
        raise WorkdirError(f"{os.path.abspath(workdir)} {what}: pass --overwrite to replace it, or write to a "
                           "new folder")
