"""The tuned lens as Belrose et al. train it (arXiv 2303.08112; the ``tuned-lens`` package, 0.2.0).

One translator per layer ``l < L`` maps that layer's residual stream ``h`` [n, d] to
``h + h @ A_l + b_l`` (``A_l`` [d, d], ``b_l`` [d], both initialised at zero, so the lens starts as the
logit lens and weight decay pulls it back towards the identity, not towards zero). The translated stream
is read out through the model's own final norm and head, frozen (``logits_fn``). The translators are
trained to minimise ``KL(p_final || p_lens)`` per position (the model's own final-layer distribution at
the same position, not the next token), summed over layers, mean over positions, by the package's
recipe (``tuned_lens/scripts/ingredients.py``, ``train_loop.py``): SGD with Nesterov momentum 0.9 and
learning rate ``lr_scale * (1 - 0.9)`` (the package undoes PyTorch's ``1 / (1 - beta)`` step scaling, so
its ``lr_scale`` 1.0 is 0.1 here), decayed linearly to 0 over the steps, coupled weight decay 1e-3, the
joint gradient clipped to norm 1.0 before the decay is added, 250 steps. What differs from the package is
only the data: the package draws 2^18 tokens a step from a corpus; here each step draws ``batch_tokens``
positions from the fitting half of the held-out documents (``RECIPE``; the study states both).

:func:`train_translators` is written in JAX/optax and checked against the package's ``TunedLens`` and a
PyTorch run of its recipe on a tiny Hugging Face model (``tests/test_literature.py``).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The package's defaults (tuned_lens 0.2.0): optimizer, schedule and step count; ``batch_tokens`` is ours.
RECIPE = dict(steps=250, lr_scale=1.0, momentum=0.9, weight_decay=1e-3, clip=1.0, batch_tokens=128)


def describe(recipe: dict) -> str:
    """One line a report can print: the optimizer, its settings and the steps."""
    r = {**RECIPE, **recipe}
    return (f"SGD with Nesterov momentum {r['momentum']:g}, learning rate {r['lr_scale'] * (1 - r['momentum']):g} "
            f"decayed linearly to 0, weight decay {r['weight_decay']:g}, gradient norm clipped to {r['clip']:g}; "
            f"{r['steps']} steps of {r['batch_tokens']} positions (the tuned-lens package's recipe, "
            "its 2^18 tokens a step aside)")


def optimizer(steps: int, lr_scale: float = 1.0, momentum: float = 0.9, weight_decay: float = 1e-3,
              clip: float = 1.0) -> optax.GradientTransformation:
    """The package's ``torch.optim.SGD(lr=lr_scale * (1 - momentum), momentum, nesterov=True,
    weight_decay)`` after ``clip_grad_norm_(clip)``, with ``get_linear_schedule_with_warmup(0, steps)``.
    PyTorch adds the decay to the clipped gradient before the momentum, as ``add_decayed_weights`` here."""
    schedule = optax.linear_schedule(lr_scale * (1 - momentum), 0.0, steps)
    return optax.chain(optax.clip_by_global_norm(clip), optax.add_decayed_weights(weight_decay),
                       optax.sgd(schedule, momentum=momentum, nesterov=True))


def init_translators(n_layers: int, d: int) -> dict:
    """``{'a': [L, d, d], 'b': [L, d]}`` float32 zeros: every translator starts as the identity."""
    return dict(a=jnp.zeros((n_layers, d, d), jnp.float32), b=jnp.zeros((n_layers, d), jnp.float32))


def translate(translators: dict, layer: int, h: jax.Array) -> jax.Array:
    """``h + h @ A + b`` of one layer: h [..., d] -> [..., d] (the package's ``h + Linear(h)``, with
    ``A`` the transpose of its ``weight``)."""
    return h + h @ translators["a"][layer] + translators["b"][layer]


def kl_from_final(target_logp: jax.Array, logits: jax.Array) -> jax.Array:
    """Mean over positions of ``KL(p || q)``: ``target_logp`` [n, V] the model's final log-probabilities,
    ``logits`` [n, V] the lens's. Columns outside the vocabulary must be cut off, not set to -inf."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(target_logp) * (target_logp - logq), axis=-1))


def lens_loss(translators: dict, xs: jax.Array, target_logp: jax.Array, logits_fn: Callable) -> jax.Array:
    """The training objective: the per-layer KL summed over layers. xs [L, n, d] the residual streams of
    layers 0..L-1 at the same n positions."""
    return sum(kl_from_final(target_logp, logits_fn(translate(translators, i, xs[i]))) for i in range(xs.shape[0]))


def _batches(n: int, batch_tokens: int, steps: int, seed: int):
    """Position indices per step: every position when they fit in one batch (full-batch, deterministic),
    else a fresh random draw without replacement each step (the package shuffles its corpus)."""
    if batch_tokens >= n:
        return None
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n, batch_tokens, replace=False) for _ in range(steps)])


def train_translators(xs, targets, logits_fn: Callable, *, target_fn: Callable | None = None,
                      steps: int = RECIPE["steps"], batch_tokens: int = RECIPE["batch_tokens"],
                      lr_scale: float = RECIPE["lr_scale"], momentum: float = RECIPE["momentum"],
                      weight_decay: float = RECIPE["weight_decay"], clip: float = RECIPE["clip"],
                      seed: int = 0) -> tuple[dict, list[float]]:
    """Trains one translator per layer by the package's recipe.

    ``xs`` [L, N, d] float32: the residual stream after 0..L-1 blocks at N positions; ``targets`` [N, ...]:
    what the final distribution is computed from at the same positions, ``target_fn(targets[idx])`` ->
    [n, V] log-probabilities (default: ``log_softmax(logits_fn(targets))``, i.e. ``targets`` is the final
    residual stream [N, d]); ``logits_fn``: [n, d] -> [n, V] the frozen readout (final norm and head, the
    vocabulary only). Returns the translators (``{'a': [L, d, d], 'b': [L, d]}``) and the objective
    before each step (summed over layers, on that step's batch).
    """
    xs = jnp.asarray(xs, jnp.float32)
    targets = jnp.asarray(targets)
    if target_fn is None:
        target_fn = lambda y: jax.nn.log_softmax(logits_fn(y).astype(jnp.float32), axis=-1)  # noqa: E731
    opt = optimizer(steps, lr_scale, momentum, weight_decay, clip)
    params = init_translators(xs.shape[0], xs.shape[2])
    state = opt.init(params)

    @jax.jit
    def step(params, state, idx):
        x, t = (xs, targets) if idx is None else (xs[:, idx], targets[idx])
        loss, grads = jax.value_and_grad(lens_loss)(params, x, jax.lax.stop_gradient(target_fn(t)), logits_fn)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    order = _batches(xs.shape[1], batch_tokens, steps, seed)
    history = []
    for s in range(steps):
        params, state, loss = step(params, state, None if order is None else jnp.asarray(order[s]))
        history.append(float(loss))
    if not all(math.isfinite(x) for x in history):
        raise FloatingPointError("the tuned lens's objective is not finite: the readout produced inf/nan")
    return params, history
