"""Meshes and logical-axis rules.

Mesh axes are always ``('data', 'fsdp', 'tensor')``. Parameters and activations name *logical* axes
(``vocab``, ``embed``, ``mlp``, ``heads``, ``batch``...) and the rules below map them onto mesh axes, so
a model never mentions a device layout. The vocabulary lives on ``tensor`` at both ends of the network:
the input lookup and the output head read the (possibly tied) matrix in one layout.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
VOCAB_AXIS = "tensor"

# Logical axis name -> mesh axis (or axes, or None for replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("length", None),
    ("norm", None),
    ("layers", None),
)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axis types.

    ``jax.make_mesh`` defaults to Explicit axes in current JAX, which Linen logical partitioning does
    not expect, so the axis types are spelled out. ``data * fsdp * tensor`` must equal the number of
    devices used (all of ``jax.devices()`` unless ``devices`` is given).
    """
    shape = (data, fsdp, tensor)
    devices = list(jax.devices() if devices is None else devices)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh data*fsdp*tensor = {data}*{fsdp}*{tensor} = {int(np.prod(shape))} does not match "
            f"the {len(devices)} devices available; set mesh sizes whose product is {len(devices)}.")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
