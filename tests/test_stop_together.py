"""Every process of a multi-process job stops together (the trainer's stop agreement): 2 processes x 1
CPU device over gloo, each started here so that each one's end is timed.

A SIGINT reaching one process (a terminal's Ctrl-C reaches only the process in the foreground): every
process saves the same step's checkpoint and exits 130 with the same line (it exited 130 only there; the
others exited 0 as if SIGTERM had come). A write failing on any one process is held by
tests/test_storage_deadline.py's two-process test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_train_support import REPO, free_port

TRAIN = ["--config", "configs/experiments/tiny.py", "--config.model.d_model=32", "--config.model.n_layers=1",
         "--config.model.n_heads=2", "--config.model.d_ff=64", "--config.model.max_seq_len=32",
         "--config.train.seq_len=32", "--config.train.global_batch_size=8", "--config.train.num_steps=5000",
         "--config.train.log_every=5", "--config.train.checkpoint_every=10", "--config.train.eval_every=100000"]
# A cap on waiting for progress (a first checkpoint, a process's end), not a measure: on a loaded 2-core
# machine compiling and training ten steps takes minutes; the cap only ends a hang.
PROGRESS_CAP_S = 1200


def _start(workdir: str, **env) -> list[subprocess.Popen]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "TIEFLAX_COORDINATOR": f"localhost:{free_port()}", "TIEFLAX_NUM_PROCESSES": "2", **env}
    procs = []
    for i in range(2):
        procs.append(subprocess.Popen([sys.executable, "-m", "tieflax.cli", "train", "--workdir", workdir, *TRAIN], cwd=REPO,
                                      env={**env, "TIEFLAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def _ends(procs, cap_s: float) -> list[float | None]:
    """Seconds from now until each process ended (None: still running at the cap; then all are killed)."""
    t0, ended = time.monotonic(), [None] * len(procs)
    while None in ended and time.monotonic() - t0 < cap_s:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return ended


def _wait_for(predicate, procs) -> None:
    t0 = time.monotonic()
    while not predicate():
        if any(p.poll() is not None for p in procs) or time.monotonic() - t0 > PROGRESS_CAP_S:
            for p in procs:
                p.kill()
            pytest.fail(f"no progress: {[p.communicate()[1][-2000:] for p in procs]}")
        time.sleep(0.1)


def _steps(workdir) -> list[int]:
    folder = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def test_a_sigint_on_one_process_stops_every_process_at_the_same_step_with_130(tmp_path):
    workdir = str(tmp_path / "run")
    procs = _start(workdir)
    _wait_for(lambda: _steps(workdir), procs)
    procs[1].send_signal(signal.SIGINT)   # only process 1, as a terminal's Ctrl-C reaching one
    ended = _ends(procs, PROGRESS_CAP_S)
    outs = [p.communicate() for p in procs]
    lines = [[line for line in err.splitlines() if line.startswith("tieflax train: ")] for _, err in outs]
    print(f"ended {ended} s after the SIGINT: {lines}")
    assert [p.returncode for p in procs] == [130, 130], outs
    steps = set()
    for said in lines:
        assert len(said) == 1, lines
        m = re.fullmatch(r"tieflax train: stopped by SIGINT \(Ctrl-C\): checkpoint saved at step (\d+); rerun the "
                         r"same command to resume from step \1", said[0])
        assert m, said
        steps.add(int(m.group(1)))
    assert len(steps) == 1 and _steps(workdir)[-1] == steps.pop(), (lines, _steps(workdir))
