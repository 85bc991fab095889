"""The line every process of a job stops with when a save outlives the checkpoint deadline
(tieflax/train/stop.py's ``late_line``): it names the processes whose own share of the save is not written,
or process 0 when every share is written and only the save's finishing part, orbax's primary process's
alone, is left; no process when every share is unwritten (the bucket itself stopped answering).
tests/test_stop_together.py runs the first case in a 2-process job."""

from __future__ import annotations

from tieflax.run.checkpoints import SaveDeadlinePassed
from tieflax.train.stop import LATE, PENDING, UNWRITTEN, late_line

LATE_SAVE = SaveDeadlinePassed(40, "gs://b/run/checkpoints", 30.0)
STILL_SAVING = PENDING | LATE


def test_the_processes_whose_share_is_not_written_are_named():
    assert late_line(None, LATE_SAVE, [STILL_SAVING, STILL_SAVING | UNWRITTEN]) == f"process 1: {LATE_SAVE}"
    assert late_line(None, LATE_SAVE, [STILL_SAVING | UNWRITTEN, STILL_SAVING, STILL_SAVING | UNWRITTEN]) == \
        f"processes 0, 2: {LATE_SAVE}"


def test_every_share_unwritten_names_no_process():
    assert late_line(None, LATE_SAVE, [STILL_SAVING | UNWRITTEN] * 2) == str(LATE_SAVE)


def test_every_share_written_names_process_0_finishing_the_save():
    """Process 0's storage stalled while it removed a checkpoint past ``keep_checkpoints`` (or wrote the
    commit marker): the others only wait for it. (Before: the line named no process, as if every host's
    storage had stopped answering.)"""
    line = late_line(None, LATE_SAVE, [STILL_SAVING, STILL_SAVING])
    assert line == f"process 0 (finishing the save: its commit marker, old checkpoints' removal): {LATE_SAVE}"
    assert "cannot finish checkpoint 40 in gs://b/run/checkpoints" in line


def test_a_process_whose_own_save_ended_names_the_same_checkpoint(monkeypatch):
    """A process that is not late builds the line from its own save, which may have ended by the time the
    processes agree (nothing pending): it names the save it started last, as the late one does. (Before:
    "cannot finish checkpoint None", seen once under load in tests/test_stop_together.py.)"""
    from types import SimpleNamespace

    from tieflax import storage
    from tieflax.run.checkpoints import SAVE_DEADLINE_ENV

    monkeypatch.setenv(SAVE_DEADLINE_ENV, "30")  # LATE_SAVE's deadline (at least the storage deadline)
    monkeypatch.setenv(storage.DEADLINE_ENV, "30")
    # Made here, not at import: the advice a line ends with depends on the credentials the suite has set.
    late = SaveDeadlinePassed(40, "gs://b/run/checkpoints", 30.0)
    ended = SimpleNamespace(pending=None, last_started=40, where="gs://b/run/checkpoints")
    codes = [STILL_SAVING & ~LATE, STILL_SAVING | UNWRITTEN]
    assert late_line(ended, None, codes) == late_line(None, late, codes) == f"process 1: {late}"
