"""notebooks/*.ipynb: committed without outputs, badge and install cell first, and run top to bottom.

Each notebook runs in a fresh IPython kernel started from this interpreter (so it sees this environment's
tieflax), with no device count in its XLA_FLAGS, so that the notebook's own first cell has to provide the
8 fake CPU devices. Any cell error fails the test with the cell's traceback. The kernel is stopped when its
notebook ends, passed or failed, and the test checks that nothing of it is left running.
"""

import contextlib
import gc
import importlib.util
import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import time

import nbformat
import pytest
from train_support import suite_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
_spec = importlib.util.spec_from_file_location("build_notebooks",
                                               os.path.join(ROOT, "tools", "build_notebooks.py"))
build_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_notebooks)

NOTEBOOKS = sorted(build_notebooks.NOTEBOOKS)
# What libtpu's C++ start-up writes on a machine without a TPU (libtpu 0.0.42.1 and 0.0.52).
LIBTPU_NOISE = re.compile(r"Failed to find host bounds|could not determine TPU|TPU_WORKER_HOSTNAMES|"
                          r"INVALID_ARGUMENT|InitGoogle|^E0000 ")
CELL_TIMEOUT_S = 600  # per cell; the whole-suite budget is enforced by measuring, not by this


def _read(name):
    return nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_every_notebook_is_listed():
    on_disk = sorted(f for f in os.listdir(NOTEBOOK_DIR) if f.endswith(".ipynb"))
    assert on_disk == NOTEBOOKS, "notebooks/ and tools/build_notebooks.py NOTEBOOKS disagree"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_stripped(name):
    nb = _read(name)
    nbformat.validate(nb)
    for i, cell in enumerate(_code_cells(nb)):
        assert cell.outputs == [], f"{name}: code cell {i} has outputs; strip them (rebuild the notebook)"
        assert cell.execution_count is None, f"{name}: code cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{name}: widget state in the metadata"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_starts_with_badge_and_install_cell(name):
    nb = _read(name)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(build_notebooks.badge(name)), (
        f"{name}: the first cell must start with the Open-in-Colab badge for this file")
    setup = _code_cells(nb)[0].source
    assert '"google.colab" in sys.modules' in setup and build_notebooks.PIP_SPEC in setup
    assert "pip install -e '.[notebooks]'" in setup, (
        "the local branch must say how to install tieflax with the notebooks' extra (jupyter, ipywidgets)")
    assert "xla_force_host_platform_device_count=8" in setup
    assert not re.search(r"^\s*(import|from)\s+jax\b", setup, re.M), (
        f"{name}: the set-up cell must set XLA_FLAGS before anything imports jax")
    # Its one tieflax import, after XLA_FLAGS: the console's start (prepare_process), which imports no jax.
    assert re.findall(r"^\s*(?:import|from)\s+(tieflax[\w.]*)", setup, re.M) == ["tieflax.hardware.process"]
    assert setup.index("xla_force_host_platform_device_count=8") < setup.index("prepare_process()"), name
    settings = _code_cells(nb)[1].source
    assert settings.startswith("# Settings.") and "real run" in settings, (
        f"{name}: the second code cell holds the small defaults and says what to change for a real run")


def test_the_set_up_cell_s_tieflax_import_starts_no_jax():
    """What the set-up cell imports before XLA_FLAGS is read must not import jax (nor anything that does)."""
    code = "import sys, tieflax.hardware.process; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "[]"), proc.stderr[-2000:]


def test_notebooks_match_their_sources():
    stale = [n for n in NOTEBOOKS if build_notebooks.render(n) != open(
        os.path.join(NOTEBOOK_DIR, n), encoding="utf-8").read()]
    assert not stale, f"{stale} differ from tools/notebook_cells/; run python tools/build_notebooks.py"


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    """A kernelspec that starts this very interpreter (a plain 'python3' spec may resolve another one)."""
    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / "tieflax-test"
    spec_dir.mkdir()
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tieflax test", "language": "python"}))
    return [str(root)]


def _execute(nb, cwd, kernel_dirs, kernels=None) -> float:
    """Runs ``nb`` in a fresh kernel, in place; returns the CPU seconds of the kernel and of its children.

    The kernel is killed when the notebook ends, passed or failed (nbclient stops only the kernels of the
    managers it makes; without this, every kernel lived on, idle, to the end of the worker). ``kernels``
    receives the kernel's process."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    kernels = [] if kernels is None else kernels
    km = KernelManager(kernel_name="tieflax-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
    # As a user's kernel starts: no device count, no JAX_PLATFORMS, no shared data cache. On a machine without
    # a TPU, the set-up cell's prepare_process must keep libtpu from starting (test_notebook_runs checks the
    # outputs for its lines). Only where JAX's CUDA plugin is installed is the kernel pinned to the CPU, which
    # the probe expects. Without TIEFLAX_DATA_CACHE_DIR the notebooks keep their data in their own folders, as
    # a user's do: no other test of the suite prepares 01's or 03's data, so a shared cache saves them nothing.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "TIEFLAX_DATA_CACHE_DIR")}
    # The suite's compiler settings stay (tests/conftest.py: its CPU emitters where this jaxlib has them;
    # notebook 01 as a script on 3.11: 22.0 CPU-s with them, 24.8 without), as do JAX_COMPILATION_CACHE_DIR
    # (01 and 03 train the same tiny models, so 03 reuses 01's compiled programs), JAX_DISABLE_MOST_OPTIMIZATIONS
    # and OMP_NUM_THREADS.
    if suite_xla_flags(None):
        env["XLA_FLAGS"] = suite_xla_flags(None)
    if importlib.util.find_spec("jax_cuda12_plugin") is not None:
        env["JAX_PLATFORMS"] = "cpu"
    # "immediate" and cleanup_kc: nbclient kills the kernel's process group (SIGKILL: bounded, and nothing
    # the kernel does at exit is the test's) and reaps it when the notebook ends, passed or failed.
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False, shutdown_kernel="immediate",
                            on_notebook_start=lambda _km=km, **_: kernels.append(_km.provisioner.process),
                            resources={"metadata": {"path": str(cwd)}})
    cpu = _children_cpu()
    try:
        client.execute(env=env, cleanup_kc=True)
    finally:
        left = _stop_leftovers(kernels)
        del client, km
        _collect_kernel_clients()
        # Here, so that it holds where a cell failed too (that error shows as this one's context).
        assert not left, f"the kernel's processes {left} were still running after its notebook ended"
    return _children_cpu() - cpu


def _children_cpu() -> float:
    """CPU seconds of this process's reaped children (a reaped kernel brings those of its own)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stop_leftovers(kernels) -> list[int]:
    """The processes of the kernels' process groups still running (not within 10 s) once nbclient stopped
    them: none, unless its kill failed. Each is killed now and the kernel reaped: no test leaves one behind."""
    left = []
    for process in kernels:
        deadline = time.monotonic() + 10  # SIGKILL'd processes end at once; a loaded machine may delay it
        while (group := _group_members(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group:
            left += group
            with contextlib.suppress(ProcessLookupError):  # they ended meanwhile
                os.killpg(process.pid, signal.SIGKILL)
        if process.poll() is None:
            left += [] if process.pid in left else [process.pid]
            process.kill()
            process.wait(timeout=60)
    return left


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid`` (the kernel and its children: jupyter_client
    starts a kernel in a session of its own), from /proc; [] where there is none."""
    members = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or it ended while being read
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(pid))
    return members


def _collect_kernel_clients() -> None:
    """The kernel's clients are left in reference cycles: collected now, not in whichever test this worker
    runs next, where a client's ``__del__`` says "Could not destroy zmq context" (traitlets' logger) into
    that test's captured console (seen in tests/test_train_observers.py's console test)."""
    traitlets = logging.getLogger("traitlets")
    level = traitlets.level
    traitlets.setLevel(logging.ERROR)
    try:
        gc.collect()
    finally:
        traitlets.setLevel(level)


def test_a_cell_error_fails_the_run(tmp_path, kernel_dirs):
    """The harness itself: an exception in any cell must surface as a failure, not as an output."""
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("raise ValueError('broken cell')"),
                                         nbformat.v4.new_code_cell("y = 2")])
    kernels = []
    with pytest.raises(CellExecutionError, match="broken cell"):
        _execute(nb, tmp_path, kernel_dirs, kernels)
    assert nb.cells[2].outputs == [] and nb.cells[2].execution_count is None  # execution stopped there
    # A failed notebook's kernel is stopped too (and _execute checked that nothing of its group is left).
    assert len(kernels) == 1 and kernels[0].returncode is not None, "the failed notebook's kernel still runs"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, kernel_dirs):
    nb = _read(name)
    # A last cell reports what the kernel saw, so the test can check the interpreter and the devices.
    nb.cells.append(nbformat.v4.new_code_cell(
        "import resource, sys, jax\n"
        "cpu = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print('PROBE', sys.executable, jax.device_count(), jax.default_backend(), cpu.ru_utime + cpu.ru_stime)"))
    t0 = time.perf_counter()
    cpu = _execute(nb, tmp_path, kernel_dirs)
    probe = "".join(o.get("text", "") for o in nb.cells[-1].outputs).split()
    # Wall time depends on what else the machine runs; the kernel's CPU seconds do much less. The first
    # CPU figure is the kernel's own at the probe, the second the whole kernel's with its children's.
    print(f"{name}: {time.perf_counter() - t0:.1f} s wall, {float(probe[-1]):.1f} s kernel CPU "
          f"({cpu:.1f} s with its children)")
    assert probe[:2] == ["PROBE", sys.executable], f"kernel ran {probe[1:2]}, not {sys.executable}"
    noise = [line for cell in _code_cells(nb) for o in cell.outputs
             for line in (o.get("text", "") + o.get("data", {}).get("text/plain", "")).splitlines()
             if LIBTPU_NOISE.search(line)]
    assert not noise, f"{name}: libtpu's start-up lines in the outputs: {noise[:3]}"
    assert probe[2:4] == ["8", "cpu"], f"the notebook's set-up cell should give 8 CPU devices, got {probe[2:4]}"
