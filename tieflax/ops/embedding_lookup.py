"""Vocabulary-parallel embedding lookup: the input side of a vocab-sharded (possibly tied) matrix.

Each device holds rows ``[r * V_local, (r + 1) * V_local)`` of the table on the vocab axis; it looks up
the ids it owns (a local ``take``), zeroes the others and a ``psum`` over the vocab axis assembles the
result. Traffic: one ``[N_local, d]`` psum; the table is never gathered over vocab, so the same
``P(vocab, None)`` layout serves the lookup and the fused cross-entropy head.

When the table's hidden dimension is also sharded (FSDP: ``P(vocab, 'fsdp')``, the training layout), the
lookup keeps it so: each device gathers the ids of its FSDP group (ints, tiny), reads its own column
slice of its own rows, and one ``all_to_all`` over the FSDP axis trades "all tokens, d / n columns" for
"my tokens, all d columns". Neither the table nor its gradient is ever held whole on a device: the
gradient is a scatter-add into the local ``[V_local, d / n]`` shard (gathering the table instead costs
a full-size copy of it, its cast, and a full-size gradient reduced afterwards).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def vocab_parallel_embed(table: jax.Array, ids: jax.Array, *, mesh: Mesh | None = None,
                         vocab_axis: str = "tensor",
                         batch_axes: tuple[str, ...] = ("data", "fsdp"),
                         embed_axis: str | None = "fsdp") -> jax.Array:
    """Rows of ``table`` [V_pad, d] at ``ids`` [...] int -> [..., d] in ``table.dtype``.

    ``mesh=None``: ``jnp.take(table, ids, axis=0)``. With a mesh, ``table`` is split over ``vocab_axis``
    and the leading dimension of ``ids`` over ``batch_axes`` (it must divide evenly); ids outside
    ``[0, V_pad)`` give zero rows (no shard owns them). The gradient w.r.t. ``table`` is the usual
    scatter-add, reduced over the batch axes by ``shard_map``'s transpose.

    ``embed_axis``: a batch axis over which the table's ``d`` is also split (``P(vocab, embed_axis)``,
    see the module docstring); used when it is one of ``batch_axes``, has more than one device and
    divides ``d``; otherwise the table is read as ``P(vocab, None)``.
    """
    if table.ndim != 2:
        raise ValueError(f"table must be [V_pad, d], got shape {table.shape}.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integers, got {ids.dtype}.")
    if mesh is None:
        return jnp.take(table, ids, axis=0)
    for ax in (vocab_axis,) + tuple(batch_axes):
        if ax not in mesh.axis_names:
            raise ValueError(f"axis {ax!r} is not in the mesh axes {mesh.axis_names}; "
                             "fix vocab_axis/batch_axes.")
    nv = mesh.shape[vocab_axis]
    if table.shape[0] % nv:
        raise ValueError(f"V_pad={table.shape[0]} must be a multiple of the {vocab_axis!r} axis size {nv}; "
                         "pad the vocabulary (tieflax rounds V up to shards x 128).")
    nb = math.prod(mesh.shape[a] for a in batch_axes)
    if ids.ndim == 0 or ids.shape[0] % nb:
        raise ValueError(f"ids leading dim of shape {ids.shape} must be divisible by the batch axes "
                         f"{tuple(batch_axes)} of total size {nb}; pass batch_axes=() to replicate ids.")
    bax = tuple(batch_axes) if batch_axes else None
    ids_spec = P(bax, *([None] * (ids.ndim - 1)))
    split_d = (embed_axis in tuple(batch_axes) and mesh.shape[embed_axis] > 1
               and table.shape[1] % mesh.shape[embed_axis] == 0)

    def body(tab, ids):
        if split_d:  # every token of the FSDP group, for this device's columns
            ids = lax.all_gather(ids, embed_axis, axis=0, tiled=True)
        v_local = tab.shape[0]
        local = ids - lax.axis_index(vocab_axis) * v_local
        mine = (local >= 0) & (local < v_local)
        rows = jnp.take(tab, jnp.where(mine, local, 0), axis=0)
        rows = lax.psum(jnp.where(mine[..., None], rows, jnp.zeros((), tab.dtype)), vocab_axis)
        if split_d:  # [n * N_local, ..., d / n] -> [N_local, ..., d]: my tokens, every column slice
            rows = lax.all_to_all(rows, embed_axis, split_axis=0, concat_axis=rows.ndim - 1, tiled=True)
        return rows

    table_spec = P(vocab_axis, embed_axis if split_d else None)
    return jax.shard_map(body, mesh=mesh, in_specs=(table_spec, ids_spec),
                         out_specs=P(bax, *([None] * ids.ndim)))(table, ids)
