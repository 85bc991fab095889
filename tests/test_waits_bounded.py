"""A 2-process job (gloo, one CPU device per process) never waits on the other process forever:

* each process imports tieflax from its own copy of the code (as each host of a pod does, under its own
  home): the job finishes (on jax 0.12 it hung in its first cross-process collective, before
  ``tieflax.hardware.distributed`` took the source paths out of the compiled programs);
* one process frozen inside the stop check: every process ends within ``TIEFLAX_COLLECTIVE_DEADLINE_S``
  with the same one line naming the step;
* one process stopped (SIGSTOP) before a stop check: the other says it waits (at half the deadline), answers a
  SIGTERM at once, in one line, not after the collective, and ends within the deadline with one line naming
  the process that did not arrive.

The processes are started here, not through ``launch/local_multiprocess.sh``: each needs its own code
folder or its own patch."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from train_support import REPO, free_port, suite_xla_flags
from two_process_support import TRAIN as TWO_PROCESS_TRAIN

DEADLINE_S = 20
# The job of tests/test_stop_together.py (tests/two_process_support.py: its compiled programs and token files
# are shared), 6 steps with a stop check at each (log_every=1), checkpoints at 3 and 6, an evaluation at 6.
TRAIN = ["train", *TWO_PROCESS_TRAIN, *[f"--config.{o}" for o in (
    "train.num_steps=6", "train.eval_every=6", "train.log_every=1", "train.checkpoint_every=3")]]
MAIN = "import sys; from tieflax.cli import main; sys.argv[0] = 'tieflax'; sys.exit(main())"
# Process 1 of the frozen job: inside the stop check of step 4 (the wait is entered), it never reaches the
# collective, as a process stuck in one would not leave it.
FROZEN_AT_STEP_4 = """
import time
from jax.experimental import multihost_utils
import tieflax.train.loop as loop
from tieflax.train import stop as stop_module
real = stop_module.stop_everywhere
def stop_everywhere(stop, step=None):
    if step == 4:
        multihost_utils.process_allgather = lambda *a, **k: time.sleep(3600)
    return real(stop, step)
loop.stop_everywhere = stop_everywhere
"""

# Process 1 of the other job stops itself (SIGSTOP) before the stop check of step 3: it never arrives.
STOPPED_BEFORE_STEP_3 = """
import os, signal
import tieflax.train.loop as loop
real = loop.stop_everywhere
def stop_everywhere(stop, step=None):
    if step == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    return real(stop, step)
loop.stop_everywhere = stop_everywhere
"""


def _start(tmp_path, workdir, *, code: dict[int, str] | None = None, patch: dict[int, str] | None = None,
           overrides: tuple[str, ...] = (), deadline_s: int = DEADLINE_S):
    """Two processes of `tieflax train` over gloo; ``code``: process -> the folder it imports tieflax
    from (default: this repository); ``patch``: process -> Python run before the command; ``overrides``:
    more ``--config.`` settings (after TRAIN's); ``deadline_s``: their collective deadline."""
    port = free_port()
    procs = []
    for i in range(2):
        src = (code or {}).get(i, REPO)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": suite_xla_flags(1),
               "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               "TIEFLAX_COORDINATOR": f"localhost:{port}", "TIEFLAX_NUM_PROCESSES": "2",
               "TIEFLAX_PROCESS_ID": str(i), "TIEFLAX_COLLECTIVE_DEADLINE_S": str(deadline_s)}
        out = open(tmp_path / f"process_{i}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-c", (patch or {}).get(i, "") + "\n" + MAIN, *TRAIN,
                                       *[f"--config.{o}" for o in overrides], "--workdir", str(workdir)], cwd=src, env=env, stdout=out,
                                      stderr=subprocess.STDOUT))
    return procs


def _log(tmp_path, i: int) -> str:
    return (tmp_path / f"process_{i}.log").read_text()


def _wait_for(predicate, what: str, limit_s: float = 240):
    end = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < end, f"{what}: not within {limit_s} s"
        time.sleep(0.2)


def _end_all(procs, limit_s: float) -> list[int]:
    try:
        return [p.wait(timeout=limit_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _tieflax_lines(text: str, pattern: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.search(pattern, ln)]


def test_hosts_whose_code_lives_at_different_paths_finish_the_job(tmp_path):
    """Each process imports tieflax from its own copy (the pod's `~/tieflax-src` under each home)."""
    code = {}
    for i in range(2):
        code[i] = str(tmp_path / f"host{i}" / "tieflax-src")
        # With the bytecode (tests/conftest.py compiles it once; copytree keeps the sources' times, so it stays
        # valid): each process would otherwise compile every module it imports from source (0.3 CPU-s each).
        # The code objects still name the copy's files: Python sets their file names to the source's path on load.
        shutil.copytree(os.path.join(REPO, "tieflax"), os.path.join(code[i], "tieflax"))
    procs = _start(tmp_path, tmp_path / "run", code=code)
    codes = _end_all(procs, 300)
    assert codes == [0, 0], (_log(tmp_path, 0), _log(tmp_path, 1))
    assert '"step": 6' in _log(tmp_path, 0)


def test_a_process_frozen_inside_a_collective_ends_every_process_with_one_line(tmp_path):
    procs = _start(tmp_path, tmp_path / "run", patch={1: FROZEN_AT_STEP_4})
    _wait_for(lambda: "step 3/6" in _log(tmp_path, 0), "step 3 on process 0")
    t0 = time.monotonic()
    codes = _end_all(procs, DEADLINE_S + 60)
    took = time.monotonic() - t0
    assert codes == [1, 1], (_log(tmp_path, 0), _log(tmp_path, 1))
    assert took < DEADLINE_S + 30, took
    lines = [_tieflax_lines(_log(tmp_path, i), r"collective|did not arrive") for i in range(2)]
    assert len(lines[0]) == 1 and lines[0] == lines[1], lines
    assert "the stop check at step 4" in lines[0][0] and f"within {DEADLINE_S} s" in lines[0][0], lines
    assert "resume from the last finished checkpoint" in lines[0][0]
    for i in range(2):
        assert "Traceback" not in _log(tmp_path, i), _log(tmp_path, i)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="no SIGSTOP on this system")
def test_a_process_that_stops_arriving_is_named_and_sigterm_is_answered_while_waiting(tmp_path):
    procs = _start(tmp_path, tmp_path / "run", patch={1: STOPPED_BEFORE_STEP_3})
    try:
        # process 0 waits for it and says so (at half the deadline); then SIGTERM: the answer is a line, at once
        _wait_for(lambda: "waiting for the other processes" in _log(tmp_path, 0), "the waiting line")
        procs[0].send_signal(signal.SIGTERM)
        _wait_for(lambda: "SIGTERM received while waiting" in _log(tmp_path, 0), "the SIGTERM line", 20)
        assert procs[0].wait(timeout=DEADLINE_S + 30) == 1, _log(tmp_path, 0)
    finally:
        procs[1].kill()
        _end_all(procs, 30)
    text = _log(tmp_path, 0)
    [line] = _tieflax_lines(text, r"did not arrive")
    assert line.startswith("tieflax: the stop check at step 3: process 1 did not arrive within 20 s"), line
    [answer] = _tieflax_lines(text, r"SIGTERM received")
    assert "a second signal stops at once" in answer, answer
    assert "Traceback" not in text, text


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="no SIGSTOP on this system")
def test_a_second_signal_while_waiting_ends_the_process_at_once(tmp_path):
    """The first SIGTERM is answered with a line and the wait goes on (to the others or the deadline); the
    second ends the process at once with 128 + SIGTERM, in one line, well before the deadline. The deadline
    is 40 s here: the waiting line comes at half of it, and the signals must land before its end."""
    deadline_s = 40
    procs = _start(tmp_path, tmp_path / "run", patch={1: STOPPED_BEFORE_STEP_3}, deadline_s=deadline_s)
    try:
        _wait_for(lambda: "waiting for the other processes" in _log(tmp_path, 0), "the waiting line")
        procs[0].send_signal(signal.SIGTERM)
        _wait_for(lambda: "SIGTERM received while waiting" in _log(tmp_path, 0), "the SIGTERM line", 20)
        assert procs[0].poll() is None, _log(tmp_path, 0)   # the first signal does not end the wait
        second = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=deadline_s) == 128 + signal.SIGTERM, _log(tmp_path, 0)
        took = time.monotonic() - second
    finally:
        procs[1].kill()
        _end_all(procs, 30)
    text = _log(tmp_path, 0)
    [line] = _tieflax_lines(text, r"second signal \(SIGTERM\)")
    assert line.startswith("tieflax: stopped at once by a second signal (SIGTERM) while waiting for the other "
                           "processes"), line
    assert "did not arrive" not in text, text   # it ended before the deadline's line
    assert took < 10, took
    assert "Traceback" not in text, text
