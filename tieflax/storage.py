"""One path layer for the package: local folders, Cloud Storage (``gs://``) and S3 (``s3://``).

Every module that reads, writes, lists or deletes something on a run path (a workdir, a report folder,
a data cache, a token store) asks this module; nothing else calls ``open``, ``os.path``, ``os.rename``
or ``shutil`` on such a path. Paths stay plain strings: a local path (made absolute) or a URL
``gs://bucket/prefix`` / ``s3://bucket/prefix``.

The atomicity policy is chosen here, once, per kind of storage:

* Whole objects only. ``write_bytes`` on a local path writes a temporary file beside the target and
  renames it (a reader never sees half a file); on an object store one PUT is atomic already, and there
  is no rename to use.
* No appends: object stores have none (gcsfs silently ignores append mode), so logs are written as
  immutable segments (see ``tieflax.run.metrics``).
* ``create_new`` writes an object only if it does not exist yet (``O_EXCL`` locally, a generation
  precondition on Cloud Storage and S3): the primitive behind ``config.json``'s claim on a prefix and
  the lease (``tieflax.lease``).

Objects go through tensorstore's key-value store of their bucket (``kvstore_spec``; the same library that
writes orbax's and the token store's arrays), which speaks the Cloud Storage JSON API and S3 directly:
one request per call, no client-side cache, generations for compare-and-set. Orbax itself takes the same
URL strings (etils.epath with gcsfs / s3fs underneath, for its metadata files).

Credentials are the libraries' own: application default credentials for Cloud Storage, the AWS
credential chain for S3. Test servers are found through the
standard variables (``STORAGE_EMULATOR_HOST`` for gcsfs; ``TENSORSTORE_GCS_HTTP_URL`` for tensorstore;
``AWS_ENDPOINT_URL`` for S3).
"""

from __future__ import annotations

import contextlib
import fnmatch
import errno
import os
import re
import tempfile
import threading
import time
from typing import Callable, Iterator

from tieflax.errors import UserError

# gcsfs >= 2025 first asks a bucket's layout over gRPC (zonal/hierarchical buckets). tieflax needs no
# feature of those bucket kinds, the plain JSON-API file system reads and writes them all, and the probe
# logs an error per bucket wherever gRPC is not answered (test servers, some proxies). Set before gcsfs
# is first imported; a user's own setting wins.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

REMOTE_SCHEMES = ("gs", "s3")

# Every remote call has a deadline: tensorstore retries a failed request with backoff (up to 32 times, 32 s
# apart: a quarter of an hour) and waits on a stalled connection forever. Within the deadline its own
# retries and backoff (``_RETRIES``) run as usual; when it passes, the call is cancelled and the command
# stops with one line naming the object.
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
_RETRIES = {"max_retries": 1000, "initial_delay": "0.5s", "max_delay": "8s"}  # the deadline bounds them
# A transfer that moves nothing for a minute is dropped and retried on a new connection (libcurl's
# low-speed watchdog; tensorstore sets no timeout on its requests). Read when tensorstore starts.
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "60")
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


class StorageError(UserError, RuntimeError):
    """A path cannot be used as asked; the message names the path and what to do."""


# ------------------------------------------------------------------------------------------------ names

def is_remote(path: str) -> bool:
    """True for ``gs://...`` and ``s3://...``."""
    return str(path).split("://", 1)[0] in REMOTE_SCHEMES and "://" in str(path)


def resolve(path: str | os.PathLike) -> str:
    """The canonical form of a run path: a remote URL without a trailing slash, or an absolute local path.

    Refuses, before any work, what would otherwise be taken for a local folder: another scheme
    (``http://``, ``hdfs://``), a URL with its colon or a slash missing (``gs:/bucket``, ``gs:bucket``,
    ``gs//bucket``: :func:`refuse_url_typo`), or no bucket.
    """
    text = os.fspath(path)
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme not in REMOTE_SCHEMES:
            raise StorageError(f"{text}: the scheme {scheme}:// is not supported; use a local path, "
                               "gs://bucket/prefix or s3://bucket/prefix")
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise StorageError(f"{text} names no bucket: write {scheme}://BUCKET/prefix")
        parts = [p for p in rest.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise StorageError(f"{text}: '.' and '..' have no meaning in an object name; write the prefix "
                               "in full")
        return f"{scheme}://" + "/".join(parts)
    refuse_url_typo(text)
    return os.path.abspath(os.path.expanduser(text))


def refuse_url_typo(text: str) -> None:
    """Refuses a local path that is a bucket URL with its colon or a slash missing, which would otherwise
    train into a local folder named after the bucket: ``gs:/bkt``, ``gs:bkt/x`` and ``gs:`` (a first
    component ``gs:...``), and ``gs//bkt/x`` (typed ``gs//``); the same for ``s3``.

    Only the forms a typo makes are refused. ``gs/bkt`` (one slash) is a plain relative path, as legal as
    any, and a real folder named ``gs:x`` or ``gs`` stays reachable as ``./gs:x`` or ``./gs//bkt``: the
    ``./`` says a folder was meant, which no one typing a URL writes."""
    for scheme in REMOTE_SCHEMES:
        if text.startswith((f"{scheme}:", f"{scheme}//")):
            rest = text[len(scheme):].lstrip(":").lstrip("/")
            url = f"{scheme}://{rest}" if rest else f"{scheme}://BUCKET/prefix"
            raise StorageError(f"{text} looks like a {scheme}:// URL with a colon or slash missing: write {url} "
                               f"(or ./{text} for a local folder of that name)")


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URL."""
    if is_remote(base):
        return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts if p])
    return os.path.join(base, *parts)


def name(path: str) -> str:
    """The last component (``basename``); a trailing slash is no component."""
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path.rstrip(os.sep) or path)


def parent(path: str) -> str:
    """The folder or prefix holding ``path``."""
    if is_remote(path):
        head = path.rstrip("/").rsplit("/", 1)[0]
        return head if "://" in head and head.split("://", 1)[1] else path
    return os.path.dirname(os.path.abspath(path))


def bucket_and_key(path: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of a remote URL; key '' for the bucket itself. The key as ``resolve`` would
    write it (no empty parts: ``gs://b/run/`` and ``gs://b//run`` name ``run``), so every remote call
    takes a URL as the user typed it."""
    scheme, rest = path.split("://", 1)
    bucket, _, key = rest.partition("/")
    return scheme, bucket, "/".join(p for p in key.split("/") if p)


def forget_listings(path: str) -> None:
    """Drops gcsfs's / s3fs's cached listings before orbax looks at ``path``: those file systems cache
    a folder's listing for the life of the process, so a long-lived process (a notebook, a test, a
    study that trains and then reads back) would see the checkpoints that existed when it first looked."""
    if not is_remote(path):
        return
    import fsspec  # noqa: PLC0415

    cls = fsspec.get_filesystem_class(path.split("://", 1)[0])
    for instance in list(getattr(cls, "_cache", {}).values()):
        instance.invalidate_cache()


def kvstore_spec(path: str) -> dict:
    """A tensorstore key-value store spec rooted at ``path`` (a folder or prefix; keys are relative)."""
    if not is_remote(path):
        return {"driver": "file", "path": os.path.abspath(path) + "/"}
    scheme, bucket, key = bucket_and_key(path)
    spec = {"driver": "gcs" if scheme == "gs" else "s3", "bucket": bucket,
            "path": (key + "/") if key else ""}
    if scheme == "s3" and os.environ.get("AWS_ENDPOINT_URL"):
        spec["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
        spec["aws_region"] = os.environ.get("AWS_DEFAULT_REGION", os.environ.get("AWS_REGION", "us-east-1"))
    return spec


# ------------------------------------------------------------------------------------------------ reads
# Remote objects are read and written through tensorstore's key-value store of the bucket: one request
# per call, no client-side listing cache (gcsfs caches sizes and listings, so a file rewritten through
# another client could be read back cut to its old size), and the same generations for compare-and-set.

_BUCKETS: dict[tuple[str, str], object] = {}


def _bucket_store(path: str):
    """``(kvstore of the bucket, key)``; stores are opened once per bucket and process."""
    scheme, bucket, key = bucket_and_key(path)
    store = _BUCKETS.get((scheme, bucket))
    if store is None:
        import tensorstore as ts  # noqa: PLC0415

        spec = kvstore_spec(f"{scheme}://{bucket}")
        if scheme == "gs":
            spec["context"] = {"gcs_request_retries": dict(_RETRIES)}
        store = _wait(ts.KvStore.open(spec))
        _BUCKETS[(scheme, bucket)] = store
    return store, key


def _keys_under(path: str) -> list[str]:
    """Keys (relative to the bucket) of every object under the prefix ``path/``."""
    import tensorstore as ts  # noqa: PLC0415

    store, key = _bucket_store(path)
    prefix = key.rstrip("/") + "/" if key else ""
    if prefix:  # [prefix, prefix with its last byte + 1): every key that starts with prefix
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        found = _wait(store.list(ts.KvStore.KeyRange(prefix, end)))
    else:
        found = _wait(store.list())
    # Filtered again here: some servers (the Cloud Storage emulator) ignore the range's offsets.
    return sorted(k for k in (k.decode() for k in found) if k.startswith(prefix))


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


def _read_remote(path: str) -> bytes | None:
    def read():
        store, key = _bucket_store(path)
        r = _wait(store.read(key))
        return None if r.state == "missing" else bytes(r.value)
    return _remote(path, "read", read)


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
        folder, name = os.path.split(os.path.abspath(path))
        tmp_fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
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


# What a store that stopped answering looks like from the libraries underneath orbax (gcsfs/aiohttp, tensorstore's
# curl transport, google-auth): a connection reset or refused, a timeout, a 5xx/408/429, curl's "too slow".
_NO_ANSWER_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN}
_NO_ANSWER_TEXT = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|5\d\d|408|429)\b|timed? ?out|timeout|too slow|"
                             r"server disconnected|connection (reset|refused|aborted|closed)|cannot connect|"
                             r"temporarily unavailable|broken pipe", re.IGNORECASE)
_NO_ANSWER_TYPES = ("ClientError", "ClientOSError", "ServerDisconnectedError", "ServerTimeoutError",
                    "ClientConnectorError", "ClientPayloadError", "TimeoutError", "ConnectionError",
                    "TransportError", "RetryError")


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_no_answer(e: BaseException) -> bool:
    """True when ``e`` (or an exception it was raised from) says a store did not answer (a transient
    outage: worth retrying within the deadline), not that it refused (no permission, no bucket) or that
    a disk is full."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return False
        if re.search(r"\b(401|403|404)\b|forbidden|permission|access denied|not found|no such bucket", str(x),
                     re.IGNORECASE):
            return False
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _NO_ANSWER_ERRNOS:
            return True
        if any(t.__name__ in _NO_ANSWER_TYPES for t in type(x).__mro__) or _NO_ANSWER_TEXT.search(str(x)):
            return True
    return False


def object_named_in(e: BaseException, under: str) -> str | None:
    """The object under ``under`` (a gs:// or s3:// prefix) that ``e``'s messages name, as a URL, if any
    (gcsfs names it as ``bucket/key``, tensorstore as ``gs://bucket/key`` or in an HTTP URL)."""
    scheme, bucket, _ = bucket_and_key(under)
    key_text = r"[^\s\"',\]\)]+"
    patterns = (rf"{scheme}://{re.escape(bucket)}/({key_text})", rf"/b/{re.escape(bucket)}/o/({key_text})",
                rf"/b/{re.escape(bucket)}/o\?(?:[^\s]*&)?name=([^\s&\"']+)", rf"(?<![\w/]){re.escape(bucket)}/({key_text})")
    for x in _chain(e):
        for pattern in patterns:
            match = re.search(pattern, str(x))
            if match:
                import urllib.parse  # noqa: PLC0415

                key = urllib.parse.unquote(match.group(1).split("?", 1)[0]).rstrip(":.;")
                return f"{scheme}://{bucket}/{key}"
    return None


def _gcs_credentials_configured() -> bool:
    if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING") or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return True
    home = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    return os.path.isfile(os.path.join(home, "application_default_credentials.json"))


def _why(path: str, action: str, detail: str) -> str:
    scheme, bucket, _ = bucket_and_key(path)
    text = " ".join(detail.split())
    low = text.lower()
    code = {c for c in ("401", "403", "404") if re.search(rf"\b{c}\b", low)}  # HTTP status in the text
    if "credential" in low or "anonymous caller" in low or "401" in code or "unauthenticated" in low:
        fix = ("no credentials found (the request went out anonymous): run `gcloud auth application-default "
               "login` or set GOOGLE_APPLICATION_CREDENTIALS" if scheme == "gs" else
               "no credentials found: configure the AWS credential chain (aws configure, AWS_PROFILE or "
               "AWS_ACCESS_KEY_ID)")
    elif "nosuchbucket" in low or ("not found" in low and "bucket" in low) or "404" in code:
        fix = f"the bucket {scheme}://{bucket} does not exist: create it (or fix the name)"
    elif "403" in code or "forbidden" in low or "access denied" in low or "permission" in low:
        fix = (f"permission denied on {scheme}://{bucket}: grant this account write access to the bucket "
               "(roles/storage.objectAdmin) or choose another" if action == "write" else
               f"permission denied on {scheme}://{bucket}: grant this account read access")
    else:
        fix = "check the bucket, the network and the credentials"
    return f"cannot {action} {path}: {fix} ({text[:200]})"
