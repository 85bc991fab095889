"""What a program that owns its process sets before JAX starts, as the ``tieflax`` console does.

Importing tieflax changes nothing in the process; these settings are the program's to make, once, before its
first JAX computation: the console calls :func:`prepare_process` first thing (``tieflax.cli.main``), the
benchmarks' scripts as they start, the notebooks in their set-up cell. Standard library only (it imports no
JAX), so a notebook can call it before XLA reads its flags.
"""

from __future__ import annotations

from tieflax.hardware import gpu_flags, platforms


def prepare_process() -> None:
    """JAX kept to the CPU where no TPU or GPU is attached (:func:`tieflax.hardware.platforms.skip_absent_tpu`:
    no libtpu start-up errors on a machine without a TPU), and the GPU XLA flags that
    ``TIEFLAX_GPU_XLA_FLAGS`` chooses on a GPU run (:func:`tieflax.hardware.gpu_flags.apply`). Both change
    ``os.environ``, so that child processes agree.

    Call before the first JAX computation; a later call changes nothing JAX already read (a warning says so
    for the GPU flags). Never raises: a ``TIEFLAX_GPU_XLA_FLAGS`` that is not a choice adds nothing here,
    and the console refuses it in one line (``tieflax.cli.check_settings``)."""
    platforms.skip_absent_tpu()
    gpu_flags.apply()
