"""The tie as training differentiates it; ``model/embedding.py``'s ``nn.share_scope`` is the tie itself.

A tied model is differentiated *untied*: the step applies the untied twin of the model
(:func:`gradient_twin`) to :func:`untied_view` of the parameters, ``{..., embed: W, lm_head: W}`` (the
same values twice), and :func:`fold_tied_gradient` sums the two gradients back into ``W``. That is exactly
the tied gradient (autodiff would add the same two terms) and costs no extra matmul, and it yields the
lookup (input) and head (output) contributions separately, for the ``grad_norm/embed_lookup`` and
``grad_norm/embed_head`` metrics and for :func:`scale_input_gradient`, the intervention of Lopardo et
al. (arXiv 2603.26663) that multiplies the lookup path before the sum (``train.tied_input_grad_scale``).
"""

from __future__ import annotations

import jax

from tieflax.model.transformer import TransformerLM


@jax.named_scope("untied_view")  # a profile's ops say which are the tie's (tools/profile_table.py)
def untied_view(params: dict) -> dict:
    """Tied params -> the untied tree with the same matrix twice (no copy: both leaves are one array).

    ``embed/embedding`` [V_pad, E] is also ``lm_head/embedding``; with a decoupled width
    (``model.embed_dim``) the head's ``out_proj`` [E, d] moves from ``embed`` to ``lm_head``, where the
    untied model reads it. Every other leaf is passed through as it is.
    """
    embed = dict(params["embed"])
    head = {"embedding": embed["embedding"]}
    if "out_proj" in embed:  # decoupled width (model.embed_dim): the head's projection goes with the head
        head["out_proj"] = embed.pop("out_proj")
    return {**params, "embed": embed, "lm_head": head}


def gradient_twin(model: TransformerLM) -> TransformerLM:
    """The model the step differentiates: ``model``'s untied twin (same config and mesh, untied) when
    ``model`` is tied, else ``model`` itself. Applied to :func:`untied_view` it computes what ``model``
    computes on the tied parameters."""
    if not model.config.tie_embeddings:
        return model
    return TransformerLM(model.config.replace(tie_embeddings=False), mesh=model.mesh)


def scale_input_gradient(g_lookup: jax.Array, scale: float) -> jax.Array:
    """The lookup path's gradient [V_pad, E] times ``scale`` (``train.tied_input_grad_scale``).

    At 1.0 nothing is multiplied, so the compiled step is the one of a config without the field, bit for
    bit (tests/test_literature.py)."""
    return g_lookup if scale == 1.0 else g_lookup * scale


@jax.named_scope("tie_fold")
def fold_tied_gradient(grads: dict, *, input_grad_scale: float = 1.0) -> tuple[dict, dict[str, jax.Array]]:
    """The gradient of :func:`untied_view`'s tree -> the gradient of the tied parameters.

    ``grads``: the untied view's gradient (``embed/embedding`` the lookup path's, ``lm_head/embedding``
    the head path's, both [V_pad, E]). Returns ``(tied grads, parts)``: the tied tree's gradient, whose
    ``embed/embedding`` is ``scale * g_lookup + g_head`` (``lm_head``'s other leaves, e.g. ``out_proj``,
    move back into ``embed``), and ``parts = {'lookup': scale * g_lookup, 'head': g_head}``.
    """
    g_lookup = scale_input_gradient(grads["embed"]["embedding"], input_grad_scale)
    g_head_tree = grads["lm_head"]
    g_head = g_head_tree["embedding"]
    folded = {k: v for k, v in grads.items() if k != "lm_head"}
    folded["embed"] = {**grads["embed"], "embedding": g_lookup + g_head,
                       **{k: v for k, v in g_head_tree.items() if k != "embedding"}}
    return folded, {"lookup": g_lookup, "head": g_head}
