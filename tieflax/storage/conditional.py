"""Conditional writes: ``create_new`` writes an object only if it does not exist yet (``O_EXCL`` locally, a
generation precondition on Cloud Storage and S3), ``compare_and_set`` only if its generation is still the
one read: the primitives behind ``config.json``'s claim on a prefix and the lease (``lease``)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile

from tieflax.storage.buckets import _bucket_store
from tieflax.storage.deadlines import _remote, _wait
from tieflax.storage.files import _umask
from tieflax.storage.paths import is_remote, kvstore_spec, name, parent

class ObjectStamp:
    """An object's storage generation as tensorstore reports it (opaque bytes), for compare-and-set."""

    def __init__(self, generation: bytes):
        self.generation = generation

    @staticmethod
    def missing() -> "ObjectStamp":
        return ObjectStamp(b"\x02")  # tensorstore's StorageGeneration::NoValue: "the key does not exist"


def _store_and_key(path: str):
    """``(kvstore, key)`` for one object, local (tensorstore's file driver) or remote."""
    if is_remote(path):
        return _bucket_store(path)
    import tensorstore as ts  # noqa: PLC0415

    return _wait(ts.KvStore.open(kvstore_spec(parent(path)))), name(path)


def create_new(path: str, data: bytes) -> bool:
    """Writes ``path`` only if nothing exists there; False (and nothing written) when something does.

    Two processes racing for the same path: exactly one gets True (``O_EXCL`` locally; a
    does-not-exist precondition on Cloud Storage / S3).
    """
    if not is_remote(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.lexists(path):
            return False
        # Whole or not at all: the data goes to a temporary file, hard-linked to ``path`` (which fails when
        # something is there). With O_EXCL alone a racing reader could see the file empty, half written
        # (two `prepare --shard` processes storing one tokenizer.json: "EOF while parsing").
        # Named as every temporary file of the path layer (``.<name>.<random>.tmp``), which a folder's checks
        # know for one: without the suffix, a token store's `--out` check on one pod host, run while another
        # host created a file there, refused the folder as holding a foreign file (seen at a load of 16).
        folder, name = os.path.split(os.path.abspath(path))
        tmp_fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        try:
            try:
                with os.fdopen(tmp_fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o666 & ~_umask())
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    if e.errno is not None and e.filename in (None, tmp):  # a full disk: name the real file
                        raise OSError(e.errno, e.strerror, path) from None
                    raise
            # a file system without hard links: create-only with O_EXCL, as before
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies, as open()
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException as e:  # a full disk: no truncated file left to pass for the real one
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            if isinstance(e, OSError) and e.errno is not None and e.filename is None:
                raise OSError(e.errno, e.strerror, path) from None
            raise
        return True
    return compare_and_set(path, data, ObjectStamp.missing()) is not None


def read_with_stamp(path: str) -> tuple[bytes | None, ObjectStamp]:
    """``(content or None when absent, stamp)`` of an object, read in one request."""
    def read():
        store, key = _store_and_key(path)
        r = _wait(store.read(key))
        return (None if r.state == "missing" else bytes(r.value)), ObjectStamp(r.stamp.generation)
    return _remote(path, "read", read)


def compare_and_set(path: str, data: bytes | None, expected: ObjectStamp) -> ObjectStamp | None:
    """Writes (or, with ``data`` None, deletes) ``path`` only if its generation is still ``expected``.

    Returns the new stamp, or None when the object changed in between (nothing written).
    """
    def write():
        store, key = _store_and_key(path)
        stamp = _wait(store.write(key, data, if_equal=expected.generation))
        return ObjectStamp(stamp.generation) if stamp.generation else None
    return _remote(path, "write", write)
