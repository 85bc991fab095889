"""The Run (``tieflax.run.run``): a run directory opened once, its parts closed in order on every exit.

Nothing here trains: opening a Run validates, resolves, checks, locks and compares identity only.
"""

from __future__ import annotations

import os

import pytest

from tieflax.config import default_config
from tieflax.run.layout import LOCK_FILE, WorkdirError
from tieflax.run.run import Run


def test_open_resolves_once_holds_the_lock_and_releases_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Run.open("run", default_config()) as run:
        assert run.path == str(tmp_path / "run")  # resolved: every writer gets this path
        assert os.path.exists(os.path.join(run.path, LOCK_FILE))
        assert run.resume.fresh
    assert not os.path.exists(tmp_path / "run" / LOCK_FILE)


def test_a_file_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(WorkdirError, match="is a file"):
        with Run.open(str(tmp_path / "afile"), default_config()):
            pass


class _Part:
    def __init__(self, name: str, log: list, fails: bool = False):
        self.name, self.log, self.fails = name, log, fails

    def close(self, *args):
        self.log.append(self.name)
        if self.fails:
            raise OSError(f"{self.name} failed")


def _with_parts(run: Run, log: list, failing: str = "") -> None:
    run.profiler, run.console, run.writer, run.saves = (
        _Part(n, log, fails=n == failing) for n in ("profiler", "console", "writer", "saves"))
    run.also_close(_Part("signal", log).close)


def test_parts_close_in_order_once_and_the_first_failure_is_raised(tmp_path):
    log: list = []
    with pytest.raises(OSError, match="writer failed"):
        with Run.open(str(tmp_path / "run"), default_config()) as run:
            _with_parts(run, log, failing="writer")
    assert log == ["profiler", "console", "writer", "saves", "signal"]  # every part, once, in order
    run.close()  # the loop closes first, then the context: the second close does nothing
    assert len(log) == 5


def test_an_error_on_its_way_is_not_replaced_by_a_failed_close(tmp_path):
    log: list = []
    with pytest.raises(KeyError):
        with Run.open(str(tmp_path / "run"), default_config()) as run:
            _with_parts(run, log, failing="saves")
            raise KeyError("the loop's own error")
    assert log == ["profiler", "console", "writer", "saves", "signal"]
