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
import pathlib
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


def _bare_python(code: str, **env_more: str) -> subprocess.CompletedProcess:
    """``python -c code`` as a user's script starts: no JAX_PLATFORMS, no XLA_FLAGS."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", **env_more)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


# Prints the environment variables that importing ``modules`` changed, and every other module those imports
# loaded, in the order they loaded.
_ENV_CHANGES = """
import importlib, json, os, sys
before, loaded = dict(os.environ), set(sys.modules)
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except Exception:
        pass
print(json.dumps({{"changed": {{k: os.environ.get(k) for k in set(before) | set(os.environ)
                               if before.get(k) != os.environ.get(k)}},
                   "others": [m for m in sys.modules if m not in loaded and not m.startswith("tieflax")]}}))
"""


def test_importing_tieflax_changes_nothing_in_the_environment():
    """A library import leaves the process's environment as it found it, GPU flags asked for too: JAX's
    platform, XLA's flags and the storage libraries' settings are for the program that owns the process
    (the console, or a script calling prepare_process). What the libraries tieflax imports set themselves
    (jax sets TF_CPP_MIN_LOG_LEVEL, for one) is measured by importing those libraries alone."""
    import json

    ours = ["tieflax", "tieflax.cli", "tieflax.train", "tieflax.storage", "tieflax.hardware.distributed"]
    with_tieflax = _bare_python(_ENV_CHANGES.format(modules=ours), TIEFLAX_GPU_XLA_FLAGS="recommended")
    assert with_tieflax.returncode == 0, with_tieflax.stderr[-2000:]
    found = json.loads(with_tieflax.stdout.splitlines()[-1])
    alone = _bare_python(_ENV_CHANGES.format(modules=found["others"]), TIEFLAX_GPU_XLA_FLAGS="recommended")
    assert alone.returncode == 0, alone.stderr[-2000:]
    libraries = json.loads(alone.stdout.splitlines()[-1])["changed"]
    assert found["changed"] == libraries, {k: v for k, v in found["changed"].items() if libraries.get(k) != v}


def _writes_the_environment(node) -> bool:
    """``os.environ[k] = v``, ``del os.environ[k]``, ``os.environ.setdefault/update/pop/clear(...)``,
    ``os.putenv``/``os.unsetenv``."""
    import ast

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("putenv", "unsetenv"):
            return True
        return (node.func.attr in ("setdefault", "update", "pop", "popitem", "clear", "__setitem__")
                and "environ" in ast.unparse(node.func.value))
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        return any(isinstance(t, ast.Subscript) and "environ" in ast.unparse(t.value) for t in targets)
    return False


def test_no_tieflax_module_writes_the_environment_as_it_is_imported():
    """Every module, read: no statement that runs at import (outside a function) sets, updates or removes
    an environment variable; the test above imports the main ones to catch what a reading cannot."""
    import ast

    found = []
    for path in sorted(pathlib.Path(REPO, "tieflax").rglob("*.py")):
        tree = ast.parse(path.read_text())
        at_import = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                  ast.ClassDef))]
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}"
                  for top in at_import for node in ast.walk(top) if _writes_the_environment(node)]
    assert not found, "set at import (move it into the function that needs it):\n" + "\n".join(found)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_prepare_process_keeps_libtpu_quiet_in_a_script():
    """A script or a notebook, not the console: ``prepare_process()`` before the first JAX computation keeps
    libtpu from starting, whether jax is imported before it or after; without it libtpu does start."""
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        pytest.skip("a TPU is attached: libtpu's start-up is then wanted")
    prepare = "from tieflax.hardware.process import prepare_process; prepare_process(); "
    for code in (prepare + "import tieflax.train; import jax; jax.devices()",
                 "import jax; " + prepare + "import tieflax.ops.cross_entropy; jax.numpy.ones(2).block_until_ready()"):
        proc = _bare_python(code)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", ""), (code, proc.stderr[-2000:])
    plain = _bare_python("import tieflax.train; import jax; jax.devices()")  # what prepare_process keeps out
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
