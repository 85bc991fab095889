"""Runs that live in a bucket: a gs:// workdir against a Cloud Storage protocol server on 127.0.0.1.

Training killed with -9 after a committed checkpoint resumes from the bucket and ends where an
uninterrupted local run ends; the lease keeps two runs apart; bad paths are refused before any work.
(Two processes on a gs:// workdir, stopped and resumed: tests/test_multiprocess_train.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from train_support import REPO, micro_config, start_train
from tieflax.run import checkpoints as ckpt
from tieflax import storage
from tieflax.storage import lease
from tieflax.run import lock as wd
from tieflax.cli import main
from tieflax.run.metrics import read_metrics
from tieflax.train import train_and_evaluate

# 20 steps, as tests/test_unfinished_and_links.py's and tests/test_eval_harness.py's micro runs (the learning
# rate schedule is compiled in, so a step count is a program of its own): the suite's compilation cache then
# holds this run's programs (15 steps compiled programs of their own). Saved every 10 steps (it was 15 steps
# saved every 5): the kill still comes after the first committed checkpoint with 10 steps to go, and the
# runs save fewer checkpoints; what is tested is the resume from the bucket.
N = 20


def _config(micro_data):
    c = micro_config(micro_data, num_steps=N)
    c.train.log_every, c.train.checkpoint_every = 5, 10
    return c


def _committed_steps(workdir: str) -> list[int]:
    """Steps whose checkpoint orbax has committed (on Cloud Storage: its commit_success.txt marker)."""
    folder = ckpt.checkpoint_dir(workdir)
    return sorted(int(n) for n in storage.listdir(folder)
                  if n.isdigit() and storage.is_file(storage.join(folder, n, "commit_success.txt")))


def test_kill9_on_a_bucket_resumes_to_the_local_result(gcs, micro_data, tmp_path, capsys):
    config = _config(micro_data)
    local = train_and_evaluate(config, str(tmp_path / "local"))

    run = gcs.new_bucket() + "/runs/tiny"
    proc = start_train(run, config, log_path=str(tmp_path / "gs.log"))
    deadline = time.time() + 300
    while not _committed_steps(run):
        assert proc.poll() is None, open(tmp_path / "gs.log").read()[-3000:]
        assert time.time() < deadline, "no committed checkpoint in the bucket within 300 s"
        time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=60)
    killed_at = max(_committed_steps(run))
    assert killed_at < N

    # The same run, resumed with no argument but the workdir: its config is read from the bucket (the
    # dead holder's lease is stale).
    capsys.readouterr()
    assert main(["train", "--workdir", run]) == 0
    out = capsys.readouterr()
    assert f"resuming from step {killed_at}" in out.out, out
    assert "taking over the stale lease" in out.err
    result = json.loads(out.out.strip().splitlines()[-1])
    assert result["step"] == N and result["final_val_loss"] == local["final_val_loss"]

    assert main(["val-loss", "--workdir", run]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["loss"] == pytest.approx(local["final_val_loss"], rel=1e-6)
    assert [r["step"] for r in read_metrics(run, "train")] == [5, 10, 15, 20]

    names = gcs.objects(run.rsplit("/runs", 1)[0], "runs/tiny/")
    top = {n.split("/")[2] for n in names}
    assert top == {"checkpoints", "config.json", "data.json", "metrics", "tensorboard", "tokenizer.json"}, top
    assert wd.LOCK_FILE not in top  # the lease is given back at the end
    assert not os.path.exists(os.path.join(REPO, "gs:")) and not os.path.exists("gs:")


def test_a_live_lease_refuses_and_a_stale_one_is_taken_over(gcs, capsys):
    run = gcs.new_bucket() + "/run"
    lock = storage.join(run, wd.LOCK_FILE)
    other_host = {"host": "pod-worker-7", "pid": 12, "command": "train", "since": "now",
                  "heartbeat": time.time()}
    storage.write_text(lock, json.dumps(other_host))
    with pytest.raises(wd.WorkdirError, match=r"in use by `tieflax train` \(host pod-worker-7, PID 12.*renewed"):
        with wd.workdir_lock(run, "train"):
            pass
    assert json.loads(storage.read_text(lock))["host"] == "pod-worker-7"  # untouched

    storage.write_text(lock, json.dumps({**other_host, "heartbeat": time.time() - lease.LEASE_SECONDS - 1}))
    with wd.workdir_lock(run, "train") as held:
        assert json.loads(storage.read_text(lock))["pid"] == os.getpid()
        held.check()
        with wd.workdir_lock(run, "convert"):  # re-entrant within one process
            pass
        assert storage.is_file(lock)
    assert "taking over the stale lease of `tieflax train` (host pod-worker-7" in capsys.readouterr().err
    assert not storage.exists(lock)


def test_the_heartbeat_renews_and_a_lost_lease_stops_the_holder(gcs, monkeypatch):
    monkeypatch.setattr(lease, "HEARTBEAT_SECONDS", 0.2)
    run = gcs.new_bucket() + "/run"
    lock = storage.join(run, wd.LOCK_FILE)
    with wd.workdir_lock(run, "train") as held:
        first = json.loads(storage.read_text(lock))["heartbeat"]
        time.sleep(1.0)
        assert json.loads(storage.read_text(lock))["heartbeat"] > first
        storage.write_text(lock, json.dumps({"host": "elsewhere", "pid": 1, "command": "train",
                                             "heartbeat": time.time()}))  # taken over under our feet
        deadline = time.time() + 10
        with pytest.raises(wd.WorkdirError, match="taken over by another process"):
            while time.time() < deadline:
                held.check()
                time.sleep(0.1)
    assert json.loads(storage.read_text(lock))["host"] == "elsewhere"  # the new holder's lease is kept


def test_bad_remote_paths_are_refused_in_one_line_before_any_work(gcs, tmp_path, capsys, monkeypatch):
    config_file = os.path.join(REPO, "configs", "experiments", "tiny.py")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", config_file, "--workdir", "gs:/bucket/run"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "slash missing" in err, err
    assert main(["train", "--config", config_file, "--workdir", "gs://no-such-bucket-b/run"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gs://no-such-bucket-b does not exist" in err, err
    assert os.listdir(tmp_path) == []  # no folder named gs:, no cache


def test_two_runs_cannot_both_claim_a_prefix(gcs, micro_data):
    run = gcs.new_bucket() + "/run"
    config = _config(micro_data)
    assert ckpt.save_config(run, config, claim=True)
    storage.delete(storage.join(run, "config.json"))
    # The claim is create-only: a config.json written between the check and the write is not overwritten.
    storage.write_text(storage.join(run, "config.json"), "{}")
    assert storage.create_new(storage.join(run, "config.json"), b"mine") is False
    assert storage.read_text(storage.join(run, "config.json")) == "{}"


def test_missing_credentials_and_a_read_only_bucket_are_refused_before_any_work(tmp_path):
    """A server that wants a token and refuses writes to buckets named ro-*: Cloud Storage's own answers
    (401 to an anonymous caller, 403 to a role that only reads). Each command says so in one line, with
    the fix, and writes nothing (in the bucket, or a local folder). Subprocesses: tensorstore takes its
    credentials once per process."""
    from object_store import GcsServer  # noqa: PLC0415

    server = GcsServer("--require-token", "test-token", "--deny-writes", r"^ro-")
    try:
        writable, read_only = server.new_bucket("rw"), server.new_bucket("ro")
        config_file = os.path.join(REPO, "configs", "experiments", "tiny.py")
        cwd, home = tmp_path / "cwd", tmp_path / "home"
        cwd.mkdir(), home.mkdir()

        def train(workdir: str, **env_changes) -> str:
            env = {**os.environ, **server.env, **env_changes}
            env = {k: v for k, v in env.items() if v is not None}
            proc = subprocess.run([sys.executable, "-m", "tieflax.cli", "train", "--config", config_file,
                                   "--workdir", workdir], cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode != 0, proc.stdout
            lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tieflax")]
            assert len(lines) == 1, proc.stderr
            return lines[0]

        # no credentials: no token, no ADC file, no metadata server (tensorstore then goes out anonymous)
        err = train(writable + "/run", GOOGLE_AUTH_TOKEN_FOR_TESTING=None, GOOGLE_APPLICATION_CREDENTIALS=None,
                    HOME=str(home))
        assert "no credentials found" in err and "gcloud auth application-default login" in err, err
        err = train(read_only + "/run")
        assert f"permission denied on {read_only}" in err and "roles/storage.objectAdmin" in err, err
        assert server.objects(writable) == [] and server.objects(read_only) == []
        assert os.listdir(cwd) == []
    finally:
        server.stop()


def test_an_s3_workdir_is_refused_before_any_work(s3, tmp_path, capsys, monkeypatch):
    """orbax-checkpoint writes checkpoint arrays to local paths and gs:// only (it turns s3://b/run into
    the relative path s3:/b/run): a run on s3:// is refused in one line, with the way out, writing
    nothing. (The storage layer itself works on S3: tests/test_storage.py::test_s3_roundtrip.)"""
    monkeypatch.chdir(tmp_path)
    bucket = s3.new_bucket()
    config_file = os.path.join(REPO, "configs", "experiments", "tiny.py")
    assert main(["train", "--config", config_file, "--workdir", bucket + "/run"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "orbax-checkpoint writes checkpoint arrays" in err, err
    assert "gs://" in err and not storage.listdir(bucket)
    assert os.listdir(tmp_path) == []
