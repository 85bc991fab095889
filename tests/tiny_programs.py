"""Compiling the unit tests' tiny programs without XLA's backend optimisations.

A unit test's model has a few layers of width 16-64 and runs once or twice: LLVM's optimisation passes then
cost more CPU than they save, and most of a unit-test file's time is compilation (its jitted functions and
the op-by-op kernels JAX compiles for eager code). ``jax_disable_most_optimizations`` lowers the backend
optimisation level to 0 and skips LLVM's expensive passes; the HLO passes (fusion, layout, sharding) still
run, so what a test asserts about the compiled program (collectives, temporaries, dtypes) is unchanged.
Both sides of every comparison in a file compile under the same setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def without_backend_optimisations() -> Iterator[None]:
    """Compile without backend optimisations inside the block; on leaving, restore the setting and clear
    JAX's in-memory caches, so no later file reuses a program compiled here (the persistent cache keys on
    the compile options, so it keeps the two apart by itself)."""
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
        jax.clear_caches()
