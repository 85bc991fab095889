"""One compare-and-set lease on any path of ``tieflax.storage``: the workdir's lock on a bucket and the
token store's build lock are both this; and its local counterpart, a lock file (``LockFile``).

On an object store there is no ``O_EXCL`` and no PID to check from another host. A lease is an object
created only if absent (a generation precondition), rewritten every ``heartbeat_seconds`` by its holder
(conditional on the generation it last wrote, so two holders can never both renew), and free to take
over once nobody renewed it for ``lease_seconds``, or at once when its holder ran on this host and its
process is gone (kill -9). Hosts' clocks are compared (NTP-synchronised on cloud VMs); the margin is
four heartbeats.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Callable

from tieflax import storage

HEARTBEAT_SECONDS = 15.0
LEASE_SECONDS = 60.0
RELEASE_SECONDS = 5.0     # the most that releasing a lease waits (its heartbeat, its removal)


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused PID from the holder."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:  # never a run path: the kernel's table
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_record(**fields) -> dict:
    """This process as a lease or lock holder: host, PID, its start time, the time, and ``fields``."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "start": process_start(os.getpid()), **fields}


def alive(holder: dict) -> bool:
    """False only when the holder is certainly gone: same host and its PID is not (or no longer) it."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        pid = int(holder.get("pid", -1))
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, ValueError, OverflowError, TypeError):
        return False
    start = holder.get("start")
    return start is None or process_start(pid) in (None, start)


def is_me(holder: dict | None) -> bool:
    return bool(holder) and holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()


class Lease:
    """A lease on ``path`` for ``record`` (``holder_record()``), renewed by a daemon thread.

    ``refuse(holder, age_seconds)`` builds the exception raised when a live holder has it; ``owner`` names
    what the lease guards in the one line printed when a stale lease is taken over. ``lost`` is set (a
    sentence) once another process took the lease over after missed heartbeats."""

    def __init__(self, path: str, record: dict, *, refuse: Callable[[dict, float], Exception], owner: str,
                 heartbeat_seconds: float | None = None, lease_seconds: float | None = None):
        self.path, self.record, self.owner = path, record, owner
        self._refuse = refuse
        # read at each lease, not at import: tests shorten them
        self.heartbeat_seconds = heartbeat_seconds or HEARTBEAT_SECONDS
        self.lease_seconds = lease_seconds or LEASE_SECONDS
        self.stamp: storage.ObjectStamp | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self, data: bytes | None) -> bool:
        try:
            holder = json.loads(data) if data else None
        except ValueError:
            return False
        mine = json.loads(json.dumps(self.record))
        return isinstance(holder, dict) and {k: v for k, v in holder.items() if k != "heartbeat"} == mine

    def _content(self) -> bytes:
        return json.dumps({**self.record, "heartbeat": time.time()}).encode()

    def acquire(self) -> bool:
        """Takes the lease; False when this process holds it already (re-entrant). Raises ``refuse(...)``
        when a live process holds it, or a RuntimeError-based one when others keep taking it."""
        for _ in range(3):
            data, stamp = storage.read_with_stamp(self.path)
            if data is not None:
                try:
                    holder = json.loads(data)
                except ValueError:
                    holder = None
                holder = holder if isinstance(holder, dict) else None
                if is_me(holder):
                    return False
                age = time.time() - float((holder or {}).get("heartbeat", 0.0))
                if holder and age < self.lease_seconds and alive(holder):
                    raise self._refuse(holder, age)
                what = "an unreadable lease" if holder is None else (
                    f"the stale lease of `tieflax {holder.get('command')}` (host {holder.get('host')}, PID "
                    f"{holder.get('pid')}, " + ("no longer running)" if age < self.lease_seconds else
                                                f"not renewed for {age:.0f} s)"))
                print(f"tieflax: {self.owner}: taking over {what}", file=sys.stderr, flush=True)
            self.stamp = storage.compare_and_set(self.path, self._content(), stamp)
            if self.stamp is not None:
                self._thread = threading.Thread(target=self._heartbeat, name="tieflax-lease", daemon=True)
                self._thread.start()
                return True
            # another process wrote it between our read and our write: look again
        raise self._refuse({"command": "(several)", "host": "?", "pid": "?"}, 0.0)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                stamp = storage.compare_and_set(self.path, self._content(), self.stamp)
            except storage.StorageError:
                continue  # a transient failure: the next heartbeat retries well within the lease
            if stamp is None:
                data, now = storage.read_with_stamp(self.path)
                if self._mine(data):  # a renewal that timed out but landed: the lease is still ours
                    self.stamp = now
                    continue
                self.lost = (f"the lease on {self.owner} was taken over by another process "
                             f"({(data or b'').decode(errors='replace')[:200]}); this command stopped: check "
                             "that only one command writes there")
                return
            self.stamp = stamp

    def release(self) -> None:
        """Stops the heartbeat and removes the lease within ``RELEASE_SECONDS`` in all. The heartbeat's
        renewal in flight is waited for within that time, and the removal gets what is left; a renewal
        still in flight then means the store is not answering, so no removal is tried (a lease left behind
        goes stale, and the next command takes it over with a message). Both waits had the whole time each
        before, twice the bound a stopped command promised (seen: 27 s instead of 25 on a loaded machine)."""
        self._stop.set()
        ends = time.monotonic() + RELEASE_SECONDS
        if self._thread is not None:
            self._thread.join(timeout=RELEASE_SECONDS)
            if self._thread.is_alive():
                return
        left = ends - time.monotonic()
        if self.lost is None and self.stamp is not None and left > 0:
            with contextlib.suppress(storage.StorageError), storage.deadline_within(left):
                storage.compare_and_set(self.path, None, self.stamp)

    def __enter__(self) -> "Lease":
        self._owned = self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        if self._owned:
            self.release()


class LockFile:
    """The local counterpart of ``Lease``, with its interface (``acquire``, ``release``, ``lost``): the file
    ``folder/name`` created with ``O_EXCL`` (exactly one creator) holding ``record`` (``holder_record()``).

    A holder whose process is gone (same host: ``alive`` says so) is taken over, said on stderr naming
    ``owner``; a live one is refused with ``refuse(holder, path)``, and ``refuse(None, path)`` when other
    processes keep replacing the file. The folder is created for the lock and removed again on release when the lock
    made it and it is left empty (a refused or failed command leaves no empty folder behind)."""

    lost = None  # nobody takes a lock file over while its process lives (a lease can be taken over)

    def __init__(self, folder: str, name: str, record: dict, *, refuse: Callable[[dict | None, str], Exception],
                 owner: str):
        self.folder, self.path, self.record, self.owner = folder, storage.join(folder, name), record, owner
        self._refuse = refuse
        self._created = False
        self._mine = False  # this object created the file (O_EXCL): release() removes it

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(storage.read_bytes(self.path))
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def acquire(self) -> bool:
        """True once this process created the file; False when it held it already (re-entrant)."""
        self._created = not storage.exists(self.folder)
        storage.makedirs(self.folder)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # being written this instant, or left empty by a crash
                    if time.time() - _mtime(self.path) < 5:
                        time.sleep(0.5)
                        continue
                elif holder.get("host") == self.record["host"] and holder.get("pid") == self.record["pid"]:
                    return False  # this process holds it already (a command calling another)
                elif alive(holder):
                    raise self._refuse(holder, self.path) from None
                what = "an unreadable lock" if holder is None else (
                    f"the stale lock of PID {holder.get('pid')} (`tieflax {holder.get('command')}`, no longer "
                    "running)")
                print(f"tieflax: {self.owner}: taking over {what}", file=sys.stderr, flush=True)
                storage.delete(self.path)
                continue
            # From here on release() removes the file, also when a signal stops the record's write below.
            self._mine = True
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.record, f)
            return True
        raise self._refuse(None, self.path)

    def release(self) -> None:
        """Removes the file this object created while it is still this process's (its record, or no record
        yet: a signal came while it was written), then the folder if the lock made it. Nothing when
        ``acquire`` did not create it (refused, or held already by an outer command)."""
        if not self._mine:
            return
        self._mine = False
        holder = self._holder()
        if holder is None or (holder.get("pid") == self.record["pid"] and holder.get("host") == self.record["host"]):
            storage.delete(self.path)
        if self._created:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
