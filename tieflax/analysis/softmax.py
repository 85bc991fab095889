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

from tieflax.analysis.frequency import bucket_means, check_counts, frequency_buckets


@functools.partial(jax.jit, static_argnames=("vocab_size", "logit_scale", "softcap"))
def _block_stats(h, w, bias, keep, *, vocab_size, logit_scale, softcap):
    z = jnp.einsum("nd,vd->nv", h.astype(jnp.float32), w.astype(jnp.float32)) * logit_scale
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if softcap:
        z = softcap * jnp.tanh(z / softcap)
    z = jnp.where(jnp.arange(w.shape[0]) < vocab_size, z, -jnp.inf)  # padding rows get no mass
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse, (jnp.exp(z - lse[:, None]) * keep[:, None]).sum(0)  # keep [n]: 0 for padded tokens


def softmax_statistics(hidden, weight, *, vocab_size: int, logit_scale: float = 1.0,
                       softcap: float | None = None, bias=None, token_block: int = 1024
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(lse [N] float64, mean probability [V] float64) of the model's output softmax.

    hidden: [..., d] final hidden states (any float dtype); weight: [V_pad, d] head matrix; bias: [V_pad]
    or None; ``logit_scale`` and ``softcap`` as :func:`tieflax.model.head_loss_kwargs` gives them
    (its ``valid_vocab`` is ``vocab_size``). ``mean_prob[j] = mean_t softmax(z_t)[j]`` over the N tokens, so it sums to 1.
    """
    h = jnp.asarray(hidden).reshape(-1, jnp.shape(hidden)[-1])
    w = jnp.asarray(getattr(weight, "value", weight))
    n = h.shape[0]
    lses, total = [], np.zeros(w.shape[0], np.float64)
    block = min(token_block, n)
    for start in range(0, n, block):
        blk = h[start:start + block]
        keep = blk.shape[0]
        if keep < block:  # pad the last block so every block has one compiled shape
            blk = jnp.pad(blk, ((0, block - keep), (0, 0)))
        mask = (jnp.arange(block) < keep).astype(jnp.float32)
        lse, probs = _block_stats(blk, w, bias, mask, vocab_size=vocab_size, logit_scale=float(logit_scale),
                                  softcap=float(softcap) if softcap else None)
        lses.append(np.asarray(lse[:keep], np.float64))
        total += np.asarray(probs, np.float64)
    return np.concatenate(lses), total[:vocab_size] / n


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
