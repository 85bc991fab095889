"""tieflax: tied vs untied input/output embeddings in JAX/Flax language models."""

__version__ = "0.1.0"

# On a machine without a TPU or GPU, keep JAX from starting libtpu (whose C++ start-up prints "Failed to
# find host bounds" and INVALID_ARGUMENT lines no Python code can filter): JAX_PLATFORMS=cpu unless the user
# chose a platform. Cheap: JAX is not imported here (tieflax/hardware/platforms.py).
from tieflax.hardware.platforms import skip_absent_tpu as _skip_absent_tpu

_skip_absent_tpu()

# TIEFLAX_GPU_XLA_FLAGS=recommended: NVIDIA's XLA flags for LLM training added to XLA_FLAGS before JAX starts
# its GPU backend, on a GPU run only; off by default until a GPU measures them (tieflax/hardware/gpu_flags.py).
# Never raises: a value that is not a choice adds nothing here and is refused in one line when a command
# starts (tieflax.cli.check_settings), so that `--help` and every import still work.
from tieflax.hardware.gpu_flags import apply as _apply_gpu_xla_flags  # noqa: E402

_apply_gpu_xla_flags()
