"""Multi-process start-up: one program, many processes (TPU pod workers, SLURM tasks, local CPU processes).

``initialize()`` must run before anything touches a JAX device. It calls ``jax.distributed.initialize``
when the launch is multi-process and does nothing for a plain single-process run:

* TPU pod (``launch/tpu_pod.sh``) and SLURM (``launch/slurm_gpu.sbatch``): JAX detects the cluster
  itself; the launchers set ``TIEFLAX_DISTRIBUTED=1``.
* Explicit (``launch/local_multiprocess.sh``, tests): ``TIEFLAX_COORDINATOR=host:port``,
  ``TIEFLAX_NUM_PROCESSES``, ``TIEFLAX_PROCESS_ID``, or the same as arguments. On CPU the collectives
  go over gloo.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time

import jax

from tieflax import storage

_ENV_COORDINATOR = "TIEFLAX_COORDINATOR"
_ENV_NUM_PROCESSES = "TIEFLAX_NUM_PROCESSES"
_ENV_PROCESS_ID = "TIEFLAX_PROCESS_ID"
_ENV_AUTO = "TIEFLAX_DISTRIBUTED"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu: bool | None = None) -> bool:
    """Joins the multi-process job described by the arguments or the environment; returns True if it did.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator (default ``$TIEFLAX_COORDINATOR``).
      num_processes, process_id: default ``$TIEFLAX_NUM_PROCESSES`` / ``$TIEFLAX_PROCESS_ID``.
      cpu: use gloo CPU collectives; default: when ``JAX_PLATFORMS`` is ``cpu``.
    """
    coordinator_address = coordinator_address or os.environ.get(_ENV_COORDINATOR)
    if num_processes is None and os.environ.get(_ENV_NUM_PROCESSES):
        num_processes = int(os.environ[_ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(_ENV_PROCESS_ID):
        process_id = int(os.environ[_ENV_PROCESS_ID])
    explicit = coordinator_address is not None
    if not explicit and os.environ.get(_ENV_AUTO, "") not in ("1", "true", "True"):
        return False
    if explicit and (num_processes is None or process_id is None):
        raise ValueError(f"a coordinator address was given ({coordinator_address}) but not "
                         f"num_processes/process_id; set ${_ENV_NUM_PROCESSES} and ${_ENV_PROCESS_ID}.")
    if cpu is None:
        cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu"
    _source_paths_out_of_programs()
    if cpu:
        # CPU devices of different processes talk over gloo; without it cross-process collectives fail.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _native_output_to_stderr()
    if explicit:
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id)
    else:
        jax.distributed.initialize()  # TPU pod / SLURM: JAX reads the cluster from the environment
    return True


# Every compiled program carries, in its ops' metadata, where in the Python source each op was made.
SOURCE_PATHS_WITHOUT_FOLDERS = r".*/"


def _source_paths_out_of_programs() -> None:
    """Every process compiles the same programs, wherever its code lives and however it was started: an
    op's source location is its innermost frame of user code alone (not the whole call stack, which holds
    the launcher's frames), and a source file is named by its base name alone.

    On jax 0.12 on CPU, two processes whose programs differ only in that metadata wait for each other in
    their first cross-process collective forever: one jitted mean over a 2-process mesh, the script at
    /a/x.py on one process and /b/x.py on the other, hangs; the same path, or jax 0.10, finishes. A pod's
    hosts, each with the code under its own home, are exactly that; so are processes started through
    different entry points (``tieflax`` and ``python -c``), whose call stacks differ. A setting the user
    made (``JAX_HLO_SOURCE_FILE_CANONICALIZATION_REGEX``) is kept."""
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    if jax.config.jax_hlo_source_file_canonicalization_regex is None:
        jax.config.update("jax_hlo_source_file_canonicalization_regex", SOURCE_PATHS_WITHOUT_FOLDERS)


def _native_output_to_stderr() -> None:
    """gloo says "[Gloo] Rank 0 is connected to 1 peer ranks ..." on the process's stdout (file descriptor
    1) from the threads that connect it, at the first collective, several at once and cut into each other:
    between a command's own lines (a sample, train's final JSON line), which a caller reads from stdout.
    So descriptor 1 becomes a copy of stderr, for native code, and ``sys.stdout`` writes to the original
    stdout, buffered as before."""
    old = sys.stdout
    try:
        if old.fileno() != 1:
            return
    except (AttributeError, OSError, ValueError):  # not a file (a notebook's stream): not ours to move
        return
    old.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(original, "w", encoding=old.encoding, errors=old.errors)
    sys.stdout.reconfigure(line_buffering=getattr(old, "line_buffering", False),
                           write_through=getattr(old, "write_through", False))


def is_main_process() -> bool:
    return jax.process_index() == 0


# ------------------------------------------------------------------------------------------ agreement
_rounds: dict[str, int] = {}


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is True on any (one collective)."""
    if jax.process_count() == 1:
        return flag
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    with waiting_for_others("an agreement of every process"):
        return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def first_failure(local_error: str | None, tag: str, *, name_process_0: bool = False) -> str | None:
    """Every process calls this at the same point; all get the same answer: the message of the lowest
    failing process, or None when no process failed.

    A failure seen by one process (a lock refused, a save that failed, a checkpoint it cannot read)
    becomes every process's failure, decided by one collective, instead of the others waiting at the
    next collective forever. The message names the failing process (``process 1: ...``) unless it is
    process 0, the job's own voice; ``name_process_0``: that one too, unless every process failed (a
    failure of one host's own, such as its storage refusing its share of a save). Single-process: returns
    ``local_error``.
    """
    if jax.process_count() == 1:
        return local_error
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    with waiting_for_others(f"the {tag} check"):
        failed = np.asarray(multihost_utils.process_allgather(np.int32(local_error is not None))).reshape(-1)
    if not failed.any():
        return None
    first = int(np.argmax(failed))
    # The text travels through the coordinator's key-value store (each key is written once: a round
    # counter keeps them apart).
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    client = jax_distributed.global_state.client
    _rounds[tag] = _rounds.get(tag, 0) + 1
    key = f"tieflax/{tag}/{_rounds[tag]}"
    if jax.process_index() == first:
        client.key_value_set(key, local_error)
    message = client.blocking_key_value_get(key, 120_000)
    if first == 0 and not (name_process_0 and not failed.all()):
        return message
    return f"process {first}: {message}"


def say(key: str, value: str) -> None:
    """Posts ``value`` under ``key`` in the coordinator's key-value store (a later word replaces it)."""
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    jax_distributed.global_state.client.key_value_set(key, value, allow_overwrite=True)


def words_under(prefix: str) -> dict[int, str]:
    """What the processes posted under ``prefix``/<process index> (``say``), by process index; answers at
    once (nothing waits for a process that has not posted)."""
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    prefix = prefix.rstrip("/") + "/"
    found = jax_distributed.global_state.client.key_value_dir_get(prefix)
    return {int(key[len(prefix):]): value for key, value in found if key[len(prefix):].isdigit()}


def leave_coordinator_last(timeout_s: float = 30.0) -> None:
    """Call before a process of a multi-process job ends on its own (``os._exit``, every process at the same
    step). Process 0 holds the coordination service: when it ends first, another process still on its way
    out sees the service gone and aborts (SIGABRT, a crash report instead of its line). So each other
    process says it is leaving, and process 0 waits for them (at most ``timeout_s``) and a moment more."""
    if jax.process_count() == 1:
        return
    import time  # noqa: PLC0415

    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    client = jax_distributed.global_state.client
    if jax.process_index() != 0:
        try:
            client.key_value_set(f"tieflax/leaving/{jax.process_index()}", "1")
        except Exception:  # noqa: BLE001 (the coordinator is gone already: nothing to wait for)
            pass
        return
    deadline = time.monotonic() + timeout_s
    for i in range(1, jax.process_count()):
        try:
            client.blocking_key_value_get(f"tieflax/leaving/{i}", max(1, int(1000 * (deadline - time.monotonic()))))
        except Exception:  # noqa: BLE001 (that process is gone, or stuck: leave at the deadline)
            break
    time.sleep(0.5)  # its os._exit, after its word


# ------------------------------------------------------------------------------ waits on the others
_POLL_S = 1.0                # how often the watch looks at the clock (and, past _WORD_AFTER_S, the others)
_WORD_AFTER_S = 5.0          # a wait this long is said in the coordinator, where the others can read it
_SHOW_AFTER_S = 120.0        # a wait this long is shown on the console (half the deadline, if that is sooner)
_LEAVE_S = 10.0              # process 0, which holds the coordination service, waits this long for the others


@contextlib.contextmanager
def waiting_for_others(what: str, step: int | None = None):
    """The code inside waits on the other processes (a collective, a step with cross-process
    collectives): bounded by ``TIEFLAX_COLLECTIVE_DEADLINE_S`` (default 900 s). Past it, every process that waits ends
    with one line naming the step and the processes that did not arrive (exit 1); SIGTERM or Ctrl-C
    during the wait says what it waits for, and a second one ends the process at once. A blocked
    collective never returns to Python, so the bound is kept by a thread (``_Watch``), which ends the
    process with ``os._exit``: the steps since the last finished checkpoint are lost, nothing else.
    Single-process: nothing to wait for, no watch."""
    if jax.process_count() == 1:
        yield
        return
    watch = _Watch.started()
    watch.enter(what, step)
    try:
        yield
    except Exception:
        # A process that gave up ends; the collective it left fails here ("connection closed by peer"):
        # this process ends with the line it gave, not a traceback of the symptom.
        line = watch.given_up_line()
        if line is not None:
            _say_and_exit(line, 1)
        raise
    finally:
        watch.leave()


class _Wait:
    def __init__(self, what: str, step: int | None, last_step: int | None):
        self.name, self.since = what_at(what, step, last_step), time.monotonic()
        self.said = self.shown = False   # said in the coordinator; shown on the console


def what_at(what: str, step: int | None, last_step: int | None = None) -> str:
    """``the stop check at step 12``; a wait that knows no step of its own: ``... (after step 12)``, the
    last step a wait named."""
    if step is not None:
        return f"{what} at step {step}"
    return what if last_step is None else f"{what} (after step {last_step})"


class _Watch:
    """One per process: a thread that keeps the deadline of the wait the main thread is in (``_Wait``),
    reads the signals that arrive meanwhile (``signal.set_wakeup_fd``: the main thread, blocked in native
    code, cannot run their Python handlers), and ends the process when the wait cannot end."""

    _instance: "_Watch | None" = None

    @classmethod
    def started(cls) -> "_Watch":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self.deadline_s = storage.collective_deadline_seconds()
        self.process, self.count = jax.process_index(), jax.process_count()
        self.wait: _Wait | None = None
        self.last_step: int | None = None
        self.signals_seen = 0
        self._lock = threading.Lock()
        self._signals, writer = socket.socketpair()
        self._signals.setblocking(False)
        writer.setblocking(False)
        self._writer = writer   # kept open for the process's life
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="tieflax-wait-watch", daemon=True).start()

    def enter(self, what: str, step: int | None) -> None:
        with self._lock:
            self.wait = _Wait(what, step, self.last_step)
            self.last_step = step if step is not None else self.last_step

    def leave(self) -> None:
        with self._lock:
            self.wait = None

    def _run(self) -> None:
        while True:
            select.select([self._signals], [], [], _POLL_S)
            try:
                signums = list(self._signals.recv(64))
            except BlockingIOError:
                signums = []
            with self._lock:
                wait = self.wait
            for signum in signums:
                self._on_signal(signum, wait)
            if wait is not None:
                self._look(wait)

    def _on_signal(self, signum: int, wait: _Wait | None) -> None:
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        self.signals_seen += 1
        if wait is None:   # the main thread runs the handler itself (tieflax.train.stop.StopSignal)
            return
        name = signal.Signals(signum).name
        if self.signals_seen > 1:
            _say_and_exit(f"stopped at once by a second signal ({name}) while waiting for the other processes "
                          f"({wait.name}): the steps after the last finished checkpoint are lost; rerun the same "
                          "command to resume from it", 128 + signum)
        left = self.deadline_s - (time.monotonic() - wait.since)
        print(f"tieflax: {name} received while waiting for the other processes ({wait.name}): stopping when "
              f"they arrive, or in {max(left, 0):.0f} s ({storage.COLLECTIVE_DEADLINE_ENV}); a second signal stops at once",
              file=sys.stderr, flush=True)

    def _look(self, wait: _Wait) -> None:
        waited = time.monotonic() - wait.since
        if waited < _WORD_AFTER_S:
            return
        if not wait.shown and waited >= min(_SHOW_AFTER_S, self.deadline_s / 2):
            wait.shown = True   # a wedged job says so well before its deadline
            print(f"tieflax: waiting for the other processes ({wait.name}) for {waited:.0f} s; if they do not "
                  f"arrive, every process ends in {self.deadline_s - waited:.0f} s ({storage.COLLECTIVE_DEADLINE_ENV})",
                  file=sys.stderr, flush=True)
        try:
            if not wait.said:
                say(f"tieflax/waiting/{self.process}", wait.name)
                wait.said = True
            if waited >= self.deadline_s:
                self._give_up(wait)
            line = self.given_up_line()
            if line is not None:   # another process gave up: the same line here, and a word that this one ends
                say(f"tieflax/gave_up/{self.process}", line)
        except Exception:  # noqa: BLE001 (the coordinator is gone: its own heartbeat ends this process)
            return
        if line is not None:
            _say_and_exit(line, 1)

    def given_up_line(self) -> str | None:
        """The line of the lowest process that gave up waiting, if any did."""
        try:
            given_up = words_under("tieflax/gave_up")
        except Exception:  # noqa: BLE001 (no coordinator to ask)
            return None
        return given_up[min(given_up)] if given_up else None

    def _give_up(self, wait: _Wait) -> None:
        """Past the deadline: the line that names who did not arrive, said to the others and printed."""
        arrived = {p for p, name in words_under("tieflax/waiting").items() if name == wait.name}
        arrived.add(self.process)
        missing = [p for p in range(self.count) if p not in arrived]
        within = f"within {self.deadline_s:g} s ({storage.COLLECTIVE_DEADLINE_ENV})"
        if missing:
            who = f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            line = f"{wait.name}: {who} did not arrive {within}"
        else:
            line = (f"{wait.name}: every process arrived but the collective did not end {within} (a process stuck "
                    "inside it, or processes running different programs: the same code and versions on every host?)")
        line += "; every process ends here: rerun the same command to resume from the last finished checkpoint"
        say(f"tieflax/gave_up/{self.process}", line)
        if self.process == 0:   # it holds the coordination service: the others read the line first
            end = time.monotonic() + _LEAVE_S
            while time.monotonic() < end and not arrived <= set(words_under("tieflax/gave_up")) | {0}:
                time.sleep(0.2)
        _say_and_exit(line, 1)


def _say_and_exit(line: str, code: int) -> None:
    print(f"tieflax: {line}", file=sys.stderr, flush=True)
    os._exit(code)
