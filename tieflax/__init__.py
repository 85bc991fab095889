"""tieflax: tied vs untied input/output embeddings in JAX/Flax language models.

Importing tieflax (any module of it) changes nothing in the process: no environment variable, no JAX
setting. A program that owns its process and wants the console's start (JAX kept off libtpu where no TPU is
attached; the GPU XLA flags ``TIEFLAX_GPU_XLA_FLAGS`` chooses) calls
``tieflax.hardware.process.prepare_process()`` before its first JAX computation.
"""

__version__ = "0.1.0"
