"""The suite's shared JAX compilation cache: written by every process, and each entry whole or absent.

On a place on `PYTHONPATH` (tests/conftest.py puts it there for the workers and every process they start),
Python imports this module at start-up. It changes two things in JAX's persistent compilation cache, for
the suite's processes only:

- **Every process writes its entries.** JAX writes from process 0 only (so that hosts do not contend for
  one file on a shared store), and on CPU a program's cache key holds the client's topology, which differs
  per process: process 1 of a 2-process run never finds an entry and compiles every program, every
  launch. Here each process's entries have their own keys, so writing them is safe, and the next launch's
  process 1 reads its own. Measured on a 60-step 2-process micro run with a warm cache: 12.1 -> 7.3-7.5
  CPU-s (3.11) and 10.6 -> 6.8-7.1 (3.12), the losses the same to every digit; in the whole 3.11 suite,
  8 CPU-s off test_stop_together and 6 off test_storage_deadline_two_processes.
- **An entry appears whole.** JAX writes an entry's file in place, so a process reading it while another
  still writes it gets a truncated stream: JAX compiles again and warns on stderr ("Error reading
  persistent compilation cache entry ... incomplete or truncated stream", seen once in a 3.12 suite),
  which a test of a command's console would count. Here the entry is written to a temporary file beside
  it and renamed into place, which is atomic on one filesystem.

JAX is not imported here (most of the suite's processes never use it): a finder waits for each module to
load and patches it. A JAX whose modules lack what is patched is left as it is.
"""

import importlib.abc
import importlib.util
import os
import sys
import types


class _StateAsProcess0:
    """JAX's distributed state as it is, but for the process id, which reads 0."""

    process_id = 0

    def __init__(self, state):
        self._state = state

    def __getattr__(self, name):
        return getattr(self._state, name)


class _DistributedAsProcess0:
    """`jax._src.distributed` as it is, but for its state's process id, which reads 0."""

    def __init__(self, distributed):
        self._distributed = distributed
        self.global_state = _StateAsProcess0(distributed.global_state)

    def __getattr__(self, name):
        return getattr(self._distributed, name)


def _write_as_process_0(compiler):
    """Replaces `compiler._cache_write` by JAX's own code run with globals in which this is process 0.

    Nothing shared changes: the real process id stays what it is for every other reader (orbax reads it from
    its save threads to pick its barriers' participants), so a write cannot race them.
    """
    write = getattr(compiler, "_cache_write", None)
    distributed = getattr(compiler, "distributed", None)
    if write is None or not hasattr(getattr(distributed, "global_state", None), "process_id"):
        return
    namespace = {**vars(compiler), "distributed": _DistributedAsProcess0(distributed)}
    cache_write = types.FunctionType(write.__code__, namespace, write.__name__, write.__defaults__,
                                     write.__closure__)
    cache_write.__kwdefaults__ = write.__kwdefaults__
    compiler._cache_write = cache_write


def _put_whole(lru_cache):
    """Replaces `LRUCache.put` (without eviction, the suite's case) by a write to a temporary file and a rename."""
    cache_class = getattr(lru_cache, "LRUCache", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    put = getattr(cache_class, "put", None)
    if put is None or suffix is None:
        return

    def put_whole(self, key, value):
        if self.eviction_enabled or not key:  # eviction's lock and bookkeeping: JAX's own write
            return put(self, key, value)
        path = self.path / f"{key}{suffix}"
        if path.exists():
            return
        partial = self.path / f".{key}.{os.getpid()}.partial"
        partial.write_bytes(value)
        os.replace(partial, path)

    cache_class.put = put_whole


_PATCHES = {"jax._src.compiler": _write_as_process_0, "jax._src.lru_cache": _put_whole}


class _WhenJaxLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on each patched module's import, wraps its loader to patch it once executed."""

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.pop(name, None)
        if patch is None:
            return None
        if not _PATCHES:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _WhenJaxLoads())
