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


def too_little(n: int, unit: str = "seed") -> str:
    """Why ``n`` resampling units give no interval (``""`` when they do): an interval needs at least 2 units
    at each level it resamples, e.g. "1 seed: no interval over seeds"."""
    if n >= 2:
        return ""
    what = f"{n} {unit}" if n == 1 else f"no {unit}"
    return f"{what}: no interval over {unit}s"


def bootstrap_ci(values, *, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0, unit: str = "seed") -> dict:
    """Percentile bootstrap of the mean of ``values`` [n] (e.g. per-seed paired differences).

    Returns ``{'mean', 'lo', 'hi', 'n'}``; NaNs are dropped; with fewer than two values the interval is NaN
    and ``missing`` says why (one seed has no spread to resample: "1 seed: no interval over seeds"). Note
    that with n = 3 the bootstrap distribution has only 10 distinct means and under-covers: the report
    states n next to every interval.
    """
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    n = len(x)
    if n == 0:
        return dict(mean=float("nan"), lo=float("nan"), hi=float("nan"), n=0, missing=too_little(0, unit))
    if n == 1:
        return dict(mean=float(x[0]), lo=float("nan"), hi=float("nan"), n=1, missing=too_little(1, unit))
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
                        seed: int = 0, units: tuple[str, str] = ("seed", "document")) -> dict:
    """CI of the token-weighted mean loss difference ``a - b``, resampling seeds and documents.

    loss_a, loss_b: [S, D] summed loss per (seed, document) of the two variants; tokens: [D] scored tokens
    per document (the same documents for every run). Each replicate draws S seeds and D documents with
    replacement and computes ``sum(a - b) / sum(tokens)`` over the draw. Also returns the intervals when
    only seeds (``seed_lo``, ``seed_hi``) or only documents (``doc_lo``, ``doc_hi``) are resampled, so the
    report can say which source of noise dominates.

    An interval needs at least 2 units at each level it resamples: with one seed the joint and the
    seeds-only intervals are NaN, with one document the joint and the documents-only ones, and
    ``missing`` says what is missing ("1 seed: no interval over seeds"; ``units`` names the two levels).
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
    nan2 = (float("nan"),) * 2
    missing = "; ".join(m for m in (too_little(s, units[0]), too_little(d, units[1])) if m)
    out = dict(mean=mean, n_seeds=s, n_docs=d, missing=missing)
    out["lo"], out["hi"] = nan2 if missing else _interval(both, level)
    out["seed_lo"], out["seed_hi"] = _interval(seeds_only, level) if s > 1 else nan2
    out["doc_lo"], out["doc_hi"] = _interval(docs_only, level) if d > 1 else nan2
    return out


def two_level_ratio(num, den, *, minus=None, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0,
                    units: tuple[str, str] = ("seed", "document")) -> dict:
    """CI of a ratio of sums ``sum(num) / sum(den)`` over [S, D] (seed, document) cells, resampling seeds
    and documents together as :func:`two_level_bootstrap` does (e.g. the share of a loss difference that
    the rarest frequency bins carry: ``num`` their summed difference, ``den`` the whole one). ``minus``:
    ``(num2, den2)`` of the same shape (or [D], the same for every seed), whose ratio of sums over the same
    draw is subtracted (e.g. the rarest bins' share of the tokens). The same rule: fewer than 2 units at a
    level gives no interval, and ``missing`` says why."""
    a, b = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"need [S, D] numerator and denominator, got {a.shape} and {b.shape}")
    s, d = a.shape
    a2, b2 = (np.broadcast_to(np.asarray(m, np.float64), a.shape) for m in minus) if minus is not None else (None, None)
    total = b.sum()
    mean = float(a.sum() / total) if total != 0 else float("nan")
    if minus is not None:
        mean = mean - float(a2.sum() / b2.sum()) if b2.sum() != 0 else float("nan")
    missing = "; ".join(m for m in (too_little(s, units[0]), too_little(d, units[1])) if m)
    out = dict(mean=mean, n_seeds=s, n_docs=d, missing=missing, lo=float("nan"), hi=float("nan"))
    if missing or not math.isfinite(mean):
        return out
    rng = np.random.default_rng(seed)
    seed_w = np.stack([np.bincount(r, minlength=s) for r in rng.integers(0, s, size=(n_boot, s))])
    doc_w = np.stack([np.bincount(r, minlength=d) for r in rng.integers(0, d, size=(n_boot, d))])
    top = np.einsum("ns,sd,nd->n", seed_w, a, doc_w)
    bottom = np.einsum("ns,sd,nd->n", seed_w, b, doc_w)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = top / bottom
        if minus is not None:
            ratios = ratios - np.einsum("ns,sd,nd->n", seed_w, a2, doc_w) / np.einsum("ns,sd,nd->n", seed_w, b2, doc_w)
    ratios = ratios[np.isfinite(ratios)]
    if len(ratios) >= n_boot // 2:
        out["lo"], out["hi"] = _interval(ratios, level)
    return out


def excludes_zero(ci: dict) -> bool | None:
    """True when the interval lies wholly on one side of 0; None when there is no interval."""
    lo, hi = ci.get("lo", float("nan")), ci.get("hi", float("nan"))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return lo > 0 or hi < 0


def missing(ci: dict) -> str:
    """Why ``ci`` has no interval ("" when it has one): what its resampling levels lack."""
    if excludes_zero(ci) is not None:
        return ""
    if ci.get("missing"):
        return ci["missing"]
    return "no value to resample" if not math.isfinite(ci.get("mean", float("nan"))) else "no interval"


def verdict(ci: dict, positive: str, negative: str) -> str:
    """A sentence from a CI: ``positive`` if it lies above 0, ``negative`` below, else "unresolved ...";
    no interval (fewer than 2 units at a level it resamples) gives none: "no verdict from < 2 units (...)"
    (the words of ``tieflax.study.findings``)."""
    ex = excludes_zero(ci)
    if ex is None:
        return f"no verdict from < 2 units ({missing(ci)})"
    if not ex:
        return "unresolved (the 95% interval includes 0 at this n)"
    return positive if ci["lo"] > 0 else negative


def fmt_ci(ci: dict, digits: int = 3) -> str:
    """``mean [lo, hi] (n=..)``; without an interval the mean and what is missing (never ``nan``)."""
    n = ci.get("n", ci.get("n_seeds", 0))
    if not math.isfinite(ci.get("lo", float("nan"))):
        why = missing(ci)
        return f"{ci['mean']:+.{digits}f} (n={n}; {why})" if math.isfinite(ci["mean"]) else f"n/a ({why})"
    return f"{ci['mean']:+.{digits}f} [{ci['lo']:+.{digits}f}, {ci['hi']:+.{digits}f}] (n={n})"


def fmt_interval(lo: float, hi: float, digits: int = 4) -> str:
    """``[lo, hi]`` with signs, or ``no interval`` where either end is undefined (never ``nan``)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "no interval"
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"
