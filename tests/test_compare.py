"""`tieflax compare`: the parameter-matched variant, config checks, and a shortened end-to-end run whose
report has every section and plot; `tieflax analyze` on one of its runs."""

import json
import os

import numpy as np
import pytest

from tieflax import cli
from tieflax.analysis import study
from tieflax.analysis.params import param_report
from tieflax.analysis.report import REPORT, claims, load_summary
from tieflax.config import load_config
from tieflax.model import ModelConfig

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tie_vs_untie.py")
WORDS = ("the of and to in that he shall unto for his a lord they be is him not them it with all thou thy "
         "was god which my me said but ye their have will thee from as are when this out were upon man by "
         "you israel king son up there hath then people came had house into her").split()
PLOTS = ("loss_curves", "loss_differences", "norm_vs_frequency", "movement_by_bin", "anisotropy",
         "gradient_interference", "updated_by_bin")


@pytest.mark.parametrize("strategy,shape", [("width", dict(n_layers=2)), ("depth", dict(n_layers=6)),
                                            ("embed_dim", dict(n_layers=2))])
def test_matched_untied_has_the_tied_total(strategy, shape):
    mc = ModelConfig(family="llama", vocab_size=500, d_model=64, n_heads=4, d_ff=256, max_seq_len=32,
                     tie_embeddings=True, **shape)
    matched, info = study.matched_untied_config(mc, strategy)
    tied_total = param_report(mc).total_tied
    assert not matched.tie_embeddings
    assert info["target_total"] == tied_total
    assert info["matched_total"] == param_report(matched).total_untied  # measured, not assumed
    assert abs(info["matched_total"] - tied_total) / tied_total < (2e-2 if strategy == "embed_dim" else 2e-3)
    changed = {"width": "d_model", "depth": "n_layers", "embed_dim": "embed_dim"}[strategy]
    if strategy == "embed_dim":  # Chung et al.: the body is untouched, the embeddings narrow
        assert (matched.d_model, matched.n_layers, matched.d_ff) == (mc.d_model, mc.n_layers, mc.d_ff)
        assert 0 < matched.embed_dim < mc.d_model
        step = param_report(matched.replace(embed_dim=matched.embed_dim + 1)).total_untied - info["matched_total"]
        assert abs(tied_total - info["matched_total"]) <= step / 2  # the nearest E
    else:
        assert getattr(matched, changed) < getattr(mc, changed)
    assert info["matched_shape"][changed] == getattr(matched, changed)


def test_depth_match_impossible_is_a_clear_error():
    mc = ModelConfig(family="llama", vocab_size=4000, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                     tie_embeddings=True)
    with pytest.raises(ValueError, match="match='width'"):
        study.matched_untied_config(mc, "depth")


def test_compare_config_errors_name_the_field():
    config = load_config(CONFIG, ["compare.grad_batches=0"])
    with pytest.raises(ValueError, match="config.compare.grad_batches"):
        study.compare_config(config)
    config = load_config(CONFIG, ["compare.variants=('tied', 'untyed')"])
    with pytest.raises(ValueError, match="config.compare.variants"):
        study.compare_config(config)


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    """A shortened compare: three 1-layer models, 4 steps each, on a small generated corpus."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(12):
        text = "\n".join(" ".join(rng.choice(WORDS, rng.integers(5, 15))) + "." for _ in range(8))
        (root / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    workdir = tmp_path_factory.mktemp("compare")
    overrides = [
        "data.source=files", f"data.files.paths={root}/*.txt", "data.tokenizer.vocab_size=300",
        "data.val_fraction=0.25", "model.vocab_size=300", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=16", "train.seq_len=16",
        "train.global_batch_size=8", "train.num_steps=4", "train.warmup_steps=1", "train.eval_every=4",
        "train.eval_batches=1", "train.log_every=2", "train.analyze_every=2", "compare.analysis_points=2",
        "compare.max_rows=128", "compare.seeds=(0, 1)", "compare.grad_batches=2", "compare.bootstrap=200",
        "compare.n_bins=4", "compare.variants=('tied', 'untied', 'untied_matched')",
    ]
    assert cli.main(["compare", "--config", CONFIG, "--workdir", str(workdir),
                     *[f"--config.{o}" for o in overrides]]) == 0
    return workdir


def test_compare_writes_a_report_with_every_section_and_plot(compare_run, capsys):
    workdir = compare_run
    text = (workdir / REPORT).read_text()
    for section in ("## Setup", "## Results", "## The claims, checked against these numbers",
                    "## Geometry (final checkpoint against init and a row-shuffled control)",
                    "## Gradient interference and updated rows", "## Plots",
                    "## What these numbers support, and what they do not"):
        assert section in text, section
    for plot in PLOTS:
        assert f"]({plot}.png)" in text, plot
        assert (workdir / f"{plot}.png").stat().st_size > 1000, plot
    assert "parameters vs the tied" in text and "epochs of the train split" in text
    assert (workdir / "report.html").exists()
    summary = load_summary(str(workdir))
    runs = {(r["variant"], r["seed"]): r for r in summary["runs"]}
    assert len(runs) == 6  # 3 variants x 2 seeds
    p = {v: runs[(v, 0)]["params"] for v in ("tied", "untied", "untied_matched")}
    assert p["untied"]["total"] - p["tied"]["total"] == 300 * 32
    assert p["untied_matched"]["non_embedding"] == p["tied"]["non_embedding"]  # the body is held fixed
    assert abs(p["untied_matched"]["total"] - p["tied"]["total"]) / p["tied"]["total"] < 0.02
    tied = runs[("tied", 0)]["analysis"]
    val = tied["val"]
    # The whole validation split, attributed to documents: every scored token counted once.
    assert sum(val["doc_tokens"]) == sum(runs[("untied", 1)]["analysis"]["val"]["doc_tokens"]) > 0
    assert val["loss"] == pytest.approx(sum(val["doc_loss"]) / sum(val["doc_tokens"]))
    g = tied["gradient"]["final"]
    assert -1 <= g["cosine"] <= 1 and g["batches"] == 2 and "cosine_adam" in g["shuffled"]
    m = tied["matrices"]["input"]
    assert m["movement"]["mean"] > 0 and m["init"]["aniso"]["mean_cosine"] != m["final"]["aniso"]["mean_cosine"]
    assert "arrays" in tied and "arrays" not in runs[("tied", 1)]["analysis"]  # per-row data for seed 0 only
    # Claims: every one has an interval (two seeds) and a verdict drawn from it.
    groups = {}
    for r in summary["runs"]:
        groups.setdefault(r["variant"], []).append(r)
    lines = claims(groups, summary)
    assert len(lines) == 6 and all("[" in line for line in lines)


def test_report_only_rewrites_from_the_summary(compare_run, capsys):
    workdir = compare_run
    os.remove(workdir / REPORT)
    assert cli.main(["compare", "--workdir", str(workdir), "--report-only"]) == 0
    assert (workdir / REPORT).exists()
    assert f"report: {workdir / REPORT}" in capsys.readouterr().out


def test_analyze_command_on_a_compare_run(compare_run, capsys):
    run_dir = compare_run / "untied" / "seed_0"
    assert cli.main(["analyze", "--workdir", str(run_dir), "--step", "2", "--max-rows", "64"]) == 0
    saved = json.loads((run_dir / "analysis" / "step_2.json").read_text())
    assert saved["step"] == 2 and not saved["tied"] and "cka" in saved["in_out"]
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 3"):
        cli.main(["analyze", "--workdir", str(run_dir), "--step", "3"])
