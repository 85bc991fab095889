"""Issue 53, round five: bad input ends as one line naming the problem and the fix, before any work; never a
traceback, never a silently wrong result. Repeated seeds, variants and learning rates of a study; surgery
on a run that already is what it asks for; more frequency buckets than tokens; a task's data file cut,
emptied or with an answer outside its choices; more prepare workers than cores; git's noise in an
evaluation outside a git checkout."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # before lm-eval imports datasets: no network

import pytest  # noqa: E402

from cli_support import COMPARE, SCALING, TINY, one_line  # noqa: E402
from train_support import REPO, micro_config, prepare_shared_data  # noqa: E402
from tieflax.cli import main  # noqa: E402
from tieflax.config import load_config  # noqa: E402
from tieflax.errors import ConfigError  # noqa: E402

EXAMPLE = os.path.join(REPO, "examples", "tasks", "verse_ending")


# ------------------------------------------------------------------------------- repeated study values
@pytest.mark.parametrize("override, expected", [
    ("compare.seeds=(0, 0)", "config.compare.seeds = (0, 0) repeats 0"),
    ("compare.seeds=(2, 0, 2)", "config.compare.seeds = (2, 0, 2) repeats 2"),
    ("compare.variants=('tied', 'untied', 'tied')", "config.compare.variants = ('tied', 'untied', 'tied') repeats"),
])
def test_compare_refuses_repeated_seeds_and_variants_at_validation(override, expected):
    """(0, 0) trained one run and reported "2 seed(s)": a bootstrap over two identical units."""
    from tieflax.study.compare import compare_config

    with pytest.raises(ConfigError, match="give each once") as e:
        compare_config(load_config(COMPARE, [override]))
    assert expected in str(e.value)


@pytest.mark.parametrize("override, expected", [
    ("sweep.lrs=(0.0, 1e-2)", "0.0 is not a learning rate"),
    ("sweep.lrs=(-1e-3, 1e-2)", "-0.001 is not a learning rate"),
    ("sweep.lrs=(1e-2, 1e999)", "inf is not a learning rate"),
    ("sweep.lrs=('fast',)", "'fast' is not a learning rate"),
    ("sweep.lrs=(1e-2, 1e-2)", "repeats 0.01"),
    ("sweep.lrs=(1e-3, 0.0010000001)", "repeats 0.0010000001 (the same as 0.001)"),   # one folder lr_0.001
    ("sweep.seeds=(1, 1)", "config.sweep.seeds = (1, 1) repeats 1"),
    ("sweep.variants=('tied', 'untied', 'untied')", "config.sweep.variants"),
])
def test_sweep_refuses_bad_or_repeated_rates_seeds_and_variants_at_validation(override, expected):
    """A rate of 0 was refused only once its first run started, naming config.train.learning_rate."""
    from tieflax.study.sweep import sweep_config

    field = override.partition("=")[0]
    with pytest.raises(ConfigError, match=f"config.{field} = ") as e:
        sweep_config(load_config(SCALING, [override]))
    assert expected in str(e.value)


@pytest.mark.slow
def test_repeated_study_values_are_one_line_and_leave_no_workdir(tmp_path, capsys):
    workdir = tmp_path / "study"
    err = one_line(capsys, ["compare", "--config", COMPARE, "--workdir", str(workdir), "--config.compare.seeds=(0,0)"])
    assert "config.compare.seeds" in err and "give each once" in err
    err = one_line(capsys, ["sweep", "--config", SCALING + ":smoke", "--workdir", str(workdir),
                            "--config.sweep.lrs=(0.0, 0.01)"])
    assert "config.sweep.lrs" in err and "learning_rate" not in err
    assert not workdir.exists()


# ------------------------------------------------------------------------------------- a trained run
@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    """A tied micro run (512-token vocabulary) with a checkpoint at step 2."""
    from tieflax.train import train_and_evaluate

    data = str(tmp_path_factory.mktemp("data"))
    prepare_shared_data(data)
    config = micro_config(data, tied=True, num_steps=2)
    config.train.checkpoint_every = 2
    workdir = str(tmp_path_factory.mktemp("tied") / "run")
    train_and_evaluate(config, workdir)
    return workdir


@pytest.mark.slow
def test_surgery_on_a_run_that_already_is_tied_or_untied_is_one_line(tied_run, tmp_path, capsys):
    """`convert --tie` on a tied run was a 22-line traceback (the surgery's ValueError)."""
    err = one_line(capsys, ["convert", "--tie", "mean", "--workdir", tied_run, "--out", str(tmp_path / "a")])
    assert "is already tied" in err and "--untie" in err
    untied = str(tmp_path / "untied")
    assert main(["convert", "--untie", "--workdir", tied_run, "--out", untied]) == 0
    capsys.readouterr()
    err = one_line(capsys, ["convert", "--untie", "--workdir", untied, "--out", str(tmp_path / "b")])
    assert "is already untied" in err and "--tie input|output|mean" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_more_frequency_buckets_than_tokens_is_one_line(tied_run, capsys):
    """`analyze --buckets 100000` on a 512-token vocabulary was a 25-line traceback, after the data."""
    err = one_line(capsys, ["analyze", "--workdir", tied_run, "--buckets", "100000", "--no-plots"])
    assert "--buckets 100000" in err and "512 tokens" in err and "use at most 512" in err
    assert not os.path.exists(os.path.join(tied_run, "analysis"))


# ------------------------------------------------------------------------------------ task data files
def _task_copy(folder, lines=None) -> tuple[str, str]:
    """The example task under ``folder``, reading its own copy of the data (``lines``: that copy's text):
    -> (include path, data file)."""
    include = os.path.join(str(folder), "tasks")
    os.makedirs(os.path.join(include, "verse_ending"))
    data = os.path.join(include, "verse_ending", "verses.jsonl")
    shutil.copyfile(os.path.join(EXAMPLE, "verses.jsonl"), data)
    if lines is not None:
        with open(data, "w", encoding="utf-8") as f:
            f.write(lines)
    with open(os.path.join(EXAMPLE, "verse_ending.yaml"), encoding="utf-8") as f:
        yaml = f.read().replace("examples/tasks/verse_ending/verses.jsonl", data)
    with open(os.path.join(include, "verse_ending", "verse_ending.yaml"), "w", encoding="utf-8") as f:
        f.write(yaml)
    return include, data


def _example_lines() -> list[str]:
    with open(os.path.join(EXAMPLE, "verses.jsonl"), encoding="utf-8") as f:
        return f.read().splitlines(keepends=True)


def _refused(include: str):
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    from tieflax.eval.decode import EvalError
    from tieflax.eval.tasks import check_task_files

    with pytest.raises(EvalError) as e:
        check_task_files(include)
    return str(e.value)


def test_a_task_data_file_cut_mid_line_or_emptied_is_refused_naming_file_and_line(tmp_path):
    """A cut file was a 96-line traceback out of the datasets library, an emptied one 49 lines."""
    lines = _example_lines()
    include, data = _task_copy(tmp_path / "cut", "".join(lines[:6]) + lines[6][:30])
    err = _refused(include)
    assert "verse_ending.yaml" in err and f"{data}, line 7: not a JSON object" in err and "fix or remove" in err
    include, data = _task_copy(tmp_path / "empty", "")
    err = _refused(include)
    assert f"its data file {data} holds no items" in err


@pytest.mark.parametrize("answer", [4, 7, -1, "the moon"])
def test_an_answer_outside_its_items_choices_is_refused_naming_file_line_and_item(tmp_path, answer):
    """lm-eval scored such an item as wrong for every model (a negative index: the last choice), with a
    warning in its log."""
    lines = _example_lines()
    item = json.loads(lines[2])
    item["answer"] = answer
    lines[2] = json.dumps(item) + "\n"
    include, data = _task_copy(tmp_path, "".join(lines))
    err = _refused(include)
    assert f"{data}, line 3: the answer (answer = {answer!r}) is not one of the item's 4 choices" in err
    assert "Let there be light" in err   # the item itself


@pytest.mark.slow
def test_evaluate_refuses_a_damaged_task_file_in_one_line_before_the_run_is_read(tmp_path, capsys):
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    include, data = _task_copy(tmp_path, "".join(_example_lines()[:3]) + '{"context": "And God')
    err = one_line(capsys, ["evaluate", "--workdir", str(tmp_path / "no_run"), "--tasks", "verse_ending",
                            "--include-path", include])
    assert f"{data}, line 4: not a JSON object" in err


@pytest.mark.slow
def test_an_evaluation_outside_a_git_checkout_prints_no_git_error(tmp_path, monkeypatch, capfd):
    """lm-eval records the commit of the folder it runs in by running git with git's stderr on ours:
    "fatal: not a git repository" in every successful evaluation outside a checkout."""
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    from lm_eval.api.model import LM

    from tieflax.eval.tasks import run_tasks, task_manager

    class Constant(LM):   # every continuation equally likely: the scores do not matter here
        def loglikelihood(self, requests):
            return [(0.0, False) for _ in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    include, _ = _task_copy(tmp_path / "task")
    elsewhere = tmp_path / "not_a_checkout"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("GIT_DIR", raising=False)
    results = run_tasks(Constant(), ["verse_ending"], task_manager(["verse_ending"], include))
    assert results["results"]["verse_ending"]["sample_len"] == 16 and "git_hash" in results
    assert "not a git repository" not in capfd.readouterr().err


# ---------------------------------------------------------------------------------- prepare's workers
@pytest.mark.slow
def test_prepare_uses_at_most_one_worker_per_core_and_says_so(tmp_path, monkeypatch, capsys):
    """1000 workers on 2 cores took 160 s where 1 took 5 s, without a word."""
    import tieflax.data.store_build as store_build

    given = []
    monkeypatch.setattr(store_build, "build_store", lambda *a, workers, **k: given.append(workers))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)   # this process's cores
    err = one_line(capsys, ["prepare", "--config", TINY, "--out", str(tmp_path / "store"), "--workers", "1000"],
                   code=0)
    assert "--workers 1000" in err and "2 cores; using 2 workers" in err and given == [2]
    assert main(["prepare", "--config", TINY, "--out", str(tmp_path / "store"), "--workers", "2"]) == 0
    assert given == [2, 2] and capsys.readouterr().err == ""
