"""A bucket that stops answering while a checkpoint is written: an outage shorter than the checkpoint
deadline is ridden out (the broken save said in one line, training on, the last save retried), a longer one
stops in one line naming the object, the bucket and the deadline, never a full disk's advice
(``tieflax.run.save_watch.SaveWatch``)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from tieflax import storage
from tieflax.run import save_watch as ckpt

BUCKET = "gs://quiet-bucket"
OBJECT = f"{BUCKET}/run/checkpoints/20/state/ocdbt.process_0/d/0123abcd"


class _Silent(OSError):
    """What gcsfs/aiohttp raise when the bucket resets a connection that waited too long."""


class FakeManager:
    """orbax's manager as SaveWatch sees it; ``failures``: how many saves in a row end without an answer."""

    directory = f"{BUCKET}/run/checkpoints"

    def __init__(self, failures: int):
        self.failures, self.saved = failures, []

    def save(self, step):
        self.saved.append(step)

    def wait_until_finished(self):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("save failed") from _Silent(errno.ECONNRESET, f"Connection reset by peer: {OBJECT}")

    def is_saving_in_progress(self):
        return False

    def check_for_errors(self):
        pass

    def close(self):
        pass


@pytest.fixture
def watch(monkeypatch):
    monkeypatch.setenv(storage.DEADLINE_ENV, "3")
    monkeypatch.setenv(ckpt.SAVE_DEADLINE_ENV, "3")
    monkeypatch.setattr(ckpt, "save", lambda manager, step, state, loader: manager.save(step))
    removed = []
    monkeypatch.setattr(storage, "rmtree", removed.append)
    monkeypatch.setattr(storage, "watchdog", lambda *a, **k: __import__("contextlib").nullcontext())

    def make(failures):
        w = ckpt.SaveWatch(FakeManager(failures))
        w.removed = removed
        return w
    return make


def test_an_outage_within_the_deadline_is_ridden_out_and_the_last_save_retried(watch, caplog):
    w = watch(failures=2)
    w.start(20, "state", "loader")
    with caplog.at_level("WARNING", logger=ckpt.__name__):
        w.check(21)  # the save broken by the outage: said, training goes on
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "checkpoint 20 was not saved: no answer from gs://quiet-bucket" in said[0], said
    assert OBJECT in said[0]
    w.start(40, "state", "loader")
    w.close()  # the last save breaks too: retried (its partial objects deleted) until it goes through
    assert w.manager.saved == [20, 40, 40], w.manager.saved
    assert w.removed == [f"{BUCKET}/run/checkpoints/40"]


def test_an_outage_past_the_deadline_is_one_line_naming_object_bucket_and_deadline(watch):
    """It was a gcsfs/aiohttp traceback ending in "free space on that disk" (the OS error of a reset
    connection taken for a full disk's)."""
    w = watch(failures=10**6)
    w.start(20, "state", "loader")
    t0 = time.monotonic()
    with pytest.raises(ckpt.CheckpointError) as stop:
        w.close()
    line = str(stop.value)
    assert "\n" not in line and "free space" not in line, line
    assert f"no answer from {BUCKET} within the 3 s checkpoint deadline" in line and OBJECT in line, line
    assert time.monotonic() - t0 < 60  # retried within the deadline, then stopped (not forever)
    assert len(w.manager.saved) >= 2


def test_a_full_local_disk_keeps_its_advice(watch):
    w = watch(failures=0)
    w.manager.directory = "/tmp/run/checkpoints"
    e = RuntimeError("save failed")
    e.__cause__ = OSError(errno.ENOSPC, "No space left on device", "/tmp/run/checkpoints/20/x")
    assert "free space on that disk" in str(w._error(20, e))


# A 512-token BPE (the one tests/test_eval_harness.py's runs train on the same corpus, in the suite's data
# cache): with tiny.py's 8,192 a step of this model cost ten times as much (the head and the loss over the
# vocabulary); what is tested is a save riding out an outage, and a save writes the same objects either way.
# A constant learning rate (no warmup, no decay), as tests/test_store_changes.py's runs of this model: the
# compiled step then does not depend on num_steps (a 60-step schedule was a program of its own), so the runs
# of both files use one program from the suite's compilation cache; what a save writes does not depend on it.
TRAIN = ["--config", "configs/experiments/tiny.py", "--config.model.d_model=32", "--config.model.n_layers=1",
         "--config.model.n_heads=2", "--config.model.d_ff=64", "--config.model.max_seq_len=32",
         "--config.model.vocab_size=512", "--config.data.tokenizer.vocab_size=512",
         "--config.train.seq_len=32", "--config.train.global_batch_size=8", "--config.train.num_steps=60",
         "--config.train.warmup_steps=0", "--config.train.min_lr_ratio=1.0",
         "--config.train.log_every=10", "--config.train.checkpoint_every=20", "--config.train.eval_every=1000"]


@pytest.mark.slow
def test_a_bucket_frozen_for_seconds_during_a_checkpoint_write_is_ridden_out(tmp_path):
    """The emulator is frozen (SIGSTOP: connections accepted, never answered) as checkpoint 40's arrays are
    written, for a few seconds (well inside the deadline), then thawed: the run ends normally with every
    checkpoint committed. Bounds are on progress (the run ends), generous in time (a loaded machine)."""
    from object_store import GcsServer

    server = GcsServer()
    try:
        bucket = server.new_bucket()
        env = {**os.environ, **server.env, storage.DEADLINE_ENV: "120", "JAX_PLATFORMS": "cpu"}
        proc = subprocess.Popen([sys.executable, "-m", "tieflax.cli", "train", "--workdir", f"{bucket}/run", *TRAIN],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        froze = False
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 600:
            if any(o.startswith("run/checkpoints/40/state/") for o in server.objects(bucket, "run/checkpoints/")):
                os.kill(server.process.pid, signal.SIGSTOP)
                froze = True
                time.sleep(5)
                os.kill(server.process.pid, signal.SIGCONT)
                break
            time.sleep(0.05)
        out, err = proc.communicate(timeout=600)
        assert froze, ("the run ended before checkpoint 40 was written", out, err)
        assert proc.returncode == 0 and "Traceback" not in err, err
        committed = sorted({o.split("/")[2] for o in server.objects(bucket, "run/checkpoints/")
                            if o.count("/") == 3 and o.endswith("/commit_success.txt")}, key=int)
        assert committed == ["20", "40", "60"], committed
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


def test_a_lease_renewal_that_timed_out_but_landed_is_still_this_process_lease(tmp_path, monkeypatch):
    """A 91 s outage under the 180 s deadline ended the run with "the lease ... was taken over by another
    process" naming this very process: the renewal sent during the outage was written once the bucket
    answered again, its reply had timed out, and the next renewal's precondition (the old generation)
    failed."""
    from tieflax.storage import lease as lease_module

    path = str(tmp_path / "tieflax.lock")
    held = lease_module.Lease(path, lease_module.holder_record(command="train"), owner=str(tmp_path),
                              refuse=lambda holder, age: RuntimeError("held"), heartbeat_seconds=0.05)
    assert held.acquire()
    real = storage.compare_and_set
    calls = []

    def lands_then_times_out(p, data, expected):
        calls.append(p)
        if len(calls) == 1:
            real(p, data, expected)  # written, but the answer never came back
            raise storage.StorageError(f"cannot write {p}: no answer within 3 s")
        return real(p, data, expected)

    monkeypatch.setattr(storage, "compare_and_set", lands_then_times_out)
    t0 = time.monotonic()
    while len(calls) < 4 and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    assert len(calls) >= 4 and held.lost is None, held.lost
    monkeypatch.setattr(storage, "compare_and_set", real)
    held.release()
    assert not os.path.exists(path)


def test_releasing_a_lease_on_a_store_that_stopped_answering_takes_release_seconds_in_all(tmp_path, monkeypatch):
    """A prepare whose bucket froze ended 27 s after the freeze where 25 were promised (its deadline 15, the
    release 5, 5 to spare; at load ~12): the release waited ``RELEASE_SECONDS`` for the heartbeat's renewal
    in flight, then as long again for the removal."""
    import threading

    from tieflax.storage import lease as lease_module

    path = str(tmp_path / "tieflax.lock")
    held = lease_module.Lease(path, lease_module.holder_record(command="prepare"), owner=str(tmp_path),
                              refuse=lambda holder, age: RuntimeError("held"), heartbeat_seconds=0.05)
    assert held.acquire()
    thawed, calls = threading.Event(), []

    def frozen(p, data, expected):  # a store that does not answer: each call ends at its deadline
        calls.append(p)
        at = getattr(storage._DEADLINE, "at", None)
        thawed.wait(30 if at is None else max(0.0, at - time.monotonic()))
        raise storage.StorageError(f"cannot write {p}: no answer")

    monkeypatch.setattr(storage, "compare_and_set", frozen)
    t0 = time.monotonic()
    while not calls and time.monotonic() - t0 < 30:  # a renewal is in flight
        time.sleep(0.01)
    assert calls
    t0 = time.monotonic()
    held.release()
    took = time.monotonic() - t0
    thawed.set()
    assert took < lease_module.RELEASE_SECONDS + 1, took
