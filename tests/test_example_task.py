"""The example local lm-eval task (examples/tasks/verse_ending) runs offline with ``tieflax evaluate`` on a
tiny trained run, as docs/evaluation.md walks through it."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # before lm-eval imports datasets: no network

import pytest  # noqa: E402

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")

from tieflax.cli import main  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join("examples", "tasks")
# A run small enough to train in seconds (the evaluation guide's tiny run is the same command with 600
# steps); the task needs only a checkpoint and a tokenizer.
TRAIN = ["--config.model.vocab_size=512", "--config.data.tokenizer.vocab_size=512", "--config.model.d_model=32",
         "--config.model.n_layers=2", "--config.model.d_ff=64", "--config.model.max_seq_len=64",
         "--config.train.seq_len=64", "--config.train.num_steps=20", "--config.train.global_batch_size=8",
         "--config.train.eval_every=1000", "--config.train.eval_batches=1", "--quiet"]


@pytest.mark.slow
def test_the_example_task_runs_offline_on_a_tiny_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)   # the task's data_files path is relative to the repository root, as documented
    run, out = str(tmp_path / "run"), str(tmp_path / "lm_eval")
    assert main(["train", "--config", "configs/experiments/tiny.py", "--workdir", run, *TRAIN]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--workdir", run, "--tasks", "verse_ending", "--include-path", TASKS,
                 "--output", out, "--log-samples"]) == 0
    printed = capsys.readouterr().out
    with open(os.path.join(TASKS, "verse_ending", "verses.jsonl")) as f:
        items = [json.loads(line) for line in f]
    # Every item was scored (the whole local file, offline), each choice once, and the accuracy is a
    # share of the 16 items.
    (results,) = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names if n.startswith("results")]
    with open(results) as f:
        scores = json.load(f)["results"]["verse_ending"]
    assert scores["acc,none"] * len(items) == pytest.approx(round(scores["acc,none"] * len(items)))
    assert 0.0 <= scores["acc_norm,none"] <= 1.0
    (samples,) = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names if n.startswith("samples_")]
    with open(samples) as f:
        scored = [json.loads(line) for line in f]
    assert sorted(s["doc_id"] for s in scored) == list(range(len(items)))
    assert all(len(s["resps"]) == len(items[s["doc_id"]]["choices"]) for s in scored)
    assert "verse_ending" in printed
