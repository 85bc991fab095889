"""Every process of a multi-process job stops together (the trainer's stop agreement): 2 processes x 1
CPU device over gloo, each started here so that each one's end is timed.

A SIGINT reaching one process (a terminal's Ctrl-C reaches only the process in the foreground): every
process saves the same step's checkpoint and exits 130 with the same line (it exited 130 only there; the
others exited 0 as if SIGTERM had come). One process whose storage stops answering while it saves (the
bucket answers the others): every process stops at the same step with the same line naming that process.
One process refused (403) a request of a save, in its blocking start or in its writes: every process stops
within seconds with the same line naming that process; a refused read that gcsfs does without is no
failure. A write failing on every process (the bucket itself silent) is held by
tests/test_storage_deadline_two_processes.py.
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

from train_support import REPO, free_port, suite_xla_flags
from two_process_support import TRAIN as TWO_PROCESS_TRAIN

# The job (tests/two_process_support.py: one config with tests/test_waits_bounded.py's, whose programs and token
# files it shares), trained until it is stopped, or ends by itself after a given number of steps; a checkpoint
# every 10 steps, a stop check every 5, no evaluation but at the end of a run that ends by itself.
TRAIN = [*TWO_PROCESS_TRAIN, "--config.train.num_steps=5000", "--config.train.log_every=5",
         "--config.train.checkpoint_every=10", "--config.train.eval_every=100000"]
# A cap on waiting for progress (a first checkpoint, a process's end), not a measure: on a loaded 2-core
# machine compiling and training ten steps takes minutes; the cap only ends a hang.
PROGRESS_CAP_S = 1200


def _start(workdir: str, per_process: tuple[dict, ...] = ({}, {}), steps: int | None = None,
           more: tuple[str, ...] = (), **env) -> list[subprocess.Popen]:
    """The 2 processes, started; ``per_process``: each one's own variables beside ``env``; ``steps``: a run
    that ends by itself after that many steps (else it trains until it is stopped); ``more``: further
    arguments (after TRAIN's)."""
    train = TRAIN + ([f"--config.train.num_steps={steps}"] if steps is not None else []) + list(more)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": suite_xla_flags(1),
           "TIEFLAX_COORDINATOR": f"localhost:{free_port()}", "TIEFLAX_NUM_PROCESSES": "2", **env}
    procs = []
    for i in range(2):
        procs.append(subprocess.Popen([sys.executable, "-m", "tieflax.cli", "train", "--workdir", workdir, *train], cwd=REPO,
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


def _wait_for(predicate, procs, every_s: float = 0.1) -> None:
    """Until ``predicate()``, asked every ``every_s``."""
    t0 = time.monotonic()
    while not predicate():
        if any(p.poll() is not None for p in procs) or time.monotonic() - t0 > PROGRESS_CAP_S:
            for p in procs:
                p.kill()
            pytest.fail(f"no progress: {[p.communicate()[1][-2000:] for p in procs]}")
        time.sleep(every_s)


def _the_one_line(procs, outs, what: str) -> str:
    """Every process exited 1 with one ``tieflax`` line on stderr, the same on each, and no traceback; -> that
    line. ``what``: what happened, for the printed timings."""
    lines = [[line for line in err.splitlines() if line.startswith("tieflax")] for _, err in outs]
    print(f"after {what}: {lines}")
    assert [p.returncode for p in procs] == [1, 1], [(p.returncode, err[-3000:]) for p, (_, err) in zip(procs, outs)]
    for (_, err), said in zip(outs, lines):
        assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0] == lines[1], lines
    return lines[0][0]


def _only_checkpoint_10_readable(server, bucket: str, monkeypatch) -> None:
    """The run's committed checkpoints are [10], and step 10 loads (read here, against ``server``)."""
    from tieflax import storage  # noqa: PLC0415
    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415

    assert _committed(server, bucket) == [10], _committed(server, bucket)
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    storage._BUCKETS.clear()
    _, params, step = ckpt.load_latest_params(bucket + "/run")
    assert step == 10 and params, step


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
# request on, nothing goes through it any more, and "frozen" is printed). The argument after a regex says what
# becomes of the requests it matches (several pairs: each regex its own): "refuse", every matching request is
# answered by the proxy itself with Cloud Storage's 403 (a JSON error body; then the connection closes) instead
# of being forwarded, and "refused" is printed; "delay=<seconds>", the first matching request is held that long,
# then forwarded ("delayed" is printed as it is held): a slow answer, not a stalled one; none or "freeze", the
# freeze above. Everything else goes through.
_PROXY = """
import re, socket, sys, threading, time
upstream = ("127.0.0.1", int(sys.argv[1]))
# (regex, what to do with a request it matches: "refuse", "delay=<seconds>" or "freeze", the event set once done)
rules = [(re.compile(sys.argv[i].encode()), sys.argv[i + 1] if i + 1 < len(sys.argv) else "freeze", threading.Event())
         for i in range(2, len(sys.argv), 2)]
FORBIDDEN = (b'{"error": {"code": 403, "message": "tieflax-test@example.iam.gserviceaccount.com does not have '
             b'storage.objects.create access to the Google Cloud Storage object.", "errors": [{"message": '
             b'"forbidden", "domain": "global", "reason": "forbidden"}]}}')
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
def answer_403(client, data):
    # The request's body (an upload) is read to its end, never forwarded; then Cloud Storage's answer, and the
    # connection is closed on both sides, as the emulator closes each after one answer (HTTP/1.0). Kept open, the
    # emulator, which serves one connection at a time, would wait for a request on its side that never comes,
    # and every process's storage would stop answering.
    head, _, body = data.partition(b"\\r\\n\\r\\n")
    length = re.search(rb"\\r\\ncontent-length: *(\\d+)", head, re.IGNORECASE)
    left = (int(length.group(1)) if length else 0) - len(body)
    while left > 0:
        more = client.recv(min(left, 65536))
        if not more:
            return
        left -= len(more)
    client.sendall(b"HTTP/1.1 403 Forbidden\\r\\nContent-Type: application/json; charset=UTF-8\\r\\n"
                   b"Connection: close\\r\\nContent-Length: %d\\r\\n\\r\\n%s" % (len(FORBIDDEN), FORBIDDEN))
    print("refused", flush=True)
def pump(a, b, requests):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            rule = next((r for r in rules if r[0].search(data)), None) if requests else None
            if rule is not None and rule[1] == "refuse":
                answer_403(a, data)
                break
            if rule is not None and rule[1].startswith("delay=") and not rule[2].is_set():
                rule[2].set()
                print("delayed", flush=True)
                time.sleep(float(rule[1].split("=")[1]))
            if rule is not None and rule[1] == "freeze" and not frozen.is_set():
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
# Above the slowest honest answer of the emulator on a loaded machine (see tests/deadline_support.py).
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
        # A listing of the bucket, asked of the emulator, which serves one request at a time (the processes' too):
        # every half second, not every tenth (CPU here and in the emulator). The stall meets whichever save
        # comes after the first committed one, as it did before.
        _wait_for(lambda: _committed(server, bucket), procs, every_s=0.5)
        os.kill(proxy.pid, signal.SIGSTOP)   # process 1's network goes quiet; process 0's still answers
        while not _stopped(proxy.pid):
            time.sleep(0.01)
        ended = _ends(procs, PROGRESS_CAP_S)
        outs = [p.communicate() for p in procs]
        os.kill(proxy.pid, signal.SIGCONT)
        line = _the_one_line(procs, outs, f"{ended} s: process 1's storage stalled")
        assert line.startswith("tieflax train: process 1: ") and f"no answer from {bucket} within" in line
        # The deadline that passed is the checkpoint's, and the line names its setting (it named the storage
        # deadline's before).
        assert line.endswith("TIEFLAX_CHECKPOINT_DEADLINE_S sets the deadline)"), line
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
        line = _the_one_line(procs, outs, f"{ended} s: process 0's storage stalled in the start of checkpoint 20")
        assert line.startswith(f"tieflax train: process 0: cannot save checkpoint 20 to {bucket}/run/checkpoints: "
                               f"no answer from {bucket} within {DEADLINE} s"), line
        assert line.endswith(f"{storage.DEADLINE_ENV} sets the deadline)"), line
        # Process 0's watchdog passes DEADLINE after its start began (the stall came with its first request);
        # process 1's, waiting for it at orbax's barrier, within the moment the two take to leave the collective
        # before the save; then each reads the other's word and exits (process 0 last, after the others' word),
        # on a busy 2-core machine: 30 s. Not one on JAX's heartbeat timeout (100 s).
        assert max(ended) < DEADLINE + 30 and max(ended) - min(ended) < 15, ended
        assert ended[0] >= ended[1], ended   # the coordinator ends last
        _only_checkpoint_10_readable(server, bucket, monkeypatch)
    finally:
        proxy.kill()
        storage._BUCKETS.clear()
        server.stop()


# ----------------------------------------------------------------------------- one host's write is refused
# Cloud Storage refuses one host's request with 403 (that host's account lacks a permission; the others' does
# not): the request goes no further than that process's proxy, which answers it itself (its "refuse" mode).
def _through_refusing_proxy(server, regex: str):
    """-> (proxy, bucket, procs, refused): the 2 processes on a new bucket, process 0 through a proxy that
    answers its requests matching ``regex`` with 403; ``refused``: a list that gets the proxy's first word."""
    from tieflax import storage  # noqa: PLC0415
    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415

    proxy = subprocess.Popen([sys.executable, "-c", _PROXY, str(server.port), regex, "refuse"],
                             stdout=subprocess.PIPE, text=True)
    through_proxy = f"http://127.0.0.1:{int(proxy.stdout.readline())}"
    bucket = server.new_bucket()
    env = {**server.env, storage.DEADLINE_ENV: str(DEADLINE), ckpt.SAVE_DEADLINE_ENV: str(2 * DEADLINE)}
    procs = _start(bucket + "/run", per_process=({"STORAGE_EMULATOR_HOST": through_proxy,
                                                  "TENSORSTORE_GCS_HTTP_URL": through_proxy}, {}), **env)
    refused: list[str] = []
    threading.Thread(target=lambda: refused.append(proxy.stdout.readline()), daemon=True).start()
    return proxy, bucket, procs, refused


# What process 0 is refused of checkpoint 20's save. Its start: the read of the step's folder (_START_OF_SAVE_20)
# and gcsfs's listing that stands in for a refused read; then no request is left in the start (orbax creates the
# step's folder in the background), so the start raises. In the background: the step's metadata (gcsfs's
# write), and the first object of process 0's own share of the arrays (tensorstore's). With steps as fast as
# this model's, the refusal may be acted on before orbax's threads have logged the failed save: their tracebacks
# stay off the console because an abandoned save keeps orbax's logging muted until the process exits
# (tieflax/run/save_watch.py, `SaveWatch.close`; while it unmuted them, they reached it once in 4 runs of the
# step-metadata case, and these runs used tiny.py's 8,192-token vocabulary, ten times slower steps, and
# programs of their own).
_START_AND_LISTING_OF_SAVE_20 = r"(?:^|\r\n)GET \S*/o(?:/|\?prefix=)run(?:%2F|/)checkpoints(?:%2F|/)20[ ?&]"
_METADATA_OF_SAVE_20 = r"(?:^|\r\n)POST \S*name=run(?:/|%2F)checkpoints(?:/|%2F)20(?:/|%2F)_CHECKPOINT_METADATA"
_OWN_SHARE_OF_SAVE_20 = r"(?:^|\r\n)POST \S*name=run(?:/|%2F)checkpoints(?:/|%2F)20(?:/|%2F)state(?:/|%2F)ocdbt"


@pytest.mark.parametrize("refused", [_START_AND_LISTING_OF_SAVE_20, _METADATA_OF_SAVE_20, _OWN_SHARE_OF_SAVE_20],
                         ids=["save-start", "step-metadata", "own-share"])
def test_a_request_refused_on_process_0_stops_every_process_with_the_same_line_naming_it(monkeypatch, refused):
    """Cloud Storage answers 403 to process 0's requests of checkpoint 20's save (the others' go through),
    in the blocking start of the save or in its background writes: every process ends at once (a refusal is
    an answer: no deadline has to pass) with exit 1 and the same one line, naming process 0 and the refused
    request, process 0 last, and checkpoint 10 stays readable. (Before: the same line on both, but naming no
    process, so that the advice "this account may not write there" pointed at every host's account, process
    1's too, whose requests went through.)"""
    from object_store import GcsServer  # noqa: PLC0415
    from tieflax import storage  # noqa: PLC0415

    server = GcsServer()
    proxy, bucket, procs, said = _through_refusing_proxy(server, refused)
    try:
        _wait_for(lambda: said, procs)
        ended = _ends(procs, PROGRESS_CAP_S)
        outs = [p.communicate() for p in procs]
        line = _the_one_line(procs, outs, f"{ended} s: process 0's request was refused")
        assert line.startswith("tieflax train: process 0: saving checkpoint 20 failed, training stopped (this "
                               "account may not write there"), line
        assert re.search(r"Forbidden|PERMISSION_DENIED", line) and re.search(r"checkpoints(/|%2F)20\b", line), line
        # No deadline passes on the way (the storage deadline is DEADLINE): the next agreement, the exit.
        assert max(ended) < DEADLINE and max(ended) - min(ended) < 10, ended
        assert ended[0] >= ended[1], ended   # the coordinator ends last
        _only_checkpoint_10_readable(server, bucket, monkeypatch)
    finally:
        proxy.kill()
        storage._BUCKETS.clear()
        server.stop()




# ------------------------------------------------------------------- slow or refused, the run goes on
# Two things a run rides through, in one run of 40 steps (each checked by its own test below): process 0's read
# that starts checkpoint 20's save answered late, and its read that starts checkpoint 30's save refused (403).
# Process 0 reaches the bucket through a proxy that holds the first and refuses the second; process 1 directly.
# Every checkpoint kept (keep_checkpoints, 3 by default), so that the bucket shows every one committed.
_START_OF_SAVE_30 = r"(?:^|\r\n)GET \S*/o/run%2Fcheckpoints%2F30[ ?]"
_HELD_S = DEADLINE + 7   # past process 1's watchdog (DEADLINE), well within process 0's (2 * DEADLINE)


@pytest.fixture(scope="module")
def slow_then_refused_run():
    """-> (said, returncodes, stderrs, ended, committed) of that run: ``said``, every word of the proxy."""
    from object_store import GcsServer  # noqa: PLC0415
    from tieflax import storage  # noqa: PLC0415
    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415

    server = GcsServer()
    proxy = subprocess.Popen([sys.executable, "-c", _PROXY, str(server.port), _START_OF_SAVE_20, f"delay={_HELD_S}",
                              _START_OF_SAVE_30, "refuse"], stdout=subprocess.PIPE, text=True)
    try:
        through_proxy = f"http://127.0.0.1:{int(proxy.stdout.readline())}"
        bucket = server.new_bucket()
        env = {**server.env, ckpt.SAVE_DEADLINE_ENV: str(2 * DEADLINE)}
        procs = _start(bucket + "/run", per_process=({"STORAGE_EMULATOR_HOST": through_proxy, "TENSORSTORE_GCS_HTTP_URL":
                                                      through_proxy, storage.DEADLINE_ENV: str(2 * DEADLINE)},
                                                     {storage.DEADLINE_ENV: str(DEADLINE)}), steps=40,
                       more=("--config.train.keep_checkpoints=4",), **env)   # all 4 kept, as the 3 of a 30-step run
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(proxy.stdout), daemon=True)
        reader.start()
        ended = _ends(procs, PROGRESS_CAP_S)
        outs = [p.communicate() for p in procs]
        proxy.kill()
        reader.join(timeout=30)   # to the proxy's end: every word it said
        print(f"ended {ended} s after the start (process 0's request held {_HELD_S} s): {said}")
        yield said, [p.returncode for p in procs], [err for _, err in outs], ended, _committed(server, bucket)
    finally:
        proxy.kill()
        server.stop()


def test_a_refused_read_of_the_step_folder_is_worked_around_and_training_goes_on(slow_then_refused_run):
    """Cloud Storage answers 403 to process 0's read of the folder object run/checkpoints/30 (the request that
    starts the save of checkpoint 30; a role that may list objects but not get them): no write was refused,
    gcsfs asks again with a listing (its way round a refused get), and the save goes through. The run goes
    on and ends by itself with every checkpoint committed, not with a line: a run that trains on is not a
    hang. (The run of the test below: its slow start of checkpoint 20 came before.)"""
    said, returncodes, errs, ended, committed = slow_then_refused_run
    assert "refused\n" in said, (said, [err[-3000:] for err in errs])
    assert returncodes == [0, 0], [(code, err[-3000:]) for code, err in zip(returncodes, errs)]
    assert None not in ended and committed == [10, 20, 30, 40], (ended, committed)
    for err in errs:
        assert not [line for line in err.splitlines() if line.startswith("tieflax")], err[-3000:]


def test_a_slow_start_on_process_0_keeps_the_others_waiting_and_the_run_goes_on(slow_then_refused_run):
    """Process 0's read that starts checkpoint 20's save is answered late: held by its proxy past process 1's
    storage deadline, within process 0's own (twice as long: as if process 1's start had begun that much
    sooner). Process 1's watchdog runs out while it waits for process 0 at orbax's barrier, it says it waits,
    no other process said its start failed or stalled, and once process 0's start ends, process 1's goes on:
    the run ends by itself, every checkpoint committed, not a line said. A slow host is not a stalled one.
    (The run of the test above: its refused read of checkpoint 30 comes after.)"""
    said, returncodes, errs, ended, committed = slow_then_refused_run
    assert said[:1] == ["delayed\n"], (said, [err[-3000:] for err in errs])
    assert returncodes == [0, 0], [(code, err[-3000:]) for code, err in zip(returncodes, errs)]
    for err in errs:
        assert not [line for line in err.splitlines() if line.startswith("tieflax")], err[-3000:]
    assert committed == [10, 20, 30, 40], committed
