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
import os
import re
import tempfile
from typing import Iterator

from tieflax.errors import UserError

# gcsfs >= 2025 first asks a bucket's layout over gRPC (zonal/hierarchical buckets). tieflax needs no
# feature of those bucket kinds, the plain JSON-API file system reads and writes them all, and the probe
# logs an error per bucket wherever gRPC is not answered (test servers, some proxies). Set before gcsfs
# is first imported; a user's own setting wins.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

REMOTE_SCHEMES = ("gs", "s3")


class StorageError(UserError, RuntimeError):
    """A path cannot be used as asked; the message names the path and what to do."""


# ------------------------------------------------------------------------------------------------ names

def is_remote(path: str) -> bool:
    """True for ``gs://...`` and ``s3://...``."""
    return str(path).split("://", 1)[0] in REMOTE_SCHEMES and "://" in str(path)


def resolve(path: str | os.PathLike) -> str:
    """The canonical form of a run path: a remote URL without a trailing slash, or an absolute local path.

    Refuses, before any work, what would otherwise be taken for a local folder: another scheme
    (``http://``, ``hdfs://``), a URL with one slash (``gs:/bucket``), or no bucket.
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
    for scheme in REMOTE_SCHEMES:
        if text.startswith(f"{scheme}:/") or text == f"{scheme}:":
            raise StorageError(f"{text} looks like a {scheme}:// URL with a slash missing: write "
                               f"{scheme}://BUCKET/prefix")
    return os.path.abspath(os.path.expanduser(text))


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URL."""
    if is_remote(base):
        return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts if p])
    return os.path.join(base, *parts)


def name(path: str) -> str:
    """The last component (``basename``)."""
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path)


def parent(path: str) -> str:
    """The folder or prefix holding ``path``."""
    if is_remote(path):
        head = path.rstrip("/").rsplit("/", 1)[0]
        return head if "://" in head and head.split("://", 1)[1] else path
    return os.path.dirname(os.path.abspath(path))


def bucket_and_key(path: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of a remote URL; key '' for the bucket itself."""
    scheme, rest = path.split("://", 1)
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key


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

        store = ts.KvStore.open(kvstore_spec(f"{scheme}://{bucket}")).result()
        _BUCKETS[(scheme, bucket)] = store
    return store, key


def _keys_under(path: str) -> list[str]:
    """Keys (relative to the bucket) of every object under the prefix ``path/``."""
    import tensorstore as ts  # noqa: PLC0415

    store, key = _bucket_store(path)
    prefix = key.rstrip("/") + "/" if key else ""
    if prefix:  # [prefix, prefix with its last byte + 1): every key that starts with prefix
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        found = store.list(ts.KvStore.KeyRange(prefix, end)).result()
    else:
        found = store.list().result()
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
    """Files matching ``pattern`` (``*``, ``?``, ``[...]``, ``**``), sorted, as paths of the same kind.
    Remotely ``*`` may also cross '/'."""
    if not is_remote(pattern):
        import glob as _glob  # noqa: PLC0415

        return sorted(p for p in _glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    scheme, bucket, key = bucket_and_key(pattern)
    literal = key.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    base = literal.rsplit("/", 1)[0] if "/" in literal else ""
    # One listing of the literal prefix, then the pattern applied here.
    keys = _remote(pattern, "list", lambda: _keys_under(f"{scheme}://{bucket}/{base}"))
    return [f"{scheme}://{bucket}/{k}" for k in keys if fnmatch.fnmatchcase(k, key)]


def _read_remote(path: str) -> bytes | None:
    def read():
        store, key = _bucket_store(path)
        r = store.read(key).result()
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


# ----------------------------------------------------------------------------------------------- writes

def write_bytes(path: str, data: bytes) -> None:
    """Writes ``path`` whole: a reader sees the old content or the new, never a part."""
    if is_remote(path):
        def write():
            store, key = _bucket_store(path)
            store.write(key, data).result()
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
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
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

    return ts.KvStore.open(kvstore_spec(parent(path))).result(), name(path)


def create_new(path: str, data: bytes) -> bool:
    """Writes ``path`` only if nothing exists there; False (and nothing written) when something does.

    Two processes racing for the same path: exactly one gets True (``O_EXCL`` locally; a
    does-not-exist precondition on Cloud Storage / S3).
    """
    if not is_remote(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies, as open()
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    return compare_and_set(path, data, ObjectStamp.missing()) is not None


def read_with_stamp(path: str) -> tuple[bytes | None, ObjectStamp]:
    """``(content or None when absent, stamp)`` of an object, read in one request."""
    def read():
        store, key = _store_and_key(path)
        r = store.read(key).result()
        return (None if r.state == "missing" else bytes(r.value)), ObjectStamp(r.stamp.generation)
    return _remote(path, "read", read)


def compare_and_set(path: str, data: bytes | None, expected: ObjectStamp) -> ObjectStamp | None:
    """Writes (or, with ``data`` None, deletes) ``path`` only if its generation is still ``expected``.

    Returns the new stamp, or None when the object changed in between (nothing written).
    """
    def write():
        store, key = _store_and_key(path)
        stamp = store.write(key, data, if_equal=expected.generation).result()
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
        store.write(key, None).result()
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


def _remote(path: str, action: str, fn):
    """Runs one remote operation, turning the libraries' failures into a StorageError that names the
    path and the fix (no bucket, no credentials, no permission)."""
    try:
        return fn()
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
