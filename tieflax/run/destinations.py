"""Where a destructive step may write: the checks ``tieflax convert`` runs before it writes or replaces.

``--overwrite`` replaces a destination folder whole, so a wrong destination loses work: a destination that
*is* the source, *contains* it (``--out`` = the source's parent) or *lies inside* it, that contains another
run (a training run beside the source) or lies inside one, or that a running command holds. Each is
refused before anything is read or written, after resolving symbolic links (a link to the source is the
source). Paths may be local or ``gs://`` / ``s3://`` URLs (``tieflax.storage``).

A new workdir (an import or a surgery) appears complete or not at all: locally it is written into
``<parent>/.<name>.partial-<pid>`` and renamed when complete (``writing_new_workdir``); a leftover partial
folder means an interrupted import, and ``check_no_partial_import`` makes training refuse, naming it. On
gs:// / s3:// (no rename) it is written in place behind the ``tieflax.incomplete`` marker object.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from typing import Iterator, Sequence

from tieflax import storage
from tieflax.run.layout import (CONFIG_FILE, INCOMPLETE_MARKER, INITIAL_PARAMS_DIR, LOCK_FILE, PARTIAL_TAG,
                                RUN_CONTENT, RunDir, WorkdirError, canonical, check_location, holds_a_run,
                                is_run)
from tieflax.run.lock import workdir_lock


def real(path: str) -> str:
    """The canonical path: links resolved locally, the URL's canonical form remotely."""
    path = canonical(path)
    return path if storage.is_remote(path) else os.path.realpath(path)


def _inside(path: str, folder: str) -> bool:
    """True when ``path`` lies strictly inside ``folder`` (both canonical)."""
    sep = "/" if storage.is_remote(folder) else os.sep
    return path != folder and path.startswith(folder.rstrip(sep) + sep)


inside = _inside


def check_destination(out: str, *, sources: Sequence[tuple[str, str]] = (), overwrite: bool,
                      flag: str = "--out") -> str:
    """Refuses ``out`` when writing or replacing it could destroy what this command did not create; returns
    it canonical (``canonical``: links are followed to compare, not in the name returned).
    ``sources``: ``(flag, path)`` of what the command reads, e.g. ``[("--workdir", run)]``. Raises
    WorkdirError naming both paths and the fix."""
    dest = real(out)
    shown = canonical(out)
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
        if is_run(ancestor):
            raise WorkdirError(f"{flag} {shown}{link} lies inside the run {ancestor}: write to a new folder "
                               "outside it")
    if overwrite and not is_run(dest):
        inner = _first_run_inside(dest)
        if inner:
            raise WorkdirError(f"{flag} {shown}{link} contains the run {inner}; --overwrite would delete it: "
                               "write to a new folder")
    return shown


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
        keys = storage.walk_files(folder)
        for path in keys:
            if storage.name(path) == LOCK_FILE:
                return storage.parent(path)
            if storage.name(path) == CONFIG_FILE:
                run = storage.parent(path)
                if any(k.startswith(storage.join(run, n)) for k in keys for n in RUN_CONTENT):
                    return run
        return None
    if not os.path.isdir(folder):
        return None
    for top, dirs, _ in os.walk(folder):
        for d in list(dirs):
            sub = os.path.join(top, d)
            if os.path.islink(sub):
                dirs.remove(d)  # rmtree removes a link, never what it points at
            elif is_run(sub):
                return sub
    return None


def check_output_folder(output: str | None, flag: str = "--output") -> str | None:
    """A folder a command writes its result files into (lm-eval's ``--output``), before any work: resolved
    (``gs:/b`` and other schemes refused), checked writable on a bucket; locally its nearest existing
    folder must be a writable folder. None stays None."""
    if output is None:
        return None
    output = canonical(output)
    storage.check_writable(output)
    if not storage.is_remote(output):
        there = output
        while not storage.exists(there) and storage.parent(there) != there:
            there = storage.parent(there)
        if not storage.is_dir(there):
            raise WorkdirError(f"{flag} {output} " + ("is a file" if there == output else f"cannot be a folder: "
                               f"{there} is a file") + ": lm-eval writes a folder of result files; choose a folder")
        if not os.access(there, os.W_OK | os.X_OK):
            raise WorkdirError(f"{flag} {output}: {there} is not writable by this user; choose a folder you can "
                               "write")
    return output


# ----------------------------------------------------------------------------------------- writing
def check_empty_or_replaceable(dest: str, *, overwrite: bool, flag: str = "--out") -> str:
    """Before any work: a local destination may hold something only with ``overwrite`` (it is replaced
    whole by a rename); a gs:// / s3:// prefix must be empty, since there is no rename to replace it
    whole, except for what an interrupted convert left behind its incomplete marker. Returns ``dest``
    canonical."""
    dest = canonical(dest)
    if not storage.is_remote(dest):
        _check_local_destination(dest, overwrite=overwrite)
        return dest
    names = set(storage.listdir(dest)) - {LOCK_FILE}
    if names and INCOMPLETE_MARKER not in names:
        raise WorkdirError(f"{flag} {dest} is not empty: on an object store convert writes only into an empty "
                           f"prefix{' (--overwrite cannot replace one: there is no rename)' if overwrite else ''}; "
                           "choose a new prefix, or delete this one first")
    return dest


@contextlib.contextmanager
def writing_new_workdir(dest: str, *, overwrite: bool, command: str = "convert") -> Iterator[str]:
    """Yields the folder to write a new workdir into, holding ``dest``'s lock; it appears complete or is
    marked incomplete.

    Local: a partial folder beside ``dest``, renamed to ``dest`` when the block ends (replacing it with
    ``overwrite``). gs:// / s3://: ``dest`` itself, with the marker object ``INCOMPLETE_MARKER`` written
    first and deleted last; `tieflax train` refuses a workdir holding it. A block that fails or is
    interrupted (SIGTERM/SIGINT arrive as exceptions, see tieflax.cli) removes what it wrote; only a
    kill -9 leaves a partial folder or a marked prefix behind, and rerunning the command clears it.
    """
    dest = canonical(dest)
    with workdir_lock(dest, command):
        if not storage.is_remote(dest):
            partial = fresh_partial_folder(dest)
            try:
                yield partial
                publish(partial, dest, overwrite=overwrite)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            return
        marker = storage.join(dest, INCOMPLETE_MARKER)
        _remove_all_but_the_lock(dest)  # empty, or what an interrupted convert left (checked before)
        storage.write_text(marker, f"tieflax {command} is writing this workdir; it is complete once this "
                                   "object is gone\n")
        try:
            yield dest
        except BaseException:
            _remove_all_but_the_lock(dest)  # this command wrote all of it (the prefix was empty)
            raise
        storage.delete(marker)


def _remove_all_but_the_lock(prefix: str) -> None:
    for path in storage.walk_files(prefix):
        if storage.name(path) != LOCK_FILE or storage.parent(path) != prefix:
            storage.delete(path)


def copy_file(src: str, dst: str) -> None:
    """One file, whole, between any two kinds of path."""
    storage.write_bytes(dst, storage.read_bytes(src))


def copy_tree(src: str, dst: str) -> list[str]:
    """Every file under ``src`` to the same place under ``dst``; returns the relative names copied."""
    src = canonical(src)
    names = []
    for path in storage.walk_files(src):
        rel = path[len(src):].lstrip("/" if storage.is_remote(src) else os.sep)
        copy_file(path, storage.join(dst, *rel.split("/" if storage.is_remote(src) else os.sep)))
        names.append(rel)
    return names


# ---------------------------------------------------------------- local: a partial folder, then a rename
def partial_folder(dest: str) -> str:
    """Where an import or surgery into the new run folder ``dest`` is written before the rename that
    completes it."""
    dest = os.path.abspath(dest)
    return os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}{PARTIAL_TAG}{os.getpid()}")


def fresh_partial_folder(dest: str) -> str:
    """An empty ``partial_folder``, after removing what interrupted imports into ``dest`` left (call it
    holding ``dest``'s lock, so no other import is writing one)."""
    for leftover in partial_imports(dest):
        if PARTIAL_TAG in os.path.basename(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
    path = partial_folder(dest)
    os.makedirs(path)
    return path


def partial_imports(dest: str) -> list[str]:
    """What interrupted imports or surgeries into the run folder ``dest`` left: partial folders beside it,
    orbax's temporary ``initial_params`` inside it, or (gs://, s3://) its incomplete marker."""
    dest = canonical(dest)
    if storage.is_remote(dest):  # no rename there: convert writes in place behind a marker object
        marker = storage.join(dest, INCOMPLETE_MARKER)
        return [marker] if storage.is_file(marker) else []
    pattern = os.path.join(os.path.dirname(dest), f".{glob.escape(os.path.basename(dest))}{PARTIAL_TAG}*")
    found = glob.glob(pattern)
    # orbax writes initial_params/ under a temporary name first: a kill during that write leaves it
    found += [p for p in glob.glob(os.path.join(glob.escape(dest), INITIAL_PARAMS_DIR + "*"))
              if os.path.basename(p) != INITIAL_PARAMS_DIR]
    return sorted(found)


def check_no_partial_import(where: RunDir | str) -> None:
    """Refuses a run whose import or surgery was interrupted (it would train from random weights)."""
    where = RunDir.named(where)
    found = partial_imports(where.path)
    if found:
        raise WorkdirError(f"an import into {where.path} did not finish ({found[0]} is "
                           "incomplete): rerun the `tieflax convert` command that writes it, or delete "
                           f"{found[0]} to train without it")


def publish(partial: str, dest: str, *, overwrite: bool) -> None:
    """Renames a complete ``partial`` folder to the new run folder ``dest``. An existing ``dest`` must be
    empty (this process's lock aside), or be replaced because ``overwrite`` was given.

    An existing ``dest`` is swapped with ``partial`` in one step where the kernel can (Linux
    ``renameat2(RENAME_EXCHANGE)``), so at every instant, a kill -9 included, ``dest`` is the old
    folder or the new one. Elsewhere it is moved aside first; a signal between the two renames puts the
    old one back before it goes on."""
    dest = os.path.abspath(dest)
    if os.path.isdir(dest) and set(os.listdir(dest)) - {LOCK_FILE}:
        if not overwrite:
            raise WorkdirError(f"{dest} is not empty{' and holds a run' if holds_a_run(dest) else ''}: "
                               "pass --overwrite to replace it, or write to a new folder")
    if os.path.isdir(dest):
        if _exchange(partial, dest):
            shutil.rmtree(partial, ignore_errors=True)   # now the old folder (and our lock in it)
            return
        old = partial.replace(PARTIAL_TAG, ".replaced-")
        try:
            os.replace(dest, old)
            os.replace(partial, dest)
        except BaseException:   # SIGTERM/SIGINT arrive as exceptions: never leave dest missing
            if os.path.isdir(old) and not os.path.exists(dest):
                os.replace(old, dest)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(partial, dest)


def _exchange(a: str, b: str) -> bool:
    """Swaps the folders ``a`` and ``b`` atomically (Linux renameat2 RENAME_EXCHANGE); False where the
    kernel, the C library or the file system cannot (then nothing was changed)."""
    import ctypes  # noqa: PLC0415
    import errno  # noqa: PLC0415

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), b)


def _check_local_destination(dest: str, *, overwrite: bool) -> None:
    """Before any work: refuse a destination that is a file, or holds something, unless ``overwrite``."""
    check_location(dest)
    if not overwrite and os.path.isdir(dest) and set(os.listdir(dest)) - {LOCK_FILE}:
        what = "holds a run" if holds_a_run(dest) else "is not empty"
        raise WorkdirError(f"{os.path.abspath(dest)} {what}: pass --overwrite to replace it, or write to a "
                           "new folder")
