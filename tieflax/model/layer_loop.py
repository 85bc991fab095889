"""The scanned layers' loop under remat 'none', in buffers the loop writes in place (no zero fill, no copy).

``jax.lax.scan`` (and ``nn.scan`` on it) starts every stacked output from a broadcast zero: the forward's
stacked residuals ([layers, B, T, d] and the like, what the backward reads) and the backward's stacked
weight gradients. XLA merges the zero broadcasts of one shape into one buffer and copies it for each
further stack of that shape: whole-stack copies before each loop (four of 256 MiB or more, 3.25 GiB,
in Llama-3.2-1B's step on one H100 at 8 x 2048, benchmarks/README.md).

``layer_loop`` runs the same layers with the same per-layer VJP, in a ``custom_vjp`` of two
``fori_loop``s over buffers from ``jax.lax.empty`` (XLA's ``AllocateBuffer`` on GPU and TPU: allocated,
not written) that each iteration updates in place (``dynamic_update_slice``):

* forward: layer i's ``jax.vjp``; its residuals (the leaves of the returned VJP) go to row i of one
  buffer each, except those the loop need not stack: a residual that is the layer's own parameter slice
  (the backward slices the stacked parameters again) and one that depends on neither the parameters nor
  the carried activations (the attention mask, the RoPE tables: computed once, before the loop);
* backward: from the last layer to the first, the VJP rebuilt from row i of the buffers, its parameter
  gradient written to row i of the gradient buffers, the input gradient carried.

The arithmetic of each layer's forward and backward is that of ``jax.vjp`` of the layer, as under a scan
(on CPU, jitted, loss and gradients equal to the bit; tests/test_layer_loop.py). ``TransformerLM`` takes
this loop for scanned layers under remat 'none' on one device (``_in_place_loop``); elsewhere ``nn.scan``
stays: other policies' residuals are the layer input (and what the policy names), which with
``offload_layer_inputs`` live in host memory that these buffers (device memory) would undo; and on a mesh
of several devices the buffers carry no sharding, so XLA would hold them whole on every device.
On CPU ``jax.lax.empty`` is a broadcast zero, as the scan's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax

Array = jax.Array


def layer_loop(body: Callable[[Any, Array, Any], Array], stacked: Any, x: Array, consts: Any) -> Array:
    """``x`` after ``n`` layers: ``x = body(params_i, x, consts)`` for i < n, ``params_i`` row i of every
    leaf of ``stacked`` (leading axis n). Differentiable in ``stacked`` and ``x``; ``consts`` (positions,
    segment ids: integers, or None) get no gradient."""

    @jax.custom_vjp
    def run(stacked, x, consts):   # no gradient asked for (evaluation): the layers alone
        return lax.fori_loop(0, jax.tree.leaves(stacked)[0].shape[0],
                             lambda i, x: body(_row(stacked, i), x, consts).astype(x.dtype), x)

    def fwd(stacked, x, consts):
        y, saved = _forward(body, stacked, x, consts)
        return y, (stacked, consts, saved)

    def bwd(res, ct):
        stacked, consts, saved = res
        grads, ct_x = _backward(stacked, saved, ct)
        return grads, ct_x, jax.tree.map(lambda _: None, consts)

    run.defvjp(fwd, bwd)
    return run(stacked, x, consts)


def _row(tree: Any, i) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _layer_vjp(body, consts):
    def f(p, x):
        return jax.vjp(lambda p, x: body(p, x, consts), p, x)
    return f


def _residual_kinds(body, p_row, x, consts) -> tuple[list, list]:
    """For each leaf of a layer's VJP: ('param', k) when it is leaf k of the layer's parameters as given,
    ('same', j) when it is leaf j again, 'stored' when it depends on the parameters or x, 'invariant'
    otherwise (a function of ``consts`` alone: computed once, outside the loop); and the leaves' avals."""
    p_leaves, p_tree = jax.tree.flatten(p_row)
    n_p = len(p_leaves)

    def traced(p_leaves, x, consts):
        _, vjp = jax.vjp(lambda p, x: body(p, x, consts), jax.tree.unflatten(p_tree, p_leaves), x)
        return jax.tree.leaves(vjp)

    jaxpr = jax.make_jaxpr(traced)(p_leaves, x, consts).jaxpr
    variant = _variant_outputs(jaxpr, [i <= n_p for i in range(len(jaxpr.invars))])
    same = _same_values(jaxpr)
    param_of = {v: k for k, v in enumerate(jaxpr.invars[:n_p])}
    kinds, first = [], {}
    for j, (v, dependent) in enumerate(zip(jaxpr.outvars, variant)):
        v = same.get(v, v) if _is_var(v) else v
        if _is_var(v) and v in param_of:
            kinds.append(("param", param_of[v]))
        elif _is_var(v) and v in first:
            kinds.append(("same", first[v]))
        else:
            kinds.append("stored" if dependent else "invariant")
            if _is_var(v):
                first[v] = j
    return kinds, [v.aval for v in jaxpr.outvars]


def _same_values(jaxpr) -> dict:
    """{var: the var it equals}, for the outputs of call-like equations that return one of their operands
    or another of their outputs unchanged (a VJP's residuals out of a ``shard_map`` or a custom_vjp,
    e.g. the attention output, also returned as the primal output)."""
    same = {}

    def canon(v):
        return same.get(v, v) if _is_var(v) else v

    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _IDENTITIES and _is_var(eqn.invars[0]):
            same[eqn.outvars[0]] = canon(eqn.invars[0])
            continue
        inner = _call_jaxpr(eqn)
        if inner is None or len(inner.invars) != len(eqn.invars) or len(inner.outvars) != len(eqn.outvars):
            continue
        inner_same = _same_values(inner)
        position = {v: i for i, v in enumerate(inner.invars)}
        seen = {}
        for o, v in zip(eqn.outvars, inner.outvars):
            if not _is_var(v):
                continue
            v = inner_same.get(v, v)
            if v in position and _is_var(eqn.invars[position[v]]):
                same[o] = canon(eqn.invars[position[v]])
            elif v in seen:
                same[o] = seen[v]
            else:
                seen[v] = o
    return same


def _variant_outputs(jaxpr, variant_in: list) -> list:
    """Which outputs of ``jaxpr`` depend on the inputs marked in ``variant_in``: through each equation,
    and into the jaxprs of calls (jit, checkpoint, custom_vjp and the like) where their operands map
    one to one; any other equation with a dependent operand makes all its outputs dependent."""
    variant = {v for v, d in zip(jaxpr.invars, variant_in) if d}
    for eqn in jaxpr.eqns:
        dep_in = [_is_var(v) and v in variant for v in eqn.invars]
        if not any(dep_in):
            continue
        inner = _call_jaxpr(eqn)
        out = (_variant_outputs(inner, dep_in) if inner is not None and len(inner.invars) == len(dep_in)
               and len(inner.outvars) == len(eqn.outvars) else [True] * len(eqn.outvars))
        variant.update(v for v, d in zip(eqn.outvars, out) if d)
    return [_is_var(v) and v in variant for v in jaxpr.outvars]


# Equations whose one output is their one operand, value for value (a sharding or a name for remat).
_IDENTITIES = {"sharding_constraint", "name", "copy"}
# Equations that run a jaxpr once on their operands, output for output (not loops: a loop's carry can
# come to depend on an operand only after some iterations).
_CALLS = {"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "custom_jvp_call", "shard_map"}


def _call_jaxpr(eqn):
    """The jaxpr a call-like equation runs on its operands (``jit``'s, ``checkpoint``'s, a custom_vjp's
    primal), or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(name)
        if inner is not None and not callable(inner):
            return getattr(inner, "jaxpr", inner)
    return None


def _is_var(v) -> bool:
    return type(v).__name__ != "Literal"   # a jaxpr's operands and outputs: Vars, or Literals (constants)


def _forward(body, stacked, x, consts):
    n = jax.tree.leaves(stacked)[0].shape[0]
    vjp_of = _layer_vjp(body, consts)
    p0 = _row(stacked, 0)
    kinds, avals = _residual_kinds(body, p0, x, consts)
    invariant = []
    if "invariant" in kinds:   # once, before the loop: layer 0's VJP with only these kept (XLA drops the rest)
        invariant = [leaf for leaf, kind in zip(jax.tree.leaves(vjp_of(p0, x)[1]), kinds) if kind == "invariant"]
    buffers = [lax.empty((n, *aval.shape), aval.dtype) for aval, kind in zip(avals, kinds) if kind == "stored"]
    treedef = []

    def step(i, carry):
        x, buffers = carry
        y, vjp = vjp_of(_row(stacked, i), x)
        leaves, tree = jax.tree.flatten(vjp)
        if len(leaves) != len(kinds):
            raise AssertionError(f"a layer's VJP has {len(leaves)} residuals here, {len(kinds)} when classified")
        treedef.append(tree)
        stored = [leaf for leaf, kind in zip(leaves, kinds) if kind == "stored"]
        buffers = [lax.dynamic_update_index_in_dim(b, leaf.astype(b.dtype), i, 0)
                   for b, leaf in zip(buffers, stored)]
        return y.astype(x.dtype), buffers

    y, buffers = lax.fori_loop(0, n, step, (x, buffers))
    return y, _Saved(treedef[-1], kinds, buffers, invariant)


class _Saved:
    """What the backward needs besides the stacked parameters: the VJP's structure, the kind of each
    residual, the stored rows and the invariant residuals (a pytree: the arrays are its leaves)."""

    def __init__(self, tree, kinds, buffers, invariant):
        self.tree, self.kinds, self.buffers, self.invariant = tree, kinds, buffers, invariant


jax.tree_util.register_pytree_node(
    _Saved, lambda s: ((s.buffers, s.invariant), (s.tree, tuple(s.kinds))),
    lambda aux, children: _Saved(aux[0], list(aux[1]), *children))


def _backward(stacked, saved: _Saved, ct):
    n = jax.tree.leaves(stacked)[0].shape[0]
    grads = jax.tree.map(lambda a: lax.empty(a.shape, a.dtype), stacked)

    def step(k, carry):
        i = n - 1 - k
        ct, grads = carry
        p_leaves = jax.tree.leaves(_row(stacked, i))
        stored = iter(lax.dynamic_index_in_dim(b, i, keepdims=False) for b in saved.buffers)
        invariant = iter(saved.invariant)
        leaves = []
        for kind in saved.kinds:
            if kind == "stored":
                leaves.append(next(stored))
            elif kind == "invariant":
                leaves.append(next(invariant))
            else:   # ('param', k): the layer's parameter leaf k; ('same', j): leaf j again
                leaves.append(p_leaves[kind[1]] if kind[0] == "param" else leaves[kind[1]])
        d_p, d_x = jax.tree.unflatten(saved.tree, leaves)(ct)
        grads = jax.tree.map(lambda g, d: lax.dynamic_update_index_in_dim(g, d.astype(g.dtype), i, 0),
                             grads, d_p)
        return d_x.astype(ct.dtype), grads

    ct_x, grads = lax.fori_loop(0, n, step, (ct, grads))
    return grads, ct_x


__all__ = ["layer_loop"]
