"""A Cloud Storage JSON-API server on 127.0.0.1 for the tests: ``gcp-storage-emulator``, plus the
generation preconditions real Cloud Storage enforces.

gcp-storage-emulator (2026.7.19) ignores ``ifGenerationMatch`` (two creates with ``ifGenerationMatch=0``
both succeed) and sends no ``x-goog-generation`` header with a download, so a client cannot
compare-and-set through it. This wrapper adds both, as Cloud Storage documents them: a write or delete
whose ``ifGenerationMatch`` differs from the object's generation (0: "must not exist") is answered
``412 Precondition Failed`` and changes nothing; downloads carry the object's generation. Everything else
is the emulator's own code.

    python tests/gcs_emulator.py --port 9023        # in-memory; buckets are created by the clients
"""

from __future__ import annotations

import argparse
import functools
import logging
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


_WRAP = {objects.insert: _preconditioned, objects.delete: _preconditioned, objects.xml_upload: _preconditioned,
         objects.download: _with_generation, objects.get: _with_generation}


def patch_handlers() -> None:
    """Rewrites the emulator's route table in place (it holds the handler functions themselves)."""
    for _, methods in emulator_server.HANDLERS:
        for method, handler in list(methods.items()):
            if handler in _WRAP:
                methods[method] = _WRAP[handler](handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    patch_handlers()
    emulator_server.create_server(args.host, args.port, in_memory=True).run()


if __name__ == "__main__":
    main()
