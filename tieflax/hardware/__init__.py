"""What the hardware can do: chips, their peaks and memory, compile targets (``targets``), and the model
FLOPs and MFU a step achieves on them (``flops``); which platform JAX starts on (``platforms``: the CPU
when no accelerator is attached), the GPU's XLA flags (``gpu_flags``), and the processes of a multi-host
job finding and waiting for each other (``distributed``).

A low floor: the training console reports MFU from here, and ``tieflax plan`` (a top floor) compiles for
the targets defined here.
"""
