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
import time

from tieflax.errors import UserError

LOCK_FILE = "tieflax.lock"
PARTIAL_TAG = ".partial-"


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


@contextlib.contextmanager
def workdir_lock(workdir: str, command: str, *, enabled: bool = True):
    """Holds ``<workdir>/tieflax.lock`` for the block (creating the folder). Re-entrant within a process.

    Raises WorkdirError when another live process holds it. ``enabled=False`` (processes other than 0 of
    a multi-process job) does nothing: process 0 holds the lock for the job.
    """
    if not enabled:
        yield
        return
    workdir = os.path.abspath(workdir)
    _check_folder(workdir)
    created = not os.path.exists(workdir)
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "start": _process_start(os.getpid())}
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
                raise WorkdirError(
                    f"{workdir} is in use by `tieflax {holder.get('command')}` (host {holder.get('host')}, "
                    f"PID {holder.get('pid')}, since {holder.get('since')}): wait for it to finish or stop "
                    f"it; if that process is gone, delete {path}") from None
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
    workdir = os.path.abspath(workdir)
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
        raise WorkdirError(f"an import into {os.path.abspath(workdir)} did not finish ({found[0]} is "
                           "incomplete): rerun the `tieflax convert` command that writes it, or delete "
                           f"{found[0]} to train without it")


def holds_a_run(folder: str) -> bool:
    """True when ``folder`` holds anything a run left (config, checkpoints, parameters, metrics)."""
    return any(os.path.exists(os.path.join(folder, n))
               for n in ("config.json", "checkpoints", "initial_params", "metrics.jsonl"))


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
