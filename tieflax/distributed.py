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

import os
import sys

import jax

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
