"""TransformerLM: a decoder-only LM whose head shares or splits the input embedding.

Ways to run it (``model.apply(variables, tokens, method=...)``):

* ``__call__`` -> logits [B, T, V_pad]: dense, for evaluation and generation at small vocabularies.
* ``features`` -> (hidden [B, T, d], head weight [V_pad, d], head bias [V_pad] or None): everything the
  fused loss needs, with no logits.
* ``decode`` -> (logits [B, t, V_pad], cache): t new tokens over a static key/value cache (generation;
  ``tieflax.model.kv_cache``, driven by ``tieflax.eval.decode``).
* ``loss`` -> (loss per token [B, T] fp32, aux): the fused, blockwise cross-entropy from ``features``;
  tied and untied models share this one code path.
* ``residual_stream`` -> [n_layers + 1, B, T, d]: the residual stream after the embedding and after
  every block, before the final norm (the lenses of ``tieflax.study.evidence``).

With ``scan_layers`` the blocks run under ``nn.scan``: their parameters are stacked along a leading
``layers`` axis (``params['layers']['block_j']``; see ``tieflax.model.layer_stacking``) and the compiler sees one
layer instead of ``n_layers``.

Padded vocabulary rows (>= ``vocab_size``) exist in the parameters but never receive probability mass
(dense logits mask them to -inf; the fused loss skips them).
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tieflax.model import kv_cache
from tieflax.model.config import ModelConfig
from tieflax.model.embedding import EMBED_AXES, Embed, LMHead
from tieflax.model.layer_loop import layer_loop
from tieflax.model.layer_stacking import LAYERS_AXIS
from tieflax.model.layers import BTD, Block, Norm, dtype_of
from tieflax.model.remat import remat_module
from tieflax.ops.cross_entropy import cross_entropy
from tieflax.ops.reference import dense_cross_entropy

Array = jax.Array


class ScanStep(nn.Module):
    """The body of the layer scan: ``layers_per_scan_step`` consecutive blocks (Gemma 2: local, global).

    Block ``j`` of every step is layer ``step * layers_per_scan_step + j``, so it has that layer's
    attention kind. Each block is rematerialised on its own, as when unrolled.
    (x [B, T, d], positions, segment_ids) -> (x, None), the carry and (no) per-step output of ``nn.scan``;
    ``residual_stream`` (the same blocks, the same carry) also outputs the stream after each block.
    """

    config: ModelConfig
    mesh: Optional[Mesh] = None  # passed to the attention kernel

    def setup(self):
        c = self.config
        block = remat_module(Block, c.remat, scanned=True, offload_inputs=c.offload_layer_inputs)
        self.blocks = [block(c, layer=j, mesh=self.mesh, name=f"block_{j}")
                       for j in range(c.layers_per_scan_step)]

    def __call__(self, x: Array, positions: Array, segment_ids: Optional[Array]) -> tuple[Array, None]:
        for block in self.blocks:
            x = block(x, positions, segment_ids)
        return x, None

    def residual_stream(self, x: Array, positions: Array, segment_ids: Optional[Array]) -> tuple[Array, Array]:
        """-> (x [B, T, d] after the step's last block, [layers_per_scan_step, B, T, d] after each block)."""
        xs = []
        for block in self.blocks:
            x = block(x, positions, segment_ids)
            xs.append(x)
        return x, jnp.stack(xs)


class TransformerLM(nn.Module):
    """Decoder-only transformer LM.

    Attributes:
      config: shapes and switches (``ModelConfig``).
      mesh: when given, the input lookup and the fused loss run vocab-parallel over its 'tensor' axis,
        and the attention kernel is chosen for its devices' platform and sharded over it.
    """

    config: ModelConfig
    mesh: Optional[Mesh] = None

    def setup(self):
        c = self.config
        self.embed = Embed(c, mesh=self.mesh)
        if c.position == "learned":
            self.position_embedding = self.param(
                "position_embedding",
                nn.with_logical_partitioning(nn.initializers.normal(c.embed_init_std), ("length", "embed")),
                (c.max_seq_len, c.d_model), dtype_of(c.param_dtype))
        if c.scan_layers:
            # One scanned step of `layers_per_scan_step` blocks; parameters gain a leading 'layers' axis.
            self.layers = nn.scan(ScanStep, variable_axes={"params": 0}, split_rngs={"params": True},
                                  in_axes=(nn.broadcast, nn.broadcast),
                                  length=c.n_layers // c.layers_per_scan_step,
                                  metadata_params={nn.PARTITION_NAME: LAYERS_AXIS},
                                  methods=("__call__", "residual_stream"))(c, mesh=self.mesh)
        else:
            block = remat_module(Block, c.remat, scanned=False, offload_inputs=c.offload_layer_inputs)
            self.blocks = [block(c, layer=i, mesh=self.mesh, name=f"block_{i}") for i in range(c.n_layers)]
        self.final_norm = Norm(c)
        self.lm_head = LMHead(c, embed=self.embed)
        if c.head_bias:
            self.head_bias = self.param(
                "head_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                (c.padded_vocab,), dtype_of(c.param_dtype))

    # --------------------------------------------------------------------------------------------------
    def _embed_inputs(self, tokens: Array, positions: Array) -> Array:
        """tokens, positions [B, T] -> the residual stream before the first block [B, T, d]: the input
        lookup, plus the learned position embedding if the model has one."""
        x = self.embed(tokens)
        if self.config.position == "learned":
            x = x + jnp.take(self.position_embedding, positions, axis=0).astype(x.dtype)
        return nn.with_logical_constraint(x, BTD)

    def hidden_states(self, tokens: Array, positions: Optional[Array] = None,
                      segment_ids: Optional[Array] = None) -> Array:
        """tokens: [B, T] int32 -> final-normed hidden states [B, T, d] in the compute dtype.

        positions [B, T] (default 0..T-1) feed RoPE / learned positions; segment_ids [B, T] keep attention
        inside one packed document (default None: one document per row, plain causal attention, which
        cuDNN runs with no mask operand).
        """
        positions, segment_ids = _default_ids(tokens, positions, segment_ids)
        x = self._embed_inputs(tokens, positions)
        if self.config.scan_layers and self._in_place_loop():
            x = self._scanned_in_place(x, positions, segment_ids)
        elif self.config.scan_layers:
            x, _ = self.layers(x, positions, segment_ids)
        else:
            for block in self.blocks:
                x = block(x, positions, segment_ids)
        return self.final_norm(x)

    def _in_place_loop(self) -> bool:
        """Whether the scanned layers run in ``layer_loop`` (remat 'none', parameters given, one device)
        instead of ``nn.scan``: the same layers and VJP, without the scan's zero-filled stacks and their
        copies. On a mesh of several devices ``nn.scan`` stays: the loop's buffers carry no sharding, and
        XLA placed them whole on every device (Llama-3.2-1B, h100:8, 8 x 2048: 1.82 -> 9.02 GB)."""
        return (self.config.remat == "none" and not self.is_initializing()
                and (self.mesh is None or self.mesh.size == 1))

    def _scanned_in_place(self, x: Array, positions: Array, segment_ids: Optional[Array]) -> Array:
        """The scan of ``hidden_states`` as ``tieflax.model.layer_loop.layer_loop``: ``ScanStep`` applied
        to each row of the stacked parameters (``params['layers']``, as ``nn.scan`` made them)."""
        step = ScanStep(self.config, mesh=self.mesh, parent=None)

        def body(p, x, consts):
            return step.apply({"params": p}, x, *consts)[0]

        stacked = nn.unbox(self.variables["params"]["layers"])
        return layer_loop(body, stacked, x, (positions, segment_ids))

    def residual_stream(self, tokens: Array, positions: Optional[Array] = None,
                        segment_ids: Optional[Array] = None) -> Array:
        """tokens [B, T] -> the residual stream at every depth, [n_layers + 1, B, T, d] in the compute dtype.

        Entry 0 is the embedding output (before any block: the lookup plus learned positions), entry l the
        output of block l - 1; no final norm, so ``hidden_states`` is ``final_norm`` of entry ``n_layers``.
        positions and segment_ids as in ``hidden_states``. Scanned layers: the scan outputs each block's
        stream (layer ``step * layers_per_scan_step + j``), returned in layer order. For reading the layers
        (lenses); training and evaluation use ``hidden_states``, which keeps no layer's output.
        """
        c = self.config
        positions, segment_ids = _default_ids(tokens, positions, segment_ids)
        x = self._embed_inputs(tokens, positions)
        if c.scan_layers:
            _, xs = self.layers.residual_stream(x, positions, segment_ids)  # [steps, per step, B, T, d]
            return jnp.concatenate([x[None], xs.reshape(c.n_layers, *x.shape)])
        xs = [x]
        for block in self.blocks:
            x = block(x, positions, segment_ids)
            xs.append(x)
        return jnp.stack(xs)

    def head_bias_or_none(self) -> Optional[Array]:
        return self.head_bias if self.config.head_bias else None

    def features(self, tokens: Array, positions: Optional[Array] = None,
                 segment_ids: Optional[Array] = None) -> tuple[Array, Array, Optional[Array]]:
        """-> (hidden [B, T, d], head weight [V_pad, d] param dtype, head bias [V_pad] or None)."""
        hidden = self.hidden_states(tokens, positions, segment_ids)
        return hidden, self.lm_head.weight(), self.head_bias_or_none()

    def __call__(self, tokens: Array, positions: Optional[Array] = None,
                 segment_ids: Optional[Array] = None) -> Array:
        """tokens [B, T] -> logits [B, T, V_pad]; padded rows are -inf."""
        c = self.config
        logits = self.lm_head(self.hidden_states(tokens, positions, segment_ids), self.head_bias_or_none())
        valid = jnp.arange(c.padded_vocab) < c.vocab_size
        return jnp.where(valid, logits, -jnp.inf)

    def decode(self, tokens: Array, positions: Array, valid: Array, cache: dict) -> tuple[Array, dict]:
        """Generation with a static key/value cache (``tieflax.model.kv_cache``), per-layer params only.

        tokens, positions [B, t] int32, valid [B, t] bool (False for left padding): t new tokens, written
        at the cache's ``index`` (t = prompt length for the prefill, then 1 per step).
        Returns (logits [B, t, V_pad] as ``__call__``, padded rows -inf; the updated cache).
        """
        c = self.config
        if c.scan_layers:
            raise ValueError("decode runs per-layer parameters: unstack scanned ones first "
                             "(tieflax.model.layer_stacking.unstack_layers, config.replace(scan_layers=False))")
        cache = kv_cache.write_slots(cache, positions, valid)
        x = self._embed_inputs(tokens, positions)
        layers = []
        for block, layer in zip(self.blocks, cache["layers"]):
            x, layer = block(x, positions, None, (layer, cache))
            layers.append(layer)
        logits = self.lm_head(self.final_norm(x), self.head_bias_or_none())
        logits = jnp.where(jnp.arange(c.padded_vocab) < c.vocab_size, logits, -jnp.inf)
        return logits, kv_cache.advance({**cache, "layers": layers}, tokens.shape[1])

    def loss(self, tokens: Array, targets: Array, positions: Optional[Array] = None,
             segment_ids: Optional[Array] = None, **loss_options: Any) -> tuple[Array, dict]:
        """Fused cross-entropy without logits. targets [B, T] int (negative = ignored).

        ``loss_options`` pass through to ``tieflax.ops.cross_entropy`` (z_loss, label_smoothing, weights,
        block sizes...). Returns (loss per token [B, T] fp32, aux dict).
        """
        hidden, weight, bias = self.features(tokens, positions, segment_ids)
        return cross_entropy(hidden, weight, targets, bias=bias, mesh=self.mesh,
                             **head_loss_kwargs(self.config), **loss_options)

    def dense_loss(self, tokens: Array, targets: Array, positions: Optional[Array] = None,
                   segment_ids: Optional[Array] = None, *, z_loss: float = 0.0,
                   label_smoothing: float = 0.0) -> tuple[Array, dict]:
        """:meth:`loss` from full fp32 logits [B, T, V_pad] (``tieflax.ops.reference.dense_cross_entropy``):
        the baseline the fused loss replaces (``config.train.loss_impl='dense'``) and the tests' dense loss.
        Returns (loss per token [B, T] fp32, aux with ``z_loss``, ``correct``, ``invalid_label_count``)."""
        hidden, weight, bias = self.features(tokens, positions, segment_ids)
        return dense_cross_entropy(hidden, weight, targets, bias=bias, z_loss=z_loss,
                                   label_smoothing=label_smoothing, with_aux=True, **head_loss_kwargs(self.config))


def _default_ids(tokens: Array, positions: Optional[Array],
                 segment_ids: Optional[Array]) -> tuple[Array, Optional[Array]]:
    """(positions [B, T] int32, defaulting to 0..T-1; segment_ids as given: None is one segment per row,
    which ``tieflax.ops.attention`` knows without an array)."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return positions, segment_ids


def head_loss_kwargs(c: ModelConfig) -> dict:
    """The model's head switches, as the fused loss's keyword arguments."""
    return dict(valid_vocab=c.vocab_size, logit_scale=c.effective_logit_scale,
                softcap=c.final_logit_softcap or None)


def embedding_matrices(params: dict) -> dict[str, Array]:
    """{'input': W_in, 'output': W_out}; for a tied model both are the same array."""
    w_in = params["embed"]["embedding"]
    w_out = params["lm_head"]["embedding"] if "lm_head" in params else w_in
    return {"input": w_in, "output": w_out}


__all__ = ["TransformerLM", "head_loss_kwargs", "embedding_matrices", "EMBED_AXES"]
