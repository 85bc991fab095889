"""Test set-up: 8 CPU devices, set before JAX starts, so mesh code runs on any machine."""

import os

# Must happen before the first `import jax` anywhere in the test session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are small and run a few steps: LLVM's optimisation passes cost more CPU than they
# save. Without them (JAX's `jax_disable_most_optimizations`: backend optimisation level 0, no expensive
# LLVM passes) the HLO passes (fusion, layout, sharding) still run, so what a test asserts of a compiled
# program (collectives, temporaries, dtypes, memory) is unchanged; workers and the CLI subprocesses they
# start inherit it. Measured on the 3.11 suite: 953 -> 818 CPU-s. A value the caller set is kept.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# libtpu's lock on this machine's (absent) TPU off: the suite only compiles for TPU topologies from the CPU,
# and two workers doing so at once (or any other process holding libtpu) failed the second with "Internal
# error when accessing libtpu multi-process lockfile" (a clean clone's test_memory_options, 2026-12-07).
# tieflax's own compile path sets the same (tieflax/hardware/targets.py). A value the caller set is kept.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# OpenMP (torch's intra-op threads, OpenBLAS under numpy) on one thread in every process of the suite: four
# workers already share 2 cores, and an OpenMP worker that waits for a core spins. The tuned lens's torch
# reference (tests/test_literature.py) took 15.7 CPU-s on torch's 2 threads on a loaded machine, 0.4 on one
# (2026-12-07). Each thread computes whole output elements, so a matmul's values do not change; a torch sum
# may round in another order, within every parity test's tolerance. A value the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# XLA's CPU compiler with its first (LLVM IR) elemental emitters instead of the MLIR fusion emitters, where the
# jaxlib still has them (0.10; 0.12 has only the new ones and stops at start on a flag it does not know, so
# the flag is tried once in a child process, by the process that loads this first; the workers and the
# subprocesses they start inherit it, tests/train_support.py's `suite_xla_flags`). The HLO passes are
# those of the new emitters but for what the older ones cannot emit: a scatter becomes a loop (the test of
# the plan's compiled FLOPs, which a loop hides, compiles with XLA's own emitters). Measured on test_model,
# test_scan, test_decode and test_model_loss (62 tests, two runs each): 72 -> 50 CPU-s; on the whole 3.11
# suite, 825 -> 702 CPU-s and 487 -> 421 s.
_OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "PYTEST_XDIST_WORKER" not in os.environ and _OLD_EMITTERS not in os.environ["XLA_FLAGS"]:
    import subprocess  # noqa: E402
    import sys  # noqa: E402

    _probe = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                            env={**os.environ, "XLA_FLAGS": _OLD_EMITTERS}, capture_output=True)
    if _probe.returncode == 0:
        os.environ["XLA_FLAGS"] += " " + _OLD_EMITTERS


import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# The helper modules that hold a test's own checks (asserts moved out of test files, not test files
# themselves): pytest rewrites their asserts as it does a test file's, so a failure shows the values compared.
pytest.register_assert_rewrite("cli_support", "run_identity_support")

# One persistent compilation cache for the run, shared by both workers and the subprocesses they start:
# many tests compile the same small programs (the same model in another test, a resumed run). Made fresh
# by the process that loads this first (xdist's controller: its workers inherit the variable) and removed
# by it at the end; a cache the caller set is used and kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tieflax-test-jax-cache-")
# One data cache for the run, made and removed the same way (tieflax.data.config.shared_cache_dir): the
# runs that train on the same corpus with the same settings share its BPE and token files instead of each
# training and tokenising its own. Its entries are named by digests of what they hold, so a run reads the
# ids it would have made; the tests of where a run keeps its own cache clear the variable.
_OWN_DATA_CACHE = None
if "TIEFLAX_DATA_CACHE_DIR" not in os.environ:
    _OWN_DATA_CACHE = os.environ["TIEFLAX_DATA_CACHE_DIR"] = tempfile.mkdtemp(prefix="tieflax-test-data-cache-")
# Every program, however quick to compile: the small ones (init, eval, data steps) recur in every CLI
# subprocess, and caching them too took a tenth off test_run_identity.py's CPU time.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Every process of a multi-process run writes that cache, not process 0 alone as JAX does (on CPU the cache
# key differs per process, so process 1 would compile every program of every 2-process launch), and each
# entry is renamed into place once written, so no process reads one half-written:
# tests/every_process_caches/sitecustomize.py, which Python loads at start from PYTHONPATH.
if "PYTEST_XDIST_WORKER" not in os.environ:
    _EVERY_PROCESS_CACHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "every_process_caches")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_EVERY_PROCESS_CACHES, os.environ.get("PYTHONPATH")]))

# The repository's own modules compiled to bytecode once, here, before the workers start: the suite starts
# hundreds of Python processes (workers, CLI commands, pod hosts, notebook kernels), and under
# PYTHONDONTWRITEBYTECODE (set on the machines these tests run on) each one would compile every tieflax
# module it imports from source again: 0.06 s of CPU for the training modules (median of 8 imports). The
# test command's `uv pip install --compile-bytecode` covers the installed libraries, not an editable
# install's sources. Reading the `__pycache__` files needs no write; they are ignored by git and rewritten
# when a source changes.
if "PYTEST_XDIST_WORKER" not in os.environ:
    import compileall  # noqa: E402

    _REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _folder in ("tieflax", "tests", "benchmarks", "tools"):
        compileall.compile_dir(os.path.join(_REPO, _folder), quiet=1)

# The longest files first: with workers taking a file at a time (setup.cfg), a long file started last
# would leave one worker running alone at the end. Ordered by the seconds each file took in one whole-suite
# run (`--durations=0`, summed per file, 2026-12-04: relative figures); the first four re-ranked from one
# whole 3.11 suite's per-test timeline on 2026-12-05 (setup.cfg keeps xdist from reordering them).
# test_waits_bounded.py leads: its 2-process jobs mostly wait (on a deadline, for a signal's line), and, last
# in the alphabet and unlisted, it ran alone at the end of a clean clone's 3.11 suite with both cores ~95%
# idle for 65 s (2026-12-07); first, its waits overlap the other workers' work.
_LONGEST_FILES_FIRST = ("test_waits_bounded.py", "test_storage_deadline.py", "test_storage_deadline_two_processes.py",
                        "test_multiprocess_train.py", "test_stop_together.py", "test_memory_options.py",
                        "test_pod_launcher.py", "test_train.py", "test_compare_tasks.py", "test_notebooks.py",
                        "test_eval_harness.py", "test_gpu_step.py", "test_compare.py", "test_decode.py",
                        "test_cross_entropy.py", "test_scan.py", "test_extras_missing.py", "test_model_loss.py",
                        "test_train_observers.py", "test_store_changes.py", "test_run_identity.py",
                        "test_model.py", "test_checkpoint_outage.py", "test_convert.py",
                        "test_prepare_ray.py", "test_token_store.py", "test_plan.py", "test_path_layer.py", "test_bucket_run.py")

# Tiers. `slow` marks what drives the CLI, trains a model, spawns processes (a second Python, a notebook
# kernel, a test server's launcher) or compiles for a TPU topology; the rest is the fast tier,
# `python -m pytest -m "not slow"` (the unit tests of kernels, model, data, analysis: under 3 minutes on
# 2 cores). `python -m pytest` runs both. A file whose every test is slow is named in SLOW_FILES; a slow
# test in an otherwise fast file is named in SLOW_TESTS (its function name: every parametrisation).
# tests/test_tiers.py checks that every name here still exists, so a rename cannot move a test silently.
SLOW_FILES = frozenset({
    "test_bucket_run.py", "test_checkpoint_outage.py", "test_clean_output.py", "test_compare.py",
    "test_compare_tasks.py", "test_convert.py", "test_cross_entropy_gpu_benchmark.py",
    "test_data_multiprocess.py", "test_eval_harness.py", "test_example_task.py", "test_extras_missing.py",
    "test_gpu_step.py", "test_multiprocess_train.py", "test_notebooks.py", "test_path_layer.py",
    "test_plan.py", "test_pod_launcher.py", "test_prepare_ray.py", "test_prepare_settings.py", "test_prepare_stops.py",
    "test_record_values.py", "test_reliability.py", "test_run_identity.py", "test_slurm.py", "test_stop_together.py",
    "test_storage_deadline.py", "test_storage_deadline_two_processes.py", "test_store_changes.py", "test_suite_cache.py",
    "test_token_store.py", "test_train.py",
    "test_train_observers.py", "test_unfinished_and_links.py", "test_user_errors.py", "test_waits_bounded.py",
})
SLOW_TESTS = {
    "test_attention.py": ("test_auto_picks_splash_when_compiled_for_a_tpu",),
    "test_bad_paths_and_settings.py": ("test_a_bad_gpu_flags_choice_lets_help_and_import_work_and_a_command_says_one_line",),
    "test_cross_entropy.py": ("test_auto_compiles_the_pallas_kernels_for_a_tpu_with_small_temporaries",
                              "test_a_replicated_head_is_read_in_place_on_a_tpu",
                              "test_xla_path_compiled_for_a_tpu_makes_no_bf16_copy_of_an_fp32_head",
                              "test_dw_is_reduced_block_by_block_on_a_tpu"),
    "test_flops.py": ("test_a_training_log_carries_tflops_per_device",),
    "test_memory_options.py": ("test_the_tpu_compiler_keeps_offloaded_layer_inputs_in_host_memory",),
    "test_params.py": ("test_cli_json",),
    "test_script_arguments.py": ("test_gpu_benchmark_help_prints_the_usage_and_runs_nothing",),
}


def is_slow(file_name: str, test_name: str) -> bool:
    """Whether a test (its file's base name, its function's name without parameters) is in the slow tier."""
    return file_name in SLOW_FILES or test_name in SLOW_TESTS.get(file_name, ())


def pytest_configure(config):
    # The CLI's collector thresholds (tieflax/cli.py says why) for the tests that trace in this process.
    from tieflax.cli import COLLECTOR_THRESHOLDS  # noqa: PLC0415

    gc.set_threshold(*COLLECTOR_THRESHOLDS)


def pytest_collection_finish(session):
    # Everything imported to collect the tests lives to the end: out of the collector's every full pass.
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    for item in items:
        if is_slow(item.path.name, getattr(item, "originalname", item.name)):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(_LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.fixture(scope="session")
def micro_data(tmp_path_factory):
    """The micro corpus (``tests/train_support.py``'s ``micro_config``) prepared once per worker: its
    tokenizer.json and token files, for every file that trains the micro model. Read it; never change it."""
    from train_support import prepare_shared_data  # noqa: PLC0415

    folder = str(tmp_path_factory.mktemp("micro_data"))
    prepare_shared_data(folder)
    return folder


@pytest.fixture(scope="module")
def lm_eval_without_env_report():
    """lm-eval's scoring in the test's process without torch's environment report in its results'
    metadata (``pip list`` and some ten shell commands in child processes, 0.53 CPU-s each time it scores
    where torch is installed): tests/lm_eval_support.py. No test reads that report."""
    from lm_eval_support import no_torch_env_report  # noqa: PLC0415

    with no_torch_env_report():
        yield


@pytest.fixture(scope="session")
def gcs():
    """A Cloud Storage protocol server on 127.0.0.1 for the session (``tests/object_store.py``); the
    standard variables point gcsfs, google-cloud-storage and tensorstore at it, here and in
    subprocesses. ``gcs.new_bucket()`` returns a fresh ``gs://`` bucket."""
    from object_store import GcsServer  # noqa: PLC0415

    yield from _serve(GcsServer())


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on 127.0.0.1 for the session (``tests/object_store.py``); ``s3.new_bucket()``
    returns a fresh ``s3://`` bucket."""
    from object_store import S3Server  # noqa: PLC0415

    yield from _serve(S3Server())


@pytest.fixture
def own_gcs(monkeypatch):
    """A Cloud Storage protocol server of the test's own (``tests/object_store.py``), which the test may
    freeze (SIGSTOP, a bucket that stops answering) without touching the session's; thawed and stopped
    after it. The standard variables point at it for the test's duration."""
    import signal  # noqa: PLC0415

    from object_store import GcsServer  # noqa: PLC0415
    from tieflax import storage  # noqa: PLC0415

    server = GcsServer()
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    storage._BUCKETS.clear()  # stores opened against another server
    try:
        yield server
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
        storage._BUCKETS.clear()


def _serve(server):
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pytest_unconfigure(config):
    if _OWN_CACHE:   # set only in the process that made it: the controller, after its workers ended
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    if _OWN_DATA_CACHE:
        shutil.rmtree(_OWN_DATA_CACHE, ignore_errors=True)
