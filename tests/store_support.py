"""Helpers shared by the tests of ``tieflax prepare`` and its token store (a helper module, not a test file):
``corpus_config`` (40 standard-library files and a ``V``-token BPE, the data config the stores are built
from) and ``cmdline`` (a process's command line, which tells prepare's workers and tasks apart).

Used by tests/test_token_store.py, test_store_changes.py and test_prepare_ray.py (``corpus_config``, ``V``),
test_prepare_stops.py and test_prepare_ray.py (``cmdline``)."""

from __future__ import annotations

from tieflax.data import default_data_config

V = 512


def corpus_config(max_files: int = 40):
    c = default_data_config()
    c.source = "python_stdlib"
    c.python_stdlib.max_files = max_files
    c.tokenizer.vocab_size = V
    c.val_fraction = 0.2
    c.read_threads = 0
    return c


def cmdline(pid: int) -> str:
    """``/proc/<pid>/cmdline``, its arguments joined by spaces; "" once the process is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
