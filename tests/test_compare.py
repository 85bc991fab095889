"""`tieflax compare`: the parameter-matched variant, config checks, and a shortened end-to-end run whose
report has every section and plot; `tieflax analyze` on one of its runs."""

import json
import os

import numpy as np
import pytest

from tieflax import cli
from tieflax.analysis import study
from tieflax.model.params import param_report
from tieflax.analysis.report import REPORT, claims, load_summary
from tieflax.config import load_config
from tieflax.model import ModelConfig

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tie_vs_untie.py")
WORDS = ("the of and to in that he shall unto for his a lord they be is him not them it with all thou thy "
         "was god which my me said but ye their have will thee from as are when this out were upon man by "
         "you israel king son up there hath then people came had house into her").split()
PLOTS = ("loss_curves", "norm_vs_frequency", "norm_by_bucket", "cosine_histograms", "gradient_interference",
         "gradient_cosine_by_bucket", "softmax_mass_by_bucket", "diagnostics_over_training")


@pytest.mark.parametrize("strategy,shape", [("width", dict(n_layers=2)), ("depth", dict(n_layers=6))])
def test_matched_untied_has_the_tied_total(strategy, shape):
    mc = ModelConfig(family="llama", vocab_size=500, d_model=64, n_heads=4, d_ff=256, max_seq_len=32,
                     tie_embeddings=True, **shape)
    matched, info = study.matched_untied_config(mc, strategy)
    tied_total = param_report(mc).total_tied
    assert not matched.tie_embeddings
    assert info["target_total"] == tied_total
    assert info["matched_total"] == param_report(matched).total_untied  # measured, not assumed
    assert abs(info["matched_total"] - tied_total) / tied_total < 2e-3
    changed = "d_model" if strategy == "width" else "n_layers"
    assert getattr(matched, changed) < getattr(mc, changed)
    assert info["matched_shape"][changed] == getattr(matched, changed)


def test_depth_match_impossible_is_a_clear_error():
    mc = ModelConfig(family="llama", vocab_size=4000, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                     tie_embeddings=True)
    with pytest.raises(ValueError, match="match='width'"):
        study.matched_untied_config(mc, "depth")


def test_compare_config_errors_name_the_field():
    config = load_config(CONFIG, ["compare.match=diagonal"])
    with pytest.raises(ValueError, match="config.compare.match"):
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
        "compare.val_batches=1", "compare.max_rows=128", "compare.analyze_init=False",  # one compile less
    ]
    assert cli.main(["compare", "--config", CONFIG, "--workdir", str(workdir),
                     *[f"--config.{o}" for o in overrides]]) == 0
    return workdir


def test_compare_writes_a_report_with_every_section_and_plot(compare_run, capsys):
    workdir = compare_run
    text = (workdir / REPORT).read_text()
    for section in ("## Setup", "## Results", "## Diagnostics (final checkpoint)",
                    "## The claims, checked against these numbers", "## Plots",
                    "## What these numbers support, and what they do not"):
        assert section in text, section
    for plot in PLOTS:
        assert f"]({plot}.png)" in text, plot
        assert (workdir / f"{plot}.png").stat().st_size > 1000, plot
    for variant in ("tied", "untied", "untied_matched"):
        assert f"| {variant} |" in text or f" {variant} " in text
    assert "n/a" not in text.split("## Diagnostics")[1].split("W_in vs W_out")[0]  # every geometry cell
    assert "parameters vs the tied model's" in text  # the match is stated
    assert (workdir / "report.html").exists()
    summary = load_summary(str(workdir))
    runs = {r["variant"]: r for r in summary["runs"]}
    totals = {v: r["params"]["total_tied" if v == "tied" else "total_untied"] for v, r in runs.items()}
    assert totals["untied"] - totals["tied"] == 300 * 32
    assert abs(totals["untied_matched"] - totals["tied"]) / totals["tied"] < 0.01
    tied = runs["tied"]["analysis"]["final"]
    assert tied["gradient"]["rows_head"] == 1.0 and tied["gradient"]["rows_lookup"] < 1.0
    steps = [s for s, _ in runs["tied"]["analysis"]["over_time"]]
    assert steps == [2, 4]  # analysis_points=2 checkpoints (step 0 is off here to save a compile)
    # The trainer logged the diagnostics hook's rows.
    rows = [json.loads(line) for line in open(workdir / "tied" / "seed_0" / "metrics.jsonl")]
    assert any(r["split"] == "diag" and "input/spearman" in {k.removeprefix("diag/") for k in r} for r in rows)
    assert len(claims({v: [r] for v, r in runs.items()})) == 6


def test_report_only_rewrites_from_the_summary(compare_run, capsys):
    workdir = compare_run
    os.remove(workdir / REPORT)
    assert cli.main(["compare", "--workdir", str(workdir), "--report-only"]) == 0
    assert (workdir / REPORT).exists()
    assert f"report: {workdir / REPORT}" in capsys.readouterr().out


def test_analyze_command_on_a_compare_run(compare_run, capsys):
    run_dir = compare_run / "untied" / "seed_0"
    assert cli.main(["analyze", "--workdir", str(run_dir), "--step", "2", "--max-rows", "64"]) == 0
    out = capsys.readouterr().out
    saved = json.loads((run_dir / "analysis" / "step_2.json").read_text())
    assert saved["step"] == 2 and not saved["tied"] and "cka" in saved["in_out"]
    assert "norm_vs_frequency:" in out and (run_dir / "analysis" / "step_2_cosines.png").exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 3"):
        cli.main(["analyze", "--workdir", str(run_dir), "--step", "3"])


def test_several_seeds_are_reported_as_mean_and_spread(compare_run):
    import copy

    from tieflax.analysis.report import render

    summary = load_summary(str(compare_run))
    extra = copy.deepcopy(summary["runs"])
    for r in extra:  # a fabricated second seed whose losses differ by a known amount
        r["seed"] = 1
        r["result"]["final_val_loss"] += 0.2
    summary["runs"] += extra
    text = render(summary, {})
    tied = [r["result"]["final_val_loss"] for r in summary["runs"] if r["variant"] == "tied"]
    assert f"{np.mean(tied):.4f} ± {np.std(tied, ddof=1):.4f} (n=2)" in text
    assert "the largest seed standard deviation is" in text
