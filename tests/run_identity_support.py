"""Helpers shared by the tests of a run's record (a helper module, not a test file): a micro run of
``STEPS`` steps (``run_config``), the module-scoped fixture ``finished`` (that run trained to its end, once
per test module) and ``copy_run`` (each test changes a copy of it).

Used by tests/test_run_identity.py and tests/test_record_values.py, which import ``finished`` by name
(``# noqa: F401``): a fixture is found where its module imports it."""

from __future__ import annotations

import shutil

import pytest

from train_support import micro_config
from tieflax.train import train_and_evaluate

STEPS = 4


def run_config(micro_data, **train):
    """``micro_config`` trained ``STEPS`` steps, logged and checkpointed every 2; ``train``: other
    ``config.train`` values."""
    c = micro_config(micro_data, num_steps=STEPS)
    c.train.log_every, c.train.checkpoint_every = 2, 2
    for k, v in train.items():
        c.train[k] = v
    return c


@pytest.fixture(scope="module")
def finished(micro_data, tmp_path_factory):
    """A run trained to the end; each test copies it."""
    workdir = str(tmp_path_factory.mktemp("identity") / "run")
    result = train_and_evaluate(run_config(micro_data), workdir)
    assert result["step"] == STEPS
    return workdir


def copy_run(src, dst) -> str:
    """A copy of the run folder ``src`` at ``dst``; -> its path."""
    shutil.copytree(src, str(dst))
    return str(dst)
