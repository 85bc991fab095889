"""What the output softmax does with rare and common tokens: log-sum-exp and per-vocab mean probability.

``softmax_statistics`` computes, blockwise over tokens (never more than ``[token_block, V_pad]`` logits
live), the per-token log-sum-exp (the same quantity as the fused loss's ``aux['lse']``) and the mean
predicted probability of every vocabulary entry. ``softmax_diagnostics`` turns them into numbers by
frequency bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tieflax.analysis.frequency import check_counts, frequency_buckets


def _tile_stats(h, w, bias, keep, vocab_size, logit_scale, softcap):
    z = jnp.einsum("nd,vd->nv", h.astype(jnp.float32), w.astype(jnp.float32)) * logit_scale
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if softcap:
        z = softcap * jnp.tanh(z / softcap)
    z = jnp.where(jnp.arange(w.shape[0]) < vocab_size, z, -jnp.inf)  # padding rows get no mass
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse, (jnp.exp(z - lse[:, None]) * keep[:, None]).sum(0)  # keep [n]: 0 for padded tokens


def block_statistics(h, w, bias=None, *, token_block: int, vocab_size: int, logit_scale: float = 1.0,
                     softcap: float | None = None):
    """Traceable core of :func:`softmax_statistics`: h [N, d], w [V_pad, d] -> (lse [N] fp32, summed
    probabilities [V_pad] fp32). Token blocks run in a ``lax.map``, so only one ``[block, V_pad]``
    tile of logits is live."""
    n = h.shape[0]
    block = min(token_block, n)
    n_blocks = -(-n // block)
    pad = n_blocks * block - n
    hp = jnp.pad(h, ((0, pad), (0, 0))).reshape(n_blocks, block, h.shape[-1])
    keep = (jnp.arange(n_blocks * block) < n).astype(jnp.float32).reshape(n_blocks, block)

    def one(args):
        return _tile_stats(args[0], w, bias, args[1], vocab_size, logit_scale, softcap)

    lse, probs = jax.lax.map(one, (hp, keep))
    return lse.reshape(-1)[:n], probs.sum(0)


@functools.partial(jax.jit, static_argnames=("token_block", "vocab_size", "logit_scale", "softcap"))
def _statistics(h, w, bias, *, token_block, vocab_size, logit_scale, softcap):
    return block_statistics(h, w, bias, token_block=token_block, vocab_size=vocab_size,
                            logit_scale=logit_scale, softcap=softcap)


def softmax_statistics(hidden, weight, *, vocab_size: int, logit_scale: float = 1.0,
                       softcap: float | None = None, bias=None, token_block: int = 1024
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(lse [N] float64, mean probability [V] float64) of the model's output softmax.

    hidden: [..., d] final hidden states (any float dtype); weight: [V_pad, d] head matrix; bias: [V_pad]
    or None; ``logit_scale`` and ``softcap`` as :func:`tieflax.model.head_loss_kwargs` gives them
    (its ``valid_vocab`` is ``vocab_size``). ``mean_prob[j] = mean_t softmax(z_t)[j]`` over the N tokens,
    so it sums to 1. Computed in fp32 blocks of ``token_block`` tokens, accumulated on the host in float64.
    """
    h = jnp.asarray(hidden).reshape(-1, jnp.shape(hidden)[-1])
    w = jnp.asarray(getattr(weight, "value", weight))
    lse, probs = _statistics(h, w, bias, token_block=token_block, vocab_size=vocab_size,
                             logit_scale=float(logit_scale), softcap=float(softcap) if softcap else None)
    return np.asarray(lse, np.float64), np.asarray(probs, np.float64)[:vocab_size] / h.shape[0]


def softmax_diagnostics(lse, mean_prob, token_counts, targets=None, n_buckets: int = 4) -> dict:
    """Log-sum-exp and probability mass by frequency bucket.

    lse: [N] per-token log-sum-exp (``aux['lse']`` of the loss, or :func:`softmax_statistics`);
    mean_prob: [V] mean predicted probability per vocabulary entry; token_counts: [V] unigram counts;
    targets: optional [N] target ids aligned with ``lse`` (negative = ignored).

    - ``mean_lse``: mean over tokens; ``bucket_lse``: mean over tokens whose *target* is in the bucket.
    - ``bucket_mass``: total predicted probability of the bucket's tokens (sums to 1 over buckets);
      ``bucket_data_mass``: the bucket's share of the unigram counts; ``bucket_mass_ratio``: their ratio
      (1 = the softmax gives the bucket its unigram share on average; > 1 over-predicts it).
    """
    counts = check_counts(token_counts)
    v = counts.size
    lse = np.asarray(lse, np.float64).reshape(-1)
    mean_prob = np.asarray(mean_prob, np.float64).reshape(-1)[:v]
    buckets = frequency_buckets(counts, n_buckets)
    data = counts / max(counts.sum(), 1)
    mass = [float(mean_prob[buckets == b].sum()) for b in range(n_buckets)]
    data_mass = [float(data[buckets == b].sum()) for b in range(n_buckets)]
    out = dict(mean_lse=float(lse.mean()), bucket_mass=mass, bucket_data_mass=data_mass,
               bucket_mass_ratio=[m / d if d > 0 else float("nan") for m, d in zip(mass, data_mass)])
    if targets is not None:
        t = np.asarray(targets).reshape(-1)
        if t.shape != lse.shape:
            raise ValueError(f"targets {t.shape} must align with lse {lse.shape}")
        ok = (t >= 0) & (t < v)
        target_bucket = np.where(ok, buckets[np.clip(t, 0, v - 1)], -1)
        out["bucket_lse"] = [float(lse[target_bucket == b].mean()) if (target_bucket == b).any()
                             else float("nan") for b in range(n_buckets)]
    return out
