"""tieflax prepare --ray: the store built by Ray tasks is the pool's to the byte (the manifest's digest and
every array's sha256), also after a Ray worker is killed mid-task, after the driver is killed (whose
tasks stop: none writes after it) and after a node is lost mid-build, and the plan cuts every source's
documents as the pool does; an address where nothing answers and a missing ``ray`` are each one line within
seconds.

One local Ray of 2 CPUs for the module (``prepare_ray.start_local``, as the command starts it; the node test
adds a second node to it, last); the corpus is 40 standard library files in input shards of 16 KiB (about
30 shards: several in flight at once)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from cli_support import WITHOUT
from store_support import V, cmdline, corpus_config
from tieflax import storage
from tieflax.data.sources import iter_documents, source_units
from tieflax.data.store_build import build_store, cut_shards

ray = pytest.importorskip("ray", reason="ray is not installed: the test command installs it (the ray extra) on the 3.11 stack only")
from tieflax.data import prepare_ray  # noqa: E402 (needs ray only to run tasks; imported after the skip)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD = 16 << 10
TASK_TITLE = "ray::_tokenise_task"   # a Ray worker's process title while it runs that task
CLI = [sys.executable, "-m", "tieflax.cli", "prepare", "--config", os.path.join(REPO, "configs/experiments/tiny.py")]


def _cli_settings(tokenizer: str) -> list[str]:
    """corpus_config() as command-line flags, with the pool store's tokenizer given (no BPE to train)."""
    return ["--config.data.source=python_stdlib", "--config.data.python_stdlib.max_files=40",
            f"--config.data.tokenizer.vocab_size={V}", f"--config.model.vocab_size={V}",
            "--config.data.val_fraction=0.2", f"--config.data.tokenizer.path={tokenizer}",
            f"--shard-mb={SHARD / (1 << 20)}"]


@pytest.fixture(scope="module")
def cluster():
    """The module's local Ray (2 CPUs); -> its address, which a driver in another process joins."""
    prepare_ray.start_local(2)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def pool_store(tmp_path_factory):
    """The one-machine build (a pool process; the store does not depend on how many), a BPE trained here:
    -> (its folder, its manifest)."""
    out = str(tmp_path_factory.mktemp("pool") / "s")
    return out, build_store(corpus_config(), out, workers=1, shard_bytes=SHARD)


def _given_tokenizer(pool: str):
    c = corpus_config()
    c.tokenizer.path = storage.join(pool, "tokenizer.json")
    return c


def _same_store(manifest: dict, pool_manifest: dict) -> None:
    assert manifest["digest"] == pool_manifest["digest"]
    assert manifest["arrays"] == pool_manifest["arrays"]   # every array's sha256 and object sizes
    assert manifest["splits"] == pool_manifest["splits"] and manifest["input_shards"] == pool_manifest["input_shards"]


def test_the_plan_cuts_every_source_as_the_pool_does(tmp_path):
    """The plan (units' lengths, cut by the pool's rule) names the same documents per shard as the pool's
    cut of the documents: the Bible (one unit, cut inside it), files with split_on pieces and .jsonl rows
    (shards that span units). No Ray: the tasks' functions called here."""
    from tieflax.data import default_data_config

    (tmp_path / "a.txt").write_text("\n\n".join(f"piece {i} " + "word " * (i * 40) for i in reversed(range(30))))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": "row " * (7 * i + 1)}) for i in range(200))
                                      + "\n" + json.dumps({"text": ""}))
    (tmp_path / "c.txt").write_text("a last document")
    kjv, files = default_data_config(), default_data_config()
    files.source, files.files.paths, files.files.split_on = "files", [str(tmp_path / "*")], "\n\n"
    for c, shard_bytes in ((kjv, 1 << 20), (files, 2000)):
        units = source_units(c)
        lengths = prepare_ray._lengths_task(c, units)
        plan = list(prepare_ray.plan_from_lengths(units, lengths, shard_bytes))
        pool = [(first, [d.text for d in batch]) for first, batch in
                cut_shards(iter_documents(c), lambda d: len(d.text), shard_bytes)]
        assert len(plan) == len(pool) > 3
        for (first, segments), (pool_first, texts) in zip(plan, pool):
            assert first == pool_first and prepare_ray.segment_texts(c, segments) == texts
        assert any(len(segments) > 1 for _, segments in plan) or c is kjv   # some shard spans two files


def test_ray_builds_the_pool_store_to_the_byte(cluster, pool_store, tmp_path):
    """The same settings (a BPE trained by the driver), tokenised as Ray tasks: the pool's store."""
    pool, pool_manifest = pool_store
    lines: list[str] = []
    manifest = build_store(corpus_config(), str(tmp_path / "s"), shard_bytes=SHARD, executor=prepare_ray.RayTasks(),
                           progress=lines.append)
    _same_store(manifest, pool_manifest)
    assert pool_manifest["input_shards"] >= 12
    assert any("Ray tasks on 2 CPUs" in line for line in lines)


def test_a_ray_worker_killed_mid_task_is_retried_and_the_store_is_the_same(cluster, pool_store, tmp_path):
    """kill -9 of the first worker seen running a tokenise task once a shard is in the ledger: Ray runs the
    task again, the build finishes, and the store's digest is the pool's."""
    pool, pool_manifest = pool_store
    killed: list[int] = []
    stop = threading.Event()

    def kill_one():
        while not stop.is_set() and not killed:
            if not _ledger(tmp_path / "s"):   # mid-build: once a shard is done (a scan of /proc costs CPU)
                time.sleep(0.005)
                continue
            for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
                if cmdline(pid).startswith(TASK_TITLE):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    break
            time.sleep(0.005)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    try:
        manifest = build_store(_given_tokenizer(pool), str(tmp_path / "s"), shard_bytes=SHARD, executor=prepare_ray.RayTasks())
    finally:
        stop.set()
        killer.join(5)
    assert killed, "no worker was seen running a task (the kill did not happen)"
    _same_store(manifest, pool_manifest)


def _ledger(out: str) -> set[str]:
    folder = os.path.join(out, "ledger")
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def _task_processes() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and cmdline(int(p)).startswith(TASK_TITLE)]


def test_a_killed_driver_leaves_no_task_writing_and_the_rerun_resumes_to_the_same_store(cluster, pool_store,
                                                                                        tmp_path):
    """`tieflax prepare --ray ADDRESS` in another process, killed (-9) once some input shards are in the
    ledger: its tasks end (no process runs one within 15 s), the ledger does not grow after, and the same
    build again (from this process: the lock of the dead driver is taken over) resumes, skipping the
    ledger's shards, to the pool's store."""
    pool, pool_manifest = pool_store
    out = str(tmp_path / "s")
    argv = [*CLI, "--out", out, "--ray", cluster, *_cli_settings(storage.join(pool, "tokenizer.json"))]
    driver = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_ledger(out)) < 3 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert driver.poll() is None, f"the driver ended before it was killed: {driver.stderr.read()[-2000:]}"
        os.kill(driver.pid, signal.SIGKILL)
        at_kill = len(_ledger(out))
    finally:
        driver.kill()
        driver.wait(10)
        driver.stderr.close()
    ends = time.monotonic() + 15
    while _task_processes() and time.monotonic() < ends:
        time.sleep(0.05)
    assert not _task_processes(), "a task of the killed driver still runs 15 s after it"
    settled = _ledger(out)
    time.sleep(2)
    assert _ledger(out) == settled and len(settled) < pool_manifest["input_shards"], (at_kill, len(settled))
    # The same build again, driven from here (the command's own path up to build_store is the first run's).
    lines: list[str] = []
    manifest = build_store(_given_tokenizer(pool), out, shard_bytes=SHARD, executor=prepare_ray.RayTasks(), progress=lines.append)
    assert any(f"({len(settled)} done before)" in line for line in lines), lines
    _same_store(manifest, pool_manifest)


def test_an_address_where_nothing_answers_and_a_missing_ray_are_one_line_within_seconds(tmp_path):
    out = str(tmp_path / "s")
    t0 = time.monotonic()
    nothing = subprocess.run([*CLI, "--out", out, "--ray", "127.0.0.1:1"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    took = time.monotonic() - t0
    lines = nothing.stderr.strip().splitlines()
    assert nothing.returncode != 0 and len(lines) == 1, nothing.stderr
    assert "--ray 127.0.0.1:1: no Ray cluster answers there" in lines[0] and "ray start --head" in lines[0]
    assert took < 60, took   # start-up and imports on a loaded 2-core machine; the probe itself waits <= 5 s
    assert not os.path.exists(out)
    absent = subprocess.run([sys.executable, "-c", WITHOUT, "ray", "prepare", "--config", CLI[-1], "--out", out,
                             "--ray"], cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = absent.stderr.strip().splitlines()
    assert absent.returncode != 0 and len(lines) == 1, absent.stderr
    assert "pip install 'tieflax[ray]'" in lines[0] and not os.path.exists(out)


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (by their parent ids in /proc), the root first."""
    children: dict[int, list[int]] = {}
    for p in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{p}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(p)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _worker_node(gcs_address: str):
    """A second node of the cluster at ``gcs_address`` (1 CPU), its processes started from here: what
    ``ray.cluster_utils.Cluster.add_node`` starts (a raylet, its agents, no log monitor) and what `ray start
    --address` starts on another host. -> its ``ray._private.node.Node``."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(gcs_address=gcs_address, num_cpus=1, num_gpus=0, object_store_memory=150 << 20,
                       min_worker_port=0, max_worker_port=0, node_manager_port=0, include_log_monitor=False)
    params.dashboard_agent_listen_port = None
    return Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)


def test_a_node_lost_mid_build_its_tasks_run_again_on_the_head_and_the_store_is_the_same(cluster, pool_store,
                                                                                       tmp_path):
    """A second node (1 CPU) joins the module's cluster, and the head's 2 CPUs are held by two tasks, so the
    build's tasks run on that node. Once a shard is in the ledger and the next task runs there, every process
    of the node (its raylet, agents and workers) is killed (-9) at once and the head is let go: Ray runs the
    lost tasks again on the head, the ledger keeps the finished shards, and the store's digest is the pool's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pool, pool_manifest = pool_store
    out, flags = str(tmp_path / "s"), tmp_path / "flags"
    flags.mkdir()

    def hold(i: int) -> None:   # a task holding one of the head's CPUs until the node is lost
        (flags / f"held-{i}").touch()
        while not (flags / "release").exists():
            time.sleep(0.05)

    head = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    holders = [ray.remote(num_cpus=1, scheduling_strategy=head)(hold).remote(i) for i in range(2)]
    node = _worker_node(cluster)
    raylet = node.all_processes["raylet"][0].process
    killed: list[int] = []
    at_kill: list[int] = []
    stop = threading.Event()

    def kill_the_node():
        while not stop.is_set():
            # Only the node runs tokenise tasks (the head is held): a shard in the ledger is its, and the next
            # task runs there; its processes are scanned only from then on (a scan costs CPU).
            if _ledger(out) and any(cmdline(p).startswith(TASK_TITLE) for p in _descendants(raylet.pid)[1:]):
                at_kill.append(len(_ledger(out)))
                for pid in _descendants(raylet.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                break
            time.sleep(0.01)
        (flags / "release").touch()

    killer = threading.Thread(target=kill_the_node, daemon=True)
    try:
        deadline = time.monotonic() + 60
        while (ray.cluster_resources().get("CPU", 0) < 3 or len(list(flags.iterdir())) < 2) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.cluster_resources().get("CPU", 0) >= 3, "the second node did not join"
        assert len(list(flags.iterdir())) == 2, "the head's CPUs were not held"
        killer.start()
        manifest = build_store(_given_tokenizer(pool), out, shard_bytes=SHARD, executor=prepare_ray.RayTasks())
    finally:
        stop.set()
        (flags / "release").touch()
        if killer.is_alive():
            killer.join(5)
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        ray.get(holders, timeout=30)
    assert killed, "no task ran on the second node while the ledger had a shard (the node was not lost mid-build)"
    assert 1 <= at_kill[0] < pool_manifest["input_shards"], at_kill
    _same_store(manifest, pool_manifest)
