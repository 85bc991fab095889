"""The slow tier's lists (tests/conftest.py) name files and tests that exist: a renamed or deleted entry would
otherwise move its tests to the fast tier, or mark nothing, without a word."""

import os
import re

import pytest

from conftest import SLOW_FILES, SLOW_TESTS, is_slow

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_every_slow_file_exists():
    missing = sorted(f for f in SLOW_FILES | set(SLOW_TESTS) if not os.path.isfile(os.path.join(TESTS, f)))
    assert not missing, f"tests/conftest.py names {missing}, not in tests/: update SLOW_FILES or SLOW_TESTS"


@pytest.mark.parametrize("file_name", sorted(SLOW_TESTS))
def test_every_slow_test_exists(file_name):
    with open(os.path.join(TESTS, file_name), encoding="utf-8") as f:
        defined = set(re.findall(r"^def (test_\w+)\(", f.read(), re.M))
    missing = sorted(set(SLOW_TESTS[file_name]) - defined)
    assert not missing, f"tests/conftest.py SLOW_TESTS[{file_name!r}] names {missing}, not defined there"


def test_a_slow_file_marks_every_test_and_a_slow_test_only_itself():
    assert is_slow("test_train.py", "test_anything")
    assert is_slow("test_flops.py", "test_a_training_log_carries_tflops_per_device")
    assert not is_slow("test_flops.py", "test_throughput_and_mfu")
    assert not is_slow("test_model.py", "test_a_training_log_carries_tflops_per_device")


def test_every_file_that_starts_a_python_process_is_slow():
    """A test file that starts a second Python (``sys.executable``: the CLI, a benchmark, a notebook kernel, a
    fake host) pays its imports and compiles again: it belongs to the slow tier, whole or test by test."""
    spawning = set()
    for name in os.listdir(TESTS):
        if name.startswith("test_") and name.endswith(".py") and name != os.path.basename(__file__):
            with open(os.path.join(TESTS, name), encoding="utf-8") as f:
                source = f.read()
            if "sys.executable" in source and re.search(r"^def test_", source, re.M):
                spawning.add(name)
    fast = sorted(spawning - SLOW_FILES - set(SLOW_TESTS))
    assert not fast, f"{fast} start a Python process but are in the fast tier: add them to SLOW_FILES (tests/conftest.py)"
