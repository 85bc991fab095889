"""Files and objects whole: read, written (a reader sees the old content or the new, never a part),
listed, deleted and moved, the same calls for a local path and a gs:// or s3:// URL."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import tempfile
from typing import Iterator

from tieflax.storage.buckets import _bucket_store, _keys_under, _read_remote
from tieflax.storage.deadlines import _remote, _wait
from tieflax.storage.paths import bucket_and_key, is_remote, join, name, refuse_url_typo, resolve


# ------------------------------------------------------------------------------------------------ reads

def exists(path: str) -> bool:
    """True when ``path`` is a file/object, or a folder/prefix holding anything."""
    if not is_remote(path):
        return os.path.exists(path)
    return is_file(path) or is_dir(path)


def is_dir(path: str) -> bool:
    """Locally a folder; remotely a prefix that holds at least one object."""
    if not is_remote(path):
        return os.path.isdir(path)
    return bool(_remote(path, "list", lambda: _keys_under(path)))


def is_file(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    return _read_remote(path) is not None


def listdir(path: str) -> list[str]:
    """Names directly under ``path`` (sorted); [] when it does not exist."""
    if not is_remote(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    prefix = bucket_and_key(path)[2].rstrip("/")
    cut = len(prefix) + 1 if prefix else 0
    return sorted({k[cut:].split("/", 1)[0] for k in _remote(path, "list", lambda: _keys_under(path))})


def walk_files(path: str) -> list[str]:
    """Every file under the folder/prefix ``path``, recursively, as full paths (sorted)."""
    if not is_remote(path):
        out = []
        for folder, _, files in os.walk(path):
            out += [os.path.join(folder, f) for f in files]
        return sorted(out)
    scheme, bucket, _ = bucket_and_key(path)
    return [f"{scheme}://{bucket}/{k}" for k in _remote(path, "list", lambda: _keys_under(path))]


def glob(pattern: str) -> list[str]:
    """Files matching ``pattern`` (``*``, ``?``, ``[...]``, ``**``), sorted, as paths of the same kind
    (remotely canonical URLs: a malformed one is refused). Remotely ``*`` may also cross '/'. A literal
    path matches itself when it is a file (remotely also where listing is not allowed)."""
    if not is_remote(pattern):
        import glob as _glob  # noqa: PLC0415

        refuse_url_typo(pattern)  # gs:bkt/*.txt: a URL to fix, not a local pattern that matches nothing

        return sorted(p for p in _glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    pattern = resolve(pattern)
    scheme, bucket, key = bucket_and_key(pattern)
    literal = key.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    base = literal.rsplit("/", 1)[0] if "/" in literal else ""
    # One listing of the literal prefix, then the pattern applied here.
    keys = _remote(pattern, "list", lambda: _keys_under(f"{scheme}://{bucket}/{base}"))
    found = [f"{scheme}://{bucket}/{k}" for k in keys if fnmatch.fnmatchcase(k, key)]
    if not found and literal == key and is_file(pattern):
        found = [pattern]
    return found


def read_bytes(path: str) -> bytes:
    """The whole file/object; FileNotFoundError naming it when absent."""
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    data = _read_remote(path)
    if data is None:
        raise FileNotFoundError(2, "No such object", path)
    return data


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def read_many(paths: list[str]) -> list[bytes | None]:
    """Each file's/object's whole content, None where it is absent, in the order given. On an object store
    the reads go out together and are awaited together (one round trip's wait for a record of small
    objects, not one per object), within one deadline; a failure names the first remote path."""
    remote = [p for p in paths if is_remote(p)]

    def read():
        futures = []
        for p in remote:  # every request is sent before the first answer is awaited
            store, key = _bucket_store(p)
            futures.append((p, store.read(key)))
        found = {}
        for p, future in futures:
            r = _wait(future)
            found[p] = None if r.state == "missing" else bytes(r.value)
        return found
    got = _remote(remote[0], "read", read) if remote else {}
    out = []
    for p in paths:
        if is_remote(p):
            out.append(got[p])
            continue
        try:
            with open(p, "rb") as f:
                out.append(f.read())
        except FileNotFoundError:
            out.append(None)
    return out


# ----------------------------------------------------------------------------------------------- writes

def write_bytes(path: str, data: bytes) -> None:
    """Writes ``path`` whole: a reader sees the old content or the new, never a part."""
    if is_remote(path):
        def write():
            store, key = _bucket_store(path)
            _wait(store.write(key, data))
        _remote(path, "write", write)
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            # mkstemp creates 0600 whatever the umask: give the file the mode open() would (0644 under 022).
            os.fchmod(f.fileno(), 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:  # a full disk: name the file
            raise OSError(e.errno, e.strerror, path) from None
        raise


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


_FALLBACK_UMASK: list[int] = []


def _umask() -> int:
    """The process umask, read without changing it: Linux reports it in /proc/self/status (read each
    time, so a later ``os.umask`` is seen). Elsewhere ``os.umask`` must set a value to return the old one,
    which for an instant applies to every thread's new files: done once, at the first write, and kept."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    if not _FALLBACK_UMASK:
        mask = os.umask(0o077)  # the most private value for that instant, not 0
        os.umask(mask)
        _FALLBACK_UMASK.append(mask)
    return _FALLBACK_UMASK[0]


def delete(path: str) -> None:
    """Removes one file/object; nothing when it is absent."""
    if not is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return

    def remove():
        store, key = _bucket_store(path)
        _wait(store.write(key, None))
    _remote(path, "write", remove)


def rmtree(path: str) -> None:
    """Removes a folder/prefix and everything under it; nothing when it is absent."""
    if not is_remote(path):
        import shutil  # noqa: PLC0415

        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        return
    for key in _remote(path, "list", lambda: _keys_under(path)):
        scheme, bucket, _ = bucket_and_key(path)
        delete(f"{scheme}://{bucket}/{key}")


def move_tree(src: str, dst: str) -> None:
    """Moves a folder/prefix. Locally one rename; an object store has none, so each object is copied
    whole and the source removed after all copies succeeded (a failure leaves both, never neither)."""
    if not is_remote(src) and not is_remote(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
        return
    files = walk_files(src)
    cut = len(src.rstrip("/")) + 1
    for f in files:
        write_bytes(join(dst, f[cut:]), read_bytes(f))
    rmtree(src)


def makedirs(path: str) -> None:
    """Creates a local folder (and parents); on an object store prefixes need no creating."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def upload_file(local_path: str, path: str) -> None:
    """Copies a local file to ``path`` whole."""
    with open(local_path, "rb") as f:
        write_bytes(path, f.read())


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local file path holding ``path``'s content for the block (the path itself when it is local):
    for libraries that only open local files (``tokenizers.Tokenizer.from_file``)."""
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="tieflax-") as tmp:
        local = os.path.join(tmp, name(path))
        with open(local, "wb") as f:
            f.write(read_bytes(path))
        yield local


# ------------------------------------------------------------------------------------------ preflight

def check_writable(path: str) -> None:
    """Before any work: the bucket exists, credentials are found and allow writing under ``path``.

    Writes and removes one probe object. Raises StorageError naming the path and the fix. Local paths
    are left to the command (its own messages name the folder).
    """
    if not is_remote(path):
        return
    probe = join(path, f".tieflax-write-probe-{os.getpid()}")
    write_bytes(probe, b"tieflax write probe")
    delete(probe)
