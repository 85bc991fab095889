"""notebooks/*.ipynb: committed without outputs, badge and install cell first, and run top to bottom.

Each notebook runs in a fresh IPython kernel started from this interpreter (so it sees this environment's
tieflax), with XLA_FLAGS removed from its environment so that the notebook's own first cell has to
provide the 8 fake CPU devices. Any cell error fails the test with the cell's traceback.
"""

import gc
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import time

import nbformat
import pytest

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


def _execute(nb, cwd, kernel_dirs):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    km = KernelManager(kernel_name="tieflax-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
    # As a user's kernel starts: no XLA_FLAGS, no JAX_PLATFORMS. On a machine without a TPU, the set-up
    # cell's prepare_process must keep libtpu from starting (test_notebook_runs checks the outputs for its lines).
    # Only where JAX's CUDA plugin is installed is the kernel pinned to the CPU, which the probe expects.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if importlib.util.find_spec("jax_cuda12_plugin") is not None:
        env["JAX_PLATFORMS"] = "cpu"
    # JAX_COMPILATION_CACHE_DIR comes from tests/conftest.py: 01 and 03 train the same tiny models, so 03
    # reuses 01's compiled programs.
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute(env=env)
    finally:
        del client, km
        _collect_kernel_clients()
    return nb


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
    with pytest.raises(CellExecutionError, match="broken cell"):
        _execute(nb, tmp_path, kernel_dirs)
    assert nb.cells[2].outputs == [] and nb.cells[2].execution_count is None  # execution stopped there


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, kernel_dirs):
    nb = _read(name)
    # A last cell reports what the kernel saw, so the test can check the interpreter and the devices.
    nb.cells.append(nbformat.v4.new_code_cell(
        "import resource, sys, jax\n"
        "cpu = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print('PROBE', sys.executable, jax.device_count(), jax.default_backend(), cpu.ru_utime + cpu.ru_stime)"))
    t0 = time.perf_counter()
    _execute(nb, tmp_path, kernel_dirs)
    probe = "".join(o.get("text", "") for o in nb.cells[-1].outputs).split()
    # Wall time depends on what else the machine runs; the kernel's CPU seconds do much less.
    print(f"{name}: {time.perf_counter() - t0:.1f} s wall, {float(probe[-1]):.1f} s kernel CPU")
    assert probe[:2] == ["PROBE", sys.executable], f"kernel ran {probe[1:2]}, not {sys.executable}"
    noise = [line for cell in _code_cells(nb) for o in cell.outputs
             for line in (o.get("text", "") + o.get("data", {}).get("text/plain", "")).splitlines()
             if LIBTPU_NOISE.search(line)]
    assert not noise, f"{name}: libtpu's start-up lines in the outputs: {noise[:3]}"
    assert probe[2:4] == ["8", "cpu"], f"the notebook's set-up cell should give 8 CPU devices, got {probe[2:4]}"
