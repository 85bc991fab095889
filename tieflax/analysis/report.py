"""The compare report: ``report.md`` (and ``report.html`` when markdown-it-py is installed) with PNG plots.

``write_report(summary, out_dir)`` needs only the summary ``run_compare`` builds (also saved as
``summary.json``), so a report can be rewritten without retraining: ``tieflax compare --report-only``.
Each claim of the tied-vs-untied literature gets a line that names the number it is judged on, the
threshold used, and what this run shows; a closing section says what such a run cannot establish.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import numpy as np

from tieflax.analysis import plots
from tieflax.analysis.jsonable import to_jsonable

REPORT = "report.md"
SUMMARY = "summary.json"


# --------------------------------------------------------------------------------------------- helpers
def _by_variant(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        out[r["variant"]].append(r)
    return dict(out)


def _values(runs: list[dict], getter) -> list[float]:
    vals = []
    for r in runs:
        try:
            v = getter(r)
        except (KeyError, TypeError, IndexError):
            continue
        if v is not None and isinstance(v, (int, float)) and math.isfinite(float(v)):
            vals.append(float(v))
    return vals


def _mean(vals: list[float]) -> float:
    return float(np.mean(vals)) if vals else float("nan")


def _fmt(vals: list[float], digits: int = 3) -> str:
    """``mean`` for one seed, ``mean ± std (n)`` for several; ``n/a`` when there is no value."""
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{np.mean(vals):.{digits}f} ± {np.std(vals, ddof=1):.{digits}f} (n={len(vals)})"


def _final(r: dict) -> dict:
    return r["analysis"]["final"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _non_embedding(r: dict) -> int:
    p = r["params"]
    n_mat = 1 if r["variant"] == "tied" else 2
    total = p["total_tied"] if r["variant"] == "tied" else p["total_untied"]
    return total - n_mat * p["embedding_matrix"]


def _total(r: dict) -> int:
    return r["params"]["total_tied"] if r["variant"] == "tied" else r["params"]["total_untied"]


def _share(r: dict) -> float:
    return r["params"]["share_tied"] if r["variant"] == "tied" else r["params"]["share_untied"]


# ---------------------------------------------------------------------------------------------- tables
RESULT_ROWS = [
    ("validation loss (nats/token)", lambda r: r["result"]["final_val_loss"], 4),
    ("validation perplexity", lambda r: r["result"]["final_val_perplexity"], 2),
    ("final train loss", lambda r: r["result"]["final_train_loss"], 4),
    ("total parameters", _total, 0),
    ("non-embedding parameters", _non_embedding, 0),
    ("embedding share of parameters", _share, 3),
    ("tokens / s (training, after compile)", lambda r: r["result"]["tokens_per_second"], 0),
]

DIAG_ROWS = [
    ("Spearman rho, row norm vs frequency: W_in", lambda r: _final(r)["input"]["spearman"]),
    ("Spearman rho, row norm vs frequency: W_out", lambda r: _final(r)["output"]["spearman"]),
    ("mean row norm: W_in", lambda r: _final(r)["input"]["mean_norm"]),
    ("mean row norm: W_out", lambda r: _final(r)["output"]["mean_norm"]),
    ("mean pairwise cosine: W_in", lambda r: _final(r)["input"]["mean_cosine"]),
    ("mean pairwise cosine: W_out", lambda r: _final(r)["output"]["mean_cosine"]),
    ("isotropy (Mu & Viswanath): W_in", lambda r: _final(r)["input"]["isotropy"]),
    ("isotropy (Mu & Viswanath): W_out", lambda r: _final(r)["output"]["isotropy"]),
    ("effective rank: W_in", lambda r: _final(r)["input"]["effective_rank"]),
    ("effective rank: W_out", lambda r: _final(r)["output"]["effective_rank"]),
    ("W_in vs W_out: mean row cosine", lambda r: _final(r)["in_out"]["row_cosine_mean"]),
    ("W_in vs W_out: linear CKA", lambda r: _final(r)["in_out"]["cka"]),
    ("gradient: rows updated by the lookup", lambda r: _final(r)["gradient"]["rows_lookup"]),
    ("gradient: rows updated by the head", lambda r: _final(r)["gradient"]["rows_head"]),
    ("gradient: mean cosine(lookup, head) per row", lambda r: _final(r)["gradient"]["cosine_mean"]),
    ("gradient: fraction of rows in conflict (cosine < 0)", lambda r: _final(r)["gradient"]["conflict_fraction"]),
    ("gradient: head share of squared norm", lambda r: _final(r)["gradient"]["head_share"]),
    ("softmax: mean log-sum-exp (val)", lambda r: _final(r)["softmax"]["mean_lse"]),
    ("softmax: predicted / unigram mass, rarest bucket", lambda r: _final(r)["softmax"]["bucket_mass_ratio"][0]),
    ("softmax: predicted / unigram mass, commonest bucket",
     lambda r: _final(r)["softmax"]["bucket_mass_ratio"][-1]),
]


def results_table(groups: dict[str, list[dict]]) -> str:
    names = list(groups)
    rows = []
    for label, getter, digits in RESULT_ROWS:
        rows.append([label] + [_fmt(_values(groups[n], getter), digits) if digits else
                               (f"{int(_mean(_values(groups[n], getter))):,}" if _values(groups[n], getter)
                                else "n/a") for n in names])
    return _table(["", *names], rows)


def diagnostics_table(groups: dict[str, list[dict]]) -> str:
    names = list(groups)
    rows = [[label] + [_fmt(_values(groups[n], getter)) for n in names] for label, getter in DIAG_ROWS]
    return _table(["", *names], rows)


# ---------------------------------------------------------------------------------------------- claims
def claims(groups: dict[str, list[dict]]) -> list[str]:
    """One bullet per claim of the seeds: the number, the threshold, and what this run shows."""
    g = {n: groups.get(n, []) for n in ("tied", "untied", "untied_matched")}

    def m(name, getter):
        return _mean(_values(g[name], getter))

    out = []
    rho_out_untied = m("untied", lambda r: _final(r)["output"]["spearman"])
    rho_in_untied = m("untied", lambda r: _final(r)["input"]["spearman"])
    rho_tied = m("tied", lambda r: _final(r)["input"]["spearman"])
    if math.isfinite(rho_out_untied):
        if rho_out_untied > 0.3:
            verdict = "consistent with the claim"
        elif rho_out_untied < -0.3:
            verdict = ("not seen here: the head's norms *fall* with frequency (rare rows are the largest), "
                       "the opposite direction (the threshold is rho > 0.3)")
        else:
            verdict = "not seen here: no clear relation (the threshold is rho > 0.3)"
        buckets = g["untied"][0]["analysis"]["final"]["output"]["bucket_norm"]
        out.append(f"**Output-head row norms grow with token frequency.** Untied W_out: Spearman rho = "
                   f"{rho_out_untied:.3f}; {verdict}. Mean norm by frequency bucket, rarest first: "
                   f"{', '.join(f'{b:.3f}' for b in buckets)}. Rho summarises one monotone trend: check "
                   "`norm_vs_frequency.png` for a non-monotone shape (for example norms falling over the "
                   "rare tail and rising over the most frequent tokens).")
    if all(map(math.isfinite, (rho_tied, rho_in_untied, rho_out_untied))):
        closer_to_head = abs(rho_tied - rho_out_untied) < abs(rho_tied - rho_in_untied)
        verdict = ("consistent with the claim: the tied matrix, which is also the input, carries the head's "
                   "frequency-norm profile rather than the one an input matrix takes on its own"
                   if closer_to_head and abs(rho_out_untied - rho_in_untied) > 0.2 else
                   "not seen here (needs the tied rho to sit closer to the untied W_out's than to the untied "
                   "W_in's, with those two differing by > 0.2)")
        out.append(f"**When tied, that distortion reaches the input.** Spearman rho: tied matrix {rho_tied:.3f}, "
                   f"untied W_out {rho_out_untied:.3f}, untied W_in {rho_in_untied:.3f}; {verdict}.")
    cos_tied = m("tied", lambda r: _final(r)["input"]["mean_cosine"])
    cos_in = m("untied", lambda r: _final(r)["input"]["mean_cosine"])
    cos_out = m("untied", lambda r: _final(r)["output"]["mean_cosine"])
    if all(map(math.isfinite, (cos_tied, cos_in, cos_out))):
        verdict = ("consistent with the claim for the input side: the tied input matrix is more anisotropic "
                   "than an untied input matrix" if cos_tied > cos_in + 0.02 else
                   "not seen here (needs the tied mean cosine to exceed the untied W_in's by > 0.02)")
        out.append(f"**Tying magnifies anisotropy.** Mean pairwise cosine: tied {cos_tied:.3f}, untied W_in "
                   f"{cos_in:.3f}, untied W_out {cos_out:.3f}; {verdict}. Compare the tied value with the "
                   "untied W_out's to see whether tying adds anisotropy beyond what the head has on its own. "
                   "See `cosine_histograms.png` and the isotropy and effective-rank rows.")
    rows_l = m("tied", lambda r: _final(r)["gradient"]["rows_lookup"])
    rows_h = m("tied", lambda r: _final(r)["gradient"]["rows_head"])
    cos_g = m("tied", lambda r: _final(r)["gradient"]["cosine_mean"])
    conflict = m("tied", lambda r: _final(r)["gradient"]["conflict_fraction"])
    if all(map(math.isfinite, (rows_l, rows_h, cos_g))):
        if cos_g < -0.05:
            verdict = "interference is seen: on average the two paths push a row in opposed directions"
        elif cos_g > 0.05:
            verdict = "no interference on average: the two paths are mostly aligned here"
        else:
            verdict = "the two paths are on average unrelated (|cosine| <= 0.05), neither aligned nor opposed"
        out.append(
            f"**The tied gradient mixes a dense output signal and a sparse input signal that interfere.** On "
            f"one training batch the head path updates {100 * rows_h:.1f}% of vocabulary rows and the lookup "
            f"path {100 * rows_l:.1f}% (dense vs sparse: {'seen' if rows_h > 5 * rows_l else 'not seen'}). On "
            f"rows both paths update, the mean cosine of the two gradients is {cos_g:.3f} and "
            f"{100 * conflict:.0f}% of those rows have a negative cosine; {verdict} (threshold +-0.05). See "
            "`gradient_interference.png` for the trend over training and `gradient_cosine_by_bucket.png` by "
            "frequency.")
    rare_head = m("tied", lambda r: _final(r)["gradient"]["bucket_rows_head"][0])
    rare_lookup = m("tied", lambda r: _final(r)["gradient"]["bucket_rows_lookup"][0])
    if math.isfinite(rare_head) and math.isfinite(rare_lookup):
        verdict = ("consistent with the claim" if rare_head > 0.99 and rare_lookup < 0.5 else "not seen here")
        out.append(f"**Under tying, rare tokens receive updates every step through the softmax denominator.** "
                   f"Rarest frequency bucket, one batch: {100 * rare_head:.1f}% of its rows get a head gradient, "
                   f"{100 * rare_lookup:.1f}% a lookup gradient; {verdict}. (In an untied model the same head "
                   "gradient goes to W_out only, and a rare token's W_in row moves only when it occurs. With an "
                   "Adam-type optimiser a row's step size depends little on its gradient's magnitude, so a "
                   "small but non-zero head gradient still moves the row every step.)")
    loss = {n: _values(g[n], lambda r: r["result"]["final_val_loss"]) for n in g}
    if loss["tied"] and loss["untied"]:
        spread = max([np.std(v, ddof=1) for v in loss.values() if len(v) > 1] or [float("nan")])
        noise = (f"the largest seed standard deviation is {spread:.4f}" if math.isfinite(spread) else
                 "one seed per variant, so seed-to-seed noise is unmeasured; treat differences below ~0.02 "
                 "nats as noise")
        diff = _mean(loss["untied"]) - _mean(loss["tied"])
        line = (f"**Untied models reach lower loss at matched non-embedding parameters (Chung et al.), while "
                f"small models prefer tying.** Validation loss: tied {_mean(loss['tied']):.4f}, untied (same "
                f"body, +V x d parameters) {_mean(loss['untied']):.4f} (untied - tied = {diff:+.4f})")
        if loss["untied_matched"]:
            diff_m = _mean(loss["untied_matched"]) - _mean(loss["tied"])
            line += (f", untied at equal total parameters {_mean(loss['untied_matched']):.4f} "
                     f"(untied_matched - tied = {diff_m:+.4f})")
        out.append(line + f"; {noise}. A negative difference favours untying.")
    return out


CAVEATS = """\
- **Scale.** These are small models trained for few steps on one corpus. Published claims about tying
  concern models of 10^8 to 10^11 parameters trained on 10^11+ tokens; a loss difference here says how
  *this* model and budget behave, not how a large one would. "Small models prefer tying" and "untied is
  better at scale" can both hold, and a run this size can only speak to the former.
- **Noise.** With one seed, differences between variants of a few hundredths of a nat are within what a
  different seed or data order could produce; run `config.compare.seeds=(0, 1, 2)` for a spread.
- **Budget, not convergence.** All variants get the same steps and tokens, not the same compute or the
  same convergence; an untied head may need more steps to pay for its extra parameters.
- **Snapshots.** The geometry and gradient numbers describe the final checkpoint (and a few earlier ones
  in the plots); the gradient statistics come from one training batch per checkpoint.
- **Associations, not causes.** A frequency-norm correlation or an anisotropic matrix is compatible with
  the mechanisms the literature proposes; this report does not isolate them (for that, vary one switch at
  a time: logit scale, weight decay on embeddings, init).
- **What is solid.** The parameter counts (exact accounting), the dense-vs-sparse structure of the two
  gradient paths (a property of the architecture, visible in any batch) and the definitions of every
  number (see `tieflax/analysis/`)."""


# ----------------------------------------------------------------------------------------------- plots
def make_plots(groups: dict[str, list[dict]], out_dir: str) -> dict[str, str]:
    first = {n: rs[0] for n, rs in groups.items() if rs}
    paths: dict[str, str] = {}
    curves = {}
    for n, rs in groups.items():
        for r in rs:
            label = n if len(rs) == 1 else f"{n} s{r['seed']}"
            train = [(row["step"], float(row.get("ce_loss", row.get("loss")))) for row in r["metrics"]
                     if row.get("split") == "train" and ("ce_loss" in row or "loss" in row)]
            val = [(row["step"], float(row["loss"])) for row in r["metrics"] if row.get("split") == "val"]
            curves[label] = dict(train=train, val=val)
    paths["loss_curves"] = plots.loss_curves(curves, os.path.join(out_dir, "loss_curves.png"))
    finals = {n: _final(r) for n, r in first.items()}
    paths["norm_vs_frequency"] = plots.norm_vs_frequency(finals, os.path.join(out_dir, "norm_vs_frequency.png"))
    paths["cosine_histograms"] = plots.cosine_histograms(finals, os.path.join(out_dir, "cosine_histograms.png"))
    series = {n: [(s, a["gradient"]) for s, a in r["analysis"]["over_time"] if "gradient" in a]
              for n, r in first.items()}
    paths["gradient_interference"] = plots.gradient_interference(
        series, os.path.join(out_dir, "gradient_interference.png"))
    paths["gradient_cosine_by_bucket"] = plots.by_bucket(
        {n: f["gradient"]["bucket_cosine"] for n, f in finals.items() if "gradient" in f},
        os.path.join(out_dir, "gradient_cosine_by_bucket.png"), reference=0.0, ylabel="mean cosine",
        title="cosine(g_lookup[i], g_head[i]) by frequency bucket, final checkpoint")
    paths["softmax_mass_by_bucket"] = plots.by_bucket(
        {n: f["softmax"]["bucket_mass_ratio"] for n, f in finals.items() if "softmax" in f},
        os.path.join(out_dir, "softmax_mass_by_bucket.png"), reference=1.0, log=True,
        ylabel="predicted / unigram mass", title="probability mass the model gives each frequency bucket "
        "(val), relative to the bucket's unigram share")
    paths["norm_by_bucket"] = plots.by_bucket(
        {f"{n} {side}": f[side]["bucket_norm"] for n, f in finals.items()
         for side in (("input",) if f.get("tied") else ("input", "output"))},
        os.path.join(out_dir, "norm_by_bucket.png"), ylabel="mean row norm",
        title="mean row norm by frequency bucket (input = W_in, output = W_out)")
    # Rows of split 'diag' hold training_diagnostics' keys, with or without their 'diag/' prefix.
    diag_rows = {n: [{k.removeprefix("diag/"): v for k, v in row.items()} for row in r["metrics"]
                     if row.get("split") == "diag"] for n, r in first.items()}
    if any(diag_rows.values()):
        paths["diagnostics_over_training"] = plots.diagnostics_over_training(
            diag_rows, [("input/spearman", "rho(norm, freq): W_in"),
                        ("output/spearman", "rho(norm, freq): W_out"),
                        ("input/mean_cosine", "mean cosine: W_in"),
                        ("output/mean_cosine", "mean cosine: W_out")],
            os.path.join(out_dir, "diagnostics_over_training.png"))
    return paths


# ---------------------------------------------------------------------------------------------- report
def _setup_section(summary: dict, groups: dict[str, list[dict]]) -> str:
    cfg = summary["config"]
    t, d = cfg["train"], cfg["data"]
    tokens = t["num_steps"] * t["global_batch_size"] * t["seq_len"]
    lines = [
        f"- Data: `{d['source']}` corpus, vocabulary {cfg['model']['vocab_size']:,}, one tokenizer and one token "
        f"cache shared by every run (`{groups[next(iter(groups))][0]['analysis'].get('data_dir', '')}`).",
        f"- Budget per run: {t['num_steps']:,} steps x {t['global_batch_size']} sequences x {t['seq_len']} tokens "
        f"= {tokens:,} training tokens; learning rate {t['learning_rate']}, warmup {t['warmup_steps']}, "
        f"weight decay {t['weight_decay']} (embeddings decayed: {t['decay_embeddings']}).",
        f"- Seeds: {', '.join(str(s) for s in summary['compare']['seeds'])} (the seed sets the init and the "
        "data order; every variant sees the same batches for a given seed).",
    ]
    shapes = []
    for n, rs in groups.items():
        mdl = rs[0]["model"]
        shapes.append([n, "yes" if mdl["tie_embeddings"] else "no", str(mdl["d_model"]), str(mdl["n_layers"]),
                       str(mdl["d_ff"]), f"{_total(rs[0]):,}", f"{_non_embedding(rs[0]):,}"])
    table = _table(["variant", "tied", "d_model", "layers", "d_ff", "total params", "non-embedding"], shapes)
    match = summary.get("match") or {}
    if match:
        lines.append(
            f"- Parameter match (Chung et al.): `untied_matched` sheds parameters by **{match['strategy']}** "
            f"(d_model {match['tied_shape']['d_model']} -> {match['matched_shape']['d_model']}, layers "
            f"{match['tied_shape']['n_layers']} -> {match['matched_shape']['n_layers']}, d_ff "
            f"{match['tied_shape']['d_ff']} -> {match['matched_shape']['d_ff']}): {match['matched_total']:,} "
            f"parameters vs the tied model's {match['target_total']:,} "
            f"({100 * match['relative_mismatch']:+.3f}%).")
    return "\n".join(lines) + "\n\n" + table


def render(summary: dict, plot_paths: dict[str, str]) -> str:
    groups = _by_variant(summary["runs"])
    parts = [
        "# Tied vs untied embeddings: comparison report",
        "",
        f"Produced by `tieflax compare` in {summary.get('wall_seconds', float('nan')) / 60:.1f} minutes. Every "
        "number below is defined in the docstrings of `tieflax/analysis/` (frequency buckets split the "
        f"vocabulary into {summary['compare']['n_buckets']} equal-size groups by train count, rarest first; "
        "padding rows are excluded everywhere).",
        "",
        "## Setup",
        "",
        _setup_section(summary, groups),
        "",
        "## Results",
        "",
        "Mean over seeds (± sample standard deviation when there are several).",
        "",
        results_table(groups),
        "",
        "![loss curves](loss_curves.png)",
        "",
        "## Diagnostics (final checkpoint)",
        "",
        "For the tied model W_in and W_out are the same matrix. Gradient rows: one training batch (the first "
        "of the run's data order), the loss's gradient split into its lookup and head paths (for a tied "
        "model these sum exactly to its gradient).",
        "",
        diagnostics_table(groups),
        "",
        "## The claims, checked against these numbers",
        "",
        *[f"- {c}" for c in claims(groups)],
        "",
        "## Plots",
        "",
    ]
    captions = {
        "norm_vs_frequency": "Row norm against train frequency, per matrix (binned mean in black).",
        "norm_by_bucket": "Mean row norm by frequency bucket.",
        "cosine_histograms": "Pairwise cosine of rows (a sample of rows): mass right of 0 is anisotropy.",
        "gradient_interference": "Gradient interference over training (step 0 = initialisation; one batch per point).",
        "gradient_cosine_by_bucket": "Cosine of the two gradient paths per frequency bucket, final checkpoint.",
        "softmax_mass_by_bucket": "Softmax mass per frequency bucket relative to its unigram share (1 = calibrated).",
        "diagnostics_over_training": "Diagnostics logged during training (rows of split `diag` in metrics.jsonl).",
    }
    for key, caption in captions.items():
        if key in plot_paths:
            parts += [f"**{caption}**", "", f"![{key}]({os.path.basename(plot_paths[key])})", ""]
    parts += ["## What these numbers support, and what they do not", "", CAVEATS, "",
              "## Runs", "", *[f"- `{r['variant']}` seed {r['seed']}: `{r['run_dir']}` "
                                f"(`tieflax analyze --workdir {r['run_dir']}` for its full diagnostics)"
                                for r in summary["runs"]], ""]
    return "\n".join(parts)


def write_report(summary: dict, out_dir: str) -> str:
    """Writes ``summary.json``, the PNGs, ``report.md`` (and ``report.html`` if cheap); returns the .md path."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, SUMMARY), "w", encoding="utf-8") as f:
        json.dump(to_jsonable(summary), f, default=float)
    plot_paths = make_plots(_by_variant(summary["runs"]), out_dir)
    text = render(summary, plot_paths)
    path = os.path.join(out_dir, REPORT)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    write_html(text, os.path.join(out_dir, "report.html"))
    return path


def write_html(markdown_text: str, path: str) -> str | None:
    """``report.html`` via markdown-it-py when it is installed (images stay relative); else nothing."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        return None
    body = MarkdownIt("commonmark").enable("table").render(markdown_text)
    html = ("<!doctype html><html><head><meta charset='utf-8'><title>tieflax compare report</title><style>"
            "body{font-family:sans-serif;max-width:70em;margin:2em auto;line-height:1.4}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
            "img{max-width:100%}</style></head><body>" + body + "</body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return path


def load_summary(out_dir: str) -> dict:
    with open(os.path.join(out_dir, SUMMARY), encoding="utf-8") as f:
        return json.load(f)
