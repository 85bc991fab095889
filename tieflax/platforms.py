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
"""

from __future__ import annotations

import os
import sys


def _accelerator_present() -> bool:
    from jax._src import hardware_utils  # noqa: PLC0415 (the probe JAX itself runs; no backend starts)

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
