"""Bounded time, one line: a bucket that stops answering stops a command within the storage deadline
(``TIEFLAX_STORAGE_DEADLINE_S``) with one line naming the object, exit 1; rerun once it answers again, the
command resumes (the same store digest).

Each test runs its own emulator (``tests/object_store.py``), frozen with SIGSTOP (a server that accepts
connections and never answers: the worst case, a stalled network) and thawed with SIGCONT (its objects
kept), so the session's shared server is never touched.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time


from deadline_support import DEADLINE, PROGRESS_CAP_S, STEPS, TRAIN, deadline_env, reference_argv, train_env
from tieflax import storage
from tieflax.storage.lease import RELEASE_SECONDS

_ONE_CALL = """
import json, os, signal, sys, time
from tieflax import storage
bucket, server = sys.argv[1], int(sys.argv[2])
storage.write_text(f"{bucket}/a.txt", "x")
os.environ[storage.DEADLINE_ENV] = "2"
os.kill(server, signal.SIGSTOP)
# SIGSTOP is delivered asynchronously: read only once every thread of the server shows as stopped ('T').
def _stopped():
    for task in os.listdir(f"/proc/{server}/task"):
        with open(f"/proc/{server}/task/{task}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "T":
                return False
    return True
t_stop = time.monotonic()
while not _stopped():
    assert time.monotonic() - t_stop < 30, "the test server did not stop"
    time.sleep(0.01)
t0 = time.monotonic()
try:
    storage.read_text(f"{bucket}/a.txt")
    frozen = None
except storage.StorageError as e:
    frozen = str(e)
took = time.monotonic() - t0
os.kill(server, signal.SIGCONT)
again = storage.read_text(f"{bucket}/a.txt")  # the same process carries on once it answers
os.environ[storage.DEADLINE_ENV] = "soon"
try:
    storage.read_text(f"{bucket}/a.txt")
    bad = None
except storage.StorageError as e:
    bad = str(e)
print(json.dumps({"frozen": frozen, "took": took, "again": again, "bad": bad}))
"""


def test_a_call_to_a_bucket_that_never_answers_stops_at_the_deadline_in_one_line(own_gcs):
    """In a process of its own, as a command meets it (run inside the test worker, after other test files,
    the frozen read was once answered: see the closing comment)."""
    import json  # noqa: PLC0415

    bucket = own_gcs.new_bucket()
    proc = subprocess.run([sys.executable, "-c", _ONE_CALL, bucket, str(own_gcs.process.pid)],
                          env=deadline_env(own_gcs), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["frozen"] is not None, ("a read from a frozen server was answered", got)
    # The read waits the deadline (2 s), then its waiter must wake: on a loaded machine a thread can wake
    # seconds late; what this holds is the stop, not the waker's punctuality (before: no stop at all).
    assert 1.5 < got["took"] < 2 + 8, got
    assert got["frozen"].startswith(f"cannot read {bucket}/a.txt: no answer from {bucket} within 2 s; check the "
                                    "network"), got
    assert "\n" not in got["frozen"]
    assert got["again"] == "x"
    assert got["bad"] and "TIEFLAX_STORAGE_DEADLINE_S='soon': give the deadline" in got["bad"], got
    # The same read inside a long-lived process (a test worker after other files, as a notebook lives):
    # tests/test_storage.py.


def test_val_loss_of_a_gs_workdir_without_credentials_offline_stops_in_one_line(tmp_path):
    """No credentials and no metadata server: tensorstore's request waited forever (> 120 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSTORE_GCS", "STORAGE_EMULATOR",
                                                                     "GOOGLE_"))}
    env.update({storage.DEADLINE_ENV: "3", "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tieflax.cli", "val-loss", "--workdir", "gs://tieflax-absent-1/run"],
                          env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tieflax")]
    # The bug was a wait without end; a command that stops is what is held. `took` includes starting Python
    # and importing jax, which alone took tens of seconds under a load of 10+: a bound of 60 s was a bound
    # on the machine, so it is the subprocess's own limit now, with the figure printed.
    print(f"the command ended after {took:.1f} s (deadline 3 s)")
    assert proc.returncode == 1, (proc.returncode, took, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    # Offline (the test machine): no answer within the deadline. With a network, Cloud Storage's 401.
    # The first object a reader of the run asks for (the import marker, then the record), named in full.
    assert re.match(r"tieflax val-loss: cannot read gs://tieflax-absent-1/run/(tieflax\.incomplete|config\.json): ",
                    lines[0]), lines
    assert ("no answer from gs://tieflax-absent-1 within 3 s; no credentials are configured" in lines[0]
            or "no credentials found" in lines[0]), lines


def _prepare(server, out: str, corpus: str, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tieflax.cli", "prepare", "--config", "configs/experiments/tiny.py", "--out", out,
         "--config.data.source=files", f"--config.data.files.paths={corpus}/*.txt",
         "--config.data.tokenizer.vocab_size=300", "--config.model.vocab_size=300",
         "--config.data.val_fraction=0.3", "--shard-mb=0.004", "--workers=2"],
        env=deadline_env(server, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_gs_prepare_whose_bucket_stops_answering_stops_in_one_line_and_resumes(own_gcs, tmp_path):
    from tieflax.data.sources import load_documents
    from tieflax.data import default_data_config

    c = default_data_config()
    c.source = "python_stdlib"
    c.python_stdlib.max_files = 30
    for i, d in enumerate(load_documents(c)):
        (tmp_path / f"{i:03d}.txt").write_text(d.text[:3000])
    corpus = str(tmp_path)
    out = own_gcs.new_bucket() + "/corpus"
    proc = _prepare(own_gcs, out, corpus)
    t_stop = None
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < PROGRESS_CAP_S:
        ledger = [o for o in own_gcs.objects(out.rsplit("/", 1)[0], "corpus/ledger/")]
        if len(ledger) >= 3:
            os.kill(own_gcs.process.pid, signal.SIGSTOP)  # the bucket stops answering mid-way
            t_stop = time.monotonic()
            break
        time.sleep(0.05)
    assert t_stop is not None, ("the prepare ended before 3 shards were done", proc.communicate())
    _, err = proc.communicate(timeout=10 * DEADLINE)
    took = time.monotonic() - t_stop
    own_gcs.thaw()  # and waits until it has served what was sent while it was frozen
    said = [line for line in err.splitlines() if line.startswith("tieflax prepare: cannot")]
    assert proc.returncode == 1, err
    assert "Traceback" not in err and len(said) == 1, err
    assert f"no answer from {out.rsplit('/', 1)[0]} within {DEADLINE} s" in said[0], said
    assert said[0].endswith("(work done so far is kept; TIEFLAX_STORAGE_DEADLINE_S sets the deadline)")
    print(f"stopped {took:.1f} s after the bucket stopped answering (deadline {DEADLINE} s): {said[0]}")
    assert took < DEADLINE + RELEASE_SECONDS + 5, took  # the worker's deadline, then the lease's release
    # Rerun with the bucket answering: it resumes from the ledger, to the digest of a build that never stopped.
    again = _prepare(own_gcs, out, corpus)
    _, err2 = again.communicate(timeout=PROGRESS_CAP_S)
    assert again.returncode == 0, err2
    assert "done before" in err2 and "(0 done before)" not in err2.split("tokenised")[-1], err2
    whole = own_gcs.new_bucket() + "/corpus"
    ref = _prepare(own_gcs, whole, corpus)
    _, err3 = ref.communicate(timeout=PROGRESS_CAP_S)
    assert ref.returncode == 0, err3
    from tieflax.data import store as st
    assert st.read_manifest(out)["digest"] == st.read_manifest(whole)["digest"]


def _train(server, argv: list[str]) -> subprocess.Popen:
    """``tieflax train`` on one process x 2 CPU devices (``deadline_support.train_env``): the devices of
    tests/test_storage_deadline_two_processes.py's reference, whose compiled programs these runs share
    through the suite's cache (on the test process's 8 devices a step of this model cost three times the CPU)."""
    return subprocess.Popen([sys.executable, "-m", "tieflax.cli", "train", *argv], env=train_env(server),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_gs_training_whose_bucket_stops_answering_stops_in_one_line_and_resumes(own_gcs, tmp_path):
    import json

    bucket = own_gcs.new_bucket()
    proc = _train(own_gcs, ["--workdir", bucket + "/run", *TRAIN])
    t_stop = None
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < PROGRESS_CAP_S:
        if any(o.endswith("commit_success.txt") for o in own_gcs.objects(bucket, "run/checkpoints/")):
            os.kill(own_gcs.process.pid, signal.SIGSTOP)  # after the first checkpoint, the bucket goes quiet
            t_stop = time.monotonic()
            break
        time.sleep(0.1)
    assert t_stop is not None, ("the run ended before its first checkpoint", proc.communicate())
    _, err = proc.communicate(timeout=10 * DEADLINE)
    took = time.monotonic() - t_stop
    own_gcs.thaw()  # and waits until it has served what was sent while it was frozen
    said = [line for line in err.splitlines() if line.startswith("tieflax")]
    print(f"stopped {took:.1f} s after the bucket stopped answering (deadline {DEADLINE} s): {said}")
    assert proc.returncode == 1 and "Traceback" not in err and len(said) == 1, err
    assert f"no answer from {bucket} within " in said[0], said
    # The writes that can meet the silence, one after another: a metrics segment at a log step (DEADLINE;
    # a failed write is kept for the close), the next save, ridden out until the checkpoint deadline
    # (2 x DEADLINE here), the last metrics segment's second try at the close (DEADLINE), the lease's
    # release; plus the steps trained between them and the exit, up to 30 s on a busy 2-core machine.
    # (A clean clone stopped in 75.1 s through a save of step 40 past the 30 s checkpoint deadline, over the
    # bound that counted only one of the two metrics writes.)
    assert took < DEADLINE + 2 * DEADLINE + DEADLINE + RELEASE_SECONDS + 30, took
    committed = sorted({o.split("/")[2] for o in own_gcs.objects(bucket, "run/checkpoints/")
                        if o.endswith("commit_success.txt")}, key=int)
    assert committed and committed[-1] != str(STEPS), committed
    # The rerun resumes from the last committed checkpoint and ends where a run that never stopped ends.
    again = _train(own_gcs, ["--workdir", bucket + "/run", *TRAIN])
    out, err2 = again.communicate(timeout=PROGRESS_CAP_S)
    assert again.returncode == 0, err2
    # The run that never stopped (deadline_support.reference_argv): in a local folder, saving only its last
    # step, on the same 2 devices in a process of its own, so its programs are the runs' above, from the
    # suite's cache. (In this process, on its 8 devices, a step cost three times the CPU.)
    ref = _train(own_gcs, reference_argv(str(tmp_path / "run")))
    out_ref, err3 = ref.communicate(timeout=PROGRESS_CAP_S)
    assert ref.returncode == 0, err3
    resumed, whole = json.loads(out.strip().splitlines()[-1]), json.loads(out_ref.strip().splitlines()[-1])
    assert resumed["step"] == whole["step"] == STEPS
    assert resumed["final_val_loss"] == whole["final_val_loss"], (resumed, whole)
    assert resumed["final_train_loss"] == whole["final_train_loss"], (resumed, whole)


def test_a_multi_process_save_still_running_past_the_checkpoint_deadline_is_a_failure(monkeypatch):
    """Several processes poll their pending save together (never a blocking wait, so no watchdog): one
    still running on a bucket past TIEFLAX_CHECKPOINT_DEADLINE_S is returned as a failure, which they then
    agree on, instead of being polled forever."""
    from tieflax.run import checkpoints as ckpt

    class Saving:  # orbax's manager with a save that never ends
        directory = "gs://b/run/checkpoints"

        def is_saving_in_progress(self):
            return True

        def check_for_errors(self):
            pass

    monkeypatch.setenv(storage.DEADLINE_ENV, "1")
    monkeypatch.setenv(ckpt.SAVE_DEADLINE_ENV, "2")
    saves = ckpt.SaveWatch(Saving())
    try:
        saves.pending, saves._started = 40, time.monotonic()
        assert saves.failure(wait=False) is None and saves.pending == 40  # within the deadline: still running
        saves._started -= 3
        error = saves.failure(wait=False)
        assert isinstance(error, ckpt.CheckpointError) and saves.pending is None
        assert str(error).startswith("cannot finish checkpoint 40 in gs://b/run/checkpoints: no answer from gs://b "
                                     "within 2 s"), error
    finally:
        saves.abandon()
        saves.close()
