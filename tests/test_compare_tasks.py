"""``config.compare.tasks``: a short CPU compare scores every run on a local multiple-choice task (offline)
and its report and summary.json hold per-task accuracy per variant and the paired difference to tied with
95% intervals; a resumed compare reuses the scores; runs scored on different prompts are refused."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # before lm-eval imports datasets

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("lm_eval", reason="the test extra (lm-eval) is not installed")

from console_support import capture_console, foreign_problems  # noqa: E402
from task_support import WORDS, write_task, write_word_corpus  # noqa: E402
from train_support import plots_not_rendered  # noqa: E402
from tieflax import cli  # noqa: E402
from tieflax.analysis import stats as st  # noqa: E402
from tieflax.study import compare as study  # noqa: E402
from tieflax.study.tasks import compare_tasks, tasks_section  # noqa: E402
from tieflax.config import load_config  # noqa: E402

# lm-eval scores in this process: without its torch environment report (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("lm_eval_without_env_report")

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tie_vs_untie.py")


def _write_task(folder, rng) -> str:
    rows = []
    for _ in range(16):
        words = list(rng.choice(WORDS, 6))
        rows.append({"question": " ".join(words[:4]), "answer": int(rng.integers(0, 3)),
                     "choices": [" ".join(rng.choice(WORDS, 2)) for _ in range(3)]})
    return write_task(folder, "tf_cmp_mc", rows, data_name="mc")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small generated corpus and the local task: -> (corpus folder, task folder)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    write_word_corpus(root, rng)
    return root, _write_task(root / "tasks", rng)


def _small(root) -> list[str]:
    # The model, batch, sequence length, steps and schedule of tests/test_compare.py's `compare_run`: their
    # train and eval programs are one another's, so in a suite run the file that trains second takes them
    # from the run's compilation cache (tests/conftest.py). At 16 tokens every item is still scored: a
    # longer context would be left-truncated to fit (tieflax/eval/harness.py), as at any length.
    return ["data.source=files", f"data.files.paths={root}/*.txt", "data.tokenizer.vocab_size=300",
            "data.val_fraction=0.25", "model.vocab_size=300", "model.d_model=32", "model.n_layers=1",
            "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=16", "train.seq_len=16",
            "train.global_batch_size=8", "train.num_steps=4", "train.warmup_steps=1", "train.log_every=2"]


@pytest.fixture(scope="module")
def scored(tmp_path_factory, corpus):
    """A 2-variant x 2-seed compare of 1-layer models (4 steps), each run scored on a 16-item local task.
    The tasks are what is checked: no tuned lens (``lens_fit_tokens=0``) and one kept checkpoint per run
    (no held-out pass at a middle checkpoint), measures these tests do not read (tests/test_compare.py
    checks them). No test here reads a plot: they are built but not rendered (``plots_not_rendered``;
    tests/test_compare.py's report test checks the rendered PNGs of the same 2 x 2 shape)."""
    root, tasks = corpus
    workdir = tmp_path_factory.mktemp("compare_tasks")
    overrides = [
        *_small(root), "train.eval_every=4", "train.eval_batches=1", "compare.max_rows=128", "compare.seeds=(0, 1)",
        "compare.grad_batches=1", "compare.val_batches=1", "compare.bootstrap=200", "compare.n_bins=4",
        "compare.analysis_points=1", "compare.lens_fit_tokens=0",
        "compare.variants=('tied', 'untied')", "compare.tasks=('tf_cmp_mc',)", f"compare.task_include_path={tasks}",
    ]
    argv = ["compare", "--config", CONFIG, "--workdir", str(workdir), *[f"--config.{o}" for o in overrides]]
    with pytest.MonkeyPatch.context() as mp:
        plots_not_rendered(mp)
        code, console = capture_console(cli.main, argv)
    assert code == 0, console
    return dict(workdir=workdir, argv=argv, tasks=tasks, console=console)


def test_compare_reports_task_accuracy_with_paired_intervals(scored):
    workdir = scored["workdir"]
    summary = json.loads((workdir / "summary.json").read_text())
    task = summary["tasks"]["tf_cmp_mc"]
    assert task["metric"] == "acc" and task["n_items"] == 16 and task["seeds"] == [0, 1]
    for v in ("tied", "untied"):
        ci = task["variants"][v]
        # The mean is the per-item accuracy averaged over seeds x items, recomputed here from the run's files.
        accs = []
        for seed in (0, 1):
            saved = json.loads((workdir / v / f"seed_{seed}" / "analysis" / "tasks.json").read_text())
            accs += [row[3] for row in saved["tasks"]["tf_cmp_mc"]["items"]]
            lines = (workdir / v / f"seed_{seed}" / "lm_eval" / "samples_tf_cmp_mc.jsonl").read_text().splitlines()
            assert len(lines) == 16 and "prompt_hash" in json.loads(lines[0])
        assert ci["mean"] == pytest.approx(np.mean(accs)) and ci["lo"] <= ci["mean"] <= ci["hi"]
    d = task["minus_tied"]["untied"]
    assert d["mean"] == pytest.approx(task["variants"]["untied"]["mean"] - task["variants"]["tied"]["mean"])
    assert d["lo"] <= d["mean"] <= d["hi"] and d["n_seeds"] == 2 and d["n_docs"] == 16
    text = (workdir / "report.md").read_text()
    assert "## Benchmark tasks" in text and "**tf_cmp_mc** (acc; 16 items x 2 seed(s))" in text
    section = text.split("## Benchmark tasks")[1].split("## The claims")[0]
    row = next(line for line in section.splitlines() if line.startswith("| untied |"))
    assert f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" in row
    assert ("includes 0" in row) == (not st.excludes_zero(d))


def test_compare_with_tasks_prints_no_foreign_warning(scored):
    assert "compare finished in" in scored["console"]
    assert foreign_problems(scored["console"]) == [], scored["console"]


def test_a_resumed_compare_reuses_the_scores(scored, monkeypatch):
    plots_not_rendered(monkeypatch)   # the report's plots are not what this checks (tests/test_compare.py's)
    workdir = scored["workdir"]
    samples = workdir / "tied" / "seed_0" / "lm_eval" / "samples_tf_cmp_mc.jsonl"
    before = samples.stat().st_mtime_ns
    code, console = capture_console(cli.main, scored["argv"])
    assert code == 0, console
    assert samples.stat().st_mtime_ns == before   # not scored again


def test_mismatched_prompt_hash_is_refused_in_one_line(scored, capsys, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    summary = json.loads((scored["workdir"] / "summary.json").read_text())
    run = next(r for r in summary["runs"] if r["variant"] == "untied" and r["seed"] == 1)
    run["tasks"]["tasks"]["tf_cmp_mc"]["items"][3][2] = "0" * 64
    (copy / "summary.json").write_text(json.dumps(summary))
    assert cli.main(["compare", "--workdir", str(copy), "--report-only"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "prompt hash" in err and "untied seed 1" in err, err
    assert not (copy / "report.md").exists()


def test_task_comparison_on_planted_items():
    """Planted: untied right on every item, tied on half: accuracy 1 vs 0.5, difference +0.5 resolved."""
    def run(v, s, values):
        items = [["t", i, f"h{i}", float(x)] for i, x in enumerate(values)]
        return dict(variant=v, seed=s, tasks=dict(tasks={"t": dict(metric="acc", items=items)}))
    runs = [run("tied", s, [i % 2 for i in range(40)]) for s in (0, 1)] + [run("untied", s, [1] * 40) for s in (0, 1)]
    out = compare_tasks(runs, n_boot=500)["t"]
    assert out["variants"]["untied"]["mean"] == 1.0 and out["variants"]["tied"]["mean"] == 0.5
    d = out["minus_tied"]["untied"]
    assert d["mean"] == pytest.approx(0.5) and d["lo"] > 0
    assert "untied scores higher" in tasks_section({"t": out}, lambda h, rows: str(rows))


def test_tasks_are_off_by_default_and_checked():
    assert tuple(study.compare_config(load_config(CONFIG)).tasks) == ()
    with pytest.raises(ValueError, match="config.compare.tasks"):
        study.compare_config(load_config(CONFIG, ["compare.tasks=('arc_easy', '')"]))


def test_sweep_takes_the_same_tasks(corpus, tmp_path, monkeypatch):
    """``tieflax sweep`` with ``config.compare.tasks``: the runs at each variant's best rate are scored and
    the sweep report gains the per-size task table (one size, one seed: intervals over items). The size,
    rate and steps are those of `scored`'s runs (tie_vs_untie.py's rate 3e-3), so their train, eval and
    scoring programs come from the compilation cache."""
    from tieflax.study import sweep

    plots_not_rendered(monkeypatch)   # the sweep report's plots: tests/test_compare.py's sweep test reads one
    root, tasks = corpus
    scaling = os.path.join(os.path.dirname(CONFIG), "tie_scaling.py")
    config = load_config(scaling + ":smoke", [*_small(root), "sweep.sizes=((32, 1, 64, 2),)", "sweep.seeds=(0,)",
                                              "sweep.lrs=(3e-3,)", "sweep.variants=('tied', 'untied')",
                                              "compare.tasks=('tf_cmp_mc',)", f"compare.task_include_path={tasks}"])
    summary = sweep.run_sweep(config, str(tmp_path), log=lambda _: None)
    task = summary["tasks"][0]["tf_cmp_mc"]
    assert task["n_items"] == 16 and task["seeds"] == [0] and set(task["minus_tied"]) == {"untied"}
    text = (tmp_path / "sweep_report.md").read_text()
    assert "## Benchmark tasks" in text and "### Size 0: (32, 1, 64, 2)" in text and "**tf_cmp_mc**" in text
    assert json.loads((tmp_path / "sweep.json").read_text())["tasks"]["0"]["tf_cmp_mc"]["n_items"] == 16
