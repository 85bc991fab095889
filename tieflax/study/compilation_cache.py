"""A persistent compilation cache for studies: their seeds and variants compile the same programs."""

from __future__ import annotations

import os

from tieflax.run.layout import RunDir


def compilation_cache(study: RunDir) -> None:
    """Seeds of one variant compile the same programs: a persistent cache (unless the user set one) turns
    the later seeds' compiles into reads. ``study``: the study's folder (``--workdir``, resolved and checked
    by the command). Kept in ``<study>/data/jax_cache`` locally; for a gs:// or s3:// study in this
    machine's cache folder (compiled programs are per machine anyway)."""
    import jax  # noqa: PLC0415

    if jax.config.jax_compilation_cache_dir:
        return
    if study.is_remote:
        path = os.path.join(os.path.expanduser("~"), ".cache", "tieflax", "jax_cache")
    else:
        path = study.file("data", "jax_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
