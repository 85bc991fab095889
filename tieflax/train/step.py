"""The step: ``build`` (model, optimizer, shardings), ``make_train_step`` and ``make_eval_step``.

Everything here is fixed for a run: the loop (``tieflax.train.loop``) calls the compiled steps. The loss is
the fused, vocabulary-parallel cross-entropy from the hidden states and the (tied or untied) head matrix,
or with ``config.train.loss_impl='dense'`` the dense baseline on full logits. Tied models are
differentiated *untied*, as ``tieflax.model.tie`` describes: the untied view of the parameters, the
gradient twin of the model, and the fold of the two gradients back into the tied matrix.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tieflax import sharding as shd
from tieflax.config import model_config
from tieflax.errors import ConfigError, UserError
from tieflax.model import ModelConfig, TransformerLM
from tieflax.model.tie import fold_tied_gradient, gradient_twin, untied_view
from tieflax.train.optim import make_optimizer
from tieflax.train_config import train_value

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions")


class TrainingError(UserError, RuntimeError):
    """Training stopped on purpose (non-finite loss, invalid labels); the message says why and what to do."""


# ================================================================================================ checks

def check_fits_mesh(config: ml_collections.ConfigDict, mc: ModelConfig, mesh_sizes: dict[str, int],
                    process_count: int) -> None:
    """Fails before anything compiles when the config cannot be laid out on the mesh, naming the field.

    The train section's ranges and choices were checked once when the command opened its config
    (``Run.open``, which a notebook's ``train_and_evaluate`` goes through too, or ``load_config`` /
    ``validate_config`` for plan and val-loss); what follows depends on the mesh and the processes only."""
    t = config.train
    data, fsdp, tensor = (mesh_sizes[a] for a in shd.MESH_AXES)

    def need(ok: bool, field: str, message: str):
        if not ok:
            raise ConfigError(f"{field}: {message}")

    need(t.global_batch_size % t.grad_accum_steps == 0, "config.train.global_batch_size",
         f"{t.global_batch_size} is not divisible by grad_accum_steps={t.grad_accum_steps}")
    micro = t.global_batch_size // t.grad_accum_steps
    need(micro % (data * fsdp) == 0, "config.train.global_batch_size",
         f"a micro-batch of {micro} sequences (global_batch_size / grad_accum_steps) cannot be split over "
         f"the data*fsdp = {data}*{fsdp} = {data * fsdp} batch shards; use a multiple of {data * fsdp}")
    need(t.global_batch_size % process_count == 0, "config.train.global_batch_size",
         f"{t.global_batch_size} is not divisible by the {process_count} processes")
    need(mc.padded_vocab % tensor == 0, "config.model.vocab_pad_multiple",
         f"the padded vocabulary {mc.padded_vocab} does not split over tensor={tensor} shards; use a "
         f"vocab_pad_multiple that is a multiple of 128 * {tensor}")
    for field, size in (("n_heads", mc.n_heads), ("n_kv_heads", mc.kv_heads), ("d_ff", mc.d_ff)):
        need(size % tensor == 0, f"config.model.{field}",
             f"{size} is not divisible by the tensor axis ({tensor}); lower config.mesh.tensor")
    need(mc.d_model % fsdp == 0, "config.mesh.fsdp",
         f"d_model={mc.d_model} is not divisible by fsdp={fsdp}")
    need(mc.position != "learned" or t.seq_len <= mc.max_seq_len, "config.train.seq_len",
         f"{t.seq_len} exceeds the learned position table (config.model.max_seq_len={mc.max_seq_len})")


# ================================================================================================ model

@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything the loop needs that does not change during training."""
    model_config: ModelConfig
    mesh: Mesh
    model: TransformerLM          # the configured model (tied or not), on the mesh
    grad_model: TransformerLM     # untied twin used for differentiation (== model when untied)
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: Any          # unboxed tree of NamedSharding, like the train state
    abstract_state: Any           # unboxed tree of ShapeDtypeStruct carrying those shardings
    init_state: Callable          # rng -> sharded train state
    init_opt_state: Callable      # params -> sharded optimizer state (fresh start from given params)


def _strip_boxes(tree: Any) -> Any:
    """Removes logical-axis boxes. Unlike ``nn.unbox`` it adds no sharding constraint (the shardings are
    set explicitly through ``out_shardings``), so it also works on abstract values."""
    from flax.core import meta  # noqa: PLC0415

    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box)


def build(config: ml_collections.ConfigDict, mesh: Mesh) -> Setup:
    mc = model_config(config)
    model = TransformerLM(mc, mesh=mesh)
    grad_model = gradient_twin(model)
    init_model = TransformerLM(mc)  # no mesh: init is a tiny forward pass, parameters are identical
    tx, schedule = make_optimizer(config.train)

    def init_boxed(rng):
        rngs = {"params": rng}
        if mc.head_rng_stream != "params":
            rngs[mc.head_rng_stream] = jax.random.fold_in(rng, 1)
        params = init_model.init(rngs, jnp.zeros((1, config.train.seq_len), jnp.int32))["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    abstract_boxed = jax.eval_shape(init_boxed, jax.random.key(0))
    shardings = shd.logical_shardings(abstract_boxed, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            _strip_boxes(abstract_boxed), shardings)
    init_state = jax.jit(lambda rng: _strip_boxes(init_boxed(rng)), out_shardings=shardings)
    init_opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])
    return Setup(mc, mesh, model, grad_model, tx, schedule, shardings, abstract, init_state, init_opt_state)


# ================================================================================================ update

def loss_options(c: ml_collections.ConfigDict, *, train: bool) -> dict:
    """The fused loss's options from ``config.train``: z-loss and label smoothing in training only (an
    evaluation is plain cross-entropy), the tile sizes (0 = the platform's default)."""
    return dict(z_loss=c.z_loss if train else 0.0, label_smoothing=c.label_smoothing if train else 0.0,
                token_block=c.loss_token_block or None, vocab_block=c.loss_vocab_block or None)


def _embedding_gradients(grads, tied: bool, input_grad_scale: float) -> tuple[Any, dict]:
    """The gradient the optimizer sees (tied: the lookup and head parts folded into one ``[V_pad, d]``
    matrix, ``tieflax.model.tie``) and the embedding gradient norms the loop logs."""
    if not tied:
        return grads, {"grad_norm/embed_in": optax.tree.norm(grads["embed"]["embedding"]),
                       "grad_norm/head_out": optax.tree.norm(grads["lm_head"]["embedding"])}
    grads, parts = fold_tied_gradient(grads, input_grad_scale=input_grad_scale)
    return grads, {"grad_norm/embed_lookup": optax.tree.norm(parts["lookup"]),  # the scaled path
                   "grad_norm/embed_head": optax.tree.norm(parts["head"]),
                   "grad_norm/embed": optax.tree.norm(grads["embed"]["embedding"])}


def attention_segments(config: ml_collections.ConfigDict, batch: dict) -> Any:
    """The segment ids the model attends within: ``batch['segment_ids']`` [B, T] for packed documents
    (``config.data.document_masking``), else None (one segment per row; the padding at the end of the
    last row is past every real token, so causality alone keeps it out). None lets cuDNN attention run
    on its causal flag with no [B, 1, T, T] mask; the einsum path gives the real tokens the same values."""
    return batch["segment_ids"] if config.data.document_masking else None


def make_train_step(config: ml_collections.ConfigDict, s: Setup) -> Callable:
    """(state, batch) -> (state, metrics); jitted with shardings, the state donated.

    batch: ``{inputs, targets, segment_ids, positions}`` [B, T] int32, B = global batch, sharded over
    (data, fsdp). The loss is the mean over targets >= 0 of the whole batch (micro-batches included),
    plus z-loss. A step whose loss or gradient is not finite, or whose labels are out of vocabulary,
    leaves the state unchanged and raises a flag the loop checks at log and checkpoint steps.
    """
    c = config.train
    tied = s.model_config.tie_embeddings
    accum = c.grad_accum_steps
    if c.loss_impl == "dense":  # the baseline: full logits (tieflax.ops.reference.dense_cross_entropy)
        method, options = TransformerLM.dense_loss, dict(z_loss=c.z_loss, label_smoothing=c.label_smoothing)
    else:
        method, options = TransformerLM.loss, loss_options(c, train=True)
    mesh = s.mesh

    def micro_loss(gparams, mb, n_tokens):
        loss, aux = s.grad_model.apply({"params": gparams}, mb["inputs"], mb["targets"], mb["positions"],
                                       attention_segments(config, mb), method=method, **options)
        valid = (mb["targets"] >= 0) & (mb["targets"] < s.model_config.vocab_size)
        stats = dict(z_loss=aux["z_loss"].sum(), correct=(aux["correct"] & valid).sum(),
                     invalid_labels=aux["invalid_label_count"])
        return loss.sum() / n_tokens, stats

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state, batch):
        params = state["params"]
        gparams = untied_view(params) if tied else params
        n_tokens = jnp.maximum((batch["targets"] >= 0).sum(), 1).astype(jnp.float32)
        if accum == 1:
            (loss, stats), grads = grad_fn(gparams, batch, n_tokens)
        else:
            # Micro-batch k takes rows k, k + accum, ...: every device holds an equal share of each one,
            # so the split needs no data movement.
            def split(x):
                x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
                return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, shd.BATCH_AXES)))

            def body(carry, mb):
                (l, st), g = grad_fn(gparams, mb, n_tokens)
                acc_l, acc_st, acc_g = carry
                return (acc_l + l, jax.tree.map(jnp.add, acc_st, st), jax.tree.map(jnp.add, acc_g, g)), None

            zeros = (jnp.zeros((), jnp.float32),
                     dict(z_loss=jnp.zeros((), jnp.float32), correct=jnp.zeros((), jnp.int32),
                          invalid_labels=jnp.zeros((), jnp.int32)),
                     jax.tree.map(jnp.zeros_like, gparams))
            (loss, stats, grads), _ = jax.lax.scan(body, zeros, jax.tree.map(split, batch))

        grads, metrics = _embedding_gradients(grads, tied, train_value(c, "tied_input_grad_scale"))
        grad_norm = optax.tree.norm(grads)
        # The norm of the parameters the step starts from, finished before they are updated: otherwise
        # XLA fuses this reduction into the update's keep-or-update select, and a fusion that reduces a
        # matrix cannot overwrite it in place, so the updated matrix went to a new buffer and was copied
        # back (on an H100, the fp32 [128256, 2048] embedding of Llama-3.2-1B: 1 GiB per step).
        param_norm = optax.tree.norm(params)
        params, param_norm = jax.lax.optimization_barrier((params, param_norm))
        updates, opt_state = s.tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)

        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (stats["invalid_labels"] == 0)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        new_state = {"step": state["step"] + 1, "params": keep(new_params, params),
                     "opt_state": keep(opt_state, state["opt_state"])}
        z = stats["z_loss"] / n_tokens
        metrics.update({
            "loss": loss, "ce_loss": loss - z, "z_loss": z, "accuracy": stats["correct"] / n_tokens,
            "grad_norm": grad_norm, "param_norm": param_norm,
            "learning_rate": s.schedule(state["step"]), "tokens": n_tokens,
            "invalid_labels": stats["invalid_labels"], "nonfinite": (~ok & (stats["invalid_labels"] == 0)),
        })
        return new_state, metrics

    batch_shardings = {k: shd.batch_sharding(mesh) for k in BATCH_KEYS}
    return jax.jit(step, in_shardings=(s.state_shardings, batch_shardings),
                   out_shardings=(s.state_shardings, shd.replicated(mesh)), donate_argnums=(0,))


def make_eval_step(config: ml_collections.ConfigDict, s: Setup) -> Callable:
    """(params, batch) -> {loss_sum, tokens, correct}: plain cross-entropy (no z-loss, no smoothing)."""
    options = loss_options(config.train, train=False)

    def step(params, batch):
        loss, aux = s.model.apply({"params": params}, batch["inputs"], batch["targets"], batch["positions"],
                                  attention_segments(config, batch), method=TransformerLM.loss, **options)
        valid = (batch["targets"] >= 0) & (batch["targets"] < s.model_config.vocab_size)
        return {"loss_sum": loss.sum(), "tokens": valid.sum(), "correct": (aux["correct"] & valid).sum(),
                "invalid_labels": aux["invalid_label_count"]}

    batch_shardings = {k: shd.batch_sharding(s.mesh) for k in BATCH_KEYS}
    return jax.jit(step, in_shardings=(s.state_shardings["params"], batch_shardings),
                   out_shardings=shd.replicated(s.mesh))


def setup_mesh(config: ml_collections.ConfigDict) -> Mesh:
    """The ``(data, fsdp, tensor)`` mesh of ``config.mesh``, checked against the config before anything
    compiles (:func:`check_fits_mesh`)."""
    mesh = shd.mesh_from_config(config.mesh)
    check_fits_mesh(config, model_config(config), dict(mesh.shape), jax.process_count())
    return mesh
