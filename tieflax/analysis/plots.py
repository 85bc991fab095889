"""PNG plots for ``tieflax analyze``, the compare report and the sweep (matplotlib on ``Figure`` objects).

``norm_vs_frequency`` and ``cosine_histograms`` take ``{label: result}`` of :func:`analyze_params` (with
``arrays``); the study's plots take seed-level values or interval dicts and draw n and error bars. Each
function writes one PNG and returns its path.
"""

from __future__ import annotations

import io
import math

import numpy as np
# Figures are drawn on `Figure` objects, never through pyplot, so importing this module neither opens a
# window nor changes the backend of a notebook that imports it.
from matplotlib.figure import Figure

from tieflax import storage

COLORS = {"tied": "tab:blue", "untied": "tab:orange", "untied_matched": "tab:green", "untied_width": "tab:red",
          "untied_depth": "tab:purple"}


def _color(label: str, i: int) -> str:
    return COLORS.get(label.split(" ")[0], f"C{i}")


def _save(fig, path: str) -> str:
    """Renders ``fig`` to PNG bytes in memory and writes them whole (local or gs:// / s3://)."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    storage.write_bytes(path, buffer.getvalue())
    return path


def norm_vs_frequency(results: dict[str, dict], path: str) -> str:
    """One row per run, columns W_in and W_out: row norm against log10 count, binned means on top."""
    n = len(results)
    fig = Figure(figsize=(10, 3.2 * n))
    axes = fig.subplots(n, 2, squeeze=False, sharex=True, sharey=True)  # one scale: W_in vs W_out
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


def _err(ci: dict) -> tuple[float, float]:
    """(below, above) error-bar lengths of a CI dict; 0 where there is no interval."""
    if not (math.isfinite(ci.get("lo", float("nan"))) and math.isfinite(ci.get("hi", float("nan")))):
        return 0.0, 0.0
    return ci["mean"] - ci["lo"], ci["hi"] - ci["mean"]


def loss_curves_seeds(curves: dict[str, dict[str, list]], path: str) -> str:
    """Mean train (thin) and validation (markers) loss over seeds per variant, min-max band over seeds.
    ``curves[variant] = {'train': [[(step, loss)] per seed], 'val': [...]}``."""
    fig = Figure(figsize=(8, 4.4))
    ax = fig.subplots()
    finite = []
    n = 0
    for i, (label, c) in enumerate(curves.items()):
        color = _color(label, i)
        for key, style in (("train", dict(lw=1)), ("val", dict(marker="o", ms=4, lw=1.5, ls="--"))):
            seeds = [dict(s) for s in c.get(key, []) if s]
            if not seeds:
                continue
            n = max(n, len(seeds))
            steps = sorted(set.intersection(*[set(s) for s in seeds]))
            if not steps:
                continue
            vals = np.array([[s[t] for t in steps] for s in seeds])
            ax.plot(steps, vals.mean(0), color=color, label=f"{label} {key}", **style)
            if len(seeds) > 1:
                ax.fill_between(steps, vals.min(0), vals.max(0), color=color, alpha=0.15, lw=0)
            finite += [v for v in vals.ravel() if math.isfinite(v)]
    if finite:  # the first steps sit near ln(V); show the part where the runs differ
        lo, hi = min(finite), np.percentile(finite, 90)
        ax.set_ylim(lo - 0.1 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"loss, mean over seeds (band: min-max, n={n} seeds per variant)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def interval_bars(cis: dict[str, dict], path: str, *, ylabel: str, title: str) -> str:
    """One bar per label at its CI mean, error bars = the 95% interval, a line at 0."""
    fig = Figure(figsize=(max(5, 1.6 * len(cis)), 3.8))
    ax = fig.subplots()
    labels = list(cis)
    means = [cis[k]["mean"] for k in labels]
    errs = np.array([_err(cis[k]) for k in labels]).T
    ax.bar(range(len(labels)), means, yerr=errs, capsize=5, color=[_color(k, i) for i, k in enumerate(labels)])
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9, wrap=True)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


LINESTYLES = {"W": "-", "W_in": "-.", "W_out": "-"}
MARKERS = {"W": "o", "W_in": "s", "W_out": "^"}


def profile_lines(series: dict[str, tuple], path: str, *, ylabel: str, title: str) -> str:
    """Per-bin curves against mean log10 frequency: ``series[label] = (x [B], values [S, B], init [S, B] or
    None)``; points at the seed mean, error bars min-max over the S seeds, init dashed. One shared axis
    (so matrices compare directly); every matrix its own colour and marker."""
    fig = Figure(figsize=(8, 4.6))
    ax = fig.subplots()
    n = 0
    for i, (label, (x, vals, init)) in enumerate(series.items()):
        vals = np.atleast_2d(np.asarray(vals, np.float64))
        n = max(n, len(vals))
        kind = label.split(": ")[-1]
        color = f"C{i}"
        mean = np.nanmean(vals, 0)
        err = np.stack([mean - np.nanmin(vals, 0), np.nanmax(vals, 0) - mean])
        ax.errorbar(x, mean, yerr=err, color=color, marker=MARKERS.get(kind, "o"), ms=4, capsize=3,
                    ls=LINESTYLES.get(kind, "-"), label=label)
        if init is not None:
            ax.plot(x, np.nanmean(np.atleast_2d(init), 0), color=color, ls=":", lw=1)
    ax.set_xlabel("mean log10 relative frequency of the bin (equal token mass per bin)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}; n={n} seeds", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def metric_panels(panels: dict[str, dict[str, tuple]], path: str, *, title: str,
                  reference: float | None = None) -> str:
    """One panel per metric, one bar per label: ``panels[metric][label] = (ci dict, init value or NaN)``;
    bars at the CI mean with its 95% interval, an ``x`` at the init value. Labels are spread on the x axis,
    so no bar hides another."""
    fig = Figure(figsize=(4.6 * len(panels), 4.4))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (metric, bars) in zip(axes, panels.items()):
        labels = list(bars)
        ns = {c.get("n", 0) for c, _ in bars.values()}
        for i, label in enumerate(labels):
            ci, init = bars[label]
            ax.bar(i, ci["mean"], yerr=np.array(_err(ci))[:, None], capsize=4, color=f"C{i}",
                   alpha=0.5 if "shuffled" in label else 1.0)
            if math.isfinite(init):
                ax.plot(i, init, "kx", ms=7)
        if reference is not None:
            ax.axhline(reference, color="gray", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{metric} (n={'/'.join(str(n) for n in sorted(ns))} seeds)", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def loss_vs_params(series: dict[str, list[tuple[float, dict]]], path: str, *, xlabel: str, title: str) -> str:
    """Validation loss against a parameter count (log x), one line per variant, CI error bars.
    ``series[variant] = [(params, ci dict), ...]``."""
    fig = Figure(figsize=(7.5, 4.6))
    ax = fig.subplots()
    for i, (label, pts) in enumerate(series.items()):
        pts = sorted(pts, key=lambda p: p[0])
        x = [p for p, _ in pts]
        y = [c["mean"] for _, c in pts]
        err = np.array([_err(c) for _, c in pts]).T
        ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=3, color=_color(label, i), label=label)
    ax.set_xscale("log")
    ax.set_xlabel(f"{xlabel} (log scale)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def seed_curves(series: dict[str, list[tuple]], path: str, *, ylabel: str, title: str,
                reference: float | None = None) -> str:
    """One line per run over training, runs of a variant in its colour: ``series[variant] = [(seed,
    steps, values), ...]``; log y axis (ratios), a line at ``reference``."""
    fig = Figure(figsize=(8, 4.4))
    ax = fig.subplots()
    for i, (label, runs) in enumerate(series.items()):
        for j, (seed, steps, values) in enumerate(runs):
            ax.plot(steps, values, color=_color(label, i), lw=1.2, alpha=0.8,
                    label=f"{label} ({len(runs)} seeds)" if j == 0 else None)
    if reference is not None:
        ax.axhline(reference, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def lens_layers(means: dict[str, dict], diffs: dict[str, tuple], path: str) -> str:
    """Left: held-out loss by layer per variant (``means[v] = {'logit': [L+1], 'tuned': [L+1]}``; dashed:
    logit lens, solid: tuned lens). Right: each variant minus tied by layer with 95% intervals
    (``diffs[v] = (logit CIs [L+1], tuned CIs [L+1])``)."""
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    for i, (label, m) in enumerate(means.items()):
        x = np.arange(len(m["tuned"]))
        left.plot(x, m["logit"], color=_color(label, i), ls="--", marker="o", ms=3, label=f"{label} logit lens")
        left.plot(x, m["tuned"], color=_color(label, i), ls="-", marker="s", ms=3, label=f"{label} tuned lens")
    layers = max((len(m["tuned"]) for m in means.values()), default=1)
    for ax in (left, right):
        ax.set_xticks(range(layers))
    left.set_xlabel("layer (0 = embedding output; last = the model)")
    left.set_ylabel("held-out loss (nats/token)")
    left.set_title("lens by layer, mean over seeds", fontsize=9)
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    for i, (label, (logit, tuned)) in enumerate(diffs.items()):
        for k, (cis, style) in enumerate(((logit, "--"), (tuned, "-"))):
            x = np.arange(len(cis)) + (0.08 * (2 * k - 1))
            err = np.array([_err(c) for c in cis]).T
            right.errorbar(x, [c["mean"] for c in cis], yerr=err, color=_color(label, i), ls=style, marker="o",
                           ms=3, capsize=3, label=f"{label} - tied, {'logit' if k == 0 else 'tuned'}")
    right.axhline(0, color="gray", lw=0.8)
    right.set_xlabel("layer")
    right.set_ylabel("loss minus tied (nats/token)")
    right.set_title("paired difference to tied, 95% CI over seeds x scored documents", fontsize=9)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    return _save(fig, path)


def bin_intervals(series: dict[str, list[dict]], path: str, *, ylabel: str, title: str) -> str:
    """Per-bin intervals, one line per label: ``series[label] = [ci dict per bin]`` (bin 0 first)."""
    fig = Figure(figsize=(8, 4.2))
    ax = fig.subplots()
    for i, (label, cis) in enumerate(series.items()):
        x = np.arange(len(cis)) + 0.06 * i
        err = np.array([_err(c) for c in cis]).T
        ax.errorbar(x, [c["mean"] for c in cis], yerr=err, color=_color(label, i), marker="o", ms=4, capsize=3,
                    label=label)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("equal-token-mass frequency bin of the target token (0 = rarest)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)
