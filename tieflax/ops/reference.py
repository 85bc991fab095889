"""Dense cross-entropy references (full [N, V] logits): tests, benchmarks and the dense baseline.

- ``numpy_cross_entropy``: float64 NumPy oracle of the loss, aux and analytic gradients, with exactly the
  semantics of :func:`tieflax.ops.cross_entropy.cross_entropy`.
- ``dense_cross_entropy``: the same loss in JAX on full logits, differentiated by autodiff (an independent
  check of the oracle's gradient formula); also the trainer's ``loss_impl='dense'`` baseline.
- ``naive_cross_entropy``: the usual optax loss on full logits; the baseline in benchmarks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def numpy_cross_entropy(hidden, weight, labels, *, valid_vocab, weights=None, z_loss=0.0,
                        label_smoothing=0.0, logit_scale=1.0, softcap=None, bias=None, cotangent=None):
    """float64 oracle. hidden [N, d], weight [V_pad, d], labels [N] -> dict of float64 NumPy arrays.

    Keys: loss [N], lse [N], z_loss [N], correct [N] bool, invalid_label_count, and the gradients of
    ``sum(cotangent * loss)``: d_hidden [N, d], d_weight [V_pad, d], d_bias [V_pad], d_weights [N].
    """
    h = np.asarray(hidden, np.float64)
    w = np.asarray(weight, np.float64)
    y = np.asarray(labels).astype(np.int64)
    n, vp, vv, eps = h.shape[0], w.shape[0], valid_vocab, label_smoothing
    wts = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    g = np.ones(n) if cotangent is None else np.asarray(cotangent, np.float64)
    b = np.zeros(vp) if bias is None else np.asarray(bias, np.float64)

    raw = logit_scale * (h @ w.T) + b
    z = softcap * np.tanh(raw / softcap) if softcap is not None else raw
    z = z[:, :vv]
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    valid = (y >= 0) & (y < vv)
    yc = np.where(valid, y, 0)
    zy = z[np.arange(n), yc]
    ce = lse - (1 - eps) * zy - eps / vv * z.sum(axis=1)
    lu = np.where(valid, ce + z_loss * lse**2, 0.0)
    aw = np.where(valid, wts, 0.0)

    p = np.exp(z - lse[:, None])
    onehot = np.zeros_like(z)
    onehot[np.arange(n), yc] = 1.0
    dz = (1 + 2 * z_loss * lse)[:, None] * p - (1 - eps) * onehot - eps / vv
    dz *= (g * aw)[:, None]
    if softcap is not None:
        dz *= 1 - (z / softcap) ** 2
    draw = np.zeros((n, vp))
    draw[:, :vv] = dz
    return dict(
        loss=aw * lu, lse=lse, z_loss=aw * z_loss * lse**2, correct=valid & (z.argmax(axis=1) == y),
        invalid_label_count=int((y >= vv).sum()),
        d_hidden=logit_scale * draw @ w, d_weight=logit_scale * draw.T @ h, d_bias=draw.sum(axis=0),
        d_weights=g * lu)


def dense_cross_entropy(hidden, weight, labels, *, valid_vocab, weights=None, z_loss=0.0,
                        label_smoothing=0.0, logit_scale=1.0, softcap=None, bias=None, with_aux=False):
    """The dense loss, the one the fused loss replaces: full logits [..., V_pad], then log-softmax in JAX.

    hidden [..., d] (e.g. [N, d] or [B, T, d]), weight [V_pad, d], labels [...] int, bias [V_pad] or None,
    weights [...] or None. The logits are fp32 (fp64 for fp64 inputs): ``logit_scale * hidden @ weight^T``,
    plus ``bias``, soft-capped, padded rows (>= ``valid_vocab``) masked. Labels < 0 are ignored and labels
    >= ``valid_vocab`` counted as invalid (both give 0), as in the fused loss. Autodiff gives the gradients
    (an independent check of the oracle's formula). It is ``config.train.loss_impl='dense'`` of the trainer
    (through ``TransformerLM.dense_loss``) and the tests' dense loss.

    Returns loss per token [...]; with ``with_aux`` ``(loss, aux)``, aux as the fused loss's:
    ``z_loss`` [...], ``correct`` [...] bool (the label is the arg-max), ``invalid_label_count`` int32.
    """
    acc = jnp.promote_types(jnp.float32, hidden.dtype)  # fp32, or fp64 for fp64 inputs
    logits = jnp.einsum("...d,vd->...v", hidden.astype(acc), weight.astype(acc))
    logits = logits * jnp.asarray(logit_scale, logits.dtype)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    if softcap:
        cap = jnp.asarray(softcap, logits.dtype)
        logits = cap * jnp.tanh(logits / cap)
    in_vocab = jnp.arange(weight.shape[0]) < valid_vocab
    logits = jnp.where(in_vocab, logits, -1e30)
    valid = (labels >= 0) & (labels < valid_vocab)
    lse = jax.nn.logsumexp(logits, axis=-1)
    zy = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    ce = lse - (1 - label_smoothing) * zy
    if label_smoothing:
        ce = ce - label_smoothing / valid_vocab * jnp.where(in_vocab, logits, 0.0).sum(-1)
    zterm = z_loss * jnp.square(lse)
    loss = ce + zterm
    if weights is not None:
        loss, zterm = weights * loss, weights * zterm
    loss = jnp.where(valid, loss, 0.0)
    if not with_aux:
        return loss
    aux = dict(z_loss=jnp.where(valid, zterm, 0.0), correct=valid & (zy >= logits.max(-1)),
               invalid_label_count=jnp.sum(labels >= valid_vocab, dtype=jnp.int32))
    return loss, aux


def naive_cross_entropy(hidden, weight, labels, *, valid_vocab):
    """The common baseline: full fp32 logits and ``optax.softmax_cross_entropy_with_integer_labels``.

    hidden [N, d], weight [V_pad, d], labels [N] -> loss [N] fp32 (ignored labels (< 0) give 0).
    """
    logits = jnp.dot(hidden, weight.T, preferred_element_type=jnp.float32)[:, :valid_vocab]
    valid = labels >= 0
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    return jnp.where(valid, loss, 0.0)
