"""Embedding geometry: anisotropy (mean cosine, isotropy score, effective rank) and input-output similarity.

All functions take a ``[V_pad, d]`` matrix and ``vocab_size`` (rows beyond it are padding and dropped)
and compute in float64 on the host. For large vocabularies the pairwise and spectral statistics use a
fixed random sample of ``max_rows`` rows (the same rows for every matrix of one call with the same
``seed``), which keeps them cheap enough to run during training.
"""

from __future__ import annotations

import numpy as np
from scipy import special

from tieflax.analysis.frequency import as_matrix


def sample_rows(n: int, max_rows: int | None, seed: int = 0) -> np.ndarray:
    """Sorted indices of at most ``max_rows`` of ``n`` rows (all rows when ``max_rows`` is None or >= n)."""
    if max_rows is None or max_rows >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_rows, replace=False))


def _unit_rows(w: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(w, axis=1, keepdims=True)
    return w / np.where(norms > 0, norms, 1.0)  # an all-zero row stays zero (cosine 0 with everything)


def pairwise_cosines(matrix, vocab_size: int, max_rows: int | None = 2048, seed: int = 0) -> np.ndarray:
    """Cosines of all distinct pairs of (sampled) valid rows, float64 [n (n - 1) / 2]."""
    w = as_matrix(matrix, vocab_size)
    u = _unit_rows(w[sample_rows(len(w), max_rows, seed)])
    gram = u @ u.T
    return gram[np.triu_indices(len(u), k=1)]


def mean_pairwise_cosine(matrix, vocab_size: int, max_rows: int | None = 2048, seed: int = 0) -> float:
    """Mean cosine over distinct row pairs: ~0 for isotropic rows, -> 1 when rows share one direction.

    Computed from the Gram matrix of unit rows: mean_{i != j} cos = (||sum_i u_i||^2 - n) / (n (n - 1)).
    """
    w = as_matrix(matrix, vocab_size)
    u = _unit_rows(w[sample_rows(len(w), max_rows, seed)])
    n = len(u)
    if n < 2:
        raise ValueError("mean_pairwise_cosine needs at least two rows")
    s = u.sum(0)
    return float((s @ s - (u * u).sum()) / (n * (n - 1)))


def isotropy_score(matrix, vocab_size: int, max_rows: int | None = None, seed: int = 0) -> float:
    """The isotropy score of Mu & Viswanath (2018, "All-but-the-top"), in (0, 1]; 1 is isotropic.

    ``I(W) = min_c Z(c) / max_c Z(c)`` with the partition function ``Z(c) = sum_i exp(<c, w_i>)`` over the
    valid rows and ``c`` running over the eigenvectors of ``W^T W`` (the principal directions). Both signs
    of each eigenvector are used, which makes the score independent of the eigensolver's sign choice.
    Computed in log space (logsumexp), so large norms do not overflow. Note the score is scale-dependent:
    rows of tiny norm (e.g. at initialisation) give Z(c) ~ V for every c and a score near 1.
    """
    w = as_matrix(matrix, vocab_size)
    w = w[sample_rows(len(w), max_rows, seed)]
    _, vecs = np.linalg.eigh(w.T @ w)
    proj = w @ vecs  # [n, d]: <c_k, w_i>
    log_z = np.concatenate([special.logsumexp(proj, axis=0), special.logsumexp(-proj, axis=0)])
    return float(np.exp(log_z.min() - log_z.max()))


def effective_rank(matrix, vocab_size: int, max_rows: int | None = None, seed: int = 0) -> float:
    """Effective rank of Roy & Vetterli (2007): ``exp(H(p))`` with ``p_k = s_k / sum_k s_k``.

    ``s_k`` are the singular values of the (uncentered) valid rows. Ranges from 1 (rank one) to ``d``
    (all singular values equal); a matrix with ``r`` equal non-zero singular values scores exactly ``r``.
    """
    w = as_matrix(matrix, vocab_size)
    w = w[sample_rows(len(w), max_rows, seed)]
    s = np.linalg.svd(w, compute_uv=False)
    if s.sum() == 0:
        return 0.0
    p = s[s > 0] / s.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def row_cosines(a, b, vocab_size: int) -> np.ndarray:
    """Cosine between row i of ``a`` and row i of ``b`` for every valid row, float64 [V]."""
    return (_unit_rows(as_matrix(a, vocab_size)) * _unit_rows(as_matrix(b, vocab_size))).sum(1)


def linear_cka(a, b, vocab_size: int) -> float:
    """Linear CKA (Kornblith et al., 2019) of two representations of the same V rows, in [0, 1].

    ``CKA = ||B^T A||_F^2 / (||A^T A||_F ||B^T B||_F)`` after centering each column. Invariant to
    orthogonal transforms and isotropic scaling of either matrix, so 1 means "the same geometry up to a
    rotation", which a row cosine cannot see.
    """
    x = as_matrix(a, vocab_size)
    y = as_matrix(b, vocab_size)
    x = x - x.mean(0)
    y = y - y.mean(0)
    # Feature-space form: d x d products, cheap when V >> d.
    cross = np.linalg.norm(y.T @ x) ** 2
    denom = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    return float(cross / denom) if denom > 0 else float("nan")


def anisotropy(matrix, vocab_size: int, max_rows: int | None = 2048, seed: int = 0) -> dict:
    """``mean_cosine``, ``isotropy`` and ``effective_rank`` of one matrix (floats), on the same row sample."""
    return dict(mean_cosine=mean_pairwise_cosine(matrix, vocab_size, max_rows, seed),
                isotropy=isotropy_score(matrix, vocab_size, max_rows, seed),
                effective_rank=effective_rank(matrix, vocab_size, max_rows, seed))


def in_out_similarity(w_in, w_out, vocab_size: int) -> dict:
    """How alike an untied model's two matrices are: mean and median row cosine, and linear CKA."""
    cos = row_cosines(w_in, w_out, vocab_size)
    return dict(row_cosine_mean=float(cos.mean()), row_cosine_median=float(np.median(cos)),
                cka=linear_cka(w_in, w_out, vocab_size))
