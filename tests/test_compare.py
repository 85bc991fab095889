"""`tieflax compare`: the parameter-matched variant, config checks, and a shortened end-to-end run whose
report has every section and plot; `tieflax analyze` on one of its runs."""

import json
import os
import re

import numpy as np
import pytest

from console_support import capture_console, foreign_problems
from task_support import write_word_corpus
from train_support import plots_not_rendered
from tieflax import cli
from tieflax.study import compare as study
from tieflax.study.resume import StudyMismatch
from tieflax.model.params import param_report
from tieflax.study.findings import LITTLE, VERDICTS, judge
from tieflax.study.report import REPORT, claims, load_summary, study_findings
from tieflax.config import load_config
from tieflax.model import ModelConfig
from tieflax.run.layout import WorkdirError

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tie_vs_untie.py")
PLOTS = ("loss_curves", "loss_differences", "norm_vs_frequency", "movement_by_bin", "anisotropy",
         "gradient_interference", "updated_by_bin", "input_path_ratio", "lens_by_layer", "rare_token_gains",
         "gains_through_training")


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
    with pytest.raises(ValueError, match="'untied_width'"):
        study.matched_untied_config(mc, "depth")


def test_variants_matched_on_non_embedding_and_on_total_parameters():
    from tieflax.config import model_config

    config = load_config(CONFIG, ["compare.variants=('tied', 'untied', 'untied_matched', 'tied_embed_decay', "
                                  "'untied_head_bias', 'tied_embed_sgd')"])
    variants, infos = study.variant_configs(config)
    p = {v: study.param_counts(model_config(variants[v])) for v in ("tied", "untied", "untied_matched")}
    assert p["untied_matched"]["non_embedding"] == p["tied"]["non_embedding"] == p["untied"]["non_embedding"]
    assert abs(p["untied_matched"]["total"] - p["tied"]["total"]) / p["tied"]["total"] < 0.01
    assert variants["tied_embed_sgd"].train.embedding_optimizer == "sgd"
    assert variants["tied_embed_decay"].train.decay_embeddings and variants["tied_embed_decay"].model.tie_embeddings
    assert variants["untied_head_bias"].model.head_bias and not variants["untied_head_bias"].model.tie_embeddings
    assert set(infos) == {"untied_matched"} and infos["untied_matched"]["matched_shape"]["embed_dim"] == 32


def test_compare_config_errors_name_the_field():
    config = load_config(CONFIG, ["compare.grad_batches=0"])
    with pytest.raises(ValueError, match="config.compare.grad_batches"):
        study.compare_config(config)
    config = load_config(CONFIG, ["compare.variants=('tied', 'untyed')"])
    with pytest.raises(ValueError, match="config.compare.variants"):
        study.compare_config(config)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_word_corpus(root, np.random.default_rng(0))
    return root


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory, corpus):
    """A shortened compare: 1-layer models, 4 steps each, on a small generated corpus (the shapes and
    schedule of tests/test_compare_tasks.py's runs: the train and eval programs one file compiles are the
    other's cache hits in a suite run). No in-training diagnostics (``train.analyze_every``, off in the
    study's config too: no test here reads them; tests/test_train.py checks that hook). The tuned lens takes
    10 SGD steps, not the study's 250: what is checked here is that it is trained, kept and reported (its
    recipe against the tuned-lens package is tests/test_literature.py's); each step is a dispatch."""
    root = corpus
    workdir = tmp_path_factory.mktemp("compare")
    overrides = [
        "data.source=files", f"data.files.paths={root}/*.txt", "data.tokenizer.vocab_size=300",
        "data.val_fraction=0.25", "model.vocab_size=300", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=16", "train.seq_len=16",
        "train.global_batch_size=8", "train.num_steps=4", "train.warmup_steps=1", "train.eval_every=4",
        "train.eval_batches=1", "train.log_every=2", "compare.analysis_points=2",
        "compare.max_rows=128", "compare.seeds=(0, 1)", "compare.grad_batches=2", "compare.bootstrap=200",
        "compare.n_bins=4", "compare.variants=('tied', 'untied')", "compare.lens_steps=10",
    ]
    argv = ["compare", "--config", CONFIG, "--workdir", str(workdir), *[f"--config.{o}" for o in overrides]]
    code, console = capture_console(cli.main, argv)
    assert code == 0, console
    (workdir / "argv.json").write_text(json.dumps(argv))  # for the resume tests
    (workdir / "console.txt").write_text(console)  # what the user saw, for test_compare_prints_no_foreign_warning
    return workdir


def test_compare_writes_a_report_with_every_section_and_plot(compare_run, capsys):
    workdir = compare_run
    text = (workdir / REPORT).read_text()
    for section in ("## Setup", "## Results", "## Findings on the study's hypotheses",
                    "## Geometry (final checkpoint against init and a row-shuffled control)",
                    "## Gradient interference and updated rows", "## Plots",
                    "## What these numbers support, and what they do not"):
        assert section in text, section
    for plot in PLOTS:
        assert f"]({plot}.png)" in text, plot
        assert (workdir / f"{plot}.png").stat().st_size > 1000, plot
    assert "epochs of the train split" in text and "2 seeds x 3 documents" in text
    html = (workdir / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(PLOTS) and '.png"' not in html  # travels alone
    assert str(workdir) not in text and "`tied/seed_0`" in text  # runs named relative to the study
    summary = load_summary(str(workdir))
    runs = {(r["variant"], r["seed"]): r for r in summary["runs"]}
    assert len(runs) == 4  # 2 variants x 2 seeds
    p = {v: runs[(v, 0)]["params"] for v in ("tied", "untied")}
    assert p["untied"]["total"] - p["tied"]["total"] == 300 * 32
    assert p["untied"]["non_embedding"] == p["tied"]["non_embedding"]
    tied = runs[("tied", 0)]["analysis"]
    val = tied["val"]
    # The whole validation split, attributed to documents: every scored token counted once.
    assert val["doc_tokens"] == runs[("untied", 1)]["analysis"]["val"]["doc_tokens"] and sum(val["doc_tokens"]) > 0
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
    # The literature table opens the report, and summary.json carries its rows (no NaN in them).
    assert text.index("## From the literature") < text.index("## Setup")
    assert [r["source"] for r in summary["literature"]] == ["arXiv 2603.26663"] * 4 + ["arXiv 2601.22040"] * 2
    assert all(r["verdict"] in VERDICTS for r in summary["literature"])
    assert [t["step"] for t in tied["through"]] == [2, 4] and "Gains through training, `untied` - tied" in text
    assert tied["lens"]["method"] == "kl" and len(tied["lens"]["kl"]) == 1
    json.dumps(summary["literature"], allow_nan=False)  # undefined numbers are null, never NaN
    al = summary["alignment"]["tied"]["0"]
    assert al["same"]["init"]["cka_input"] == pytest.approx(1.0) and al["same"]["init"]["knn_input"] == 1.0
    assert al["cross"]["untied_seed"] == 1 and tied["lens"]["layers"] == 1
    assert np.sum(val["doc_bin_tokens"]) == sum(val["doc_tokens"])


def test_one_seed_one_document_prints_no_verdict_and_no_nan(tmp_path, corpus, monkeypatch):
    """1 seed, 1 held-out document (the runlocal shape): every line says what is missing, none gives a
    verdict, nothing prints nan, and the split is called whole only when it is."""

    # No plot is read here: every figure is built from this study's numbers, none rendered (the report's
    # text and HTML are what is checked; compare_run's rendered PNGs are the first test's).
    plots_not_rendered(monkeypatch)

    # The model, batch, steps and schedule of `compare_run` (the same compiled programs: its step, eval
    # and analysis programs come from the compilation cache), one kept checkpoint, one seed.
    overrides = [
        "data.source=files", f"data.files.paths={corpus}/*.txt", "data.tokenizer.vocab_size=300",
        "data.val_fraction=0.25", "data.max_val_documents=1", "model.vocab_size=300", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=16", "train.seq_len=16",
        "train.global_batch_size=8", "train.num_steps=4", "train.warmup_steps=1", "train.eval_every=4",
        "train.eval_batches=1", "train.log_every=2", "compare.analysis_points=1", "compare.max_rows=128",
        "compare.seeds=(0,)", "compare.grad_batches=1", "compare.bootstrap=50", "compare.n_bins=4",
        "compare.val_batches=1", "compare.variants=('tied', 'untied')",
    ]
    argv = ["compare", "--config", CONFIG, "--workdir", str(tmp_path), *[f"--config.{o}" for o in overrides]]
    code, console = capture_console(cli.main, argv)
    assert code == 0, console
    text = (tmp_path / REPORT).read_text()
    for shown in (text, console, (tmp_path / "report.html").read_text()):
        assert not re.search(r"\bnan\b", shown, re.IGNORECASE), [x for x in shown.splitlines() if "nan" in x.lower()]
    legends = ("Verdicts: ", "Runs trained by")
    said = "\n".join(x for x in text.splitlines() if not x.startswith(legends))  # not the legends
    for verdict in ("holds here", "contradicted here", "unresolved"):
        assert verdict not in said, [x for x in said.splitlines() if verdict in x]
    found = [x for x in said.splitlines() if "Claim tested:" in x]
    assert len(found) == 6 and all(x.endswith("*no verdict from < 2 units*.") or "*no verdict from < 2 units*. " in x
                                   for x in found), found
    assert all(re.match(r"- \*\*[^*]*: no interval \(", x) for x in found), found   # no side is stated
    assert "1 seed: no interval over seeds" in text and "1 held-out document" in text
    summary = load_summary(str(tmp_path))
    assert {r["verdict"] for r in summary["literature"]} == {LITTLE}
    whole = summary["data"]["whole_split"]
    assert ("evaluation on the whole validation split" in text) == whole
    assert whole or "not the whole split" in text


def test_compare_prints_no_foreign_warning(compare_run):
    """The quick-start command shows progress bars, its summary and nothing else: no warning or error line
    that tieflax did not write (orbax's "Metadata file does not exist" for healthy checkpoints was one)."""
    console = (compare_run / "console.txt").read_text()
    assert "compare finished in" in console and "report: " in console
    assert foreign_problems(console) == [], console


def test_report_only_rewrites_from_the_summary_and_verdicts_follow_the_interval(compare_run, capsys, monkeypatch):
    import copy

    from tieflax.study.report import render

    workdir = compare_run
    plots_not_rendered(monkeypatch)   # no plot read here; the bucket test reads --report-only's PNGs
    os.remove(workdir / REPORT)
    assert cli.main(["compare", "--workdir", str(workdir), "--report-only"]) == 0
    assert (workdir / REPORT).exists()
    assert f"report: {workdir / REPORT}" in capsys.readouterr().out
    summary = load_summary(str(workdir))
    tied = {r["seed"]: r["analysis"]["val"] for r in summary["runs"] if r["variant"] == "tied"}
    for shift, said, verdict in ((-0.5, "Untied reaches lower loss than tied", "holds here"),
                                 (0.0, "Loss, untied - tied: no resolved difference", "unresolved"),
                                 (0.5, "Tied reaches lower loss than untied", "contradicted here")):
        fake = copy.deepcopy(summary)
        for r in fake["runs"]:
            if r["variant"] == "untied":  # untied = tied + shift per token, document by document
                t = tied[r["seed"]]
                r["analysis"]["val"]["doc_loss"] = [x + shift * n for x, n in zip(t["doc_loss"], t["doc_tokens"])]
        line = [x for x in render(fake, {}).splitlines() if "Untying reaches lower loss at matched" in x][0]
        assert line.startswith(f"- **{said}") and f"*{verdict}*" in line and f"{shift:+.4f}" in line
        groups = {}
        for r in fake["runs"]:
            groups.setdefault(r["variant"], []).append(r)
        for f, _ in study_findings(groups, fake):   # no heading contradicted by its own interval
            if f is not None:
                assert f["verdict"] == judge(f, f["predicted"], f["ref"]), f


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_resumed_compare_refuses_runs_trained_with_another_config(compare_run, capsys):
    """A rerun with --config.train.num_steps changed reused the finished runs silently."""
    argv = json.loads((compare_run / "argv.json").read_text())
    before = sorted(os.listdir(compare_run / "tied" / "seed_0"))
    capsys.readouterr()
    assert cli.main(argv + ["--config.train.num_steps=5"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.num_steps 4 -> 5" in err and "--retrain-changed" in err, err
    assert sorted(os.listdir(compare_run / "tied" / "seed_0")) == before  # nothing trained or removed
    assert "tieflax.lock" not in os.listdir(compare_run)  # the study's own lock released
    _strict((compare_run / "summary.json").read_text())
    _strict((compare_run / "tied" / "seed_0" / "analysis" / "compare.json").read_text())


def test_a_finished_study_rerun_says_each_run_is_finished_and_trains_nothing(compare_run, monkeypatch):
    """A rerun of a finished study printed "training tied (seed 0)" and "resuming from step 4" for each
    run although nothing trained."""
    plots_not_rendered(monkeypatch)   # no plot read here (compare_run's are checked by the first test)
    argv = json.loads((compare_run / "argv.json").read_text())
    steps = sorted(os.listdir(compare_run / "tied" / "seed_0" / "checkpoints"))
    before = load_summary(str(compare_run))
    code, console = capture_console(cli.main, argv)
    assert code == 0, console
    assert "training" not in console and "resuming from step" not in console, console
    for variant in ("tied", "untied"):
        for seed in (0, 1):
            assert f"{variant} (seed {seed}) in {variant}/seed_{seed}\n" in console, console
    assert console.count("nothing to train") == 4, console   # each finished run announced once
    assert sorted(os.listdir(compare_run / "tied" / "seed_0" / "checkpoints")) == steps
    after = load_summary(str(compare_run))   # the runs' provenance and compute time survive the rerun
    assert after["provenance"] == before["provenance"] and before["provenance"]["runs_trained"] == 4
    assert f"{before['provenance']['compute_seconds'] / 60:.1f} minutes of training" in (compare_run / REPORT).read_text()


def test_report_only_from_a_bucket(compare_run, gcs, capsys):
    """`tieflax compare --workdir gs://B/compare --report-only`: summary.json read from the bucket, the
    report, its HTML and the PNGs written there whole; nothing else in the bucket."""
    from tieflax import storage

    study = gcs.new_bucket() + "/compare"
    storage.write_bytes(f"{study}/summary.json", (compare_run / "summary.json").read_bytes())
    assert cli.main(["compare", "--workdir", study, "--report-only"]) == 0
    assert f"report: {study}/report.md" in capsys.readouterr().out
    names = set(gcs.objects(study.rsplit("/", 1)[0], ""))
    assert names == {f"compare/{n}" for n in ("summary.json", "report.md", "report.html",
                                              *[f"{p}.png" for p in PLOTS])}, names
    own_time = re.compile(r" This report was written on [^.]*\(\d+\.\d s\)\.")   # the report's own time, apart
    assert own_time.sub("", storage.read_text(f"{study}/report.md")) == own_time.sub("", (compare_run / REPORT).read_text())
    assert 'src="data:image/png;base64,' in storage.read_text(f"{study}/report.html")
    png = storage.read_bytes(f"{study}/loss_curves.png")
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_report_only_on_an_unfinished_study_says_finish_it_first(tmp_path, capsys):
    (tmp_path / "study" / "tied" / "seed_0").mkdir(parents=True)
    assert cli.main(["compare", "--workdir", str(tmp_path / "study"), "--report-only"]) == 1
    err = capsys.readouterr().err
    assert "has not finished" in err and "finish the study first" in err
    assert cli.main(["compare", "--workdir", str(tmp_path / "none"), "--report-only"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_analyze_command_on_a_compare_run(compare_run, capsys):
    run_dir = compare_run / "untied" / "seed_0"
    assert cli.main(["analyze", "--workdir", str(run_dir), "--step", "2", "--max-rows", "64"]) == 0
    saved = json.loads((run_dir / "analysis" / "step_2.json").read_text())
    assert saved["step"] == 2 and not saved["tied"] and "cka" in saved["in_out"]
    capsys.readouterr()
    assert cli.main(["analyze", "--workdir", str(run_dir), "--step", "3"]) == 1
    assert "tieflax analyze: " in (err := capsys.readouterr().err) and "no checkpoint at step 3" in err


def test_sweep_picks_rates_finds_a_planted_crossover_and_resumes(tmp_path, monkeypatch):
    """The sweep's orchestration on a planted loss surface (no training: ``train`` is injected)."""
    import math

    from tieflax.study import sweep

    best = {"tied": 3e-3, "untied": 1e-2, "untied_matched": 1e-2}
    calls = []

    def fake_train(cfg, run_dir):
        from tieflax.config import model_config

        calls.append(run_dir)
        p = study.param_counts(model_config(cfg))
        name = run_dir.split(os.sep)[-4]
        # Loss falls with size; untied_matched pays 0.1 at the smallest size and gains as d_model grows:
        # it crosses tied between the two sizes. Seeds add +-0.01; a wrong learning rate costs 0.5.
        loss = 6 - 0.5 * math.log10(p["total"]) + (0.1 - 0.004 * (cfg.model.d_model - 16)) * (name != "tied")
        loss += 0.01 * (cfg.seed - 0.5) + 0.5 * (abs(math.log10(cfg.train.learning_rate / best[name])) > 0.1)
        return dict(final_val_loss=loss)

    overrides = ["data.tokenizer.path=unused.json", "model.vocab_size=500", "data.tokenizer.vocab_size=500"]
    config = load_config(os.path.join(os.path.dirname(CONFIG), "tie_scaling.py:smoke"), overrides)
    config.sweep.update(sizes=((16, 1, 32, 2), (64, 1, 128, 2)), seeds=(0, 1), lrs=(3e-3, 1e-2))
    summary = sweep.run_sweep(config, str(tmp_path), train=fake_train, log=lambda _: None)
    assert summary["best_lr"] == best
    n_calls = len(calls)
    assert n_calls == 3 * 2 + 3 * 2 * 2 - 3  # lr phase, then sizes x variants x seeds, reusing 3 lr runs
    cur = sweep.curves(summary)
    c = sweep.crossover(cur["tied"], cur["untied_matched"], "total", n_boot=200)
    d = c["mean_diff"]
    assert d[0] > 0 > d[1] and c["x"][0] < c["crossing"] < c["x"][1] and c["share"] == 1.0
    assert c["crossing"] == pytest.approx(c["x"][0] + (c["x"][1] - c["x"][0]) * d[0] / (d[0] - d[1]))
    text = open(summary["report"]).read()
    assert "Crossing: at about 10^" in text and (tmp_path / "loss_vs_total.png").stat().st_size > 1000
    assert "At the edge of the grid" in text  # a 2-rate grid: every best rate is at an edge
    plots_not_rendered(monkeypatch)   # the resumes' reports: no plot is read from here on
    with pytest.raises(WorkdirError, match="--resume"):
        sweep.run_sweep(config, str(tmp_path), train=fake_train)
    sweep.run_sweep(config, str(tmp_path), train=fake_train, resume=True, log=lambda _: None)
    assert len(calls) == n_calls  # every run was finished: nothing retrained
    # A resume with a field that changes results refused the old runs naming it; it had reused them
    # silently and recorded the new value in sweep.json.
    config.train.num_steps = 50
    with pytest.raises(StudyMismatch, match=r"train.num_steps 4 -> 50.*--retrain-changed"):
        sweep.run_sweep(config, str(tmp_path), train=fake_train, resume=True, log=lambda _: None)
    assert len(calls) == n_calls
    config.train.log_every = 3  # not a result field: no refusal for it
    summary = sweep.run_sweep(config, str(tmp_path), train=fake_train, resume=True, retrain_changed=True,
                              log=lambda _: None)
    assert len(calls) == 2 * n_calls and summary["config"]["train"]["num_steps"] == 50
    assert json.load(open(tmp_path / "sweep.json"))["runs"][0]["loss"] == summary["runs"][0]["loss"]


def test_embedding_sgd_ablation_steps_embeddings_by_their_gradient():
    import jax.numpy as jnp

    from tieflax.train.optim import make_optimizer
    from tieflax.train_config import default_train_config

    c = default_train_config()
    c.update(embedding_optimizer="sgd", embedding_sgd_lr=0.5, learning_rate=1e-3, warmup_steps=0,
             min_lr_ratio=1.0, grad_clip_norm=0.0, weight_decay=0.0)
    params = {"embed": {"embedding": jnp.ones((4, 2))}, "block": {"kernel": jnp.ones((2, 2))}}
    grads = {"embed": {"embedding": jnp.full((4, 2), 1e-4).at[0].set(1e-1)},
             "block": {"kernel": jnp.full((2, 2), 1e-4)}}
    tx, _ = make_optimizer(c)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["embed"]["embedding"], -0.5 * grads["embed"]["embedding"], rtol=1e-6)
    np.testing.assert_allclose(updates["block"]["kernel"], -1e-3, rtol=1e-3)  # Adam: ~lr whatever the size
    c.embedding_optimizer = "adagrad"
    with pytest.raises(ValueError, match="config.train.embedding_optimizer"):
        make_optimizer(c)
