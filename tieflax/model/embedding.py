"""The input embedding and the LM head: where tying happens, and only here.

``Embed`` owns ``embedding`` [V_pad, d]. ``LMHead`` either shares ``Embed``'s scope (``nn.share_scope``),
so its ``embedding`` *is* the input matrix, or owns an ``embedding`` of the same name, shape, orientation
and logical axes. Untying is therefore a copy, and the parameter counts differ by exactly V x d.

Both sides read the matrix in one layout, vocab-sharded (logical axes ``('vocab', 'embed')``), so tying
never forces a re-layout or an all-gather over the vocabulary.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tieflax.model.config import ModelConfig
from tieflax.model.layers import dtype_of
from tieflax.ops.embedding_lookup import vocab_parallel_embed

Array = jax.Array
EMBED_AXES = ("vocab", "embed")


def _normal(std: float):
    return nn.with_logical_partitioning(nn.initializers.normal(std), EMBED_AXES)


class Embed(nn.Module):
    """Token lookup. ids: [B, T] int -> [B, T, d] in the compute dtype, x sqrt(d) if configured.

    With a mesh, the lookup is vocab-parallel (each device reads its own vocab rows; one psum), so the
    matrix is never gathered over the vocabulary.
    """

    config: ModelConfig
    mesh: Optional[Mesh] = None

    @nn.compact
    def __call__(self, ids: Array) -> Array:
        c = self.config
        embedding = self.param("embedding", _normal(c.embed_init_std), (c.padded_vocab, c.d_model),
                               dtype_of(c.param_dtype))
        table = embedding.astype(dtype_of(c.dtype))
        if self.mesh is None:
            x = jnp.take(table, ids, axis=0)
        else:
            x = vocab_parallel_embed(table, ids, mesh=self.mesh)
        if c.scale_input_embedding:
            # Gemma rounds the normaliser to the compute dtype; doing the same keeps checkpoints faithful.
            x = x * jnp.asarray(c.d_model ** 0.5, x.dtype)
        return x


class LMHead(nn.Module):
    """The output matrix [V_pad, d]: the input embedding itself when ``config.tie_embeddings``.

    ``embed`` is the model's ``Embed``: shared when tied; when untied it is only read once, at init, if
    ``head_init='copy_embed'``. ``weight()`` returns the raw parameter (for the fused loss, which never
    builds logits); ``__call__(hidden)`` returns dense logits [B, T, V_pad] for evaluation and generation.
    """

    config: ModelConfig
    embed: Embed

    def setup(self):
        if self.config.tie_embeddings:
            # From here on the head's scope *is* Embed's: `weight()` resolves Embed's parameter.
            nn.share_scope(self, self.embed)

    @nn.compact
    def weight(self) -> Array:
        """The head matrix [V_pad, d] in the parameter dtype (the input embedding when tied)."""
        c = self.config
        shape, pdt = (c.padded_vocab, c.d_model), dtype_of(c.param_dtype)
        if c.tie_embeddings:
            # Embed has run (the lookup precedes the head), so this returns its existing parameter;
            # the initializer is Embed's own and only matters if the head were called first.
            return self.param("embedding", _normal(c.embed_init_std), shape, pdt)
        return self.param("embedding", nn.with_logical_partitioning(self._init, EMBED_AXES), shape, pdt)

    def _init(self, key, shape, dtype):
        c = self.config
        if c.head_init == "copy_embed":
            return jnp.asarray(nn.unbox(self.embed.get_variable("params", "embedding")), dtype)
        if c.head_rng_stream != "params":
            # A named stream lets a user reseed the head alone: rngs={'params': k, 'head': k2}.
            key = self.make_rng(c.head_rng_stream)
        return nn.initializers.normal(c.effective_head_init_std)(key, shape, dtype)

    def __call__(self, hidden: Array, bias: Optional[Array] = None) -> Array:
        """hidden: [B, T, d] -> logits [B, T, V_pad] (fp32 if ``logits_fp32``), scaled and capped."""
        c = self.config
        dt = jnp.float32 if c.logits_fp32 else dtype_of(c.dtype)
        logits = jnp.einsum("btd,vd->btv", hidden.astype(dt), self.weight().astype(dt))
        return finish_logits(logits, c, bias)


def finish_logits(logits: Array, c: ModelConfig, bias: Optional[Array]) -> Array:
    """Applies the study switches in the order the fused loss uses: scale, bias, soft-cap."""
    logits = logits * jnp.asarray(c.effective_logit_scale, logits.dtype)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    if c.final_logit_softcap:
        cap = jnp.asarray(c.final_logit_softcap, logits.dtype)
        logits = cap * jnp.tanh(logits / cap)
    return logits
