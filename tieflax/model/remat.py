"""Rematerialisation policies: what the backward pass keeps from the forward pass, and what it recomputes.

``config.model.remat`` names one (the names pod training code commonly uses):

* ``none``: no rematerialisation of matmuls or attention; their outputs are kept (fastest, most memory).
  The norms and the MLP activation are still recomputed from their inputs, elementwise (``Norm``, ``Mlp``
  in ``tieflax.model.layers``): autodiff would keep fp32 copies of a norm's input and the activation's
  inner values, more bytes than the recompute saves time; a pre-norm runs inside the checkpoint of the
  matmuls it feeds, so its output is not kept either (the block input and the attention's residual sum
  are); likewise each matmul's kernel is cast to the compute dtype again in the backward rather than
  kept (``recast_in_backward``). ``mlp_chunk`` > 0
  rematerialises each chunk of the MLP whole (its up and gate matmuls run again in the backward),
  whatever the policy. Scanned layers on one device run in ``tieflax.model.layer_loop`` (the same VJP,
  in buffers written in place: no zero-filled stacks, no copies of them).
* ``full``: each block keeps only its input and recomputes the rest (least memory, about one extra forward).
* ``minimal``: keeps every matmul output without batch dimensions (the q/k/v/out projections and the MLP
  matmuls), recomputes the rest: the attention scores and probabilities, norms and activations.
* ``save_dot_except_mlpwi``: keeps the attention projections (q, k, v, out) and the MLP's output
  projection; recomputes the MLP's input projections (gate/up, the widest activations).
* ``save_dot_except_mlp``: keeps the attention projections q, k, v and out.
* ``save_qkv_proj``: keeps the q, k and v projections only.

The named policies find their tensors through ``checkpoint_name`` tags in ``tieflax.model.layers``.

``config.model.offload_layer_inputs`` adds to any policy but ``none``: each block's input (``layer_input``,
what every policy keeps, and with scanned layers the [layers, B, T, d] stack that dominates a long-sequence
step) is copied to host memory (``pinned_host``) in the forward pass and back in the backward pass, so it
occupies no accelerator memory in between. It costs host-device transfers, one [B, T, d] each way per layer.
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax
from jax.ad_checkpoint import Offloadable

from tieflax.model.config import REMAT_POLICIES

_cp = jax.checkpoint_policies
_QKV = ("query_proj", "key_proj", "value_proj")
POLICIES: dict[str, Optional[Callable]] = {
    "full": None,  # jax.checkpoint's default: save nothing but the inputs
    "minimal": _cp.dots_with_no_batch_dims_saveable,
    "save_dot_except_mlpwi": _cp.save_only_these_names(*_QKV, "out_proj", "mlpwo"),
    "save_dot_except_mlp": _cp.save_only_these_names(*_QKV, "out_proj"),
    "save_qkv_proj": _cp.save_only_these_names(*_QKV),
}
assert set(POLICIES) | {"none"} == set(REMAT_POLICIES)

LAYER_INPUT = "layer_input"  # the checkpoint_name of a block's input (tieflax.model.layers.Block)


def offloading_layer_input(policy: Optional[Callable]) -> Callable:
    """``policy`` (None: save nothing), except that the block input is kept in host memory."""
    offload = _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
        offload_src="device", offload_dst="pinned_host")

    def decide(prim, *args, **params):
        choice = offload(prim, *args, **params)
        if isinstance(choice, Offloadable):
            return choice
        return bool(policy(prim, *args, **params)) if policy is not None else False

    return decide


def remat_module(module_cls: type[nn.Module], policy: str, *, scanned: bool,
                 offload_inputs: bool = False) -> type[nn.Module]:
    """``module_cls`` rematerialised with the named policy (``'none'``: unchanged).

    ``offload_inputs`` keeps the block's input in host memory (see the module docstring).
    Inside ``nn.scan`` common-subexpression elimination cannot merge the recomputation into the forward
    pass, so ``prevent_cse`` (which costs some optimisations) is only needed when unrolled.
    """
    if policy == "none":
        return module_cls
    chosen = POLICIES[policy]
    if offload_inputs:
        chosen = offloading_layer_input(chosen)
    return nn.remat(module_cls, policy=chosen, prevent_cse=not scanned)
