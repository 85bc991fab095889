"""The suite's shared compilation cache (tests/every_process_caches/sitecustomize.py) is in force where it
should be: the processes the tests start load it, every process writes, and an entry written through the
temporary file keeps JAX's semantics (the first write of a key stays; nothing else is left in the folder).

A JAX whose internals moved would leave the cache as JAX has it, silently (the suite would pass, only
slower): these tests say so instead.
"""

import os
import subprocess
import sys

import pytest

from train_support import REPO

_PATCHED = os.path.join(REPO, "tests", "every_process_caches")


def _run(code: str) -> str:
    """Runs `code` in a fresh interpreter with the suite's PYTHONPATH entry first; returns its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PATCHED, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_suite_puts_the_cache_patches_on_its_processes_path():
    assert _PATCHED in os.environ["PYTHONPATH"].split(os.pathsep)


def test_a_process_other_than_0_writes_its_entries(tmp_path):
    out = _run(f"""
import os
import jax
from jax._src import distributed
jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
distributed.global_state.process_id = 1  # what JAX reads to decide who writes
jax.jit(lambda x: x * 2 + 1)(jax.numpy.ones(3)).block_until_ready()
print(distributed.global_state.process_id, sum(name.endswith("-cache") for name in os.listdir({str(tmp_path)!r})))
""")
    process_id, entries = out.split()
    assert process_id == "1"  # never changed: other readers (orbax's save threads) see the real one
    assert int(entries) >= 1  # JAX alone writes none from process 1


def test_an_entry_keeps_jaxs_semantics_and_leaves_no_partial_file(tmp_path):
    out = _run(f"""
import os
from jax._src.lru_cache import LRUCache
cache = LRUCache({str(tmp_path)!r}, max_size=-1)
cache.put("k", b"first")
cache.put("k", b"second")  # JAX keeps an existing entry
print(cache.get("k").decode(), *sorted(os.listdir({str(tmp_path)!r})))
""")
    assert out.split() == ["first", "k-cache"]  # no partial file left beside it


@pytest.mark.parametrize("module, expression, expected", [
    ("jax._src.compiler", "type(m._cache_write.__globals__['distributed']).__name__", "_DistributedAsProcess0"),
    ("jax._src.lru_cache", "m.LRUCache.put.__name__", "put_whole"),
])
def test_the_patched_functions_are_the_suites(module, expression, expected):
    assert _run(f"import {module} as m; print({expression})").strip() == expected
