"""Bounded time, one line, on every process: a bucket that stops answering under a 2-process training job
stops both processes, each with one line, and the rerun resumes (tests/test_storage_deadline.py has the
single-process commands; a file of its own so that the two long runs go to two test workers at once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deadline_support import (DEADLINE, PROGRESS_CAP_S, STEPS, TRAIN, committed_steps, reference_argv,
                              train_env)
from tieflax.storage.lease import RELEASE_SECONDS


def _train(server, workdir: str, processes: int = 2) -> list[subprocess.Popen]:
    """2 processes x 1 CPU device over gloo, each started here (so that each one's exit is timed); or, with
    ``processes=1``, the run that never stopped (``deadline_support.reference_argv``, in a local folder):
    one process x 2 devices, the same mesh and program without the second process, and the same command as
    tests/test_storage_deadline.py's reference, whose compiled programs the suite's cache holds once
    either test has run it."""
    from train_support import free_port  # noqa: PLC0415

    env = train_env(server, 2 // processes)
    if processes > 1:
        env.update(TIEFLAX_COORDINATOR=f"localhost:{free_port()}", TIEFLAX_NUM_PROCESSES=str(processes))
    argv = ["--workdir", workdir, *TRAIN] if processes > 1 else reference_argv(workdir)
    return [subprocess.Popen([sys.executable, "-m", "tieflax.cli", "train", *argv],
                             env={**env, "TIEFLAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(processes)]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a training process did not end within {timeout} s")
        out.append((p.returncode, o, e))
    return out


def test_two_process_gs_training_whose_bucket_stops_answering_stops_on_both_and_resumes(own_gcs, tmp_path):
    """Both processes stop within a bounded time of the bucket going quiet, each with one line, exit 1, no
    traceback: whichever write meets the silence first (process 0's metrics segment, a save's start on
    every process, a save's background commit), one collective at the log step or the save makes every
    process stop there, instead of the others waiting at the next collective until JAX's heartbeat
    timeout (100 s, then a crash) or its shutdown barrier (300 s). A rerun resumes to the final loss of a
    run that never stopped (one process with the same two devices)."""
    import json

    bucket = own_gcs.new_bucket()
    procs = _train(own_gcs, bucket + "/run")
    t_stop = None
    t0 = time.monotonic()
    while all(p.poll() is None for p in procs) and time.monotonic() - t0 < PROGRESS_CAP_S:
        if committed_steps(own_gcs, bucket):
            os.kill(own_gcs.process.pid, signal.SIGSTOP)  # after the first checkpoint, the bucket goes quiet
            t_stop = time.monotonic()
            break
        time.sleep(0.1)
    assert t_stop is not None, ("the run ended before its first checkpoint", _finish(procs, 10 * DEADLINE))
    ended = [None, None]
    while None in ended and time.monotonic() - t_stop < 10 * DEADLINE:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - t_stop
        time.sleep(0.1)
    results = _finish(procs, 1)
    own_gcs.thaw()  # and waits until it has served what was sent while it was frozen
    said = [[line for line in err.splitlines() if line.startswith("tieflax")] for _, _, err in results]
    print(f"stopped {ended[0]:.1f} s (process 0) and {ended[1]:.1f} s (process 1) after the bucket stopped "
          f"answering (deadline {DEADLINE} s, checkpoint deadline {2 * DEADLINE} s): {said[0]}")
    for (code, _, err), lines in zip(results, said):
        assert code == 1 and "Traceback" not in err and len(lines) == 1, err[-3000:]
        assert f"no answer from {bucket} within " in lines[0], lines
    # The checkpoint deadline, the last metrics segment's second try at the close, the lease's release.
    assert max(ended) < 2 * DEADLINE + DEADLINE + RELEASE_SECONDS + 15, ended
    committed = committed_steps(own_gcs, bucket)
    assert committed and committed[-1] != STEPS, committed
    again = _finish(_train(own_gcs, bucket + "/run"), PROGRESS_CAP_S)
    # The uninterrupted reference: one process x 2 devices, the same mesh (data=2) and program; a sum of two
    # shards has one order, so its losses are the 2-process run's (measured: equal to every printed digit).
    # In a local folder, saving only its last step (deadline_support.reference_argv).
    ref = _finish(_train(own_gcs, str(tmp_path / "run"), 1), PROGRESS_CAP_S)
    for code, _, err in again + ref:
        assert code == 0, err[-3000:]
    resumed, whole = json.loads(again[0][1].strip().splitlines()[-1]), json.loads(ref[0][1].strip().splitlines()[-1])
    assert f"resuming from step {committed[-1]}" in again[0][1], (again[0][1][-1500:], again[0][2][-3000:])
    assert resumed["step"] == whole["step"] == STEPS
    assert resumed["final_val_loss"] == pytest.approx(whole["final_val_loss"], rel=1e-6), (resumed, whole)
    assert resumed["final_train_loss"] == pytest.approx(whole["final_train_loss"], rel=1e-6), (resumed, whole)
