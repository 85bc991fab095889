"""Writes notebooks/*.ipynb from the cell sources in tools/notebook_cells/ (outputs stripped).

    python tools/build_notebooks.py           # rewrite the notebooks
    python tools/build_notebooks.py --check   # exit 1 if a committed notebook differs from its source

The notebooks are generated so that every one starts with the same Colab badge, install cell and device
set-up, and so that git only ever holds sources (no outputs, no execution counts). To change a notebook,
edit its module in tools/notebook_cells/ and rerun this script; `tests/test_notebooks.py` executes them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import nbformat

# The cell modules live beside this script (tools/notebook_cells/); tools/ is not a package.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
REPO = "tieflax/tieflax"
PIP_SPEC = f"tieflax[notebooks] @ git+https://github.com/{REPO}"
# notebook file -> module in tools/notebook_cells holding its CELLS
NOTEBOOKS = {
    "01_quickstart.ipynb": "nb01_quickstart",
    "02_sharded_cross_entropy.ipynb": "nb02_sharded_cross_entropy",
    "03_embedding_geometry.ipynb": "nb03_embedding_geometry",
}


def badge(filename: str) -> str:
    """The 'Open in Colab' badge of notebooks/<filename> on the main branch."""
    url = f"https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{filename}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


# The first code cell of every notebook. It must run before anything imports jax: XLA reads XLA_FLAGS
# once, when its CPU backend starts. The flag only shapes the CPU backend, so it is set only where no
# accelerator is visible; on a Colab TPU/GPU runtime jax uses the real chips.
SETUP_CELL = f'''\
# Install (Colab only) and devices. Run this cell first: XLA reads XLA_FLAGS once, when jax starts.
import importlib.util
import os
import subprocess
import sys

if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "{PIP_SPEC}"], check=True)
    importlib.invalidate_caches()  # the freshly installed package becomes importable in this kernel
elif importlib.util.find_spec("tieflax") is None:  # find, not import: importing tieflax may start jax
    raise ImportError("tieflax is not installed in this kernel; from the repository root run "
                      "`pip install -e '.[notebooks]'` and restart the kernel.")


def _has_accelerator() -> bool:
    """A TPU or an NVIDIA GPU is attached (checked without importing jax). A miss is harmless: the
    flag below only shapes the CPU backend, and jax still picks the accelerator."""
    vfio = os.listdir("/dev/vfio") if os.path.isdir("/dev/vfio") else []
    tpu = (os.path.exists("/dev/accel0") or any(n.isdigit() for n in vfio)
           or "COLAB_TPU_ADDR" in os.environ or "TPU_ACCELERATOR_TYPE" in os.environ)
    gpu = os.path.exists("/dev/nvidia0") or os.environ.get("COLAB_GPU", "") not in ("", "0")
    return tpu or gpu


cpu_only = os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" or not _has_accelerator()
if cpu_only and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 fake CPU devices, so that meshes and vocab-parallel code run on a laptop as on a TPU v2-8/v3-8.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# As the tieflax console starts: without a TPU or GPU, JAX on the CPU only (an installed libtpu would
# print its start-up errors), and the GPU XLA flags TIEFLAX_GPU_XLA_FLAGS asks for on a GPU.
from tieflax.hardware.process import prepare_process  # noqa: E402

prepare_process()
'''


def _source(text: str) -> str:
    return text.strip("\n")


def build(filename: str) -> nbformat.NotebookNode:
    """The notebook for ``filename``: badge + title, setup cell, then the module's CELLS."""
    cells_module = importlib.import_module(f"notebook_cells.{NOTEBOOKS[filename]}")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "colab": {"provenance": [], "toc_visible": True},
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    cells = [nbformat.v4.new_markdown_cell(badge(filename) + "\n\n" + _source(cells_module.INTRO)),
             nbformat.v4.new_code_cell(_source(SETUP_CELL))]
    for kind, text in cells_module.CELLS:
        new = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        cells.append(new(_source(text)))
    for i, cell in enumerate(cells):
        cell.id = f"c{i:02d}"  # stable ids: rebuilding an unchanged notebook gives an identical file
    nb.cells = cells
    nbformat.validate(nb)
    return nb


def render(filename: str) -> str:
    return nbformat.writes(build(filename)) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a notebook is stale")
    ap.add_argument("names", nargs="*", help="notebook file names (default: all)")
    args = ap.parse_args(argv)
    stale = []
    for name in args.names or NOTEBOOKS:
        path = os.path.join(NOTEBOOK_DIR, name)
        text = render(name)
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if current == text:
            continue
        if args.check:
            stale.append(name)
        else:
            os.makedirs(NOTEBOOK_DIR, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path, ROOT)}")
    if stale:
        print(f"stale notebooks (rerun python tools/build_notebooks.py): {stale}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
