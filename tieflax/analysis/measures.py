"""The study's corrected measures: each one measures the claim it is attached to.

- **Equal-token-mass bins** (:func:`mass_bins`): a Zipfian vocabulary put in equal-*row* buckets puts
  almost all the text in one bucket; here each bin holds about the same share of the training tokens, so
  the frequent head is resolved and the rare tail is one or two bins.
- **Norm against log-frequency** (:func:`frequency_profile`): mean row norm per mass bin, and Spearman's
  rho *within* each bin (a stratum), so the rare tail cannot decide the sign for the whole vocabulary.
- **Movement from init** (:func:`row_movement`): ``||W_t[i] - W_0[i]||`` per row, by mass bin: what rows
  actually do, rather than whether a gradient touched them.
- **Anisotropy of unit rows** (:func:`unit_anisotropy`): mean cosine (uncentred and unigram-weighted),
  isotropy (Mu & Viswanath) of the unit, centred rows and after removing their top principal
  components (all-but-the-top), and effective rank / d.
- **Contextual anisotropy** (:func:`mean_cosine_from_sum`): mean cosine between hidden states of distinct
  positions (Ethayarajh, 2019), from a running sum of unit vectors.
- **Interference on accumulated gradients** (:func:`accumulated_interference`): the lookup and head
  gradients summed over K held-out batches, their whole-matrix cosine raw and in the metric of Adam's
  preconditioner, and the cross term's share of the first-order loss change.
- **Magnitude-aware updated fractions** (:func:`updated_fractions`): a row counts as updated only if its
  gradient is at least a given fraction of a typical looked-up row's.

Every function reads only the valid rows ``[:V]`` (``V = len(token_counts)``) and computes in float64.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special, stats

from tieflax.analysis.frequency import as_matrix, check_counts
from tieflax.analysis.geometry import sample_rows


# -------------------------------------------------------------------------------------------- bins
def mass_bins(token_counts, n_bins: int = 8) -> np.ndarray:
    """Bin id per token, int [V] in ``0..n_bins-1`` (0 = rarest): bins of about equal token *mass*.

    Tokens are sorted by count (ties by id); token i goes to ``floor(n_bins * c_i / C)`` where ``c_i`` is
    the mass of all tokens before it plus half its own (its midpoint) and ``C`` the total. A token whose
    own mass exceeds ``1 / n_bins`` sits alone in its bin, and the bins after it may be empty. Unseen
    tokens (count 0) land in bin 0 with the rarest seen ones.
    """
    counts = check_counts(token_counts).astype(np.float64)
    if n_bins < 1:
        raise ValueError(f"n_bins={n_bins} must be >= 1")
    total = counts.sum()
    if total <= 0:
        raise ValueError("token_counts are all zero: no token mass to bin")
    order = np.lexsort((np.arange(counts.size), counts))
    sorted_counts = counts[order]
    mid = np.cumsum(sorted_counts) - sorted_counts / 2
    bins = np.empty(counts.size, np.int64)
    bins[order] = np.minimum((n_bins * mid / total).astype(np.int64), n_bins - 1)
    return bins


def _spearman(x: np.ndarray, y: np.ndarray, min_rows: int = 10) -> float:
    if len(x) < min_rows or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(stats.spearmanr(x, y).statistic)


def frequency_profile(matrix, token_counts, n_bins: int = 8, min_rows: int = 10) -> dict:
    """Row norm against log-frequency, by equal-token-mass bin (:func:`mass_bins`).

    Returns lists over bins (rarest first; NaN for an empty bin): ``rows`` (tokens in the bin), ``mass``
    (its share of the train tokens), ``log10_freq`` (mean log10 relative frequency, unseen = 0.5
    occurrences), ``norm`` (mean row norm), ``rho`` (Spearman rho of norm vs count *within* the bin; NaN
    with fewer than ``min_rows`` rows or no spread), plus ``rho_all`` (over every row) and ``rho_head``
    (over the tokens of the upper half of the token mass: the frequent head, where most text is).
    """
    counts = check_counts(token_counts)
    w = as_matrix(matrix, counts.size)
    norms = np.linalg.norm(w, axis=1)
    bins = mass_bins(counts, n_bins)
    log_freq = np.log10(np.maximum(counts, 0.5) / counts.sum())
    out = dict(rows=[], mass=[], log10_freq=[], norm=[], rho=[])
    for b in range(n_bins):
        sel = bins == b
        out["rows"].append(int(sel.sum()))
        out["mass"].append(float(counts[sel].sum() / counts.sum()))
        out["log10_freq"].append(float(log_freq[sel].mean()) if sel.any() else float("nan"))
        out["norm"].append(float(norms[sel].mean()) if sel.any() else float("nan"))
        out["rho"].append(_spearman(norms[sel], counts[sel], min_rows))
    head = bins >= n_bins // 2
    out["rho_all"] = _spearman(norms, counts, min_rows)
    out["rho_head"] = _spearman(norms[head], counts[head], min_rows)
    out["norm_ratio_top_bottom"] = _ratio_last_first(out["norm"])
    return out


def _ratio_last_first(values: list[float]) -> float:
    """Last finite value / first finite value (commonest bin over rarest); NaN when undefined."""
    finite = [v for v in values if math.isfinite(v)]
    return finite[-1] / finite[0] if len(finite) >= 2 and finite[0] else float("nan")


# --------------------------------------------------------------------------------------- movement
def row_movement(matrix, initial, token_counts, n_bins: int = 8) -> dict:
    """How far each row moved from its initial value, by equal-token-mass bin.

    ``move_i = ||W_t[i] - W_0[i]||``; ``rel_i = move_i / ||W_0[i]||``. Returns ``mean`` (over rows),
    ``bin_move`` and ``bin_rel`` (bin means, rarest first) and ``move_ratio_top_bottom`` (commonest bin's
    mean movement over the rarest's: > 1 when frequent rows moved more).
    """
    counts = check_counts(token_counts)
    w, w0 = as_matrix(matrix, counts.size), as_matrix(initial, counts.size)
    if w.shape != w0.shape:
        raise ValueError(f"matrix {w.shape} and its initial value {w0.shape} must have the same shape")
    move = np.linalg.norm(w - w0, axis=1)
    n0 = np.linalg.norm(w0, axis=1)
    rel = move / np.where(n0 > 0, n0, 1.0)
    bins = mass_bins(counts, n_bins)
    mean_in = lambda x: [float(x[bins == b].mean()) if (bins == b).any() else float("nan")  # noqa: E731
                         for b in range(n_bins)]
    out = dict(mean=float(move.mean()), bin_move=mean_in(move), bin_rel=mean_in(rel))
    out["move_ratio_top_bottom"] = _ratio_last_first(out["bin_move"])
    return out


# ------------------------------------------------------------------------------------- anisotropy
def _unit(w: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(w, axis=1, keepdims=True)
    return w / np.where(n > 0, n, 1.0)


def _isotropy(x: np.ndarray) -> float:
    """Mu & Viswanath's I(X) = min_c Z(c) / max_c Z(c) over the principal directions (both signs)."""
    _, vecs = np.linalg.eigh(x.T @ x)
    proj = x @ vecs
    log_z = np.concatenate([special.logsumexp(proj, axis=0), special.logsumexp(-proj, axis=0)])
    return float(np.exp(log_z.min() - log_z.max()))


def weighted_mean_cosine(u: np.ndarray, weights: np.ndarray) -> float:
    """Expected cosine of two *distinct* rows drawn with probabilities ``weights`` (unit rows ``u``):
    ``(||sum p_i u_i||^2 - sum p_i^2) / (1 - sum p_i^2)``. Uniform weights give the mean pairwise cosine."""
    p = np.asarray(weights, np.float64)
    p = p / p.sum()
    s = p @ u
    self_ = (p ** 2).sum()
    return float((s @ s - self_ * 1.0) / (1.0 - self_)) if self_ < 1 else float("nan")


def unit_anisotropy(matrix, token_counts, max_rows: int | None = 2048, seed: int = 0,
                    n_top: int | None = None) -> dict:
    """Anisotropy of unit-normalised rows (norms, which track frequency, are taken out first).

    - ``mean_cosine``: mean cosine over distinct pairs (uncentred): the shared direction.
    - ``mean_cosine_freq``: the same with pairs drawn by unigram frequency (:func:`weighted_mean_cosine`):
      the anisotropy that the text, rather than the vocabulary list, sees.
    - ``isotropy_centered``: Mu & Viswanath's isotropy of the unit rows after subtracting their mean.
    - ``isotropy_abtt``: the same after also removing the top ``n_top`` principal components
      (all-but-the-top; default ``max(1, d // 100)``, their choice).
    - ``effective_rank_frac``: effective rank (Roy & Vetterli) of the centred unit rows divided by d, in
      (0, 1]: 1 = every direction used equally.
    - ``top_pc_share``: share of the centred unit rows' variance along their top ``n_top`` principal
      components (``n_top / d`` when isotropic). On unit rows Mu & Viswanath's score stays near 1 (every
      projection is at most 1 in size), so this share is the more sensitive of the two.

    The pairwise and spectral numbers use a fixed sample of ``max_rows`` rows (``seed``); the
    frequency-weighted cosine uses every row (it is O(V d)).
    """
    counts = check_counts(token_counts)
    u_all = _unit(as_matrix(matrix, counts.size))
    d = u_all.shape[1]
    u = u_all[sample_rows(len(u_all), max_rows, seed)]
    n = len(u)
    if n < 3:
        raise ValueError("unit_anisotropy needs at least three rows")
    s = u.sum(0)
    mean_cos = float((s @ s - (u * u).sum()) / (n * (n - 1)))
    weights = counts.astype(np.float64)
    freq_cos = weighted_mean_cosine(u_all, weights) if weights.sum() > 0 else float("nan")
    c = u - u.mean(0)
    sv = np.linalg.svd(c, compute_uv=False)
    p = sv[sv > 0] / sv.sum() if sv.sum() > 0 else np.ones(1)
    eff_rank = float(np.exp(-(p * np.log(p)).sum()))
    k = n_top if n_top is not None else max(1, d // 100)
    evals, vecs = np.linalg.eigh(c.T @ c)
    top = vecs[:, ::-1][:, :k]
    abtt = c - (c @ top) @ top.T
    share = float(evals[::-1][:k].sum() / evals.sum()) if evals.sum() > 0 else float("nan")
    return dict(mean_cosine=mean_cos, mean_cosine_freq=freq_cos, isotropy_centered=_isotropy(c),
                isotropy_abtt=_isotropy(abtt), effective_rank_frac=eff_rank / d, top_pc_share=share)


def mean_cosine_from_sum(unit_sum, sum_sq_norm: float, n: int) -> float:
    """Mean cosine over distinct pairs of n unit vectors given only their sum ``sum_i u_i`` [d] and
    ``sum_i ||u_i||^2`` (n for unit vectors; less when some are zero): ``(||s||^2 - sum ||u_i||^2) /
    (n (n - 1))``. Lets contextual anisotropy be accumulated over many batches without storing them."""
    s = np.asarray(unit_sum, np.float64)
    return float((s @ s - sum_sq_norm) / (n * (n - 1))) if n > 1 else float("nan")


# ---------------------------------------------------------------------------------- interference
def accumulated_interference(lookup, head, second_moment=None, token_counts=None, n_bins: int = 8,
                             eps: float = 1e-8) -> dict:
    """Interference of the two gradient paths of a (tied) matrix, on gradients accumulated over batches.

    ``lookup``, ``head``: [V(_pad), d] mean gradients over K held-out batches; ``second_moment``: [V, d]
    mean over the K batches of the squared *total* gradient (``(g_L + g_H)^2``: what Adam's ``nu``
    estimates for the tied matrix); ``token_counts`` [V] sets the valid rows (and the bins).

    A gradient step ``-lr P g`` with ``g = g_L + g_H`` changes the loss to first order by
    ``-lr g^T P g = -lr (g_L^T P g_L + g_H^T P g_H + 2 g_L^T P g_H)``. The last term is the interference:
    negative when the two paths pull apart. With ``P = I`` (SGD) and ``P = 1 / (sqrt(nu) + eps)``
    (Adam's preconditioner, elementwise) this returns:

    - ``cosine`` / ``cosine_adam``: ``g_L^T P g_H / sqrt(g_L^T P g_L  g_H^T P g_H)``.
    - ``cross_share`` / ``cross_share_adam``: ``2 g_L^T P g_H / g^T P g``: the share of the first-order loss
      decrease that the cross term adds (negative: interference costs that share of the decrease).
    - ``bin_cosine``: raw cosine restricted to the rows of each equal-token-mass bin (rarest first).
    """
    counts = None if token_counts is None else check_counts(token_counts)
    v = None if counts is None else counts.size
    gl, gh = as_matrix(lookup, v), as_matrix(head, v)
    if gl.shape != gh.shape:
        raise ValueError(f"lookup {gl.shape} and head {gh.shape} gradients must have the same shape")

    def forms(p):
        ll, hh, lh = (gl * p * gl).sum(), (gh * p * gh).sum(), (gl * p * gh).sum()
        cos = lh / math.sqrt(ll * hh) if ll > 0 and hh > 0 else float("nan")
        tot = ll + hh + 2 * lh
        return float(cos), float(2 * lh / tot) if tot > 0 else float("nan")

    out = {}
    out["cosine"], out["cross_share"] = forms(1.0)
    if second_moment is not None:
        p = 1.0 / (np.sqrt(as_matrix(second_moment, v)) + eps)
        out["cosine_adam"], out["cross_share_adam"] = forms(p)
    if counts is not None:
        bins = mass_bins(counts, n_bins)
        bc = []
        for b in range(n_bins):
            sel = bins == b
            a, h = gl[sel], gh[sel]
            den = np.linalg.norm(a) * np.linalg.norm(h)
            bc.append(float((a * h).sum() / den) if den > 0 else float("nan"))
        out["bin_cosine"] = bc
    out["lookup_norm"], out["head_norm"] = float(np.linalg.norm(gl)), float(np.linalg.norm(gh))
    return out


def updated_fractions(lookup, head, token_counts, taus=(0.01, 0.1), n_bins: int = 8) -> dict:
    """Which rows the gradient moves *appreciably*, not merely by a non-zero amount.

    A row's gradient is ``||g_L[i] + g_H[i]||``; the reference is the median of that over rows with a
    non-zero lookup gradient (the rows the batch looked up). For each ``tau``, ``frac_<tau>`` is the
    fraction of valid rows whose gradient reaches ``tau x`` the reference, and ``bin_frac_<tau>`` the same
    per equal-token-mass bin (rarest first). ``head_over_lookup_rarest``: the median gradient of the
    rarest bin over the reference.
    """
    counts = check_counts(token_counts)
    gl, gh = as_matrix(lookup, counts.size), as_matrix(head, counts.size)
    g = np.linalg.norm(gl + gh, axis=1)
    looked_up = np.linalg.norm(gl, axis=1) > 0
    if not looked_up.any():
        raise ValueError("no row has a lookup gradient: pass the lookup gradient of a non-empty batch")
    ref = float(np.median(g[looked_up]))
    bins = mass_bins(counts, n_bins)
    out = dict(reference=ref)
    for tau in taus:
        hit = g >= tau * ref
        out[f"frac_{tau:g}"] = float(hit.mean())
        out[f"bin_frac_{tau:g}"] = [float(hit[bins == b].mean()) if (bins == b).any() else float("nan")
                                    for b in range(n_bins)]
    first = next(b for b in range(n_bins) if (bins == b).any())
    out["head_over_lookup_rarest"] = float(np.median(g[bins == first]) / ref) if ref > 0 else float("nan")
    return out


def shuffled_rows(matrix, vocab_size: int, seed: int = 0) -> np.ndarray:
    """The valid rows in a random order: the row-shuffled control. Any measure that depends on which row
    belongs to which token (frequency profiles, weighted cosines, per-bin numbers) falls to its null."""
    w = as_matrix(matrix, vocab_size)
    return w[np.random.default_rng(seed).permutation(len(w))]
