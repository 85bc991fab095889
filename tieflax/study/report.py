"""The compare report: ``report.md`` (and ``report.html`` when markdown-it-py is installed) with PNG plots.

``write_report(summary, out_dir)`` needs only the summary ``run_compare`` builds (also saved as
``summary.json``), so a report can be rewritten without retraining: ``tieflax compare --report-only``.
Every claim gets the number it is judged on with a paired 95% bootstrap interval over seeds (and, for the
loss, over held-out documents too); its verdict is whether that interval excludes 0. Geometry numbers
come with the same matrix at initialisation and a row-shuffled control.
"""

from __future__ import annotations

import base64
import math
import re
import time
from collections import defaultdict

import numpy as np

from tieflax import storage
from tieflax import strict_json as jsonable
from tieflax.analysis import plots
from tieflax.analysis import stats as st
from tieflax.strict_json import to_jsonable
from tieflax.study import literature
from tieflax.study.findings import Claim, direction, finding, heading

REPORT = "report.md"
SUMMARY = "summary.json"
NAN = float("nan")


# --------------------------------------------------------------------------------------------- helpers
def _by_variant(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        out[r["variant"]].append(r)
    return dict(out)


def seed_units(summary: dict) -> list[int]:
    """The distinct seeds the study's runs hold: its resampling units (a finished study has every variant
    at each)."""
    return sorted({int(r["seed"]) for r in summary["runs"]})


def check_units(summary: dict) -> None:
    """Refuses, in one line, a summary whose runs repeat a (variant, seed): an interval over copies of one
    run is not an interval (``config.compare.seeds`` refuses a repeat before training; this guards a
    summary.json written otherwise)."""
    from tieflax.errors import ConfigError  # noqa: PLC0415

    seen = set()
    for r in summary["runs"]:
        key = (r["variant"], int(r["seed"]))
        if key in seen:
            raise ConfigError(f"summary.json holds `{key[0]}` seed {key[1]} twice: a repeated run is one unit, not "
                              "two; rerun `tieflax compare` with each seed once in config.compare.seeds")
        seen.add(key)


def _get(r: dict, getter) -> float:
    try:
        v = getter(r)
    except (KeyError, TypeError, IndexError, ZeroDivisionError, ValueError):
        return NAN
    return float(v) if v is not None and isinstance(v, (int, float)) else NAN


def per_seed(groups: dict, variant: str, getter) -> dict[int, float]:
    """``{seed: value}`` of one variant's runs (``getter(run)``; NaN where it does not apply)."""
    return {r["seed"]: _get(r, getter) for r in groups.get(variant, [])}


def ci_of(groups: dict, variant: str, getter, n_boot: int = st.N_BOOT) -> dict:
    """Bootstrap CI over seeds of one variant's value."""
    return st.bootstrap_ci(list(per_seed(groups, variant, getter).values()), n_boot=n_boot)


def paired(groups: dict, va: str, ga, vb: str, gb, n_boot: int = st.N_BOOT) -> dict:
    """CI over seeds of ``ga(va) - gb(vb)``, paired by seed (only seeds both variants have)."""
    a, b = per_seed(groups, va, ga), per_seed(groups, vb, gb)
    seeds = sorted(set(a) & set(b))
    return st.bootstrap_ci([a[s] - b[s] for s in seeds], n_boot=n_boot)


NUMERIC = re.compile(r"^[+-]?(\d|n/a)")


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: a column whose every filled cell starts with a number (or n/a) is right-aligned,
    text left-aligned."""
    def align(j: int) -> str:
        cells = [row[j] for row in rows if j < len(row) and row[j]]
        return "---:" if cells and all(NUMERIC.match(c) for c in cells) else "---"

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align(j) for j in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _num(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "n/a"


def _ci_cell(ci: dict, digits: int = 3) -> str:
    if not math.isfinite(ci["mean"]):
        return "n/a"
    if not math.isfinite(ci["lo"]):
        return f"{ci['mean']:.{digits}f}"
    return f"{ci['mean']:.{digits}f} [{ci['lo']:.{digits}f}, {ci['hi']:.{digits}f}]"


# Getters: run -> number.
def _a(fn):
    """A getter of the run from one of its analysis dict (``fn(analysis)``)."""
    return lambda r: fn(r["analysis"])


def mat(side: str, state: str, group: str, key: str):
    """Getter of ``analysis['matrices'][side][state][group][key]``."""
    return _a(lambda a: a["matrices"][side][state][group][key])


LOSS = _a(lambda a: a["val"]["loss"])


def matrices_of(groups: dict) -> list[tuple[str, str, str]]:
    """``(label, variant, side)`` for every distinct matrix: one for tied variants, two for untied."""
    out = []
    for v, rs in groups.items():
        tied = rs[0]["analysis"]["tied"] if rs and rs[0].get("analysis") else rs[0]["model"]["tie_embeddings"]
        out += [(f"{v}: W", v, "input")] if tied else [(f"{v}: W_in", v, "input"), (f"{v}: W_out", v, "output")]
    return out


def loss_comparisons(summary: dict, groups: dict) -> list[dict]:
    """For every variant but ``tied``: the two-level (seeds x documents) CI of its loss minus tied's."""
    out = []
    n_boot = summary.get("compare", {}).get("bootstrap", st.N_BOOT)
    tied = {r["seed"]: r["analysis"]["val"] for r in groups.get("tied", []) if r.get("analysis")}
    for v, rs in groups.items():
        if v == "tied":
            continue
        other = {r["seed"]: r["analysis"]["val"] for r in rs if r.get("analysis")}
        seeds = sorted(set(tied) & set(other))
        if not seeds:
            continue
        a = np.array([other[s]["doc_loss"] for s in seeds])
        b = np.array([tied[s]["doc_loss"] for s in seeds])
        tokens = np.asarray(tied[seeds[0]]["doc_tokens"])
        keep = tokens > 0
        ci = st.two_level_bootstrap(a[:, keep], b[:, keep], tokens[keep], n_boot=n_boot)
        out.append(dict(variant=v, **ci))
    return out


# ---------------------------------------------------------------------------------------------- tables
def results_table(groups: dict[str, list[dict]]) -> str:
    """Loss and parameters per variant: mean over seeds with a bootstrap 95% interval over seeds."""
    rows = []
    for v, rs in groups.items():
        p = rs[0]["params"]
        rows.append([v, str(len(rs)), _ci_cell(ci_of(groups, v, LOSS), 4),
                     _ci_cell(ci_of(groups, v, lambda r: r["result"]["final_train_loss"]), 4),
                     f"{p['total']:,}", f"{p['non_embedding']:,}", f"{p['embedding']:,}"])
    return _table(["variant", "seeds", "val loss, full split [95% CI]", "final train loss",
                   "total params", "non-embedding", "embedding"], rows)


GEOMETRY = [  # (label, group, key, digits)
    ("rho(norm, count), frequent half of the mass", "profile", "rho_head", 3),
    ("mean norm, commonest bin / rarest bin", "profile", "norm_ratio_top_bottom", 3),
    ("mean cosine of unit rows", "aniso", "mean_cosine", 3),
    ("mean cosine, unigram-weighted pairs", "aniso", "mean_cosine_freq", 3),
    ("effective rank / d (centred unit rows)", "aniso", "effective_rank_frac", 3),
    ("variance share of the top PC (centred unit rows)", "aniso", "top_pc_share", 3),
    ("isotropy, all-but-the-top (Mu & Viswanath)", "aniso", "isotropy_abtt", 3),
]


def diagnostics_table(groups: dict[str, list[dict]]) -> str:
    """Geometry of every matrix: final [95% CI over seeds], at init, row-shuffled control, final - init."""
    rows = []
    for label, group, key, digits in GEOMETRY:
        for name, v, side in matrices_of(groups):
            fin, ini = mat(side, "final", group, key), mat(side, "init", group, key)
            rows.append([f"{label}: {name}", _ci_cell(ci_of(groups, v, fin), digits),
                         _num(ci_of(groups, v, ini)["mean"], digits),
                         _num(ci_of(groups, v, mat(side, "shuffled", group, key))["mean"], digits),
                         _ci_cell(paired(groups, v, fin, v, ini), digits)])
    for name, v, side in matrices_of(groups):
        rows.append([f"movement from init, commonest bin / rarest bin: {name}",
                     _ci_cell(ci_of(groups, v, _a(lambda a, s=side: _moved(a, s, "movement")))),
                     "(0 moved)",
                     _num(ci_of(groups, v, _a(lambda a, s=side: _moved(a, s, "movement_shuffled")))["mean"]),
                     ""])
    for v in groups:
        rows.append([f"contextual anisotropy (hidden states): {v}",
                     _ci_cell(ci_of(groups, v, _a(lambda a: a["val"]["context_cos"]))),
                     _num(ci_of(groups, v, _a(lambda a: a["val"]["context_cos_init"]))["mean"]), "",
                     _ci_cell(paired(groups, v, _a(lambda a: a["val"]["context_cos"]),
                                     v, _a(lambda a: a["val"]["context_cos_init"])))])
    return _table(["measure: matrix", "final [95% CI]", "init", "row-shuffled", "final - init [95% CI]"], rows)


GRADIENT = [
    ("cosine(g_lookup, g_head), whole matrix", "cosine"),
    ("cross-term share of the first-order loss change (SGD)", "cross_share"),
    ("cosine in Adam's metric", "cosine_adam"),
    ("cross-term share, Adam-preconditioned", "cross_share_adam"),
]


def gradient_table(groups: dict[str, list[dict]]) -> str:
    """Interference of the two paths, every variant (for untied ones: the control), final and init."""
    rows = []
    for label, key in GRADIENT:
        for v in groups:
            g = lambda state, k=key: _a(lambda a: a["gradient"][state][k])  # noqa: E731
            rows.append([f"{label}: {v}", _ci_cell(ci_of(groups, v, g("final"))),
                         _num(ci_of(groups, v, g("init"))["mean"]),
                         _num(ci_of(groups, v, _a(lambda a, k=key: a["gradient"]["final"]["shuffled"][k]))["mean"])])
    for v in groups:
        rows.append([f"rows with a gradient >= 1% of a looked-up row's (all rows): {v}",
                     _ci_cell(ci_of(groups, v, _a(lambda a: a["gradient"]["final"]["updated"]["frac_0.01"]))),
                     _num(ci_of(groups, v, _a(lambda a: a["gradient"]["init"]["updated"]["frac_0.01"]))["mean"]), ""])
        rows.append([f"same, rarest bin: {v}",
                     _ci_cell(ci_of(groups, v, _a(lambda a: a["gradient"]["final"]["updated"]["bin_frac_0.01"][0]))),
                     _num(ci_of(groups, v, _a(lambda a: a["gradient"]["init"]["updated"]["bin_frac_0.01"][0]))["mean"]),
                     ""])
    return _table(["measure: variant", "final [95% CI]", "init", "row-shuffled control"], rows)


# ---------------------------------------------------------------------------------------------- claims
# The study's own hypotheses (no paper behind them is measured here; the literature table has those).
HYPOTHESIS = "the study's hypothesis"
CLAIMS = {
    "rho": Claim("Output-head row norms grow with token frequency", HYPOTHESIS, "above",
                 "Untied head row norms rose with token frequency over training (frequent half of the mass)",
                 "Untied head row norms fell with token frequency over training (frequent half of the mass)",
                 "Head row norms against frequency"),
    "profile": Claim("When tied, the head's frequency profile reaches the input", HYPOTHESIS, "below",
                     "An untied input embedding carries more of the frequency profile than the tied matrix",
                     "The tied matrix carries more of the frequency profile than an untied input embedding",
                     "Frequency profile, untied W_in - tied"),
    "aniso": Claim("Tying magnifies anisotropy", HYPOTHESIS, "below",
                   "An untied head is more anisotropic than the tied matrix",
                   "The tied matrix is more anisotropic than an untied head",
                   "Anisotropy, untied W_out - tied"),
    "rare_rows": Claim("Under tying, rare rows are updated every step through the softmax", HYPOTHESIS, "below",
                       "An untied input embedding moved its rare rows more than the tied matrix",
                       "The tied matrix moved its rare rows more than an untied input embedding",
                       "Rare-row movement, untied W_in - tied"),
    "interference": Claim("The tied gradient's output and input signals interfere", HYPOTHESIS, "below",
                          "The tied matrix's two gradient paths help each other (raw gradients)",
                          "The tied matrix's two gradient paths interfere (raw gradients)",
                          "Gradient interference"),
    "untied": Claim("Untying reaches lower loss at matched non-embedding parameters", HYPOTHESIS, "below",
                    "Tied reaches lower loss than untied with the same body",
                    "Untied reaches lower loss than tied with the same body", "Loss, untied - tied"),
    "untied_matched": Claim("Small models prefer tying at matched total parameters", HYPOTHESIS, "above",
                            "Tied reaches lower loss than untied at equal total parameters (untied_matched)",
                            "Untied reaches lower loss than tied at equal total parameters (untied_matched)",
                            "Loss, untied_matched - tied"),
}
LOSS_NAMES = {"untied": "untied, same body (matched non-embedding parameters)",
              "untied_matched": "untied at the tied total, same body, narrower embeddings (Chung et al.)",
              "untied_width": "untied at the tied total by a narrower body (width)",
              "untied_depth": "untied at the tied total by fewer layers (depth)"}


def _moved(a: dict, side: str, key: str) -> float:
    return a["matrices"][side][key]["move_ratio_top_bottom"]


def study_findings(groups: dict[str, list[dict]], summary: dict | None = None) -> list[tuple[dict | None, str]]:
    """``[(finding or None, line), ...]``: each claim's :func:`tieflax.study.findings.finding` (None for a
    line with no claim behind it: ablations, other matched variants) and the bullet the report prints."""
    found = [_row_norm_claim(groups), _profile_reaches_input_claim(groups), _anisotropy_claim(groups),
             _rare_rows_claim(groups), _interference_claim(groups), *_loss_claims(groups, summary),
             _ablation_claim(groups)]
    return [claim for claim in found if claim]


def claims(groups: dict[str, list[dict]], summary: dict | None = None) -> list[str]:
    """One bullet per finding: what was found, the claim it tests and its verdict, then the numbers."""
    return [line for _, line in study_findings(groups, summary)]


def _stated(key: str, ci: dict, details: str) -> tuple[dict, str]:
    f = finding(CLAIMS[key], ci)
    return f, f"{heading(f)} {details}"


def _analysed(groups: dict[str, list[dict]], *variants: str) -> bool:
    """Whether every variant ran and its first run was analysed."""
    return all(v in groups and groups[v] and groups[v][0].get("analysis") for v in variants)


def _rho(side: str, state: str = "final"):
    """The Spearman rho of head-row norm against frequency, of one matrix (input/output) at one state."""
    return mat(side, state, "profile", "rho_head")


def _row_norm_claim(groups: dict[str, list[dict]]):
    """Output-head row norms grow with token frequency (untied W_out, final minus init)."""
    if not _analysed(groups, "untied"):
        return None
    ci = paired(groups, "untied", _rho("output"), "untied", _rho("output", "init"))
    return _stated("rho", ci, (
        "Spearman rho of row norm against count within the frequent half of the token mass (untied W_out), "
        f"final - init (one run against its own start, not a difference of variants): {st.fmt_ci(ci)}. "
        "(One rho over all rows is decided by the rare tail; `norm_vs_frequency.png` shows every bin.)"))


def _profile_reaches_input_claim(groups: dict[str, list[dict]]):
    """When tied, the head's frequency profile reaches the input."""
    if not _analysed(groups, "tied", "untied"):
        return None
    d_in = paired(groups, "untied", _rho("input"), "tied", _rho("input"))
    d_out = paired(groups, "untied", _rho("output"), "tied", _rho("input"))
    move = _a(lambda a: math.log(a["matrices"]["input"]["movement"]["move_ratio_top_bottom"]))
    m_t, m_u = ci_of(groups, "tied", move), ci_of(groups, "untied", move)
    moved = lambda ci: direction(ci, "frequent rows moved more", "rare rows moved more", "which rows moved")  # noqa: E731
    return _stated("profile", d_in, (
        f"rho (frequent half), untied W_in - tied: {st.fmt_ci(d_in)}; untied W_out - tied: {st.fmt_ci(d_out)}. "
        "Which rows moved, log(movement of the commonest bin / the rarest) of each matrix alone: tied "
        f"{st.fmt_ci(m_t)} ({moved(m_t)}), untied W_in {st.fmt_ci(m_u)} ({moved(m_u)}). The sign matters: the "
        "claim is about frequent rows growing."))


def _anisotropy_claim(groups: dict[str, list[dict]]):
    """Tying magnifies anisotropy."""
    if not _analysed(groups, "tied", "untied"):
        return None
    cos = lambda side: mat(side, "final", "aniso", "mean_cosine")  # noqa: E731
    beyond = paired(groups, "untied", cos("output"), "tied", cos("input"))
    vs_in = paired(groups, "untied", cos("input"), "tied", cos("input"))
    moved_in = paired(groups, "untied", cos("input"), "untied", mat("input", "init", "aniso", "mean_cosine"))
    freq = paired(groups, "untied", mat("output", "final", "aniso", "mean_cosine_freq"),
                  "tied", mat("input", "final", "aniso", "mean_cosine_freq"))
    context = _a(lambda a: a["val"]["context_cos"])
    ctx = paired(groups, "untied", context, "tied", context)
    return _stated("aniso", beyond, (
        "Mean cosine of unit rows, untied W_out - tied (the decisive comparison: anisotropy beyond what a head "
        f"has on its own) {st.fmt_ci(beyond)}. Untied W_in - tied {st.fmt_ci(vs_in)}, but read it with how far "
        f"W_in moved from its init (its final - init: {st.fmt_ci(moved_in)}): an untrained matrix is isotropic, "
        f"not 'untied'. Unigram-weighted, untied W_out - tied {st.fmt_ci(freq)}; contextual anisotropy of "
        f"hidden states, untied - tied {st.fmt_ci(ctx)}."))


def _rare_rows_claim(groups: dict[str, list[dict]]):
    """Under tying, rare rows are updated every step through the softmax."""
    if not _analysed(groups, "tied", "untied"):
        return None
    rare = _a(lambda a: math.log(a["matrices"]["input"]["movement"]["bin_move"][0]))
    d = paired(groups, "untied", rare, "tied", rare)
    frac = ci_of(groups, "tied", _a(lambda a: a["gradient"]["final"]["updated"]["bin_frac_0.01"][0]))
    ratio = ci_of(groups, "tied", _a(lambda a: a["gradient"]["final"]["updated"]["head_over_lookup_rarest"]))
    return _stated("rare_rows", d, (
        "Every row has a non-zero head gradient by construction, so the measure is magnitude-aware: the "
        f"rarest bin's median gradient over a looked-up row's is {st.fmt_ci(ratio, 4)} (tied, final; a ratio), "
        f"and a share {st.fmt_ci(frac)} of its rows reach 1% of it. What the rows did: log(rarest-bin movement "
        f"from init), untied W_in - tied, {st.fmt_ci(d)}."))


def _interference_claim(groups: dict[str, list[dict]]):
    """The tied gradient's output and input signals interfere (the cross term's share)."""
    if not _analysed(groups, "tied"):
        return None
    parts, cis = [], {}
    for key, label in (("cross_share", "raw (SGD)"), ("cross_share_adam", "Adam-preconditioned")):
        cis[key] = ci = ci_of(groups, "tied", _a(lambda a, k=key: a["gradient"]["final"][k]))
        ctl = ""
        if _analysed(groups, "untied"):
            c = paired(groups, "untied", _a(lambda a, k=key: a["gradient"]["final"][k]),
                       "tied", _a(lambda a, k=key: a["gradient"]["final"][k]))
            ctl = f"; the untied control - tied {st.fmt_ci(c)}"
        found = direction(ci, "the paths help each other", "the paths interfere", "the paths")
        parts.append(f"{label}, tied alone: {st.fmt_ci(ci)} ({found}{ctl})")
    k = groups["tied"][0]["analysis"]["gradient"]["final"].get("batches", "?")
    return _stated("interference", cis["cross_share"], (
        f"On gradients averaged over {k} held-out batches, the share of the first-order loss decrease that the "
        f"cross term 2<g_lookup, g_head> adds (< 0: it costs loss decrease): {'; '.join(parts)}. The "
        "row-shuffled control is in the gradient table."))


def _loss_claims(groups: dict[str, list[dict]], summary: dict | None) -> list:
    """Validation loss of each variant minus tied, over seeds and documents: one finding per variant."""
    out = []
    for c in loss_comparisons(summary or {}, groups):
        ci = dict(c, n=c["n_seeds"])
        joint = st.fmt_interval(c["lo"], c["hi"]) if math.isfinite(c["lo"]) else f"({c['missing']})"
        numbers = (f"Validation loss on the full held-out split, {c['variant']} - tied: {c['mean']:+.4f} {joint} nats "
                   f"per token (seeds only {st.fmt_interval(c['seed_lo'], c['seed_hi'])}, documents only "
                   f"{st.fmt_interval(c['doc_lo'], c['doc_hi'])}; {c['n_seeds']} seeds x {c['n_docs']} documents; "
                   f"< 0 favours {c['variant']}).")
        if c["variant"] in CLAIMS:
            out.append(_stated(c["variant"], ci, numbers))
        else:
            name = LOSS_NAMES.get(c["variant"], c["variant"])
            found = direction(ci, f"Tied reaches lower loss than {name}", f"{name} reaches lower loss than tied",
                              f"Loss, {c['variant']} - tied")
            out.append((None, f"**{found}.** {numbers}"))
    return out


def _ablation_claim(groups: dict[str, list[dict]]):
    """Mechanism ablations: one switch each, against its base."""
    ablation = [(v, base) for v, base in (("tied_embed_decay", "tied"), ("untied_embed_decay", "untied"),
                                          ("tied_rsqrt_logits", "tied"), ("untied_rsqrt_logits", "untied"),
                                          ("tied_head_bias", "tied"), ("untied_head_bias", "untied"),
                                          ("tied_embed_sgd", "tied"), ("untied_embed_sgd", "untied"))
                if _analysed(groups, v, base)]
    if not ablation:
        return None
    lines = []
    for v, base in ablation:
        ratio = _a(lambda a: math.log(a["matrices"]["output"]["profile"]["norm_ratio_top_bottom"]))
        dl = paired(groups, v, LOSS, base, LOSS)
        dr = paired(groups, v, ratio, base, ratio)
        found = direction(dl, "raises the loss", "lowers the loss", "its loss change")
        lines.append(f"`{v}` - `{base}` (an ablation minus its own base): {found}; val loss {st.fmt_ci(dl, 4)}; "
                     f"log(commonest / rarest mean head-row norm) {st.fmt_ci(dr)}")
    return (None, "**Mechanism ablations**, one switch each (a positive norm-ratio change means the rare rows "
                  "shrank relative to the frequent ones):\n  - " + "\n  - ".join(lines))


def caveats(summary: dict) -> str:
    cfg = summary["config"]
    t = cfg["train"]
    data = summary.get("data") or {}
    tokens = t["num_steps"] * t["global_batch_size"] * t["seq_len"]
    epochs = tokens / data["train_tokens"] if data.get("train_tokens") else NAN
    n = len(seed_units(summary))
    return "\n".join([
        *(["- **Too little data.** With 1 seed no interval over seeds exists (and with 1 held-out document none "
           "over documents): such lines give the mean and say what is missing, and no verdict."] if n < 2 or
          (data.get("n_docs") or 2) < 2 else []),
        f"- **Seeds.** {n} distinct seed(s) per variant. A percentile bootstrap over {n} seeds has few distinct "
        "resamples and under-covers; intervals over seeds are a floor on the uncertainty, not a ceiling.",
        f"- **Budget.** {tokens:,} training tokens per run ({epochs:.2f} epochs of the train split"
        + (": over-epoching, the model sees repeated text" if epochs > 1 else "") + "); every variant gets "
        "the same steps and learning rate, not its own tuned rate (`tieflax sweep` tunes it per variant).",
        "- **Scale.** Small models, one corpus. Published claims concern 10^8 to 10^11 parameters; a "
        "difference here describes this model and budget. The size trend is `tieflax sweep`'s job.",
        "- **Associations.** Geometry differences are compatible with the mechanisms proposed in the "
        "literature; the ablation variants switch one mechanism at a time.",
    ])


# ----------------------------------------------------------------------------------------------- plots
def make_plots(groups: dict[str, list[dict]], out_dir: str, summary: dict | None = None) -> dict[str, str]:
    paths: dict[str, str] = {}
    curves = {}
    for v, rs in groups.items():
        tr = [[(row["step"], float(row.get("ce_loss", row.get("loss")))) for row in r["metrics"]
               if row.get("split") == "train" and ("ce_loss" in row or "loss" in row)] for r in rs]
        va = [[(row["step"], float(row["loss"])) for row in r["metrics"] if row.get("split") == "val"] for r in rs]
        curves[v] = dict(train=tr, val=va)
    paths["loss_curves"] = plots.loss_curves_seeds(curves, storage.join(out_dir, "loss_curves.png"))
    comps = loss_comparisons(summary or {}, groups)
    if comps:
        paths["loss_differences"] = plots.interval_bars(
            {c["variant"]: c for c in comps}, storage.join(out_dir, "loss_differences.png"),
            ylabel="val loss minus tied (nats/token)",
            title=f"validation loss minus tied, 95% CI over seeds x documents (n={comps[0]['n_seeds']} seeds, "
                  f"{comps[0]['n_docs']} docs)")
    mats = matrices_of(groups)

    def bins_of(v, side, key, sub):
        rs = [r for r in groups[v] if r.get("analysis")]
        return np.array([r["analysis"]["matrices"][side][sub][key] if sub == "movement" else
                         r["analysis"]["matrices"][side][sub]["profile"][key] for r in rs], np.float64)

    profiles = {}
    for name, v, side in mats:
        rs = [r for r in groups[v] if r.get("analysis")]
        if not rs:
            continue
        x = np.array(rs[0]["analysis"]["matrices"][side]["final"]["profile"]["log10_freq"])
        profiles[name] = dict(x=x, final=bins_of(v, side, "norm", "final"), init=bins_of(v, side, "norm", "init"),
                              move=bins_of(v, side, "bin_move", "movement"))
    if profiles:
        paths["norm_vs_frequency"] = plots.profile_lines(
            {k: (p["x"], p["final"], p["init"]) for k, p in profiles.items()},
            storage.join(out_dir, "norm_vs_frequency.png"), ylabel="mean row L2 norm",
            title="row norm by equal-token-mass bin (dotted: same matrix at init)")
        paths["movement_by_bin"] = plots.profile_lines(
            {k: (p["x"], p["move"], None) for k, p in profiles.items()},
            storage.join(out_dir, "movement_by_bin.png"), ylabel="mean ||W_t[i] - W_0[i]||",
            title="row movement from init by equal-token-mass bin")
    aniso = {}
    for key, label in (("mean_cosine", "mean cosine"), ("mean_cosine_freq", "mean cosine, unigram-weighted"),
                       ("effective_rank_frac", "effective rank / d"), ("top_pc_share", "top-PC variance share")):
        aniso[label] = {name: (ci_of(groups, v, mat(side, "final", "aniso", key)),
                               ci_of(groups, v, mat(side, "init", "aniso", key))["mean"])
                        for name, v, side in mats}
    paths["anisotropy"] = plots.metric_panels(aniso, storage.join(out_dir, "anisotropy.png"),
                                              title="unit-row anisotropy, 95% CI over seeds (x: same matrix at init)")
    grad = {}
    for key, label in (("cross_share", "cross-term share (SGD)"), ("cross_share_adam", "cross-term share (Adam)"),
                       ("cosine", "cosine(g_lookup, g_head)")):
        panel = {}
        for v in groups:
            panel[v] = (ci_of(groups, v, _a(lambda a, k=key: a["gradient"]["final"][k])),
                        ci_of(groups, v, _a(lambda a, k=key: a["gradient"]["init"][k]))["mean"])
            panel[f"{v} shuffled"] = (ci_of(groups, v, _a(lambda a, k=key: a["gradient"]["final"]["shuffled"][k])), NAN)
        grad[label] = panel
    paths["gradient_interference"] = plots.metric_panels(
        grad, storage.join(out_dir, "gradient_interference.png"), reference=0.0,
        title="gradient interference on K held-out batches, 95% CI over seeds (x: at init)")
    upd = {v: np.array([r["analysis"]["gradient"]["final"]["updated"]["bin_frac_0.01"]
                        for r in rs if r.get("analysis")]) for v, rs in groups.items()}
    x0 = next(iter(profiles.values()))["x"] if profiles else None
    if x0 is not None:
        paths["updated_by_bin"] = plots.profile_lines(
            {v: (x0, u, None) for v, u in upd.items() if len(u)}, storage.join(out_dir, "updated_by_bin.png"),
            ylabel="fraction of rows", title="rows whose gradient reaches 1% of a looked-up row's, by bin")
    paths.update(literature.make_plots(summary or {}, groups, out_dir))
    return paths


# ---------------------------------------------------------------------------------------------- report
def _setup_section(summary: dict, groups: dict[str, list[dict]]) -> str:
    cfg = summary["config"]
    t, d = cfg["train"], cfg["data"]
    data = summary.get("data") or {}
    tokens = t["num_steps"] * t["global_batch_size"] * t["seq_len"]
    whole = data.get("whole_split", not summary.get("compare", {}).get("val_batches"))
    where = ("evaluation on the whole validation split" if whole else
             f"evaluation on the first {summary['compare']['val_batches']} validation batches "
             "(`compare.val_batches`), not the whole split")
    lines = [
        f"- Data: `{d['source']}` corpus, vocabulary {cfg['model']['vocab_size']:,}; one tokenizer and token "
        f"cache for every run. Train split {data.get('train_tokens', 0):,} tokens; {where} "
        f"({data.get('val_tokens', 0):,} scored tokens in {data.get('n_docs', 0)} held-out "
        "document" + ("" if data.get("n_docs", 0) == 1 else "s") + ")" + (", not on a few batches." if whole else "."),
        f"- Budget per run: {t['num_steps']:,} steps x {t['global_batch_size']} sequences x {t['seq_len']} tokens "
        f"= {tokens:,} training tokens; learning rate {t['learning_rate']}, warmup {t['warmup_steps']}, "
        f"weight decay {t['weight_decay']} (embeddings decayed: {t['decay_embeddings']}).",
        f"- Seeds: {', '.join(str(s) for s in summary['compare']['seeds'])}, paired: a seed fixes the init key "
        "and the data order, the same for every variant.",
    ]
    shapes = []
    for n, rs in groups.items():
        m, p = rs[0]["model"], rs[0]["params"]
        shapes.append([n, "yes" if m["tie_embeddings"] else "no", str(m["d_model"]), str(m["n_layers"]),
                       str(m["d_ff"]), str(m.get("embed_dim") or m["d_model"]), f"{p['total']:,}",
                       f"{p['non_embedding']:,}"])
    table = _table(["variant", "tied", "d_model", "layers", "d_ff", "embedding width", "total params",
                    "non-embedding"], shapes)
    for name, m in (summary.get("match") or {}).items():
        lines.append(f"- `{name}` ({m['strategy']}): {m['matched_shape']} vs {m['tied_shape']}; "
                     f"{m['matched_total']:,} parameters vs the tied {m['target_total']:,} "
                     f"({100 * m['relative_mismatch']:+.3f}%).")
    return "\n".join(lines) + "\n\n" + table


CAPTIONS = {
    "loss_differences": "Validation loss of each variant minus tied, paired by seed and document (95% CI).",
    "loss_curves": "Training and validation loss, mean over seeds (band: min-max over seeds).",
    "norm_vs_frequency": "Row norm by equal-token-mass bin (error bars: min-max over seeds; dotted: init).",
    "movement_by_bin": "How far rows moved from their initial values, by bin.",
    "anisotropy": "Anisotropy of unit rows per matrix (bars: final with 95% CI; x: init).",
    "gradient_interference": "Interference of the two gradient paths per variant, with the row-shuffled control.",
    "updated_by_bin": "Magnitude-aware 'updated' fraction by bin (tied: the head reaches every row, but how hard).",
    "input_path_ratio": "Head over lookup gradient norm into the tied matrix over training, every seed.",
    "lens_by_layer": "Logit and tuned lens by layer (left), and each variant minus tied with 95% CI (right).",
    "rare_token_gains": "Loss difference to tied by frequency bin of the target token (95% CI).",
    "gains_through_training": "Untied - tied by frequency bin of the target token at every analysed checkpoint.",
}


def _tasks_part(summary: dict) -> list[str]:
    """The benchmark-task section (``config.compare.tasks``), or nothing when no task was scored."""
    from tieflax.study.tasks import tasks_section  # noqa: PLC0415

    text = tasks_section(summary.get("tasks") or {}, _table)
    return ["## Benchmark tasks", "", text, ""] if text else []


def literature_part(summary: dict, groups: dict) -> list[str]:
    """The "From the literature" table (``tieflax.study.literature``) with its note."""
    rows = literature.literature_rows(summary, groups)
    if not rows:
        return []
    note = ("Verdicts: *holds here* / *contradicted here* when the 95% interval lies on the claim's / the other "
            "side of 0, *unresolved* when it includes 0, *no verdict from < 2 units* when no interval exists "
            "(fewer than 2 seeds or documents to resample; the row says which). The finding is the side the "
            "interval lies on, in words. Differences of variants are untied - tied; the bias and path rows "
            "measure tied runs alone and say so. Details, controls and plots: \"The literature claims, "
            "measured\" below.")
    if "tied_input_grad_scaled" not in groups:
        note += (" The intervention row (the input path's gradient scaled during training) appears when the "
                 "`tied_input_grad_scaled` variant is trained: `configs/experiments/tie_literature.py`.")
    return ["## From the literature", "", literature.literature_table(rows, _table), "", note, ""]


def provenance_line(summary: dict) -> str:
    """Where the runs came from (kept across reruns and ``--report-only``), and this report's own time."""
    p = summary.get("provenance")
    if not p:
        runs = f"Produced by `tieflax compare` in {summary.get('wall_seconds', NAN) / 60:.1f} minutes"
    else:
        trained, n = p.get("runs_trained", len(summary["runs"])), len(summary["runs"])
        how = (f"Runs trained by `{_here(p['command'], summary)}`" if trained else
               f"Runs reused by `{_here(p['command'], summary)}` (trained earlier by a study that kept no provenance)")
        reused = "" if trained in (0, n) else f" ({trained} trained by it, the others reused)"
        runs = (f"{how} at commit {p['commit']} on {p['date']}: {n} runs{reused}, {p['compute_seconds'] / 60:.1f} "
                "minutes of training (as each run first measured it) and analysis")
        again = p.get("remeasured")
        if again:
            runs += f"; measured again (analysis only) at commit {again['commit']} on {again['date']}"
    written = summary.get("report_written")
    own = f" This report was written on {written['date']} ({written['seconds']:.1f} s)." if written else ""
    return runs + "." + own


def _here(command: str, summary: dict) -> str:
    """``command`` with the study's folder (where its runs live) written ``<this folder>``: the report names
    no absolute path, so it reads the same wherever the folder goes."""
    for r in summary.get("runs", [])[:1]:
        rel = run_path(r)
        folder = str(r["run_dir"]).rstrip("/")[: -len(rel)].rstrip("/") if rel != str(r["run_dir"]) else ""
        if folder:
            return command.replace(folder, "<this folder>")
    return command


def run_path(r: dict) -> str:
    """A run's folder relative to the study's (``<variant>/seed_<s>``, the layout ``run_compare`` writes), so
    the report reads the same wherever the folder is moved or mailed."""
    rel = f"{r['variant']}/seed_{r['seed']}"
    return rel if str(r["run_dir"]).rstrip("/").endswith(rel) else str(r["run_dir"])


def render(summary: dict, plot_paths: dict[str, str]) -> str:
    groups = _by_variant(summary["runs"])
    lit_detail = literature.section(summary, groups, _table, loss_comparisons(summary, groups))
    parts = [
        "# Tied vs untied embeddings: comparison report", "",
        f"{provenance_line(summary)} Every interval is a paired percentile bootstrap 95% interval; every "
        "difference of variants is taken as the variant minus tied (*untied - tied*), and a line that is not "
        "says what it is. Each finding in bold is what its interval shows; the claim it tests is quoted beside "
        "it with its source and a verdict drawn from the interval alone (*holds here*, *contradicted here*, "
        "*unresolved*, or *no verdict from < 2 units*). "
        f"Frequency bins hold equal shares of the training tokens ({summary['compare']['n_bins']} bins, rarest "
        "first); padding rows are excluded everywhere. Definitions: `tieflax/analysis/measures.py`.", "",
        *literature_part(summary, groups),
        "## Setup", "", _setup_section(summary, groups), "",
        "## Results", "", results_table(groups), "",
        *_tasks_part(summary),
        "## Findings on the study's hypotheses", "",
        *[f"- {c}" for c in claims(groups, summary)], "",
        *(["## The literature claims, measured", "", lit_detail, ""] if lit_detail else []),
        "## Geometry (final checkpoint against init and a row-shuffled control)", "",
        "The row-shuffled control permutes which row belongs to which token: measures that depend on token "
        "frequency (rho, bin ratios, unigram-weighted cosine, movement by bin) fall to their null there, while "
        "order-free ones (plain cosine, rank, isotropy) equal the final value up to the row sample. The init "
        "column is the same matrix before training: a measure that barely moved from it describes the "
        "initialisation, not tying. Ratios (commonest bin / rarest bin) are of mean values per bin.", "",
        diagnostics_table(groups), "",
        "## Gradient interference and updated rows", "",
        "Lookup and head gradients averaged over K held-out batches; for an untied model the same numbers "
        "are the control (its two paths update different matrices). Shares are fractions of the first-order "
        "loss decrease; 'rows' lines are fractions of the rows.", "",
        gradient_table(groups), "",
        "## Plots", "",
    ]
    for key, caption in CAPTIONS.items():
        if key in plot_paths:
            parts += [f"**{caption}**", "", f"![{key}]({storage.name(plot_paths[key])})", ""]
    parts += ["## What these numbers support, and what they do not", "", caveats(summary), "",
              "## Runs", "", "Folders relative to this report's:", "",
              *[f"- `{r['variant']}` seed {r['seed']}: `{run_path(r)}`" for r in summary["runs"]], ""]
    return "\n".join(parts)


def write_report(summary: dict, out_dir: str) -> str:
    """Writes ``summary.json``, the PNGs, ``report.md`` (and ``report.html`` if cheap); returns the .md path.
    ``out_dir`` may be a local folder or a ``gs://`` / ``s3://`` prefix; every file is written whole."""
    started = time.perf_counter()
    check_units(summary)
    storage.makedirs(out_dir)
    summary = to_jsonable(summary)
    if any(r.get("tasks") for r in summary["runs"]):
        # Recomputed from the per-item scores each time (``--report-only`` included): a prompt-hash
        # mismatch is refused here, before anything is written.
        from tieflax.study.tasks import compare_tasks  # noqa: PLC0415

        summary["tasks"] = to_jsonable(compare_tasks(summary["runs"],
                                                     summary.get("compare", {}).get("bootstrap", st.N_BOOT)))
    summary["literature"] = literature.summary_rows(literature.literature_rows(summary, _by_variant(summary["runs"])))
    storage.write_text(storage.join(out_dir, SUMMARY), jsonable.dumps(summary))
    plot_paths = make_plots(_by_variant(summary["runs"]), out_dir, summary)
    written = dict(date=time.strftime("%Y-%m-%d %H:%M"), seconds=time.perf_counter() - started)
    text = render(dict(summary, report_written=written), plot_paths)
    path = storage.join(out_dir, REPORT)
    storage.write_text(path, text)
    write_html(text, storage.join(out_dir, "report.html"), out_dir)
    return path


def write_html(markdown_text: str, path: str, out_dir: str | None = None) -> str | None:
    """``report.html`` via markdown-it-py when it is installed, else nothing. Self-contained: every PNG the
    report shows is embedded (a ``data:`` URI, read from ``out_dir``), so the file can be mailed alone."""
    try:
        from markdown_it import MarkdownIt  # noqa: PLC0415
    except ImportError:
        return None
    body = MarkdownIt("commonmark").enable("table").render(markdown_text)
    if out_dir is not None:
        body = embed_images(body, out_dir)
    html = ("<!doctype html><html><head><meta charset='utf-8'><title>tieflax compare report</title><style>"
            "body{font-family:sans-serif;max-width:70em;margin:2em auto;line-height:1.4}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
            "img{max-width:100%}</style></head><body>" + body + "</body></html>")
    storage.write_text(path, html)
    return path


def embed_images(html: str, out_dir: str) -> str:
    """Every ``<img src="NAME.png">`` of ``html`` as a base64 ``data:image/png`` URI of ``out_dir/NAME.png``."""
    def inline(match: re.Match) -> str:
        data = storage.read_bytes(storage.join(out_dir, match.group(1)))
        return f'src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}"'

    return re.sub(r'src="([^":/]+\.png)"', inline, html)


def load_summary(out_dir: str) -> dict:
    """``summary.json`` of a finished study in ``out_dir``; a study still in progress (runs but no summary
    yet) or a folder that holds none is a one-line error saying which and what to do."""
    from tieflax.run.layout import WorkdirError  # noqa: PLC0415

    path = storage.join(out_dir, SUMMARY)
    try:
        return jsonable.loads(storage.read_text(path))
    except FileNotFoundError:
        pass
    if not storage.exists(out_dir):
        raise WorkdirError(f"--workdir {out_dir} does not exist: give the folder a `tieflax compare` wrote")
    if storage.listdir(out_dir):
        raise WorkdirError(f"{out_dir} holds a study that has not finished (no {SUMMARY} yet): finish the study "
                           "first (rerun the same `tieflax compare` command without --report-only); "
                           "--report-only rewrites the report of a finished one")
    raise WorkdirError(f"{out_dir} is empty: run `tieflax compare` there first")
