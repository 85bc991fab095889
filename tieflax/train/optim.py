"""The optimiser: AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask.

Everything is built from ``config.train`` (defaults in ``tieflax/train_config.py``) with optax. Gradient
accumulation is not an optax wrapper here: the train step scans over micro-batches and hands one summed
gradient to this optimiser, so one optimiser update is one train step and the logged gradient norms are
those of the full batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import ml_collections
import optax

# Parameter names (last path component, or a module on the path) that are embedding matrices: the input
# embedding, the untied head and learned positions. Their decay is its own switch because the tied-vs-
# untied study must be able to treat the two sides identically (or not) on purpose.
EMBEDDING_NAMES = ("embedding", "position_embedding")


def learning_rate_schedule(c: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup 0 -> ``learning_rate`` over ``warmup_steps``, cosine to ``learning_rate * min_lr_ratio``
    at ``num_steps``."""
    warmup = min(int(c.warmup_steps), int(c.num_steps))
    if warmup == 0 and c.min_lr_ratio == 1.0:
        # Constant: independent of num_steps, so a run extended by raising num_steps keeps its schedule.
        return optax.constant_schedule(c.learning_rate)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=c.learning_rate, warmup_steps=warmup,
        decay_steps=max(int(c.num_steps), warmup + 1), end_value=c.learning_rate * c.min_lr_ratio)


def _path_names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def decay_mask(params: Any, *, decay_embeddings: bool, decay_norms_and_biases: bool) -> Any:
    """A tree of bools like ``params`` (boxed or not): True where weight decay applies.

    Matrices (ndim >= 2) decay, except embedding matrices unless ``decay_embeddings``; vectors (norm
    scales, biases, the head bias) decay only if ``decay_norms_and_biases``.
    """
    def leaf(path, x):
        names = _path_names(path)
        if any(n in EMBEDDING_NAMES for n in names):
            return bool(decay_embeddings)
        if getattr(x, "ndim", 0) < 2:
            return bool(decay_norms_and_biases)
        return True

    return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(c: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(``tx``, ``schedule``) from ``config.train``. ``tx.init`` accepts boxed or unboxed params."""
    schedule = learning_rate_schedule(c)
    mask: Callable[[Any], Any] = lambda p: decay_mask(  # noqa: E731
        p, decay_embeddings=c.decay_embeddings, decay_norms_and_biases=c.decay_norms_and_biases)
    parts = []
    if c.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(c.grad_clip_norm))
    adam = optax.adamw(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                       weight_decay=c.weight_decay, mask=mask)
    choice = c.get("embedding_optimizer", "adam")
    if choice == "adam":
        parts.append(adam)
    elif choice == "sgd":
        # The mechanism ablation: embedding matrices take plain SGD with momentum (a row's step is
        # proportional to its gradient, so a tiny softmax gradient makes a tiny step), the rest AdamW.
        ratio = c.embedding_sgd_lr / c.learning_rate
        sgd = optax.chain(optax.add_decayed_weights(c.weight_decay if c.decay_embeddings else 0.0),
                          optax.sgd(lambda step: schedule(step) * ratio, momentum=0.9))
        parts.append(optax.multi_transform({"adam": adam, "sgd": sgd}, _embedding_labels))
    else:
        raise ValueError(f"config.train.embedding_optimizer = {choice!r}: choose 'adam' or 'sgd'")
    return optax.chain(*parts), schedule


def _embedding_labels(params: Any) -> Any:
    """'sgd' on embedding matrices, 'adam' elsewhere (boxed or unboxed trees)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "sgd" if any(n in EMBEDDING_NAMES for n in _path_names(path)) else "adam", params)
