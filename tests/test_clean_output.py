"""The console reads clean: no libtpu start-up noise without a TPU, every imported package declared, and
the console capture the quick-start test relies on sees every channel (the quick-start test itself is
``test_compare.py::test_compare_prints_no_foreign_warning``)."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import importlib.util
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest

from console_support import capture_console, foreign_problems

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imported_top_level_modules() -> set[str]:
    names = set()
    for folder, _, files in os.walk(os.path.join(REPO, "tieflax")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names.update(a.name.split(".")[0] for a in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"tieflax", "__future__"}


def _declared() -> dict[str, str]:
    """Normalised distribution name -> its requirement line, over install_requires and every extra."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in cfg["options.extras_require"].values():
        lines += extra.splitlines()
    out = {}
    for line in filter(None, (x.strip() for x in lines)):
        name = re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]
        out[re.sub(r"[-_.]+", "-", name).lower()] = line
    return out


def test_every_imported_package_is_declared_with_a_version_range():
    declared = _declared()
    providers = importlib.metadata.packages_distributions()
    missing = []
    for module in sorted(_imported_top_level_modules()):
        dists = [re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [module])]
        # jaxlib ships with jax, which pins it exactly; libtpu comes with the TPU install of jax.
        if not any(d in declared for d in dists) and module not in ("jaxlib", "libtpu"):
            missing.append(f"{module} (from {dists})")
    assert not missing, f"imported by tieflax but not declared in setup.cfg: {missing}"
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    for line in filter(None, (x.strip() for x in cfg["options"]["install_requires"].splitlines())):
        assert ">=" in line and "<" in line, f"install_requires entry without a version range: {line}"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_a_command_prints_nothing_from_libtpu_on_a_machine_without_a_tpu():
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        pytest.skip("a TPU is attached: libtpu's start-up is then wanted")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # were libtpu loaded, tests running side by side may share it
    proc = subprocess.run([sys.executable, "-m", "tieflax.cli", "params", "--config",
                           os.path.join(REPO, "configs", "models", "gpt2.py"), "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert '"total": 124439808' in proc.stdout
    assert proc.stderr == "", proc.stderr  # no TPU_WORKER_HOSTNAMES, no "could not determine TPU ..."


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_importing_tieflax_from_python_prints_nothing_from_libtpu():
    """A script or a notebook, not the console: importing any tieflax module keeps libtpu from starting
    (tieflax/__init__.py), whether jax is imported before it or after; without tieflax it does start."""
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        pytest.skip("a TPU is attached: libtpu's start-up is then wanted")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"

    def run(code):
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)

    for code in ("import tieflax.train; import jax; jax.devices()",
                 "import jax; import tieflax.ops.cross_entropy; jax.numpy.ones(2).block_until_ready()"):
        proc = run(code)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", ""), (code, proc.stderr[-2000:])
    plain = run("import jax; jax.devices()")   # the same start without tieflax: what the guard keeps out
    assert "TPU" in plain.stderr, plain.stderr[-2000:]


def test_the_console_capture_sees_every_channel():
    def noisy():
        print("progress")
        os.write(2, b"E0000 00:00:1.0 12 common_lib.cc:554] from C++\n")
        logging.getLogger("absl").warning("Metadata file does not exist: x")
        logging.getLogger("tieflax.train").warning("our own warning")
        warnings.warn("a library's warning", UserWarning)
        return 7

    result, text = capture_console(noisy)
    assert result == 7 and "progress" in text
    assert foreign_problems(text) == ["E0000 00:00:1.0 12 common_lib.cc:554] from C++",
                                      "WARNING:absl:Metadata file does not exist: x",
                                      "WARNING:py.warnings:UserWarning: a library's warning"]
