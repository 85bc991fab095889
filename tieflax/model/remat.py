"""Rematerialisation policies: what the backward pass keeps from the forward pass, and what it recomputes.

``config.model.remat`` names one (the names pod training code commonly uses):

* ``none``: no rematerialisation; every intermediate is kept (fastest, most memory).
* ``full``: each block keeps only its input and recomputes the rest (least memory, about one extra forward).
* ``minimal``: keeps every matmul output without batch dimensions (the q/k/v/out projections and the MLP
  matmuls), recomputes the rest: the attention scores and probabilities, norms and activations.
* ``save_dot_except_mlpwi``: keeps the attention projections (q, k, v, out) and the MLP's output
  projection; recomputes the MLP's input projections (gate/up, the widest activations).
* ``save_dot_except_mlp``: keeps the attention projections q, k, v and out.
* ``save_qkv_proj``: keeps the q, k and v projections only.

The named policies find their tensors through ``checkpoint_name`` tags in ``tieflax.model.layers``.
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax

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


def remat_module(module_cls: type[nn.Module], policy: str, *, scanned: bool) -> type[nn.Module]:
    """``module_cls`` rematerialised with the named policy (``'none'``: unchanged).

    Inside ``nn.scan`` common-subexpression elimination cannot merge the recomputation into the forward
    pass, so ``prevent_cse`` (which costs some optimisations) is only needed when unrolled.
    """
    if policy == "none":
        return module_cls
    return nn.remat(module_cls, policy=POLICIES[policy], prevent_cse=not scanned)
