"""Two processes x 4 CPU devices over gloo (launch/local_multiprocess.sh), on a gs:// workdir, against one
process x 8 devices on a local one.

Phase 1 trains 4 steps and checkpoints; phase 2 reruns the command with num_steps=8 (``--allow-change
train.num_steps``) and resumes. The learning rate is constant (no warmup, min_lr_ratio=1) so that
extending num_steps does not change the schedule. Every step's loss must match the single-process run on the same data: the global batch, the
mesh (data=8) and the program are the same; only the cross-process reduction order may differ.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

from train_support import REPO, config_overrides, micro_config, subprocess_env, suite_xla_flags
from tieflax.run import checkpoints as ckpt
from tieflax.run.metrics import read_metrics
from tieflax.train import train_and_evaluate

LOSS_RTOL = 1e-5  # fp32 all-reduce order across processes vs within one


def _config(micro_data: str, num_steps: int, checkpoint_every: int = 2):
    c = micro_config(micro_data, num_steps=num_steps)
    c.train.warmup_steps, c.train.min_lr_ratio = 0, 1.0
    c.train.log_every, c.train.checkpoint_every = 1, checkpoint_every
    return c


def _launch(workdir: str, config, logs: str, expect_failure: bool = False, args: tuple[str, ...] = (),
            **env_changes: str) -> subprocess.CompletedProcess:
    cmd = ["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "4", "python", "-m",
           "tieflax.cli", "train", "--config", os.path.join(REPO, "configs", "experiments", "tiny.py"),
           "--workdir", workdir, *config_overrides(config), *args]
    env = subprocess_env(4, WORKDIR_LOGS=logs, **env_changes)
    env["XLA_FLAGS"] = suite_xla_flags(None)  # the launcher sets the per-process device count
    # Its own session, so that a timeout kills the launcher's processes too, not only the launcher.
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as launched:
        try:
            stdout, stderr = launched.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            os.killpg(launched.pid, signal.SIGKILL)
            stdout, stderr = launched.communicate()
            pytest.fail(f"the 2-process run did not end within 420 s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    proc = subprocess.CompletedProcess(cmd, launched.returncode, stdout, stderr)
    if proc.returncode != 0 and not expect_failure:
        other = open(os.path.join(logs, "process_1.log")).read() if os.path.exists(
            os.path.join(logs, "process_1.log")) else ""
        pytest.fail(f"multi-process run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-4000:]}\n--- process 1 ---\n{other[-4000:]}")
    return proc


def test_two_processes_match_one_and_resume(tmp_path, gcs, micro_data):
    """The two-process run lives in a bucket (a gs:// workdir on the Cloud Storage test server), as on a
    pod: every process reads and writes it directly, process 0 holds the lease for both. A checkpoint every
    4 steps: the resume needs only step 4's, and each save in the bucket is the emulator's work too."""
    multi = gcs.new_bucket() + "/multi"

    _launch(multi, _config(micro_data, 4, checkpoint_every=4), str(tmp_path))
    assert ckpt.latest_step(multi) == 4
    _launch(multi, _config(micro_data, 8, checkpoint_every=4), str(tmp_path),
            args=("--allow-change", "train.num_steps"))  # from 4
    assert ckpt.latest_step(multi) == 8

    single = str(tmp_path / "single")
    result = train_and_evaluate(_config(micro_data, 8), single)

    got = {r["step"]: r["loss"] for r in read_metrics(multi, "train")}
    want = {r["step"]: r["loss"] for r in read_metrics(single, "train")}
    assert sorted(got) == sorted(want) == list(range(1, 9))
    np.testing.assert_allclose([got[s] for s in range(1, 9)], [want[s] for s in range(1, 9)],
                               rtol=LOSS_RTOL)
    assert want[8] < want[1]  # it trained
    val = {r["step"]: r["loss"] for r in read_metrics(multi, "val")}
    np.testing.assert_allclose(val[8], result["final_val_loss"], rtol=LOSS_RTOL)


def _keep_only_checkpoint(workdir: str, step: int) -> None:
    """As if the run had been killed (kill -9) just after saving checkpoint ``step``: the later ones go."""
    for name in os.listdir(os.path.join(workdir, ckpt.CHECKPOINT_DIR)):
        if name.isdigit() and int(name) > step:
            shutil.rmtree(os.path.join(workdir, ckpt.CHECKPOINT_DIR, name))
    assert ckpt.latest_step(workdir) == step


def test_checkpoints_of_two_processes_resume_on_one_and_back(tmp_path, capsys, micro_data):
    """Checkpoint 4 of 2 processes x 4 devices resumes on 1 process x 8 devices, whose checkpoint 6 then
    resumes on 2 processes again. The data iterator's state is saved one file per process; it counts
    global batches, so each resume reads exactly the batches of an uninterrupted run: every resumed
    step's loss matches the uninterrupted 2-process run's (itself matching one process, test above)."""
    run, config = str(tmp_path / "run"), _config(micro_data, 8)

    _launch(run, config, str(tmp_path))                      # 2 processes, uninterrupted: checkpoints 4, 6, 8
    want = {r["step"]: r["loss"] for r in read_metrics(run, "train")}
    want_val = {r["step"]: r["loss"] for r in read_metrics(run, "val")}[8]
    _keep_only_checkpoint(run, 4)
    result = train_and_evaluate(config, run)                 # 1 process, from the 2-process checkpoint 4
    assert result["step"] == 8
    assert "tieflax: resuming from step 4" in capsys.readouterr().out
    resumed_on_one = {r["step"]: r["loss"] for r in read_metrics(run, "train")}
    _keep_only_checkpoint(run, 6)
    proc = _launch(run, config, str(tmp_path))               # 2 processes, from the 1-process checkpoint 6
    assert "tieflax: resuming from step 6" in proc.stdout
    assert ckpt.latest_step(run) == 8
    assert not os.path.exists(os.path.join(run, "checkpoints_unreadable"))

    got = {r["step"]: r["loss"] for r in read_metrics(run, "train")}  # a repeated step: the later row
    assert sorted(want) == sorted(got) == list(range(1, 9))
    steps = range(5, 9)
    np.testing.assert_allclose([resumed_on_one[s] for s in steps], [want[s] for s in steps], rtol=LOSS_RTOL)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=LOSS_RTOL)
    np.testing.assert_allclose(result["final_val_loss"], want_val, rtol=LOSS_RTOL)
    np.testing.assert_allclose({r["step"]: r["loss"] for r in read_metrics(run, "val")}[8], want_val,
                               rtol=LOSS_RTOL)

def test_a_save_failing_on_process_1_stops_both_by_the_next_save(tmp_path, monkeypatch, micro_data):
    """Process 1 may not write its share of the step-4 checkpoint (a storage server that answers 403 to
    its objects, as Cloud Storage answers a role that cannot create them); process 0's share succeeds.
    Both processes must stop with the same one line, naming process 1 and the refused write, at the first
    log step after orbax reports the save ended and at the latest where the next save would start (step 6),
    instead of process 0 waiting at orbax's commit barrier for a save that will never end. How many log
    steps pass before orbax reports the refusal depends on the machine's load (one on an idle machine, two
    in a clean clone's 3.12 suite on three workers), so the bound is the next save, as in test_train's
    full-disk test."""
    from object_store import GcsServer  # noqa: PLC0415

    server = GcsServer("--deny-writes", r"/checkpoints/4/.*process_1")
    for name, value in server.env.items():  # this process reads the bucket afterwards
        monkeypatch.setenv(name, value)
    try:
        run = server.new_bucket() + "/run"
        config = _config(micro_data, 8)
        proc = _launch(run, config, str(tmp_path), expect_failure=True)
        process_1 = open(os.path.join(tmp_path, "process_1.log")).read()
        assert proc.returncode != 0, proc.stdout
        stopped = [ln for ln in proc.stderr.splitlines() if ln.startswith("tieflax train:")]
        assert len(stopped) == 1 and "process 1" in stopped[0] and "checkpoint 4" in stopped[0], proc.stderr
        assert [ln for ln in process_1.splitlines() if ln.startswith("tieflax train:")] == stopped, process_1
        logged = [r["step"] for r in read_metrics(run, "train")]
        assert max(logged) <= 4 + config.train.checkpoint_every, logged  # stopped by the next save
        assert ckpt.latest_step(run) == 2  # the failed step is not taken for a checkpoint
    finally:
        server.stop()
