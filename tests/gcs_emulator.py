"""A Cloud Storage JSON-API server on 127.0.0.1 for the tests: ``gcp-storage-emulator``, plus the
generation preconditions real Cloud Storage enforces.

gcp-storage-emulator (2026.7.19) ignores ``ifGenerationMatch`` (two creates with ``ifGenerationMatch=0``
both succeed) and sends no ``x-goog-generation`` header with a download, so a client cannot
compare-and-set through it. This wrapper adds both, as Cloud Storage documents them: a write or delete
whose ``ifGenerationMatch`` differs from the object's generation (0: "must not exist") is answered
``412 Precondition Failed`` and changes nothing; downloads carry the object's generation. Everything else
is the emulator's own code.

Two access rules, off unless asked for, answer as Cloud Storage answers a caller it refuses, so that the
tests can see what a user without credentials or without write access sees:

- ``--require-token T``: a request without ``Authorization: Bearer T`` is answered ``401`` ("Anonymous
  caller does not have storage.objects.get access ...", Cloud Storage's answer to a caller with no
  credentials);
- ``--deny-writes REGEX``: a create, upload or delete of an object whose ``bucket/name`` matches REGEX
  is answered ``403`` ("... does not have storage.objects.create access ...", its answer to a caller
  whose role only reads: a read-only bucket, or an IAM condition on a prefix).

    python tests/gcs_emulator.py --port 9023        # in-memory; buckets are created by the clients
"""

from __future__ import annotations

import argparse
import functools
import http.server
import logging
import re
import threading
from http import HTTPStatus

from gcp_storage_emulator import server as emulator_server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_write_lock = threading.Lock()  # a precondition check and its write are one step, as on Cloud Storage


def _current_generation(storage, bucket: str, object_id: str) -> str:
    try:
        return str(storage.get_file_obj(bucket, object_id)["generation"])
    except NotFound:
        return "0"


def _object_id(request) -> str | None:
    if "object_id" in request.params:
        return request.params["object_id"]
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    if isinstance(data, dict) and isinstance(data.get("meta"), dict):
        return data["meta"].get("name")
    return None


def _preconditioned(handler):
    """Checks ``ifGenerationMatch`` against the object's generation before the emulator's handler."""
    @functools.wraps(handler)
    def wrapped(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if not wanted:
            return handler(request, response, storage, *args, **kwargs)
        object_id = _object_id(request)
        with _write_lock:
            if object_id is not None and _current_generation(
                    storage, request.params["bucket_name"], object_id) != str(wanted[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                                         "specified did not hold.", "errors": [{"reason": "conditionNotMet"}]}})
                return None
            return handler(request, response, storage, *args, **kwargs)
    return wrapped


def _with_generation(handler):
    """Adds ``x-goog-generation`` to downloads, as Cloud Storage sends it."""
    @functools.wraps(handler)
    def wrapped(request, response, storage, *args, **kwargs):
        out = handler(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        except (NotFound, KeyError):
            pass
        return out
    return wrapped


def _refuse(response, status: HTTPStatus, caller: str, permission: str, reason: str) -> None:
    """Cloud Storage's answer to a caller who lacks ``permission``."""
    message = (f"{caller} does not have {permission} access to the Google Cloud Storage object. Permission "
               f"'{permission}' denied on resource (or it may not exist).")
    response.status = status
    response.json({"error": {"code": int(status), "message": message,
                             "errors": [{"message": message, "domain": "global", "reason": reason}]}})


def _authorised(token: str | None, permission: str, handler):
    """Refuses a request that does not carry ``token`` (Cloud Storage's answer to an anonymous caller)."""
    @functools.wraps(handler)
    def wrapped(request, response, storage, *args, **kwargs):
        if token is not None and request.get_header("Authorization") != f"Bearer {token}":
            _refuse(response, HTTPStatus.UNAUTHORIZED, "Anonymous caller", permission, "required")
            return None
        return handler(request, response, storage, *args, **kwargs)
    return wrapped


def _writable(denied: re.Pattern | None, permission: str, handler):
    """Refuses a write to an object whose ``bucket/name`` matches ``denied`` (a role that only reads)."""
    @functools.wraps(handler)
    def wrapped(request, response, storage, *args, **kwargs):
        object_id = _object_id(request)
        if denied is not None and object_id is not None and denied.search(
                f"{request.params['bucket_name']}/{object_id}"):
            _refuse(response, HTTPStatus.FORBIDDEN, "test-caller@tieflax.test", permission, "forbidden")
            return None
        return handler(request, response, storage, *args, **kwargs)
    return wrapped


_WRITES = (objects.insert, objects.delete, objects.xml_upload)
_WRAP = {objects.insert: _preconditioned, objects.delete: _preconditioned, objects.xml_upload: _preconditioned,
         objects.download: _with_generation, objects.get: _with_generation}


def patch_handlers(require_token: str | None = None, deny_writes: str | None = None) -> None:
    """Rewrites the emulator's route table in place (it holds the handler functions themselves)."""
    denied = re.compile(deny_writes) if deny_writes else None
    for _, methods in emulator_server.HANDLERS:
        for method, handler in list(methods.items()):
            wrapped = _WRAP[handler](handler) if handler in _WRAP else handler
            permission = "storage.objects.get"
            if handler in _WRITES:
                permission = "storage.objects.delete" if handler is objects.delete else "storage.objects.create"
                wrapped = _writable(denied, permission, wrapped)
            methods[method] = _authorised(require_token, permission, wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--require-token", help="answer 401 to a request without this bearer token")
    parser.add_argument("--deny-writes", help="answer 403 to writes of objects whose bucket/name matches")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    patch_handlers(args.require_token, args.deny_writes)
    # The emulator serves one connection at a time. While a test holds it frozen (SIGSTOP), the kernel
    # queues the connections its clients open, as a stalled network's server would; with the default
    # queue of 5 the rest are dropped or refused, which a client reads as a server gone, not one silent.
    http.server.HTTPServer.request_queue_size = 128
    emulator_server.create_server(args.host, args.port, in_memory=True).run()


if __name__ == "__main__":
    main()
