"""Every process of a multi-process job stops together (the trainer's stop agreement): 2 processes x 1
CPU device over gloo, each started here so that each one's end is timed.

A SIGINT reaching one process (a terminal's Ctrl-C reaches only the process in the foreground): every
process saves the same step's checkpoint and exits 130 with the same line (it exited 130 only there; the
others exited 0 as if SIGTERM had come). One process whose storage stops answering while it saves (the
bucket answers the others): every process stops at the same step with the same line naming that process.
A write failing on every process (the bucket itself silent) is held by tests/test_storage_deadline.py's
two-process test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
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


def _start(workdir: str, per_process: tuple[dict, ...] = ({}, {}), **env) -> list[subprocess.Popen]:
    """The 2 processes, started; ``per_process``: each one's own variables beside ``env``."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "TIEFLAX_COORDINATOR": f"localhost:{free_port()}", "TIEFLAX_NUM_PROCESSES": "2", **env}
    procs = []
    for i in range(2):
        procs.append(subprocess.Popen([sys.executable, "-m", "tieflax.cli", "train", "--workdir", workdir, *TRAIN], cwd=REPO,
                                      env={**env, **per_process[i], "TIEFLAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
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


# ------------------------------------------------------------------------------- one host's save stalls
# One host's network stops answering (the bucket answers the others): that process reaches the bucket through a
# TCP proxy of its own, frozen with SIGSTOP (it accepts connections and never answers: a stalled network), or
# frozen by the proxy itself when it forwards a request matching the regex of its second argument (from that
# request on, nothing goes through it any more, and "frozen" is printed).
_PROXY = """
import re, socket, sys, threading
upstream = ("127.0.0.1", int(sys.argv[1]))
freeze_on = re.compile(sys.argv[2].encode()) if len(sys.argv) > 2 else None
frozen, lock, upstreams, held = threading.Event(), threading.Lock(), [], []
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", 0))
server.listen(128)
print(server.getsockname()[1], flush=True)
def hold():
    threading.Event().wait()   # a stalled network: nothing more goes through, nothing is closed
def freeze():
    # The emulator serves one connection at a time: its side of each connection is closed, so that it serves
    # the other processes (the client's side stays open and unanswered).
    with lock:
        frozen.set()
        for up in upstreams:
            try:
                up.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    print("frozen", flush=True)
def pump(a, b, requests):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            if requests and freeze_on is not None and not frozen.is_set() and freeze_on.search(data):
                freeze()
            if frozen.is_set():
                hold()
            b.sendall(data)
    except OSError:
        pass
    if frozen.is_set():
        hold()
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    client, _ = server.accept()
    if frozen.is_set():
        held.append(client)   # accepted, never answered
        continue
    try:
        up = socket.create_connection(upstream)
    except OSError:
        client.close()
        continue
    with lock:
        upstreams.append(up)
    for a, b, requests in ((client, up, True), (up, client, False)):
        threading.Thread(target=pump, args=(a, b, requests), daemon=True).start()
"""
# The storage deadline of the run below, and its checkpoint deadline (two of it); every bound derives from them.
# Above the slowest honest answer of the emulator on a loaded machine (see tests/test_storage_deadline.py).
DEADLINE = 15


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` shows stopped ('T') in /proc (SIGSTOP is delivered asynchronously)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "T":
                return False
    return True


def _committed(server, bucket: str) -> list[int]:
    """Steps committed in ``bucket``'s run (orbax's step-level commit marker)."""
    return sorted(int(o.split("/")[2]) for o in server.objects(bucket, "run/checkpoints/")
                  if o.count("/") == 3 and o.endswith("/commit_success.txt"))


def test_one_process_whose_save_stalls_stops_every_process_with_the_same_line(monkeypatch):
    """Only process 1's storage stops answering while it saves: every process ends within a bound of the
    stall with exit 1 and the same one line naming process 1, and the last committed checkpoint stays
    readable. (Before: both lines said "cannot finish checkpoint 20 in ...: no answer" without naming a
    process, as if process 0's bucket, which answered, had stopped answering.)"""
    from object_store import GcsServer  # noqa: PLC0415
    from tieflax import storage  # noqa: PLC0415
    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415

    server = GcsServer()
    proxy = subprocess.Popen([sys.executable, "-c", _PROXY, str(server.port)], stdout=subprocess.PIPE, text=True)
    try:
        through_proxy = f"http://127.0.0.1:{int(proxy.stdout.readline())}"
        bucket = server.new_bucket()
        env = {**server.env, storage.DEADLINE_ENV: str(DEADLINE), ckpt.SAVE_DEADLINE_ENV: str(2 * DEADLINE)}
        procs = _start(bucket + "/run", per_process=({}, {"STORAGE_EMULATOR_HOST": through_proxy,
                                                           "TENSORSTORE_GCS_HTTP_URL": through_proxy}), **env)
        _wait_for(lambda: _committed(server, bucket), procs)
        os.kill(proxy.pid, signal.SIGSTOP)   # process 1's network goes quiet; process 0's still answers
        while not _stopped(proxy.pid):
            time.sleep(0.01)
        ended = _ends(procs, PROGRESS_CAP_S)
        outs = [p.communicate() for p in procs]
        os.kill(proxy.pid, signal.SIGCONT)
        lines = [[line for line in err.splitlines() if line.startswith("tieflax")] for _, err in outs]
        print(f"ended {ended} s after process 1's storage stalled: {lines}")
        assert [p.returncode for p in procs] == [1, 1], [(p.returncode, err[-3000:]) for p, (_, err) in
                                                         zip(procs, outs)]
        for (_, err), said in zip(outs, lines):
            assert len(said) == 1 and "Traceback" not in err, err[-3000:]
        assert lines[0] == lines[1], lines
        assert lines[0][0].startswith("tieflax train: process 1: ") and f"no answer from {bucket} within" in lines[0][0]
        # The deadline that passed is the checkpoint's, and the line names its setting (it named the storage
        # deadline's before).
        assert lines[0][0].endswith("TIEFLAX_CHECKPOINT_DEADLINE_S sets the deadline)"), lines[0][0]
        # The stalled save's deadline (the storage deadline for its start, the checkpoint deadline for its
        # commit), the steps up to the next agreement, the exit (process 0 last, after the others' word), on a
        # busy 2-core machine: 30 s. Both within seconds of each other, not one on JAX's heartbeat timeout (100 s).
        assert max(ended) < 2 * DEADLINE + 30 and max(ended) - min(ended) < 15, ended
        assert ended[0] >= ended[1], ended   # the coordinator ends last
        # The last committed checkpoint is kept and reads.
        committed = _committed(server, bucket)
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        storage._BUCKETS.clear()
        _, params, step = ckpt.load_latest_params(bucket + "/run")
        assert committed and step == committed[-1] and params, (committed, step)
    finally:
        os.kill(proxy.pid, signal.SIGCONT)
        proxy.kill()
        storage._BUCKETS.clear()
        server.stop()


# Process 0's first request inside the blocking start of checkpoint 20's save: orbax's primary process asks
# whether the step's folder exists (run/checkpoints/20) before it hands the writes to the background. The other
# processes make no request in that phase (their writes all go to the background): they wait for process 0 at
# orbax's next barrier, inside their own start.
_START_OF_SAVE_20 = r"(?:^|\r\n)GET \S*/o/run%2Fcheckpoints%2F20[ ?]"


def test_a_stall_inside_one_process_s_save_start_stops_every_process_with_the_same_line(monkeypatch):
    """Process 0's storage stops answering inside the blocking start of checkpoint 20's save (its request for
    run/checkpoints/20 is the one its proxy freezes on): every process ends within a bound of the storage
    deadline with exit 1 and the same one line naming process 0, process 0 last, and checkpoint 10 stays
    readable. (Before: each process ended on its own watchdog at the same moment with a line naming no
    process, process 1's blaming the bucket that answered it, and process 0, the coordinator, did not wait for
    process 1 to leave.)"""
    from object_store import GcsServer  # noqa: PLC0415
    from tieflax import storage  # noqa: PLC0415
    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415

    server = GcsServer()
    proxy = subprocess.Popen([sys.executable, "-c", _PROXY, str(server.port), _START_OF_SAVE_20],
                             stdout=subprocess.PIPE, text=True)
    try:
        through_proxy = f"http://127.0.0.1:{int(proxy.stdout.readline())}"
        bucket = server.new_bucket()
        env = {**server.env, storage.DEADLINE_ENV: str(DEADLINE), ckpt.SAVE_DEADLINE_ENV: str(2 * DEADLINE)}
        procs = _start(bucket + "/run", per_process=({"STORAGE_EMULATOR_HOST": through_proxy,
                                                      "TENSORSTORE_GCS_HTTP_URL": through_proxy}, {}), **env)
        frozen = []
        threading.Thread(target=lambda: frozen.append(proxy.stdout.readline()), daemon=True).start()
        _wait_for(lambda: frozen, procs)
        ended = _ends(procs, PROGRESS_CAP_S)
        outs = [p.communicate() for p in procs]
        lines = [[line for line in err.splitlines() if line.startswith("tieflax")] for _, err in outs]
        print(f"ended {ended} s after process 0's storage stalled in the start of checkpoint 20: {lines}")
        assert [p.returncode for p in procs] == [1, 1], [(p.returncode, err[-3000:]) for p, (_, err) in
                                                         zip(procs, outs)]
        for (_, err), said in zip(outs, lines):
            assert len(said) == 1 and "Traceback" not in err, err[-3000:]
        assert lines[0] == lines[1], lines
        line = lines[0][0]
        assert line.startswith(f"tieflax train: process 0: cannot save checkpoint 20 to {bucket}/run/checkpoints: "
                               f"no answer from {bucket} within {DEADLINE} s"), line
        assert line.endswith(f"{storage.DEADLINE_ENV} sets the deadline)"), line
        # Process 0's watchdog passes DEADLINE after its start began (the stall came with its first request);
        # process 1's, waiting for it at orbax's barrier, within the moment the two take to leave the collective
        # before the save; then each reads the other's word and exits (process 0 last, after the others' word),
        # on a busy 2-core machine: 30 s. Not one on JAX's heartbeat timeout (100 s).
        assert max(ended) < DEADLINE + 30 and max(ended) - min(ended) < 15, ended
        assert ended[0] >= ended[1], ended   # the coordinator ends last
        assert _committed(server, bucket) == [10], _committed(server, bucket)
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        storage._BUCKETS.clear()
        _, params, step = ckpt.load_latest_params(bucket + "/run")
        assert step == 10 and params, step
    finally:
        proxy.kill()
        storage._BUCKETS.clear()
        server.stop()
