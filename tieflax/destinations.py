"""Where a destructive step may write: the checks ``tieflax convert`` runs before it writes or replaces.

``--overwrite`` replaces a destination folder whole, so a wrong destination loses work: a destination that
*is* the source, *contains* it (``--out`` = the source's parent) or *lies inside* it, that contains another
run (a training run beside the source) or lies inside one, or that a running command holds. Each is
refused before anything is read or written, after resolving symbolic links (a link to the source is the
source). Paths may be local or ``gs://`` / ``s3://`` URLs (``tieflax.storage``).
"""

from __future__ import annotations

import os
from typing import Sequence

from tieflax import storage
from tieflax.workdir import LOCK_FILE, WorkdirError, holds_a_run

RUN_MARKERS = ("config.json", "checkpoints", "initial_params", "metrics.jsonl", "metrics", LOCK_FILE)


def real(path: str) -> str:
    """The canonical path: links resolved locally, the URL's canonical form remotely."""
    path = storage.resolve(path)
    return path if storage.is_remote(path) else os.path.realpath(path)


def _inside(path: str, folder: str) -> bool:
    """True when ``path`` lies strictly inside ``folder`` (both canonical)."""
    sep = "/" if storage.is_remote(folder) else os.sep
    return path != folder and path.startswith(folder.rstrip(sep) + sep)


def _is_run(folder: str) -> bool:
    if storage.is_remote(folder):
        return any(storage.exists(storage.join(folder, n)) for n in RUN_MARKERS)
    return holds_a_run(folder) or os.path.exists(os.path.join(folder, LOCK_FILE))


def check_destination(out: str, *, sources: Sequence[tuple[str, str]] = (), overwrite: bool,
                      flag: str = "--out") -> str:
    """Refuses ``out`` (returns its canonical form) when writing or replacing it could destroy what this
    command did not create. ``sources``: ``(flag, path)`` of what the command reads, e.g.
    ``[("--workdir", run)]``. Raises WorkdirError naming both paths and the fix."""
    dest = real(out)
    shown = storage.resolve(out)
    link = f" (a link to {dest})" if dest != shown else ""
    for source_flag, source in sources:
        src = real(source)
        if dest == src:
            raise WorkdirError(f"{flag} {shown}{link} is {source_flag} {src} itself: write to a new folder")
        if _inside(src, dest):
            raise WorkdirError(f"{flag} {shown}{link} contains {source_flag} {src}"
                               f"{': replacing it would delete the source' if overwrite else ''}; write to "
                               "a new folder outside it")
        if _inside(dest, src):
            raise WorkdirError(f"{flag} {shown}{link} lies inside {source_flag} {src}: write to a new folder "
                               "outside it")
    for ancestor in _ancestors(dest):
        if _is_run(ancestor):
            raise WorkdirError(f"{flag} {shown}{link} lies inside the run {ancestor}: write to a new folder "
                               "outside it")
    if overwrite and not _is_run(dest):
        inner = _first_run_inside(dest)
        if inner:
            raise WorkdirError(f"{flag} {shown}{link} contains the run {inner}; --overwrite would delete it: "
                               "write to a new folder")
    return dest


def _ancestors(path: str) -> list[str]:
    out = []
    while True:
        up = storage.parent(path)
        if up == path or (storage.is_remote(up) and storage.bucket_and_key(up)[2] == ""):
            return out
        out.append(up)
        path = up


def _first_run_inside(folder: str) -> str | None:
    """A run (or a locked folder) anywhere under ``folder``, not following links; None when none."""
    if storage.is_remote(folder):
        for path in storage.walk_files(folder):
            if storage.name(path) in ("config.json", LOCK_FILE):
                return storage.parent(path)
        return None
    if not os.path.isdir(folder):
        return None
    for top, dirs, _ in os.walk(folder):
        for d in list(dirs):
            sub = os.path.join(top, d)
            if os.path.islink(sub):
                dirs.remove(d)  # rmtree removes a link, never what it points at
            elif _is_run(sub):
                return sub
    return None
