"""Names of run paths: a local path (made absolute) or a URL ``gs://bucket/prefix`` / ``s3://bucket/prefix``,
resolved, joined and taken apart as strings; nothing here touches a file or a bucket."""

from __future__ import annotations

import os

from tieflax.errors import UserError

REMOTE_SCHEMES = ("gs", "s3")


class StorageError(UserError, RuntimeError):
    """A path cannot be used as asked; the message names the path and what to do."""


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
