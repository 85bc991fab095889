"""Meshes and logical-axis rules.

Mesh axes are always ``('data', 'fsdp', 'tensor')``. Parameters and activations name *logical* axes
(``vocab``, ``embed``, ``mlp``, ``heads``, ``batch``...) and the rules below map them onto mesh axes, so
a model never mentions a device layout. The vocabulary lives on ``tensor`` at both ends of the network:
the input lookup and the output head read the (possibly tied) matrix in one layout.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from tieflax.errors import ConfigError

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
    # Activations (tieflax/model/layers.py BTD, BTHD, BTF): batch over (data, fsdp) as above, heads and
    # the MLP width over 'tensor' (Megatron-style), the hidden size and the length replicated, so that an
    # activation is never sharded twice over 'fsdp'.
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
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
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    except AssertionError:
        # libtpu's v4 compile targets (tieflax plan) are TensorCores, two per chip, and JAX's physical
        # mesh helper asserts one device per chip ("megacore"): lay them out in the topology's own order.
        if not any(getattr(d, "core_on_chip", 0) for d in devices):
            raise
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
                    axis_types=(AxisType.Auto,) * 3)


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Resolves ``config.mesh`` (``data``, ``fsdp``, ``tensor``; one of them may be -1 = "the rest").

    Raises ConfigError (a ValueError and a user error: one line) naming ``config.mesh.<axis>`` when the
    sizes cannot tile ``num_devices``.
    """
    sizes = [int(mesh_config[a]) for a in MESH_AXES]
    free = [a for a, n in zip(MESH_AXES, sizes) if n == -1]
    for a, n in zip(MESH_AXES, sizes):
        if n == 0 or n < -1:
            raise ConfigError(f"config.mesh.{a} = {n}: use a positive size, or -1 for all remaining devices.")
    if len(free) > 1:
        raise ConfigError(f"config.mesh: only one axis may be -1, got {free}; give the others sizes.")
    fixed = int(np.prod([n for n in sizes if n != -1]))
    if free:
        if num_devices % fixed:
            raise ConfigError(f"config.mesh: the fixed axes multiply to {fixed}, which does not divide the "
                             f"{num_devices} devices; change config.mesh.{'/'.join(MESH_AXES)}.")
        sizes[MESH_AXES.index(free[0])] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(f"config.mesh data*fsdp*tensor = {fixed} but {num_devices} devices are available; "
                         "set one axis to -1 or make the product match.")
    return tuple(sizes)


def mesh_from_config(mesh_config: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The training mesh of ``config.mesh`` over ``devices`` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    return make_mesh(*mesh_shape(mesh_config, len(devices)), devices=devices)


def logical_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree of (abstract) values boxed with logical axis names.

    Boxed leaves (``nn.Partitioned`` / ``nn.LogicallyPartitioned``) map through ``LOGICAL_AXIS_RULES``;
    plain leaves (step counters, optimizer counts) are replicated. The result has the structure of the
    *unboxed* tree, so it can serve as ``in_shardings`` / ``out_shardings`` of an unboxed train state.
    """
    import flax.linen as nn  # noqa: PLC0415 (keeps `import tieflax.sharding` light)

    specs = nn.get_partition_spec(tree)
    return nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, ...] arrays: batch over ``BATCH_AXES``, replicated over 'tensor'."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
