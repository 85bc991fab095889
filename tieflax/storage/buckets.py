"""The buckets' key-value stores: remote objects are read and written through tensorstore's key-value
store of their bucket (one request per call, no client-side listing cache: gcsfs caches sizes and
listings, so a file rewritten through another client could be read back cut to its old size; and the
same generations for compare-and-set), each opened once per bucket and process."""

from __future__ import annotations

import os

from tieflax.storage.deadlines import _remote, _wait
from tieflax.storage.paths import bucket_and_key, is_remote, kvstore_spec

_RETRIES = {"max_retries": 1000, "initial_delay": "0.5s", "max_delay": "8s"}  # the deadline bounds them


def _set_remote_libraries() -> None:
    """The settings of the libraries under a bucket path, each unless the user set it; made where this
    process first opens a bucket (every remote path goes through here before orbax's: the run's folder is
    checked and locked first), not at import, which changes nothing in a process.

    - gcsfs >= 2025 first asks a bucket's layout over gRPC (zonal/hierarchical buckets). tieflax needs no
      feature of those bucket kinds, the plain JSON-API file system reads and writes them all, and the probe
      logs an error per bucket wherever gRPC is not answered (test servers, some proxies). Read when gcsfs
      is imported (by orbax's paths, or :func:`forget_listings`).
    - A transfer that moves nothing for a minute is dropped and retried on a new connection (libcurl's
      low-speed watchdog; tensorstore sets no timeout on its requests). Read when tensorstore starts its
      HTTP transport, at its first request."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "60")
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


_BUCKETS: dict[tuple[str, str], object] = {}


def _bucket_store(path: str):
    """``(kvstore of the bucket, key)``; stores are opened once per bucket and process."""
    scheme, bucket, key = bucket_and_key(path)
    store = _BUCKETS.get((scheme, bucket))
    if store is None:
        import tensorstore as ts  # noqa: PLC0415

        _set_remote_libraries()

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


def _read_remote(path: str) -> bytes | None:
    def read():
        store, key = _bucket_store(path)
        r = _wait(store.read(key))
        return None if r.state == "missing" else bytes(r.value)
    return _remote(path, "read", read)


def forget_listings(path: str) -> None:
    """Drops gcsfs's / s3fs's cached listings before orbax looks at ``path``: those file systems cache
    a folder's listing for the life of the process, so a long-lived process (a notebook, a test, a
    study that trains and then reads back) would see the checkpoints that existed when it first looked."""
    if not is_remote(path):
        return
    _set_remote_libraries()
    import fsspec  # noqa: PLC0415

    cls = fsspec.get_filesystem_class(path.split("://", 1)[0])
    for instance in list(getattr(cls, "_cache", {}).values()):
        instance.invalidate_cache()
