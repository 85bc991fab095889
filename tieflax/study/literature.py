"""The study's answer to this year's papers: the "From the literature" table at the top of the report.
One concern's two sides: the table, intervals and verdicts here; the measures they are drawn from in
``tieflax.analysis.literature``.

Each row is a claim, its source (arXiv id), the paired measure it is judged on, the value with its 95%
interval and a verdict drawn from the interval alone:

- *holds here*: the interval lies on the side the paper predicts;
- *contradicted here*: it lies on the other side;
- *unresolved*: it includes the reference value (0);
- *no verdict from < 2 units*: no interval can be formed (fewer than 2 resampling units at a level the
  interval resamples: "1 seed: no interval over seeds"), and the row says what is missing.

(:mod:`tieflax.study.findings` computes the words and each row's finding.) Every difference between
variants is taken as *untied - tied* (the variant minus ``tied``); rows that are not such a difference say
what they are instead.

Claims (Lopardo, Harish, Arnett, Gupta, arXiv 2603.26663; Leviathan, arXiv 2601.22040; the tuned lens is
Belrose et al., arXiv 2303.08112):

1. **Unembedding bias**: a tied matrix is more like an untied model's head than like its input
   embedding: linear CKA and 10-nearest-neighbour overlap, "like the head - like the input", the untied
   run of another seed (``summary['alignment']``; :func:`tieflax.study.compare.alignment_study`).
2. **The output path drives the tied matrix early**: log(||g_head|| / ||g_lookup||) over the first 10%
   of the steps, from the trainer's logged gradient norms (:func:`tieflax.analysis.literature.path_ratio`).
3. **Tied early layers contribute less to the residual stream**: the drop in tuned-lens loss over the
   first half of the layers, untied minus tied (``analysis['lens']``; the lens trained by KL as
   Belrose et al. train it, :mod:`tieflax.analysis.lens`).
4. **Scaling the input path's gradient reduces the bias** (only when ``tied_input_grad_scaled`` ran): the
   row-1 measure, ``tied_input_grad_scaled`` minus ``tied``.
5. **Untying's gains concentrate in rare tokens**: the share of the untied - tied loss difference that the
   rarest half of the equal-mass frequency bins carries, minus their share of the scored tokens.
6. **... and grow with training**: the untied - tied loss on the rarest half of the bins (nats per token
   of that half) at the last analysed checkpoint minus at the first (``analysis['through']``).

Everything here reads only the summary ``run_compare`` writes, so ``--report-only`` redraws it.
"""

from __future__ import annotations

import math

import numpy as np

from tieflax import storage
from tieflax.analysis import lens as lens_lib
from tieflax.analysis import literature as lit
from tieflax.analysis import plots
from tieflax.analysis import stats as st
from tieflax.study.findings import CONTRA, HOLDS, LITTLE, OPEN, Claim, finding, judge  # noqa: F401 (re-exported)

NAN = float("nan")
BIAS = "2603.26663"
# The tuned lens's values are printed to 3 decimals: its SGD training moves a run's value by about 1e-3
# when the parameters change by an ulp (docs/study.md), so a 4th decimal would be noise.
LENS_DIGITS = 3
LEVIATHAN = "2601.22040"


# --------------------------------------------------------------------------------------------- helpers
def _runs(groups: dict, variant: str) -> dict[int, dict]:
    return {r["seed"]: r for r in groups.get(variant, []) if r.get("analysis")}


def _n_boot(summary: dict) -> int:
    return summary.get("compare", {}).get("bootstrap", st.N_BOOT)


def cell(ci: dict, digits: int = 3, transform=None, short: bool = False) -> str:
    """``mean [lo, hi]`` (``transform`` applied to each), or the mean and what is missing (``short``:
    "no interval", for table cells under a sentence that says why); never NaN."""
    f = transform or (lambda x: x)
    mean = ci.get("mean", NAN)
    why = "no interval" if short else (st.missing(ci) or "not measured")
    if not math.isfinite(mean):
        return f"n/a ({why})"
    lo, hi = ci.get("lo", NAN), ci.get("hi", NAN)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{f(mean):+.{digits}f} ({why})"
    return f"{f(mean):+.{digits}f} [{f(lo):+.{digits}f}, {f(hi):+.{digits}f}]"


def _seed_ci(values: dict[int, float], n_boot: int) -> dict:
    return st.bootstrap_ci([values[s] for s in sorted(values)], n_boot=n_boot)


def _clean(x):
    """NaN -> None, recursively: what summary.json's literature rows carry."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


# ------------------------------------------------------------------------------------ 1. the bias
def bias_values(summary: dict, variant: str = "tied", kind: str = "cross", state: str = "final",
                key: str = "cka_diff") -> dict[int, float]:
    """``{seed: alignment[variant][seed][kind][state][key]}`` (``kind``: 'cross' or 'same')."""
    out = {}
    for seed, entry in ((summary.get("alignment") or {}).get(variant) or {}).items():
        value = (entry.get(kind) or {}).get(state, {}).get(key)
        if value is not None and math.isfinite(value):
            out[int(seed)] = float(value)
    return out


def bias_ci(summary: dict, variant: str = "tied", kind: str = "cross", state: str = "final",
            key: str = "cka_diff") -> dict:
    ci = _seed_ci(bias_values(summary, variant, kind, state, key), _n_boot(summary))
    if kind == "cross" and len(summary.get("compare", {}).get("seeds", [])) < 2:
        ci["missing"] = "1 seed: no untied run of another seed to compare with, and no interval over seeds"
    return ci


def bias_effect(summary: dict, variant: str, key: str = "cka_diff") -> dict:
    """``variant`` minus ``tied`` of the bias measure, paired by seed (both against the same untied run)."""
    a, b = bias_values(summary, variant, key=key), bias_values(summary, "tied", key=key)
    return st.bootstrap_ci([a[s] - b[s] for s in sorted(set(a) & set(b))], n_boot=_n_boot(summary))


# ---------------------------------------------------------------------------------- 2. the paths
def path_values(groups: dict, variant: str, part: str = "early") -> dict[int, float]:
    out = {}
    for r in groups.get(variant, []):
        p = lit.path_ratio(r.get("metrics") or [], int(r["train"]["num_steps"]))
        if math.isfinite(p[part]):
            out[r["seed"]] = p[part]
    return out


def path_ci(summary: dict, groups: dict, variant: str = "tied", part: str = "early") -> dict:
    return _seed_ci(path_values(groups, variant, part), _n_boot(summary))


def path_effect(summary: dict, groups: dict, variant: str, part: str = "early") -> dict:
    a, b = path_values(groups, variant, part), path_values(groups, "tied", part)
    return st.bootstrap_ci([a[s] - b[s] for s in sorted(set(a) & set(b))], n_boot=_n_boot(summary))


# ----------------------------------------------------------------------------------- 3. the lens
def _lens(r: dict) -> dict | None:
    lens = r["analysis"].get("lens")
    return lens if lens and "missing" not in lens else None


def lens_missing(groups: dict) -> str:
    for rs in groups.values():
        for r in rs:
            lens = r.get("analysis", {}).get("lens") if r.get("analysis") else None
            if lens is None:
                return "not measured (config.compare.lens_fit_tokens = 0, or an analysis from before the lens)"
            if "missing" in lens:
                return lens["missing"]
    return ""


def early_layer(n_layers: int) -> int:
    """The layer after the first half of the blocks (at least 1)."""
    return max(1, n_layers // 2)


def _lens_arrays(groups: dict, variant: str, seeds: list[int], fn) -> np.ndarray:
    return np.array([fn(_lens(_runs(groups, variant)[s])) for s in seeds], np.float64)


def lens_compare(summary: dict, groups: dict, variant: str, base: str = "tied") -> dict | None:
    """``variant`` minus ``base``, paired by seed and scored document: per layer, the logit- and the
    tuned-lens loss (``logit`` / ``tuned``: lists over layers 0..L of two-level intervals) and ``early``:
    the drop of the tuned-lens loss over the first half of the layers. None when either lacks a lens."""
    a, b = _runs(groups, variant), _runs(groups, base)
    seeds = sorted(s for s in set(a) & set(b) if _lens(a[s]) and _lens(b[s]))
    if not seeds:
        return None
    first = _lens(a[seeds[0]])
    tokens = np.asarray(first["doc_tokens"], np.float64)
    keep = tokens > 0
    n_layers = first["layers"]
    if _lens(b[seeds[0]])["layers"] != n_layers:
        return None  # another depth: layer by layer is not a pairing
    boot = dict(n_boot=_n_boot(summary))
    out = dict(seeds=seeds, layers=n_layers, docs=int(keep.sum()), early_layer=early_layer(n_layers))
    for kind in ("logit", "tuned"):
        out[kind] = [st.two_level_bootstrap(_lens_arrays(groups, variant, seeds, lambda L, i=i, k=kind: L[k][i])[:, keep],
                                            _lens_arrays(groups, base, seeds, lambda L, i=i, k=kind: L[k][i])[:, keep],
                                            tokens[keep], **boot)
                     for i in range(n_layers + 1)]
    drop = lambda L: lit.layer_contribution(L["tuned"], 0, out["early_layer"])  # noqa: E731
    out["early"] = st.two_level_bootstrap(_lens_arrays(groups, variant, seeds, drop)[:, keep],
                                          _lens_arrays(groups, base, seeds, drop)[:, keep], tokens[keep], **boot)
    return out


def lens_means(groups: dict, variant: str) -> dict | None:
    """Token-weighted mean loss per layer over the variant's seeds: ``{'logit': [L+1], 'tuned': [L+1]}``."""
    lenses = [_lens(r) for r in _runs(groups, variant).values() if _lens(r)]
    if not lenses:
        return None
    tokens = sum(np.sum(L["doc_tokens"]) for L in lenses)
    return {k: (np.sum([np.sum(L[k], axis=1) for L in lenses], axis=0) / tokens).tolist() for k in ("logit", "tuned")}


# ------------------------------------------------------------------------------------ 5. rare tokens
def rare_compare(summary: dict, groups: dict, variant: str, base: str = "tied") -> dict | None:
    """Per equal-mass bin of the target token: ``variant`` minus ``base`` loss (two-level intervals), and
    ``share``: the share of the whole difference the rarest half of the bins carries, minus their share of
    the scored tokens (> 0: the difference concentrates in rare tokens); ``total``: the whole difference."""
    a, b = _runs(groups, variant), _runs(groups, base)
    seeds = sorted(s for s in set(a) & set(b) if "doc_bin_loss" in a[s]["analysis"]["val"]
                   and "doc_bin_loss" in b[s]["analysis"]["val"])
    if not seeds:
        return None
    la = np.array([a[s]["analysis"]["val"]["doc_bin_loss"] for s in seeds], np.float64)   # [S, D, B]
    lb = np.array([b[s]["analysis"]["val"]["doc_bin_loss"] for s in seeds], np.float64)
    tokens = np.asarray(a[seeds[0]]["analysis"]["val"]["doc_bin_tokens"], np.float64)    # [D, B]
    keep = tokens.sum(1) > 0
    la, lb, tokens = la[:, keep], lb[:, keep], tokens[keep]
    n_bins = tokens.shape[1]
    boot = dict(n_boot=_n_boot(summary))
    bins = []
    for k in range(n_bins):
        docs = tokens[:, k] > 0
        bins.append(st.two_level_bootstrap(la[:, docs, k], lb[:, docs, k], tokens[docs, k], **boot) if docs.any()
                    else dict(mean=NAN, lo=NAN, hi=NAN, missing="no scored token in this bin"))
    rare = slice(0, n_bins // 2)
    diff = la - lb
    share = st.two_level_ratio(diff[:, :, rare].sum(2), diff.sum(2),
                               minus=(tokens[:, rare].sum(1), tokens.sum(1)), **boot)
    share["token_share"] = float(tokens[:, rare].sum() / tokens.sum())
    share["diff_share"] = share["mean"] + share["token_share"] if math.isfinite(share["mean"]) else NAN
    total = st.two_level_bootstrap(diff.sum(2), np.zeros_like(diff.sum(2)), tokens.sum(1), **boot)
    return dict(seeds=seeds, bins=bins, share=share, total=total, n_bins=n_bins,
                bin_tokens=tokens.sum(0).tolist())


def _through_of(run: dict) -> dict[int, list]:
    return {int(t["step"]): t["doc_bin_loss"] for t in run["analysis"].get("through") or []}


def _bin_interval(diff: np.ndarray, tokens: np.ndarray, boot: dict) -> dict:
    """Two-level interval of ``diff`` [S, D] summed loss differences per token of ``tokens`` [D] (documents
    without a token left out)."""
    docs = tokens > 0
    if not docs.any():
        return dict(mean=NAN, lo=NAN, hi=NAN, missing="no scored token")
    return st.two_level_bootstrap(diff[:, docs], np.zeros_like(diff[:, docs]), tokens[docs], **boot)


def through_compare(summary: dict, groups: dict, variant: str, base: str = "tied") -> dict | None:
    """``variant`` minus ``base`` at every analysed checkpoint both have (``analysis['through']``), paired by
    seed and document; every interval resamples seeds and documents with the same draws at every step.

    Returns ``steps`` [K]; per step ``bins`` [K][B] (loss difference per token of each bin), ``total`` [K]
    (per scored token), ``rare`` [K] (per token of the rarest half of the bins), ``share`` [K] (the rarest
    half's share of the difference minus its share of the tokens); ``growth``: ``rare`` at the last step
    minus at the first (< 0: untying's rare-token gain grew) and ``share_change`` the same of ``share``.
    None when no paired run has checkpoints measured through training."""
    a, b = _runs(groups, variant), _runs(groups, base)
    seeds = sorted(s for s in set(a) & set(b) if _through_of(a[s]) and _through_of(b[s])
                   and "doc_bin_tokens" in a[s]["analysis"]["val"])
    if not seeds:
        return None
    steps = sorted(set.intersection(*[set(_through_of(r)) for s in seeds for r in (a[s], b[s])]))
    if not steps:
        return None
    tokens = np.asarray(a[seeds[0]]["analysis"]["val"]["doc_bin_tokens"], np.float64)            # [D, B]
    keep = tokens.sum(1) > 0
    cube = lambda runs: np.array([[_through_of(runs[s])[k] for k in steps] for s in seeds], np.float64)  # noqa: E731
    diff = (cube(a) - cube(b))[:, :, keep]                                                            # [S, K, D, B]
    tokens = tokens[keep]
    n_bins = tokens.shape[1]
    rare = slice(0, n_bins // 2)
    boot = dict(n_boot=_n_boot(summary))
    rare_diff = diff[:, :, :, rare].sum(3)                                                            # [S, K, D]
    out = dict(seeds=seeds, steps=steps, n_bins=n_bins,
               bins=[[_bin_interval(diff[:, k, :, j], tokens[:, j], boot) for j in range(n_bins)]
                     for k in range(len(steps))],
               total=[_bin_interval(diff[:, k].sum(2), tokens.sum(1), boot) for k in range(len(steps))],
               rare=[_bin_interval(rare_diff[:, k], tokens[:, rare].sum(1), boot) for k in range(len(steps))],
               share=[st.two_level_ratio(rare_diff[:, k], diff[:, k].sum(2),
                                         minus=(tokens[:, rare].sum(1), tokens.sum(1)), **boot)
                      for k in range(len(steps))])
    if len(steps) < 2:
        why = (f"1 analysed checkpoint (step {steps[0]}): no change over training; keep more "
               "(config.compare.analysis_points >= 2)")
        out["growth"] = out["share_change"] = dict(mean=NAN, lo=NAN, hi=NAN, missing=why)
    else:
        out["growth"] = st.two_level_bootstrap(rare_diff[:, -1], rare_diff[:, 0], tokens[:, rare].sum(1), **boot)
        out["share_change"] = st.two_level_ratio(rare_diff[:, -1], diff[:, -1].sum(2),
                                                 minus=(rare_diff[:, 0], diff[:, 0].sum(2)), **boot)
    return out


# ------------------------------------------------------------------------------------------ the rows
CLAIMS = {
    "bias": Claim("A tied matrix is more like an untied model's head than like its input embedding", f"arXiv {BIAS}",
                  "above", "The tied matrix is more like an untied head than like an untied input embedding",
                  "The tied matrix is more like an untied input embedding than like an untied head",
                  "Unembedding bias"),
    "path": Claim("The output path's gradient dominates the tied matrix early in training", f"arXiv {BIAS}", "above",
                  "The head path's gradient is the larger one into the tied matrix early in training",
                  "The lookup path's gradient is the larger one into the tied matrix early in training",
                  "Which path drives the tied matrix early"),
    "lens": Claim("Tied early layers contribute less to the residual stream (tuned lens)", f"arXiv {BIAS}", "above",
                  "The untied model's first blocks lower the tuned-lens loss more than the tied model's",
                  "The tied model's first blocks lower the tuned-lens loss more than the untied model's",
                  "Early-layer contribution, untied - tied"),
    "intervention": Claim("Scaling the input path's gradient during training reduces the unembedding bias",
                          f"arXiv {BIAS}", "below", "Scaling the lookup gradient raised the unembedding bias",
                          "Scaling the lookup gradient lowered the unembedding bias",
                          "The intervention's effect on the bias"),
    "rare": Claim("Untying's gains concentrate in rare tokens", f"arXiv {LEVIATHAN}", "above",
                  "The rarest half of the bins carries more of the untied - tied difference than of the tokens",
                  "The rarest half of the bins carries less of the untied - tied difference than of the tokens",
                  "Where untying's gain lies"),
    "growth": Claim("Untying's gains in rare tokens grow with training", f"arXiv {LEVIATHAN}", "below",
                    "Untying's gain on the rarest half of the bins shrank over training",
                    "Untying's gain on the rarest half of the bins grew over training",
                    "Untying's rare-token gain over training"),
}


def _row(key: str, measure: str, ci: dict, value: str, verdict: str | None = None, **extra) -> dict:
    f = finding(CLAIMS[key], ci, verdict)
    note = (st.missing(ci) or "no interval") if f["verdict"] == LITTLE else ""
    if note and " (" in value:
        value = value.split(" (")[0] + " (no interval)"  # what is missing is said once, in the verdict
    return dict(f, key=key, measure=measure, value=value, missing=note, n_seeds=ci.get("n", ci.get("n_seeds", 0)),
                **extra)


def literature_rows(summary: dict, groups: dict) -> list[dict]:
    """The table's rows (plain values; NaN where a number is undefined, the table never shows it): each a
    :func:`tieflax.study.findings.finding` with ``key``, ``measure``, ``value`` and ``missing``."""
    rows = []
    tied, untied = "tied" in groups, "untied" in groups
    if tied and untied:
        for key, label in (("cka_diff", "linear CKA"), ("knn_diff", f"{summary['compare'].get('knn', 10)}-NN overlap")):
            ci = bias_ci(summary, "tied", key=key)
            rows.append(_row("bias", f"{label}: like the untied head - like the untied input embedding, tied W (final) "
                                     "against the untied run of the next seed (one tied matrix against two untied "
                                     "ones, not a difference of variants)", ci, cell(ci)))
    if tied:
        ci = path_ci(summary, groups, "tied", "early")
        rows.append(_row("path", "ln(||g_head|| / ||g_lookup||) over the first 10% of steps (logged norms), tied "
                                 "alone (> 0: the head's is larger; the ratio is exp of this)", ci, cell(ci)))
    if tied and untied:
        comp = lens_compare(summary, groups, "untied", "tied")
        if comp is None:
            ci = dict(mean=NAN, lo=NAN, hi=NAN, missing=lens_missing(groups) or "no paired lens")
            layer = "L/2"
        else:
            ci, layer = comp["early"], str(comp["early_layer"])
        rows.append(_row("lens", f"tuned-lens loss drop from layer 0 to layer {layer} (nats/token), untied - tied "
                                 "(> 0: untied's first blocks lower it more); held-out documents, translators "
                                 "trained by KL (Belrose et al.)", ci, cell(ci, LENS_DIGITS)))
    if tied and "tied_input_grad_scaled" in groups:
        scale = summary["compare"].get("input_grad_scale", NAN)
        ci = bias_effect(summary, "tied_input_grad_scaled", "cka_diff")
        rows.append(_row("intervention", f"CKA like the head - like the input, tied_input_grad_scaled (lookup "
                                         f"gradient x {scale:g}) - tied (both tied: a difference of two tied "
                                         "variants), same untied runs", ci, cell(ci)))
    if tied and untied:
        rows += _rare_rows(summary, groups)
    return rows


def _rare_rows(summary: dict, groups: dict) -> list[dict]:
    """The two rare-token rows: where untying's gain lies (share), and whether it grows over training."""
    rows = []
    comp = rare_compare(summary, groups, "untied", "tied")
    if comp is None:
        ci, verdict = dict(mean=NAN, lo=NAN, hi=NAN, missing="no per-bin losses (an analysis from before them)"), LITTLE
    else:
        ci = comp["share"]
        verdict = judge(ci, "above")
        total = judge(comp["total"], "below")
        if verdict in (HOLDS, CONTRA) and total != HOLDS:
            verdict = OPEN if total != LITTLE else LITTLE  # no resolved gain of untying to share out
    rows.append(_row("rare", "share of the untied - tied loss difference carried by the rarest half of the "
                             "equal-mass frequency bins, minus their share of the scored tokens (> 0: more of the "
                             "difference than of the tokens)", ci, cell(ci), verdict))
    through = through_compare(summary, groups, "untied", "tied")
    if through is not None:
        ci = through["growth"]
        first, last = through["steps"][0], through["steps"][-1]
        rows.append(_row("growth", f"untied - tied loss on the rarest half of the bins (nats per token of that half), "
                                   f"step {last} minus step {first} (< 0: the gain grew)", ci, cell(ci, 4)))
    return rows


def literature_table(rows: list[dict], table) -> str:
    body = [[r["finding"], f"\"{r['claim']}\" ({r['source']})", r["measure"], r["value"],
             r["verdict"] + (f" ({r['missing']})" if r["missing"] else "")] for r in rows]
    return table(["finding", "claim tested (source)", "measure", "value [95% CI]", "verdict"], body)


def summary_rows(rows: list[dict]) -> list[dict]:
    """The rows as summary.json carries them (no NaN: undefined numbers are null)."""
    return _clean(rows)


# --------------------------------------------------------------------------------------- the section
def section(summary: dict, groups: dict, table, loss_comps: list[dict] = ()) -> str:
    """The literature section's detail: every number behind the table, with its controls.
    ``loss_comps``: the report's two-level loss differences to ``tied`` (for the intervention's loss)."""
    knn = summary["compare"].get("knn", 10)
    parts = (_bias_parts(summary, table, knn) + _path_parts(summary, groups) + _lens_parts(summary, groups, table)
             + _intervention_parts(summary, groups, loss_comps, knn) + _rare_token_parts(summary, groups, table))
    seeds = len({int(r["seed"]) for rs in groups.values() for r in rs})   # distinct seeds: the units
    docs = (summary.get("data") or {}).get("n_docs", 2)
    why = "; ".join(m for m in (st.too_little(seeds, "seed"), st.too_little(docs, "document")) if m)
    if parts and why:
        parts.append(f"(\"no interval\" in these tables: {why}.)")
    return "\n".join(parts)


def _bias_parts(summary: dict, table, knn: int) -> list[str]:
    """Unembedding bias: CKA and k-NN overlap of each tied matrix with an untied run's input and head."""
    parts = []
    tied_variants = list((summary.get("alignment") or {}))
    if tied_variants:
        rows = []
        for v in tied_variants:
            for kind, label in (("cross", "untied of the next seed"), ("same", "untied of the same seed")):
                for state in ("final", "init"):
                    cis = {k: bias_ci(summary, v, kind, state, k) for k in
                           ("cka_output", "cka_input", "cka_diff", "knn_output", "knn_input", "knn_diff")}
                    if not math.isfinite(cis["cka_diff"]["mean"]):
                        continue
                    rows.append([f"{v} vs {label}, {state}"] + [cell(cis[k], short=True) for k in cis])
        chance = next((e.get("cross", e.get("same", {})).get("final", {}).get("knn_chance")
                       for e in summary["alignment"][tied_variants[0]].values()), None)
        parts += [
            "**Unembedding bias.** How alike each tied matrix is to an untied run's input embedding (W_in) and head "
            f"(W_out), over the rows of tokens seen in training: linear CKA and the share of each row's {knn} nearest "
            "neighbours (cosine) the two matrices agree on"
            + (f" (two unrelated matrices: about {chance:.4f})" if chance else "") + "; 95% intervals over seeds. "
            "What the init pairs share: a tied run and the untied run of the *same* seed draw the embedding from "
            "the same key, so at init the tied matrix *is* the untied W_in (CKA and overlap 1) and is unrelated to "
            "the untied head; against the untied run of the *next* seed nothing is shared at init (both "
            "differences near 0). The table judges the next-seed comparison.", "",
            table(["pair", "CKA with W_out", "CKA with W_in", "CKA: head - input", f"{knn}-NN with W_out",
                   f"{knn}-NN with W_in", f"{knn}-NN: head - input"], rows), ""]
    return parts


def _path_parts(summary: dict, groups: dict) -> list[str]:
    """Which path drives the tied matrix: the head's and the lookup's gradient norms, early and late."""
    parts, n_boot = [], _n_boot(summary)
    lines = []
    for v in [v for v in groups if v in ("tied", "tied_input_grad_scaled") or v.startswith("tied")]:
        if not path_values(groups, v):
            continue
        early, late = path_ci(summary, groups, v, "early"), path_ci(summary, groups, v, "late")
        diff = st.bootstrap_ci([path_values(groups, v)[s] - path_values(groups, v, "late")[s]
                                for s in sorted(path_values(groups, v))], n_boot=n_boot)
        lines.append(f"`{v}`: early {cell(early)} (ratio {_exp(early)}), late {cell(late)} (ratio {_exp(late)}); "
                     f"early - late {cell(diff)}: "
                     f"{st.verdict(diff, 'the head path dominates more early than late', 'it dominates less early than late')}")
    if lines:
        parts += ["**Which path drives the tied matrix.** ln(||g_head|| / ||g_lookup||) of the two exact gradient "
                  "contributions the trainer logs (`grad_norm/embed_head`, `grad_norm/embed_lookup`; for "
                  "`tied_input_grad_scaled` the lookup path as scaled, what enters the matrix), mean over the "
                  "logged rows of the first and of the last 10% of the steps, 95% interval over seeds "
                  "(`input_path_ratio.png`: every seed over training):\n  - " + "\n  - ".join(lines), ""]
    return parts


def _lens_parts(summary: dict, groups: dict, table) -> list[str]:
    """Lens by layer: held-out loss read out after each layer (logit and tuned lens), and paired differences."""
    parts = []
    lens_rows = []
    for v in groups:
        if v == "tied":
            continue
        comp = lens_compare(summary, groups, v, "tied")
        if comp is None:
            continue
        for i in range(comp["layers"] + 1):
            lens_rows.append([f"{v} - tied, layer {i}" + (" (the model)" if i == comp["layers"] else ""),
                              cell(comp["logit"][i], LENS_DIGITS, short=True),
                              cell(comp["tuned"][i], LENS_DIGITS, short=True)])
        lens_rows.append([f"{v} - tied, tuned-lens drop layer 0 -> {comp['early_layer']}", "",
                          cell(comp["early"], LENS_DIGITS, short=True)])
    means = {v: lens_means(groups, v) for v in groups}
    if lens_rows:
        any_lens = next(_lens(r) for rs in groups.values() for r in rs if r.get("analysis") and _lens(r))
        mean_rows = [[v, *(f"{x:.3f} / {y:.3f}" for x, y in zip(m["logit"], m["tuned"]))]
                     for v, m in means.items() if m]
        n_layers = any_lens["layers"]
        parts += [
            "**Lens by layer.** Held-out loss (nats/token) when the residual stream after each layer (0: the "
            "embedding output, before any block) is read out through the final norm and the model's own head: "
            "plain (logit lens) and through a translator per layer, `h + A h + b`, trained from the identity "
            "(A, b = 0) to minimise the KL divergence from the model's own final-layer distribution at the same "
            "position (the tuned lens as Belrose et al., arXiv 2303.08112, train it; "
            f"{lens_lib.describe(any_lens.get('recipe') or {})}), on the first {any_lens['fit_tokens']:,} "
            f"positions of the first half of the held-out documents ({any_lens['fit_docs']}), scored by the "
            f"next-token loss on {any_lens['score_docs']} documents of the second half. Mean over seeds, "
            "logit / tuned:", "",
            table(["variant", *[f"layer {i}" for i in range(n_layers + 1)]], mean_rows), "",
            "Paired differences, untied - tied (seeds x scored documents, 95% intervals; `lens_by_layer.png`); "
            "the drop row is layer 0's loss minus the later layer's, so > 0 means the variant's first blocks "
            "lower the loss more than tied's:", "",
            table(["difference", "logit lens", "tuned lens"], lens_rows), ""]
    elif lens_missing(groups):
        parts += [f"**Lens by layer.** Not measured: {lens_missing(groups)}.", ""]
    return parts


def _intervention_parts(summary: dict, groups: dict, loss_comps: list[dict], knn: int) -> list[str]:
    """The intervention: the scaled lookup gradient (``tied_input_grad_scaled``) minus ``tied``, by seed."""
    parts = []
    if "tied_input_grad_scaled" in groups and "tied" in groups:
        v = "tied_input_grad_scaled"
        scale = summary["compare"].get("input_grad_scale", NAN)
        loss = next((dict(c, n=c["n_seeds"]) for c in loss_comps if c["variant"] == v), None)
        comp = lens_compare(summary, groups, v, "tied")
        items = [
            f"unembedding bias (CKA head - input, next-seed untied): {cell(bias_effect(summary, v, 'cka_diff'))}; "
            f"{knn}-NN: {cell(bias_effect(summary, v, 'knn_diff'))}",
            f"path ratio ln(head / lookup), first 10% of steps: {cell(path_effect(summary, groups, v, 'early'))}; "
            f"last 10%: {cell(path_effect(summary, groups, v, 'late'))}",
            f"tuned-lens drop over the first layers: {cell(comp['early'], LENS_DIGITS) if comp else 'not measured'}",
            f"validation loss: {cell(loss, 4) if loss else 'not measured'}"]
        verdicts = [st.verdict(bias_effect(summary, v, "cka_diff"), "the bias grew", "the bias shrank"),
                    st.verdict(loss, "the loss rose", "the loss fell") if loss else ""]
        parts += [f"**The intervention.** `{v}` (the lookup path's gradient into the tied matrix x {scale:g}, "
                  "`train.tied_input_grad_scale`) minus `tied`, paired by seed:\n  - " + "\n  - ".join(items)
                  + f"\n\n  Bias: {verdicts[0]}" + (f"; loss: {verdicts[1]}" if verdicts[1] else "") + ".", ""]
    return parts


def share_sentence(share: dict) -> str:
    """What the rare-token share means, in words: the rarest half's share of the difference against its
    share of the tokens (a share above 1 or below 0 says the other half moved the other way)."""
    if not math.isfinite(share.get("diff_share", NAN)):
        return cell(share, short=True)
    d, t = share["diff_share"], share["token_share"]
    odd = (" (more than the whole difference: the frequent half's difference has the other sign)" if d > 1 else
           " (the rare half's difference has the other sign from the whole)" if d < 0 else "")
    return (f"the rarest half carries {d:.3f} of the difference{odd} and holds {t:.3f} of the scored tokens; "
            f"share - token share {cell(share, short=True)}")


def _rare_token_parts(summary: dict, groups: dict, table) -> list[str]:
    """Rare-token gains: the loss difference to ``tied`` by frequency bin of the target token."""
    rare_lines = []
    for v in groups:
        if v == "tied":
            continue
        comp = rare_compare(summary, groups, v, "tied")
        if comp is None:
            continue
        rare_lines.append([f"{v} - tied", *[cell(b, 4, short=True) for b in comp["bins"]],
                           share_sentence(comp["share"])])
    if not rare_lines:
        return []
    nb = len(rare_lines[0]) - 2
    return ["**Rare-token gains.** Held-out loss difference, variant - tied (nats per scored token; < 0: the "
            "variant is better), by equal-token-mass bin of the *target* token (train frequency; bin 0 the "
            "rarest), and how the whole difference splits: the rarest half of the bins' share of the summed "
            "difference against their share of the scored tokens (a share > their token share: the difference "
            "concentrates in rare tokens); 95% intervals over seeds x documents (`rare_token_gains.png`):", "",
            table(["difference", *[f"bin {k}" for k in range(nb)], "rarest half of the bins"], rare_lines), "",
            *_through_parts(summary, groups, table)]


def _through_parts(summary: dict, groups: dict, table) -> list[str]:
    """Untying's gains through training: the rare-token measures at every analysed checkpoint."""
    parts = []
    for v in [v for v in groups if v != "tied"]:
        comp = through_compare(summary, groups, v, "tied")
        if comp is None:
            continue
        rows = [[str(step), cell(comp["total"][k], 4, short=True), cell(comp["rare"][k], 4, short=True),
                 cell(comp["share"][k], 3, short=True), *[cell(b, 4, short=True) for b in comp["bins"][k]]]
                for k, step in enumerate(comp["steps"])]
        growth = comp["growth"]
        claim = CLAIMS["growth"] if v == "untied" else None
        verdict = (f"; claim \"{claim.claim}\" ({claim.source}): *{judge(growth, claim.predicted)}*"
                   if claim else "")
        parts += [f"**Gains through training, `{v}` - tied** (every analysed checkpoint, paired by seed and "
                  "document, each interval over seeds x documents with the same draws at every step): the "
                  "difference per scored token, on the rarest half of the bins (per token of that half), the "
                  "rarest half's share of the difference minus its share of the tokens, and each bin:", "",
                  table(["step", "all tokens", "rarest half", "share - token share",
                         *[f"bin {j}" for j in range(comp["n_bins"])]], rows), "",
                  f"Change over training, step {comp['steps'][-1]} minus step {comp['steps'][0]}: rarest half "
                  f"{cell(growth, 4)} nats/token (< 0: untying's rare-token gain grew), share - token share "
                  f"{cell(comp['share_change'])}{verdict}.", ""]
    return parts


def _exp(ci: dict) -> str:
    mean, lo, hi = ci.get("mean", NAN), ci.get("lo", NAN), ci.get("hi", NAN)
    if not math.isfinite(mean):
        return "n/a"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{math.exp(mean):.2f}"
    return f"{math.exp(mean):.2f} [{math.exp(lo):.2f}, {math.exp(hi):.2f}]"


# ------------------------------------------------------------------------------------------- plots
def make_plots(summary: dict, groups: dict, out_dir: str) -> dict[str, str]:
    paths = {}
    series = {}
    for v in groups:
        for r in groups[v]:
            p = lit.path_ratio(r.get("metrics") or [], int(r["train"]["num_steps"]))
            if p["steps"]:
                series.setdefault(v, []).append((r["seed"], p["steps"], np.exp(p["log_ratio"]).tolist()))
    if series:
        paths["input_path_ratio"] = plots.seed_curves(
            series, storage.join(out_dir, "input_path_ratio.png"), ylabel="||g_head|| / ||g_lookup|| (log scale)",
            title="which path drives the tied matrix: head over lookup gradient norm, every seed", reference=1.0)
    means = {v: m for v in groups if (m := lens_means(groups, v))}
    diffs = {}
    for v in groups:
        if v != "tied" and (comp := lens_compare(summary, groups, v, "tied")):
            diffs[v] = comp
    if means:
        paths["lens_by_layer"] = plots.lens_layers(
            means, {v: (c["logit"], c["tuned"]) for v, c in diffs.items()}, storage.join(out_dir, "lens_by_layer.png"))
    rare = {v: c for v in groups if v != "tied" and (c := rare_compare(summary, groups, v, "tied"))}
    if rare:
        paths["rare_token_gains"] = plots.bin_intervals(
            {v: c["bins"] for v, c in rare.items()}, storage.join(out_dir, "rare_token_gains.png"),
            ylabel="loss minus tied (nats/token)",
            title="held-out loss minus tied by frequency bin of the target (0 = rarest), 95% CI over seeds x docs")
    through = through_compare(summary, groups, "untied", "tied") if "untied" in groups else None
    if through:
        paths["gains_through_training"] = plots.bin_intervals(
            {f"step {step}": through["bins"][k] for k, step in enumerate(through["steps"])},
            storage.join(out_dir, "gains_through_training.png"), ylabel="untied - tied (nats/token)",
            title="untied - tied by frequency bin at every analysed checkpoint, 95% CI over seeds x docs")
    return paths
