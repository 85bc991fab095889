"""Token frequency: buckets, and row norms against frequency.

Every diagnostic reads only the valid rows ``[:V]`` of a ``[V_pad, d]`` matrix: padding rows never receive
probability mass or gradient, so including them would dilute every statistic. ``V`` is the length of the
unigram counts (``token_counts.npy`` of the prepared data).
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def as_matrix(x, vocab_size: int | None = None) -> np.ndarray:
    """A parameter (jax/NumPy array, or a Flax ``Partitioned`` box) as float64 [V, d], padding dropped."""
    x = getattr(x, "value", x)  # nn.Partitioned -> its array
    m = np.asarray(x, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"expected a [V_pad, d] matrix, got shape {m.shape}")
    if vocab_size is not None:
        if vocab_size > m.shape[0]:
            raise ValueError(f"vocab_size={vocab_size} exceeds the matrix's {m.shape[0]} rows; pass the "
                             "token counts of this model's tokenizer")
        m = m[:vocab_size]
    return m


def check_counts(token_counts, rows: int | None = None) -> np.ndarray:
    """``token_counts`` as int64 [V]; errors name the problem (negative counts, wrong length)."""
    counts = np.asarray(token_counts)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"token_counts must be a non-empty [V] vector, got shape {counts.shape}")
    if (counts < 0).any():
        raise ValueError("token_counts has negative entries; pass unigram counts (token_counts.npy)")
    if rows is not None and counts.size > rows:
        raise ValueError(f"token_counts has {counts.size} entries but the matrix has only {rows} rows")
    return counts.astype(np.int64)


def frequency_buckets(token_counts, n_buckets: int = 4) -> np.ndarray:
    """Bucket id per token, int [V] in ``0..n_buckets-1``: 0 holds the rarest tokens, the last the commonest.

    Tokens are sorted by count (ties by token id) and split into ``n_buckets`` groups of equal size (to
    within one), so every bucket has the same number of vocabulary rows whatever the Zipf tail looks like.
    """
    counts = check_counts(token_counts)
    if not 1 <= n_buckets <= counts.size:
        raise ValueError(f"n_buckets={n_buckets} must be between 1 and the vocabulary size {counts.size}")
    order = np.lexsort((np.arange(counts.size), counts))  # by count, then id: deterministic
    buckets = np.empty(counts.size, np.int64)
    for b, members in enumerate(np.array_split(order, n_buckets)):
        buckets[members] = b
    return buckets


def bucket_means(values: np.ndarray, buckets: np.ndarray, n_buckets: int,
                 mask: np.ndarray | None = None) -> list[float]:
    """Mean of ``values`` [V] within each bucket (NaN for a bucket with no selected rows)."""
    out = []
    for b in range(n_buckets):
        sel = buckets == b if mask is None else (buckets == b) & mask
        out.append(float(values[sel].mean()) if sel.any() else float("nan"))
    return out


def frequency_norm(matrix, token_counts, n_buckets: int = 4) -> dict:
    """Row L2 norms of an embedding matrix against log unigram frequency.

    Definition: ``norm_i = ||W[i]||_2`` for the valid rows ``i < V``. ``spearman`` is Spearman's rank
    correlation between ``norm`` and the count (ranks are the same for the count and its log; tokens
    never seen tie at the lowest rank). ``bucket_norm`` is the mean norm per frequency bucket
    (:func:`frequency_buckets`, rarest first) and ``bucket_log10_freq`` the mean log10 relative frequency
    of the bucket's tokens (unseen tokens are counted as 0.5 occurrences so the log is finite).

    matrix: [V_pad, d] any float dtype; token_counts: [V] int. Returns floats and lists of floats.
    """
    counts = check_counts(token_counts)
    w = as_matrix(matrix, counts.size)
    norms = np.linalg.norm(w, axis=1)
    buckets = frequency_buckets(counts, n_buckets)
    log_freq = np.log10(np.maximum(counts, 0.5) / max(counts.sum(), 1))
    if np.ptp(norms) == 0 or np.ptp(counts) == 0:
        rho = float("nan")  # a constant input has no rank correlation
    else:
        rho = float(stats.spearmanr(norms, counts).statistic)
    return dict(spearman=rho, mean_norm=float(norms.mean()),
                bucket_norm=bucket_means(norms, buckets, n_buckets),
                bucket_log10_freq=bucket_means(log_freq, buckets, n_buckets))
