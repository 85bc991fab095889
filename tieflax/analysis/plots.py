"""PNG plots for ``tieflax analyze`` and the compare report (matplotlib, Agg backend: no display needed).

Every function takes ``{label: result}`` where a result is the dict :func:`analyze_params` returns
(with ``arrays``) or, for curves, rows of ``metrics.jsonl``; it writes one PNG and returns its path.
"""

from __future__ import annotations

import math

import numpy as np
# Figures are drawn on `Figure` objects, never through pyplot, so importing this module neither opens a
# window nor changes the backend of a notebook that imports it.
from matplotlib.figure import Figure

COLORS = {"tied": "tab:blue", "untied": "tab:orange", "untied_matched": "tab:green"}


def _color(label: str, i: int) -> str:
    return COLORS.get(label.split(" ")[0], f"C{i}")


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def norm_vs_frequency(results: dict[str, dict], path: str) -> str:
    """One row per run, columns W_in and W_out: row norm against log10 count, binned means on top."""
    n = len(results)
    fig = Figure(figsize=(10, 3.2 * n))
    axes = fig.subplots(n, 2, squeeze=False, sharex=True)
    for row, (label, res) in enumerate(results.items()):
        a = res["arrays"]
        counts = np.asarray(a["counts"], np.float64)
        x = np.log10(np.maximum(counts, 0.5))
        for col, side in enumerate(("input", "output")):
            ax = axes[row, col]
            norms = np.asarray(a[f"norm_{side}"])
            ax.scatter(x, norms, s=2, alpha=0.25, color=_color(label, row), rasterized=True)
            # Equal-width bins in log count (a quantile binning would lump the whole frequent head
            # into one bin); bins with fewer than 3 tokens are left out.
            edges = np.linspace(x.min(), x.max() + 1e-9, 21)
            idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, 19)
            keep = [k for k in range(20) if (idx == k).sum() >= 3]
            centers = [x[idx == k].mean() for k in keep]
            means = [norms[idx == k].mean() for k in keep]
            ax.plot(centers, means, color="black", lw=1.5, label="binned mean")
            rho = res[side]["spearman"]
            tag = "tied matrix" if res.get("tied") else ("W_in (lookup)" if side == "input" else "W_out (head)")
            ax.set_title(f"{label}: {tag}, Spearman rho = {rho:.2f}", fontsize=9)
            ax.set_ylabel("row L2 norm")
            if row == n - 1:
                ax.set_xlabel("log10 train count (unseen = 0.5)")
            ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def cosine_histograms(results: dict[str, dict], path: str) -> str:
    """Histograms of pairwise row cosines (sampled rows) of W_in and W_out, runs overlaid."""
    fig = Figure(figsize=(10, 3.4))
    axes = fig.subplots(1, 2)
    for col, side in enumerate(("input", "output")):
        ax = axes[col]
        for i, (label, res) in enumerate(results.items()):
            bins = np.asarray(res["arrays"]["cos_bins"])
            counts = np.asarray(res["arrays"][f"cos_hist_{side}"], np.float64)
            density = counts / max(counts.sum(), 1) / np.diff(bins)
            ax.stairs(density, bins, lw=1.5, color=_color(label, i),
                      label=f"{label} (mean {res[side]['mean_cosine']:.3f})")
        ax.set_title(f"pairwise cosine of {'W_in (lookup)' if side == 'input' else 'W_out (head)'} rows",
                     fontsize=9)
        ax.set_xlabel("cosine")
        ax.legend(fontsize=7)
    return _save(fig, path)


def loss_curves(curves: dict[str, dict[str, list]], path: str) -> str:
    """Train (thin) and validation (markers) loss against step. ``curves[label] = {'train': [(step,
    loss)], 'val': [(step, loss)]}``; several seeds of one variant may share a colour via the label
    prefix."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for i, (label, c) in enumerate(curves.items()):
        color = _color(label, i)
        if c.get("train"):
            s, l_ = zip(*c["train"])
            ax.plot(s, l_, color=color, lw=1, alpha=0.8, label=f"{label} train")
        if c.get("val"):
            s, l_ = zip(*c["val"])
            ax.plot(s, l_, color=color, marker="o", ms=4, lw=1.5, ls="--", label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    finite = [v for c in curves.values() for key in ("train", "val") for _, v in c.get(key, [])
              if math.isfinite(v)]
    if finite:  # the first steps sit near ln(V); show the part where the runs differ
        lo, hi = min(finite), np.percentile(finite, 90)
        ax.set_ylim(lo - 0.1 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def gradient_interference(series: dict[str, list[tuple[int, dict]]], path: str) -> str:
    """Over training, from checkpoint analyses: per-row cosine of the lookup and head gradients, the
    head's share of the squared gradient norm, and the fraction of rows each path updates.
    ``series[label] = [(step, gradient_dict), ...]``."""
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    for i, (label, points) in enumerate(series.items()):
        if not points:
            continue
        steps = [s for s, _ in points]
        color = _color(label, i)
        axes[0].plot(steps, [g["cosine_mean"] for _, g in points], marker="o", color=color, label=label)
        axes[1].plot(steps, [g["head_share"] for _, g in points], marker="o", color=color, label=label)
        axes[2].plot(steps, [g["rows_lookup"] for _, g in points], marker="o", color=color,
                     label=f"{label} lookup")
        axes[2].plot(steps, [g["rows_head"] for _, g in points], marker="s", ls=":", color=color,
                     label=f"{label} head")
    axes[0].axhline(0, color="gray", lw=0.8)
    axes[0].set_title("mean cosine(g_lookup[i], g_head[i])\nover rows both paths update", fontsize=9)
    axes[1].set_title("head share of squared gradient norm", fontsize=9)
    axes[2].set_title("fraction of vocabulary rows updated (one batch)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def by_bucket(values: dict[str, list[float]], path: str, *, title: str, ylabel: str,
              reference: float | None = None, log: bool = False) -> str:
    """Grouped bars: one group per frequency bucket (rarest first), one bar per run."""
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    labels = list(values)
    n_buckets = max(len(v) for v in values.values())
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        xs = np.arange(n_buckets) + (i - (len(labels) - 1) / 2) * width
        ax.bar(xs, values[label], width=width, color=_color(label, i), label=label)
    if reference is not None:
        ax.axhline(reference, color="gray", lw=0.8)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(range(n_buckets), [f"bucket {b}" + (" (rarest)" if b == 0 else "") +
                                     (" (commonest)" if b == n_buckets - 1 else "")
                                     for b in range(n_buckets)], fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return _save(fig, path)


def diagnostics_over_training(rows: dict[str, list[dict]], keys: list[tuple[str, str]], path: str) -> str:
    """Logged ``diag/*`` scalars (``metrics.jsonl`` rows of split 'diag') against step, one panel a key."""
    fig = Figure(figsize=(4.3 * len(keys), 3.4))
    axes = fig.subplots(1, len(keys), squeeze=False)
    for col, (key, title) in enumerate(keys):
        ax = axes[0, col]
        for i, (label, rs) in enumerate(rows.items()):
            pts = [(r["step"], float(r[key])) for r in rs if key in r]
            if pts:
                s, v = zip(*pts)
                ax.plot(s, v, marker=".", color=_color(label, i), label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)
