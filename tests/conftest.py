"""Test set-up: 8 CPU devices, set before JAX starts, so mesh code runs on any machine."""

import os

# Must happen before the first `import jax` anywhere in the test session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# One persistent compilation cache for the run, shared by both workers and the subprocesses they start:
# many tests compile the same small programs (the same model in another test, a resumed run). Made fresh
# by the process that loads this first (xdist's controller: its workers inherit the variable) and removed
# by it at the end; a cache the caller set is used and kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tieflax-test-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# The longest files first: with two workers taking a file at a time (setup.cfg), a long file started last
# would leave one worker running alone at the end.
_LONGEST_FILES_FIRST = ("test_train.py", "test_notebooks.py", "test_eval_harness.py", "test_memory_options.py",
                        "test_multiprocess_train.py", "test_compare_tasks.py", "test_decode.py",
                        "test_compare.py", "test_model.py", "test_bucket_run.py", "test_scan.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.fixture(scope="session")
def gcs():
    """A Cloud Storage protocol server on 127.0.0.1 for the session (``tests/object_store.py``); the
    standard variables point gcsfs, google-cloud-storage and tensorstore at it, here and in
    subprocesses. ``gcs.new_bucket()`` returns a fresh ``gs://`` bucket."""
    from object_store import GcsServer  # noqa: PLC0415

    yield from _serve(GcsServer())


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on 127.0.0.1 for the session (``tests/object_store.py``); ``s3.new_bucket()``
    returns a fresh ``s3://`` bucket."""
    from object_store import S3Server  # noqa: PLC0415

    yield from _serve(S3Server())


def _serve(server):
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pytest_unconfigure(config):
    if _OWN_CACHE:   # set only in the process that made it: the controller, after its workers ended
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
