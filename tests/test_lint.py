"""The linter's verdict is a test: ``ruff check tieflax tests benchmarks tools`` with the configuration in
pyproject.toml ([tool.ruff]) finds nothing. Ruff comes with the ``test`` extra."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("tieflax", "tests", "benchmarks", "tools")


def _ruff() -> str:
    pytest.importorskip("ruff", reason="ruff is not installed: pip install -e '.[test]'")
    from ruff.__main__ import find_ruff_bin  # the binary the package installed

    return find_ruff_bin()


def test_ruff_finds_nothing():
    proc = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", *FOLDERS], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check {' '.join(FOLDERS)}:\n{proc.stdout}{proc.stderr}"


def test_ruff_reads_the_projects_configuration():
    """The noqa markers assume PLC0415 (imports inside functions) is checked: a bare one is a finding."""
    proc = subprocess.run([_ruff(), "check", "--no-cache", "--stdin-filename", "tieflax/probe.py", "-"],
                          cwd=ROOT, input="def f():\n    import os\n    return os\n", capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "PLC0415" in proc.stdout, proc.stdout + proc.stderr
