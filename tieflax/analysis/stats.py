"""Paired bootstrap confidence intervals: the only noise model the study's verdicts use.

Runs are paired by seed (same data order, same init stream), so a difference between two variants is
taken seed by seed and the seeds are resampled. For the validation loss the held-out documents are a
second source of noise: :func:`two_level_bootstrap` resamples seeds and documents together. A verdict is
"the 95% interval excludes 0" or "it does not"; there is no other threshold.
"""

from __future__ import annotations

import math

import numpy as np

N_BOOT = 2000
LEVEL = 0.95


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    lo, hi = np.quantile(samples, [a, 1 - a])
    return float(lo), float(hi)


def bootstrap_ci(values, *, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> dict:
    """Percentile bootstrap of the mean of ``values`` [n] (e.g. per-seed paired differences).

    Returns ``{'mean', 'lo', 'hi', 'n'}``; NaNs are dropped; with one value the interval is NaN (one seed
    has no spread to resample). Note that with n = 3 the bootstrap distribution has only 10 distinct means
    and under-covers: the report states n next to every interval.
    """
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    n = len(x)
    if n == 0:
        return dict(mean=float("nan"), lo=float("nan"), hi=float("nan"), n=0)
    if n == 1:
        return dict(mean=float(x[0]), lo=float("nan"), hi=float("nan"), n=1)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    lo, hi = _interval(x[idx].mean(1), level)
    return dict(mean=float(x.mean()), lo=lo, hi=hi, n=n)


def paired_ci(a, b, **kw) -> dict:
    """Bootstrap CI of ``mean(a - b)`` over pairs (``a[i]``, ``b[i]`` from the same seed)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal shapes, got {a.shape} and {b.shape}")
    return bootstrap_ci(a - b, **kw)


def two_level_bootstrap(loss_a, loss_b, tokens, *, n_boot: int = N_BOOT, level: float = LEVEL,
                        seed: int = 0) -> dict:
    """CI of the token-weighted mean loss difference ``a - b``, resampling seeds and documents.

    loss_a, loss_b: [S, D] summed loss per (seed, document) of the two variants; tokens: [D] scored tokens
    per document (the same documents for every run). Each replicate draws S seeds and D documents with
    replacement and computes ``sum(a - b) / sum(tokens)`` over the draw. Also returns the intervals when
    only seeds (``seed_lo``, ``seed_hi``) or only documents (``doc_lo``, ``doc_hi``) are resampled, so the
    report can say which source of noise dominates.
    """
    a, b = np.asarray(loss_a, np.float64), np.asarray(loss_b, np.float64)
    t = np.asarray(tokens, np.float64)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] != t.size:
        raise ValueError(f"need [S, D] losses and [D] tokens, got {a.shape}, {b.shape}, {t.shape}")
    diff = a - b                      # [S, D]
    s, d = diff.shape
    rng = np.random.default_rng(seed)
    mean = float(diff.sum() / (s * t.sum()))
    si = rng.integers(0, s, size=(n_boot, s))
    di = rng.integers(0, d, size=(n_boot, d))
    # sum over the drawn seeds and documents: (counts of each seed) x diff x (counts of each document).
    seed_w = np.stack([np.bincount(r, minlength=s) for r in si])          # [n_boot, S]
    doc_w = np.stack([np.bincount(r, minlength=d) for r in di])           # [n_boot, D]
    both = np.einsum("ns,sd,nd->n", seed_w, diff, doc_w) / (s * (doc_w @ t))
    seeds_only = (seed_w @ diff.sum(1)) / (s * t.sum())
    docs_only = (doc_w @ diff.mean(0)) / (doc_w @ t)
    out = dict(mean=mean, n_seeds=s, n_docs=d)
    out["lo"], out["hi"] = _interval(both, level)
    out["seed_lo"], out["seed_hi"] = _interval(seeds_only, level) if s > 1 else (float("nan"),) * 2
    out["doc_lo"], out["doc_hi"] = _interval(docs_only, level)
    return out


def excludes_zero(ci: dict) -> bool | None:
    """True when the interval lies wholly on one side of 0; None when there is no interval."""
    lo, hi = ci.get("lo", float("nan")), ci.get("hi", float("nan"))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return lo > 0 or hi < 0


def verdict(ci: dict, positive: str, negative: str) -> str:
    """A sentence from a CI: ``positive`` if it lies above 0, ``negative`` below, else "not resolved"."""
    ex = excludes_zero(ci)
    if ex is None:
        return "no interval (one seed): not resolved"
    if not ex:
        return "the 95% interval includes 0: not resolved at this n"
    return positive if ci["lo"] > 0 else negative


def fmt_ci(ci: dict, digits: int = 3) -> str:
    """``mean [lo, hi] (n=..)``."""
    n = ci.get("n", ci.get("n_seeds", 0))
    if not math.isfinite(ci.get("lo", float("nan"))):
        return f"{ci['mean']:.{digits}f} (n={n}, no interval)" if math.isfinite(ci["mean"]) else "n/a"
    return f"{ci['mean']:+.{digits}f} [{ci['lo']:+.{digits}f}, {ci['hi']:+.{digits}f}] (n={n})"
