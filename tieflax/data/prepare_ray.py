"""``tieflax prepare --ray [ADDRESS]``: the tokenising step as Ray tasks over a cluster, the same store.

    with ray_session("10.0.0.2:6379", cpus=None, say=print):       # or None: a local Ray of `cpus` CPUs
        build_store(config.data, "gs://bucket/corpus", executor=RayTasks())  # tasks, then finalize here

The driver (this process) keeps what the pool's parent does: the lock, the tokenizer (trained here, as
for the pool), ``build.json``, ``inputs.json`` and the finalize (``store_build``). What moves to the
cluster is step 2, and each task runs the pool worker's own code (``store_build.tokenise_part``: the
batched fast tokenizer, the part, then the ledger entry):

1. Plan: the source's units (its files; the Bible's one file; ``sources.source_units``) are read by plan
   tasks, a few units each, which return every unit's document lengths (``[documents] int64``). The
   driver cuts those lengths into input shards by the pool's own rule (``store_build.cut_shards``), so
   shard ``k`` holds the same documents as the pool's shard ``k`` and its part is the same bytes. A shard
   is named by segments ``(unit, first document, end)``, a few strings and ints: no text goes through
   the driver. (An ``hf`` dataset is one stream with no units: its shards' texts are sent from here, as
   the pool sends them to its processes.)
2. Tokenise: one task per input shard the ledger lacks, at most ``2 x`` the cluster's CPUs in flight (a
   fast node takes the next task when it is free, so a slow one holds back only its own). A task reads its
   segments and calls ``tokenise_part``.

Faults. A task whose worker process or node dies is retried by Ray (``MAX_RETRIES``); its part is written
to a temporary name and renamed (``storage.write_bytes``), and the ledger entry comes after the part, so
a retry writes the same bytes again and the digest does not change. An error in a task (a file that does
not decode, a bucket past the storage deadline) is not retried: the driver raises it as the pool does,
one line. When the driver fails or is stopped it cancels its tasks with ``force`` (their processes are
killed); when it is killed outright, Ray ends every task of its job (a job's workers die with its
driver; a local Ray started for the command dies with it), so no task writes after the driver is gone,
and the rerun resumes from the ledger under the store's lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
from itertools import islice
from typing import Callable, Iterator

import numpy as np

from tieflax import storage
from tieflax.data import store as st
from tieflax.data import store_build as sb
from tieflax.data.config import DataError
from tieflax.data.sources import iter_documents, source_units, unit_documents

MAX_RETRIES = 4          # a task whose worker or node died runs again, up to this many times
PLAN_UNITS_PER_TASK = 64  # units (files) whose document lengths one plan task reads
CONNECT_S = 5.0          # a TCP connection to the cluster's address, before Ray is asked to join it
JOIN_S = 60.0            # ray.init on an address that answers but is not a Ray cluster would wait for ever
PROGRESS_S = 2.0         # one progress line per this many seconds, as the pool prints
INSTALL = "pip install 'tieflax[ray]' (or pip install -e '.[ray]' in a clone)"
# A task's process imports tieflax.data without grain and JAX (see tieflax.data's docstring) and tokenises
# on one thread: parallelism comes from the tasks, one CPU each, as from the pool's processes.
WORKER_ENV = {"TIEFLAX_DATA_WORKER": "1", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# A local Ray's log monitor tails its workers' logs for the driver, which a build does not read
# (log_to_driver=False): it lists the log folder every 5 s, not every 0.1 s (its CPU over a minute idle on
# this 2-core machine: 1.7 s -> 1.0 s, taken from the tokenising).
LOCAL_RAY_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}


def import_ray():
    """The ``ray`` module, or the one line naming the extra that installs it."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise DataError(f"--ray needs the optional package 'ray', from tieflax's 'ray' extra: {INSTALL}") from None
    return ray


# ------------------------------------------------------------------------------------------ connecting

@contextlib.contextmanager
def ray_session(address: str | None, *, cpus: int, say: Callable[[str], None]):
    """Connected to the Ray cluster at ``address`` (``host:port``, ``ray://host:port`` or ``auto``) for the
    block, or, with ``address`` None, to a local Ray of ``cpus`` CPUs that ``begin_local`` starts when the
    build reaches its tokenizer and that ends with the block. A process already connected (a test's) stays
    as it is. An address where nothing answers is one line within ``CONNECT_S``; one that answers but
    never lets Ray join, one line within ``JOIN_S``: both before the corpus is read."""
    ray = import_ray()
    if ray.is_initialized():
        yield
        return
    if address is None:
        _LOCAL.update(cpus=cpus, say=say, thread=None, error=None)
        try:
            yield
        finally:
            _end_local(ray)
        return
    _check_reachable(address)
    _join(ray, address)
    say(f"joined the Ray cluster at {address}: {_cluster_cpus(ray)} CPUs")
    warm_workers(ray)
    try:
        yield
    finally:
        ray.shutdown()


def init_options() -> dict:
    """``ray.init``'s options for a driver of ``tieflax prepare``: no dashboard, the console kept to our own
    lines (a task's error comes back as its exception)."""
    return {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}


def _warm() -> int:
    return os.getpid()


def warm_workers(ray) -> None:
    """One no-op task per CPU of the cluster, not waited for: the worker processes start (and import this
    module and ``store_build``) while the driver trains or reads the tokenizer, not after it."""
    warm = _remote(ray, _warm)
    for _ in range(max(_cluster_cpus(ray), 1)):
        warm.remote()


def start_local(cpus: int) -> None:
    """A local Ray of ``cpus`` CPUs for this process. ``WORKER_ENV`` is in the environment its processes
    start with, so the workers it starts at once serve the tasks (a runtime_env would start others), with
    ``LOCAL_RAY_ENV``."""
    ray = import_ray()
    env = {**WORKER_ENV, **LOCAL_RAY_ENV}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ray.init(address="local", num_cpus=cpus, **init_options())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# The local Ray of a `--ray` without an address: started in a thread while the tokenizer is trained or
# read (a Ray takes seconds to start: 10-16 s on this 2-core machine under load), waited for by the tasks.
_LOCAL: dict = {}


def begin_local() -> None:
    """Starts the pending local Ray (``ray_session``) in a thread; nothing when none is pending."""
    if _LOCAL.get("cpus") is None or _LOCAL.get("thread") is not None:
        return

    started, release = threading.Event(), threading.Event()

    def start():
        try:
            start_local(_LOCAL["cpus"])
            warm_workers(import_ray())
        except BaseException as e:  # noqa: BLE001 (raised in the driver's thread by _wait_local)
            _LOCAL["error"] = e
        started.set()
        # Ray's processes are started with PR_SET_PDEATHSIG, which fires when the *thread* that started
        # them ends: this one lives until they are stopped (_end_local), or they would be killed now.
        release.wait()

    _LOCAL.update(started=started, release=release,
                  thread=threading.Thread(target=start, name="tieflax-ray-start", daemon=True))
    _LOCAL["thread"].start()


def _wait_local(ray) -> None:
    """Connected: the local Ray started (begun now if it was not), or its failure raised."""
    if ray.is_initialized() and _LOCAL.get("thread") is None:
        return
    begin_local()
    if _LOCAL.get("thread") is None:
        raise DataError("tieflax prepare --ray: no Ray cluster is connected (internal: build_store(executor="
                        "RayTasks()) outside ray_session)")
    _LOCAL["started"].wait()
    if _LOCAL["error"] is not None:
        e = _LOCAL["error"]
        raise DataError(f"--ray: the local Ray did not start ({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}): "
                        "check the memory and /tmp free on this machine, or run without --ray") from None
    if not _LOCAL.get("said"):
        _LOCAL["said"] = True
        _LOCAL["say"](f"started a local Ray with {_LOCAL['cpus']} CPU{'s' if _LOCAL['cpus'] != 1 else ''} for "
                      "this command")


def _end_local(ray) -> None:
    """The local Ray stopped (after its start, if it is still starting: its processes are then known), then
    the thread that started it released."""
    thread = _LOCAL.get("thread")
    if thread is not None:
        _LOCAL["started"].wait()
    if ray.is_initialized():
        ray.shutdown()
    if thread is not None:
        _LOCAL["release"].set()
        thread.join()
    _LOCAL.clear()


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of an address, or None for ``auto`` (Ray finds the cluster on this machine)."""
    text = address.removeprefix("ray://")
    if text == "auto":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise DataError(f"--ray {address}: give the head's HOST:PORT (e.g. 10.0.0.2:6379, the address `ray start "
                        "--head` prints), ray://HOST:PORT, auto, or nothing for a local Ray")
    return host.strip("[]"), int(port)


def _check_reachable(address: str) -> None:
    where = _host_port(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=CONNECT_S).close()
    except OSError as e:
        raise DataError(f"--ray {address}: no Ray cluster answers there ({e.strerror or e}): start its head "
                        "(`ray start --head` on one node) and give the address it prints, or leave the address "
                        "out for a local Ray") from None


def _join(ray, address: str) -> None:
    """``ray.init(address)``, which on an address that answers but is not a Ray head retries for minutes:
    past ``JOIN_S`` the process says so in one line and exits (nothing has been written yet)."""
    joined = threading.Event()

    def expire():
        if not joined.wait(JOIN_S):
            storage.stop_at_once(f"--ray {address}: something answers there but no Ray cluster let this process "
                                 f"join within {JOIN_S:.0f} s: check the address (the head's GCS port, 6379 by "
                                 "default) and that its Ray version is this one's")

    threading.Thread(target=expire, name="tieflax-ray-join", daemon=True).start()
    # A cluster with token authentication (Ray's default) refuses a driver without RAY_AUTH_MODE=token even
    # when the token is here: take the token where Ray keeps it, as `ray start` does on a node.
    if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN")
                                              or os.path.isfile(os.path.expanduser("~/.ray/auth_token"))):
        os.environ["RAY_AUTH_MODE"] = "token"
        with contextlib.suppress(ImportError, AttributeError):   # Ray read its config at import: again
            from ray._raylet import Config  # noqa: PLC0415

            Config.initialize("")
    try:
        # WORKER_ENV for this job's workers: the cluster's processes started with the environment of
        # `ray start`, which does not have it.
        ray.init(address=address, runtime_env={"env_vars": WORKER_ENV}, **init_options())
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise DataError(f"--ray {address}: Ray could not join the cluster there "
                        f"({str(e).splitlines()[0][:300] if str(e) else type(e).__name__}): check the address; a "
                        "cluster with token authentication (Ray's default) needs RAY_AUTH_MODE=token and its token "
                        "(~/.ray/auth_token or RAY_AUTH_TOKEN) here too; or leave the address out for a local "
                        "Ray") from None
    finally:
        joined.set()


def _cluster_cpus(ray) -> int:
    return int(ray.cluster_resources().get("CPU", 0))


# ------------------------------------------------------------------------------------------- the tasks

_SETUP: dict = {}   # in a task's process: the setup (its id) its worker state was made from


def _ensure_worker(setup: dict) -> None:
    """The pool worker's state (``store_build._init_worker``) in this Ray worker process, made once per
    build: a process runs many tasks, the tokenizer is parsed at its first."""
    if _SETUP.get("id") != setup["id"]:
        sb._init_worker(*setup["worker"])
        _SETUP["id"] = setup["id"]


def segment_texts(c, segments: list[tuple[str, int, int]]) -> list[str]:
    """The texts of an input shard named by its segments ``(unit, first document, end)``, in order."""
    return [d.text for unit, a, b in segments for d in islice(unit_documents(c, unit), a, b)]


def _tokenise_task(k: int, first: int, source, setup: dict) -> tuple[int, int, float, float, str]:
    """One input shard in a Ray worker: its texts (``source``: the segments, or the texts themselves for a
    stream), then the pool worker's ``tokenise_part``. Returns ``(k, tokens, cpu s, wall s, node)``."""
    t0 = time.perf_counter()
    _ensure_worker(setup)
    texts = source if setup["texts_sent"] else segment_texts(setup["config"], source)
    k, tokens, cpu = sb.tokenise_part(k, first, texts)
    return k, tokens, cpu, time.perf_counter() - t0, socket.gethostname()


def _lengths_task(c, units: list[str]) -> list[np.ndarray]:
    """The plan's reading: ``[documents] int64`` of each unit's document lengths (characters, as the
    pool's cut counts them)."""
    return [np.fromiter((len(d.text) for d in unit_documents(c, u)), np.int64) for u in units]


def _remote(ray, fn, **options):
    return ray.remote(num_cpus=1, **options)(fn)


def task_error(ray, e: BaseException, what: str) -> BaseException:
    """The failure of a task as this process raises it: the task's own exception (a DataError, a
    StorageError, an OSError naming the file: one line at the console), or a DataError naming ``what``."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(cause, Exception):
        return cause
    if isinstance(e, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                      ray.exceptions.OutOfMemoryError)):
        return DataError(f"{what}: its Ray worker died {MAX_RETRIES + 1} times ({type(e).__name__}): check the "
                         "nodes' memory and `ray status`, then rerun the same command (finished shards are kept)")
    first = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    return DataError(f"{what} failed on the Ray cluster ({first}); rerun the same command to resume")


# -------------------------------------------------------------------------------------------- the plan

def plan_shards(ray, c, units: list[str], shard_bytes: int) -> Iterator[tuple[int, list]]:
    """``(first document, [(unit, first, end), ...])`` per input shard, in order: the pool's cut of the
    documents (``cut_shards``) made on their lengths, read by plan tasks."""
    lengths_task = _remote(ray, _lengths_task, max_retries=MAX_RETRIES)
    groups = [units[a:a + PLAN_UNITS_PER_TASK] for a in range(0, len(units), PLAN_UNITS_PER_TASK)]
    config = ray.put(c)
    refs = [lengths_task.remote(config, g) for g in groups]
    lengths: list[np.ndarray] = []
    for g, ref in zip(groups, refs):
        try:
            lengths += ray.get(ref)
        except ray.exceptions.RayError as e:
            raise task_error(ray, e, f"reading {g[0]} (and the next {len(g) - 1} files) for the plan") from None
    yield from plan_from_lengths(units, lengths, shard_bytes)


def plan_from_lengths(units: list[str], lengths: list[np.ndarray], shard_bytes: int) -> Iterator[tuple[int, list]]:
    """The plan's cut: ``lengths[u]`` (``[documents] int64``) of each unit -> ``(first document, segments)``
    per input shard, by the pool's rule (``cut_shards``) on the lengths alone."""
    items = ((u, j, int(n)) for u, ls in enumerate(lengths) for j, n in enumerate(ls))
    for first, batch in sb.cut_shards(items, lambda item: item[2], shard_bytes):
        yield first, _segments(units, batch)


def _segments(units: list[str], batch: list[tuple[int, int, int]]) -> list[tuple[str, int, int]]:
    """Consecutive documents ``(unit index, document index, length)`` as ``(unit, first, end)`` runs."""
    out: list[list] = []
    for u, j, _ in batch:
        if out and out[-1][0] == units[u]:
            out[-1][2] = j + 1
        else:
            out.append([units[u], j, j + 1])
    return [tuple(s) for s in out]


def _shards(ray, c, shard_bytes: int) -> tuple[Iterator[tuple[int, object]] | list, bool]:
    """Every input shard as ``(first document, source)`` (a list when planned: its length is the total the
    progress shows), and whether the sources are texts (a stream's, read here)."""
    units = source_units(c)
    if units is None:   # hf: one stream, read here
        return ((first, [d.text for d in batch])
                for first, batch in sb.cut_shards(iter_documents(c), sb._text_size, shard_bytes)), True
    return list(plan_shards(ray, c, units, shard_bytes)), False


# ------------------------------------------------------------------------------------------ the driver

class RayTasks:
    """``build_store``'s executor for ``--ray``: ``begin()`` starts a pending local Ray (``ray_session``),
    a call tokenises every unfinished input shard as Ray tasks (:func:`tokenise_on_ray`)."""

    def begin(self) -> None:
        begin_local()

    def __call__(self, c, out: str, tok, settings: dict, *, say: Callable[[str], None]) -> dict:
        return tokenise_on_ray(c, out, tok, settings, say=say)


def tokenise_on_ray(c, out: str, tok, settings: dict, *, say: Callable[[str], None]) -> dict:
    """Step 2 of ``store_build`` on the Ray cluster this process is connected to: every input shard the
    ledger lacks, as a task. Returns ``tokens`` and the tasks' ``worker_cpu_s``, as the pool's does."""
    ray = import_ray()
    _wait_local(ray)
    worker = sb.worker_setup(c, out, tok, settings)
    shards, texts_sent = _shards(ray, c, settings["shard_bytes"])
    setup = ray.put({"id": hashlib.sha256(repr(worker).encode()).hexdigest(), "worker": worker,
                     "config": c, "texts_sent": texts_sent})
    follow = _Follow(ray, say, done=set(st.finished_parts(out)), limit=2 * max(_cluster_cpus(ray), 1))
    follow.total = len(shards) if isinstance(shards, list) else None
    task = _remote(ray, _tokenise_task, max_retries=MAX_RETRIES, retry_exceptions=False)
    shard_count = docs = 0
    try:
        for first, source in shards:
            k, shard_count, docs = shard_count, shard_count + 1, first + _documents(source, texts_sent)
            if k in follow.done:
                follow.stats["skipped"] += 1
                continue
            follow.wait_below_limit()
            follow.submitted(k, task.remote(k, first, source, setup))
        follow.total = shard_count
        follow.wait_below_limit(0)
    except BaseException:
        follow.cancel()
        raise
    sb.record_inputs(c, out, shard_count, docs)
    say(sb.finished_line(follow.stats, f"Ray tasks on {_cluster_cpus(ray)} CPUs"))
    return {"tokens": follow.stats["tokens"], "worker_cpu_s": follow.stats["cpu"]}


def _documents(source, texts_sent: bool) -> int:
    return len(source) if texts_sent else sum(b - a for _, a, b in source)


class _Follow:
    """The tasks in flight: their results counted, one progress line per ``PROGRESS_S`` (shards done /
    total, tokens/s, the slowest tasks), at most ``limit`` in flight, all cancelled on a failure."""

    def __init__(self, ray, say, *, done: set[int], limit: int):
        self.ray, self.say, self.done, self.limit = ray, say, done, limit
        self.pending: dict = {}          # ObjectRef -> (input shard, when submitted)
        self.walls: list[tuple[float, int]] = []   # (seconds, input shard) of the finished tasks
        self.total: int | None = None    # known once the plan is submitted
        self.stats = {"parts": 0, "tokens": 0, "cpu": 0.0, "t0": time.perf_counter(), "last": 0.0,
                      "skipped": 0}

    def submitted(self, k: int, ref) -> None:
        self.pending[ref] = (k, time.perf_counter())

    def wait_below_limit(self, limit: int | None = None) -> None:
        """Collects finished tasks until fewer than ``limit`` (default: the in-flight bound) are in flight."""
        limit = self.limit if limit is None else limit
        while self.pending and len(self.pending) >= limit:
            ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=PROGRESS_S)
            for ref in ready:
                k, _ = self.pending.pop(ref)
                try:
                    k, tokens, cpu, wall, _node = self.ray.get(ref)
                except self.ray.exceptions.RayError as e:
                    raise task_error(self.ray, e, f"input shard {k}") from None
                sb.count_part(self.stats, k, tokens, cpu)
                self.walls.append((wall, k))
            self._progress()

    def _progress(self) -> None:
        now = time.perf_counter()
        if now - self.stats["last"] < PROGRESS_S:
            return
        self.stats["last"] = now
        s = self.stats
        total = "" if self.total is None else f"/{self.total - s['skipped']}"
        rate = s["tokens"] / max(now - s["t0"], 1e-9)
        self.say(f"tokenised {s['parts']}{total} input shards ({s['skipped']} done before), {s['tokens'] / 1e6:.2f}M "
                 f"tokens, {rate / 1e6:.2f}M tokens/s, {len(self.pending)} in flight; slowest: {self._slowest(now)}")

    def _slowest(self, now: float, count: int = 3) -> str:
        """The ``count`` longest tasks: those in flight by their time since submission, the finished by
        their own time."""
        tasks = [(now - t, k, "in flight") for k, t in self.pending.values()]
        tasks += [(wall, k, "took") for wall, k in self.walls]
        tasks.sort(reverse=True)
        return ", ".join(f"shard {k} {how} {s:.1f} s" for s, k, how in tasks[:count]) or "none yet"

    def cancel(self) -> None:
        """Ends every task in flight now (``force``: their processes are killed, so none writes on)."""
        for ref in self.pending:
            with contextlib.suppress(Exception):
                self.ray.cancel(ref, force=True)
        self.pending.clear()

