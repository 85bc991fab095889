"""What the hardware can do: chips, their peaks and memory, compile targets (``targets``), and the model
FLOPs and MFU a step achieves on them (``flops``).

A low floor: the training console reports MFU from here, and ``tieflax plan`` (a top floor) compiles for
the targets defined here.
"""
