"""Which JAX backends the ``tieflax`` console lets JAX try, so a machine without a TPU starts quietly.

With ``libtpu`` installed (the ``tpu`` extra), JAX tries the TPU backend on every start. On a machine
with no TPU, libtpu's C++ start-up then writes to stderr, before any Python logging is configured:
"could not determine TPU accelerator type", an ``E0000 ... TPU_WORKER_HOSTNAMES`` error and a source
trace. Nothing in Python can filter those lines; they stop only if JAX never asks libtpu for devices.

``skip_absent_tpu()`` therefore pins JAX to the CPU when, and only when, JAX's own hardware probes
(``jax._src.hardware_utils``: TPU chips are found by their Google PCI vendor and device ids under
``/sys/bus/pci/devices``, NVIDIA GPUs by their ``/dev`` nodes, AMD GPUs by the KFD driver) find no
accelerator. On a TPU VM the probe finds the chips and nothing changes; with a GPU present nothing
changes either. A ``JAX_PLATFORMS`` the user set (even to ``''``) and ``JAX_FORCE_TPU_INIT`` always win.
Compiling for a TPU topology from a CPU machine (``jax.experimental.topologies``) loads libtpu
directly and keeps working.

Importing tieflax changes nothing in the process: the program that owns the process decides. The console
calls ``tieflax.hardware.process.prepare_process`` first thing (``tieflax.cli.main``), which runs
:func:`skip_absent_tpu`; a script or a notebook that wants the same quiet start calls it before its first
JAX computation (the notebooks' set-up cell does). The probe reads JAX's own ``hardware_utils`` from its
file without importing JAX (a few milliseconds).
"""

from __future__ import annotations

import os
import sys


def jax_hardware_probe():
    """``jax._src.hardware_utils`` (the probe JAX itself runs; it imports only the standard library), read
    from its file when JAX is not imported yet: importing the package costs a second or more, and this
    runs on every ``import tieflax``."""
    module = sys.modules.get("jax._src.hardware_utils")
    if module is not None:
        return module
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("jax")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("jax is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "_src", "hardware_utils.py")
    loaded = importlib.util.spec_from_file_location("tieflax._jax_hardware_utils", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def _accelerator_present() -> bool:
    hardware_utils = jax_hardware_probe()
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
        return True
    if hardware_utils.has_visible_nvidia_gpu():
        return True
    amd = getattr(hardware_utils, "num_available_amd_gpus", None)
    return bool(amd and amd(stop_at=1))


def skip_absent_tpu() -> bool:
    """Restricts JAX to the CPU when no TPU or GPU is attached and the user chose no platform.

    Call before JAX's first backend use (any ``jax.devices()``, array or compile). Returns True when it
    restricted JAX. Exported as ``JAX_PLATFORMS=cpu`` so child processes agree.
    """
    if "JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    try:
        if _accelerator_present():
            return False
    except Exception:  # noqa: BLE001 (a probe that cannot read /sys must not stop the command)
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # already imported: its config read the environment before we set it
        import jax  # noqa: PLC0415
        from jax._src import xla_bridge  # noqa: PLC0415

        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
    return True
