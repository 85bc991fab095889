"""The scanned layers under remat 'none' in ``tieflax.model.layer_loop`` (buffers written in place, no
zero-filled scan stacks): the loss and gradients of ``nn.scan``'s autodiff, and only what
depends on a layer's parameters or activations stacked."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scan_support import FAMILIES, TARGETS, TOKENS, init_params
from tieflax.model import TransformerLM
from tieflax.model import layer_loop as loop_module
from tieflax.model.layer_stacking import stack_layers

SEGMENTS = jnp.asarray(np.repeat([[0] * 5 + [1] * 3], TOKENS.shape[0], 0), jnp.int32)


def _config(family: str, dtype: str, **changes):
    return FAMILIES[family].replace(**{"scan_layers": True, "remat": "none", "dtype": dtype, "n_layers": 4,
                                       **changes})


def _traced_only(f):
    return functools.partial(jax.eval_shape, f)


def _loss_and_grads(c, params, in_place: bool, monkeypatch, transform=jax.jit):
    """((loss, grads), logits); ``transform=_traced_only``: the same programs traced, not compiled or run
    (for a test that reads only what tracing records)."""
    monkeypatch.setattr(TransformerLM, "_in_place_loop", lambda self: in_place)

    def f(p):
        return TransformerLM(c).apply({"params": p}, TOKENS, TARGETS, segment_ids=SEGMENTS, method="loss")[0].mean()

    logits = transform(lambda p: TransformerLM(c).apply({"params": p}, TOKENS, segment_ids=SEGMENTS))(params)
    return transform(jax.value_and_grad(f))(params), logits   # the logits: the loop without a gradient


# Each family and each dtype once (the four pairs cost twice the suite's time for no other code path).
@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("gemma2", "bfloat16")])
def test_in_place_loop_equals_scan(family, dtype, monkeypatch):
    """Loss, gradients and (no gradient asked for) logits. Jitted at XLA:CPU's default optimisation level,
    equal to the bit (llama and gemma2, fp32 and bf16; checked by hand); at the suite's level 0
    (JAX_DISABLE_MOST_OPTIMIZATIONS) XLA orders some fp32 sums differently: a few gradient entries differ in
    the last two bits (2.3e-10 absolute, 2.3e-7 relative)."""
    c = _config(family, dtype)
    params = stack_layers(init_params(c.replace(scan_layers=False)), c)
    new = _loss_and_grads(c, params, True, monkeypatch)
    old = _loss_and_grads(c, params, False, monkeypatch)
    assert jax.tree.structure(new) == jax.tree.structure(old)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-7, atol=1e-9)


def test_only_what_depends_on_the_layer_is_stacked(monkeypatch):
    """Parameter slices are sliced again in the backward, masks and positions computed once: every
    stored residual is floating point (no stacked mask or position ids), every parameter leaf is found.
    (The einsum attention: the CPU's default kernel keeps small integer block tables from inside its
    loops, which the classification does not see through and stacks: [n_layers, 128] int32 and the like.)"""
    seen = []
    kinds_of = loop_module._residual_kinds

    def spy(body, p_row, x, consts):
        kinds, avals = kinds_of(body, p_row, x, consts)
        seen.append((kinds, avals, len(jax.tree.leaves(p_row))))
        return kinds, avals

    monkeypatch.setattr(loop_module, "_residual_kinds", spy)
    c = _config("llama", "bfloat16", attention="xla")
    params = stack_layers(init_params(c.replace(scan_layers=False)), c)
    # The spy records while the programs are traced: traced only, the same calls in the same order.
    _loss_and_grads(c, params, True, monkeypatch, transform=_traced_only)
    kinds, leaves, n_params = seen[0]
    assert sorted(k[1] for k in kinds if isinstance(k, tuple) and k[0] == "param") == list(range(n_params))
    stored = [leaf for leaf, kind in zip(leaves, kinds) if kind == "stored"]
    assert stored and all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in stored)
    assert any(kind == "invariant" for kind in kinds)


def test_other_policies_and_init_keep_nn_scan(monkeypatch):
    calls = []
    monkeypatch.setattr("tieflax.model.transformer.layer_loop", lambda *a: calls.append(1) or a[2])
    c = _config("llama", "float32", remat="full")
    # Which loop runs is chosen while tracing: traced only (jax.eval_shape; the parameters too), as run
    # op by op.
    params = jax.eval_shape(lambda: stack_layers(init_params(c.replace(scan_layers=False)), c))
    jax.eval_shape(lambda p: TransformerLM(c).apply({"params": p}, TOKENS), params)
    jax.eval_shape(lambda k: TransformerLM(c.replace(remat="none")).init(k, TOKENS), jax.random.key(0))
    assert not calls
