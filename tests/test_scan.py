"""Scanned layers and remat policies: the same function, parameters and gradients as the unrolled model.

Scanned parameters are the unrolled ones stacked (``tieflax.model.layer_stacking``), so every comparison
initialises the unrolled model, stacks its parameters and checks logits, loss and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scan_support import FAMILIES, TARGETS, TOKENS, V, init_params
from tieflax.config import apply_override, default_config, model_config
from tieflax.model import ConfigError, ModelConfig, TransformerLM
from tieflax.model.config import REMAT_POLICIES
from tieflax.model.layer_stacking import LAYERS_AXIS, stack_layers, to_layout, unstack_layers
from tieflax.model.params import abstract_params, count_params

# Tiny programs: XLA's backend optimisations cost more compile time than they save (both sides alike).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _value_and_grad(c: ModelConfig, with_logits: bool = False):
    """p -> (loss, grads) of the fused loss, or ((loss, logits), grads)."""
    model = TransformerLM(c)

    def f(p):
        loss = model.apply({"params": p}, TOKENS, TARGETS, method="loss")[0].mean()
        return (loss, model.apply({"params": p}, TOKENS)[..., :V]) if with_logits else loss
    return jax.value_and_grad(f, has_aux=with_logits)


def _assert_trees_close(a, b, tol=2e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scanned_matches_unrolled(family):
    """Tied and untied: the same logits, loss and gradients, scanned or unrolled."""
    pairs = []
    for tied in (True, False):
        c = FAMILIES[family].replace(tie_embeddings=tied)
        cs = c.replace(scan_layers=True)
        params = init_params(c)
        stacked = stack_layers(params, cs)
        steps = c.n_layers // cs.layers_per_scan_step  # llama: 2 steps of one layer; gemma2: one pair
        assert stacked[LAYERS_AXIS]["block_0"]["attn"]["query"]["kernel"].shape[0] == steps
        pairs.append((c, cs, params, stacked))
    everything = jax.jit(lambda trees: [(_value_and_grad(c, True)(p), _value_and_grad(cs, True)(ps))
                                        for (c, cs, _, _), (p, ps) in zip(pairs, trees)],
                         compiler_options=FAST_COMPILE)  # one compile for the four models
    results = everything([(p, ps) for _, _, p, ps in pairs])
    for (c, cs, _, _), (((loss, logits), grads), ((loss_s, logits_s), grads_s)) in zip(pairs, results):
        assert float(jnp.abs(logits).max()) > 0.1
        np.testing.assert_allclose(logits_s, logits, atol=2e-6, rtol=0, err_msg=str(c.tie_embeddings))
        np.testing.assert_allclose(loss_s, loss, rtol=1e-6)
        _assert_trees_close(unstack_layers(grads_s, cs), grads)
    assert "lm_head" in results[1][0][1] and "lm_head" not in results[0][0][1]  # untied, tied grads


def test_scanned_gemma2_layers_keep_their_attention_kind():
    """Swapping the two blocks of each scanned pair changes the logits: local and global differ."""
    cs = FAMILIES["gemma2"].replace(scan_layers=True)
    stacked = stack_layers(init_params(FAMILIES["gemma2"]), cs)
    pair = stacked[LAYERS_AXIS]
    swapped = {**stacked, LAYERS_AXIS: {"block_0": pair["block_1"], "block_1": pair["block_0"]}}
    apply = jax.jit(TransformerLM(cs).apply, compiler_options=FAST_COMPILE)
    a, b = (apply({"params": p}, TOKENS) for p in (stacked, swapped))
    assert float(jnp.abs(a - b)[..., :V].max()) > 1e-3


@pytest.mark.parametrize("scan,policies", [(True, REMAT_POLICIES[1:]), (False, ("save_qkv_proj",))])
def test_remat_policies_give_the_gradients_of_none(scan, policies):
    base = FAMILIES["llama"].replace(scan_layers=scan, n_layers=1)  # the policies act inside each block
    params = init_params(base.replace(scan_layers=False))
    params = to_layout(params, base)
    configs = [base] + [base.replace(remat=policy) for policy in policies]
    everything = jax.jit(lambda p: [_value_and_grad(c)(p) for c in configs], compiler_options=FAST_COMPILE)
    (loss, grads), *others = everything(params)  # one compile for all policies
    for policy, (loss_p, grads_p) in zip(policies, others):
        np.testing.assert_allclose(loss_p, loss, rtol=1e-6, err_msg=policy)
        _assert_trees_close(grads_p, grads)


def test_named_policies_keep_the_tagged_projections(capsys):
    """The policies find their tensors: 'save_qkv_proj' keeps q/k/v, 'full' keeps none of them."""
    c = FAMILIES["llama"].replace(n_layers=1)
    params = init_params(c)

    def residuals(policy):
        f = lambda p: TransformerLM(c.replace(remat=policy)).apply(  # noqa: E731
            {"params": p}, TOKENS, TARGETS, method="loss")[0].mean()
        jax.ad_checkpoint.print_saved_residuals(f, params)
        return capsys.readouterr().out

    saved = residuals("save_qkv_proj")
    assert all(f"named '{n}_proj'" in saved for n in ("query", "key", "value")) and "'out_proj'" not in saved
    assert "'out_proj'" in residuals("save_dot_except_mlp")
    full = residuals("full")
    assert "named" not in full and len(full.splitlines()) < len(residuals("none").splitlines())


def test_layout_round_trip_and_counts():
    # Row s of block_j is layer s * p + j: 6 Gemma 2 layers are 3 (local, global) pairs.
    c6 = FAMILIES["gemma2"].replace(n_layers=6, scan_layers=True)
    per_layer = {f"block_{i}": {"w": np.full((2,), i)} for i in range(6)}
    stacked = stack_layers(per_layer, c6)
    np.testing.assert_array_equal(stacked[LAYERS_AXIS]["block_1"]["w"][:, 0], [1, 3, 5])
    for c in FAMILIES.values():
        cs = c.replace(scan_layers=True)
        params = init_params(c)
        back = unstack_layers(stack_layers(params, cs), cs)
        _assert_trees_close(back, params, tol=0)
        assert to_layout(params, c) is params
        with pytest.raises(ValueError, match="already stacked"):
            stack_layers(stack_layers(params, cs), cs)
        # Same totals; the stacked axis is the logical 'layers' axis (replicated by the sharding rules).
        boxed = abstract_params(cs)
        assert count_params(boxed, cs) == count_params(abstract_params(c), c)
        assert boxed[LAYERS_AXIS]["block_0"]["mlp"]["up"]["kernel"].names[0] == LAYERS_AXIS


def test_config_validation_and_old_remat_switch():
    with pytest.raises(ConfigError, match=r"config.model.n_layers: 3 layers cannot be scanned in steps of 2"):
        FAMILIES["gemma2"].replace(n_layers=3, scan_layers=True)
    FAMILIES["gemma2"].replace(n_layers=3)  # unrolled, any number of layers
    with pytest.raises(ConfigError, match=r"config.model.remat = 'everything' is not one of \('none', 'full'"):
        ModelConfig(remat="everything")
    assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"
    config = default_config()
    apply_override(config, "--config.model.remat=True")       # the old switch, on the command line
    assert model_config(config).remat == "full"
    apply_override(config, "--config.model.remat=save_qkv_proj")
    assert model_config(config).remat == "save_qkv_proj"
