"""Nothing lost, nothing silent: the workdir lock, one-line errors, damaged JSON files, and every config
field range-checked when it is loaded. Nothing here compiles; the damaged-checkpoint and full-disk cases
share the trained runs of ``tests/test_train.py`` and live there."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest

from train_support import REPO, micro_config
from tieflax.run import checkpoints as ckpt
from tieflax.cli import main
from tieflax.config import load_config
from tieflax.run.metrics import MetricWriter, MetricsFileError, read_metrics
from tieflax.model import ConfigError
from tieflax.train import final_interval_loss
from tieflax.run.layout import LOCK_FILE, RunDir
from tieflax.run.lock import workdir_lock

TINY = os.path.join(REPO, "configs", "experiments", "tiny.py")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir as a run leaves it, minus checkpoints: config.json and metrics.jsonl (nothing compiles)."""
    workdir = str(tmp_path_factory.mktemp("reliability") / "run")
    ckpt.save_config(workdir, micro_config(str(tmp_path_factory.mktemp("unused_data")), num_steps=6))
    writer = MetricWriter(RunDir.at(workdir), tensorboard=False)
    for step in (2, 4, 6):
        writer.write(step, {"loss": 5.0, "ce_loss": 5.0, "interval_steps": 2})
    writer.close()
    return workdir


def _copy(trained, tmp_path, name="run") -> str:
    out = str(tmp_path / name)
    shutil.copytree(trained, out)
    return out


def _one_line(capsys, argv, code=1) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tieflax {argv[0]}: "), err
    return err


# ---------------------------------------------------------------------------------------- the lock

def test_a_second_training_in_a_busy_workdir_refuses_in_one_line(trained, tmp_path, capsys):
    workdir = _copy(trained, tmp_path)
    holder = {"host": socket.gethostname(), "pid": os.getppid(), "command": "train", "since": "earlier"}
    with open(os.path.join(workdir, LOCK_FILE), "w") as f:
        json.dump(holder, f)
    rows = read_metrics(workdir)
    segments = sorted(os.listdir(os.path.join(workdir, "metrics")))
    err = _one_line(capsys, ["train", "--workdir", workdir, "--config.train.num_steps=8"])
    assert f"in use by `tieflax train` (host {socket.gethostname()}, PID {os.getppid()}" in err
    assert read_metrics(workdir) == rows  # no duplicate rows
    assert sorted(os.listdir(os.path.join(workdir, "metrics"))) == segments


def test_a_stale_lock_is_taken_over_with_a_message(tmp_path, capsys):
    gone = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": gone,
                                                  "command": "train", "since": "yesterday"}))
    with workdir_lock(str(tmp_path), "train"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        with workdir_lock(str(tmp_path), "convert"):  # re-entrant within one process
            pass
        assert (tmp_path / LOCK_FILE).exists()
    assert f"taking over the stale lock of PID {gone}" in capsys.readouterr().err
    assert not (tmp_path / LOCK_FILE).exists()



def test_a_signal_while_the_lock_is_written_leaves_no_lock(tmp_path, monkeypatch):
    """A SIGTERM landing after the lock file is created and before its record is written (the command's
    handler raises there) released nothing: the command said "the workdir's lock is released" and left
    tieflax.lock behind (seen on a busy machine in test_user_errors' study set-up test)."""
    from tieflax.storage import lease
    from tieflax.errors import Interrupted

    def stopped_while_writing(record, f):
        f.write("{")  # part of the record is out: the file exists and does not parse
        raise Interrupted(15, "stopped by SIGTERM")

    monkeypatch.setattr(lease.json, "dump", stopped_while_writing)
    with pytest.raises(Interrupted), workdir_lock(str(tmp_path), "train"):
        pass
    assert not (tmp_path / LOCK_FILE).exists()


# ------------------------------------------------------------------------------- config and inputs

@pytest.mark.parametrize("override,field", [
    ("train.eval_batches=-1", "config.train.eval_batches"),
    ("train.learning_rate=-0.001", "config.train.learning_rate"), ("train.warmup_steps=-5", "config.train.warmup_steps"),
    ("train.label_smoothing=1.0", "config.train.label_smoothing"),
    ("train.loss_token_block=-1", "config.train.loss_token_block"),
    ("train.loss_vocab_block=-1", "config.train.loss_vocab_block"), ("train.seq_len=0", "config.train.seq_len"),
    ("train.global_batch_size=0", "config.train.global_batch_size"), ("train.adam_b2=1.0", "config.train.adam_b2"),
    ("train.min_lr_ratio=2.0", "config.train.min_lr_ratio"), ("mesh.data=0", "config.mesh.data"),
    ("seed=-1", "config.seed"), ("data.val_fraction=1.5", "config.data.val_fraction"),
    ("train.loss_impl='sparse'", "config.train.loss_impl")])
def test_an_out_of_range_config_field_is_refused_at_load_naming_it(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(TINY, [override])


def test_a_rejected_override_leaves_config_json_untouched(trained, tmp_path, capsys):
    workdir = _copy(trained, tmp_path)
    before = open(os.path.join(workdir, "config.json")).read()
    err = _one_line(capsys, ["train", "--workdir", workdir, "--config.train.seq_len=0"])
    assert "config.train.seq_len" in err
    assert open(os.path.join(workdir, "config.json")).read() == before
    new = tmp_path / "new"
    err = _one_line(capsys, ["train", "--config", TINY, "--workdir", str(new), "--config.train.global_batch_size=0"])
    assert "config.train.global_batch_size" in err and not new.exists()  # no tokenizer, no cache


def test_val_loss_refuses_overrides_that_change_the_model(trained, capsys):
    err = _one_line(capsys, ["val-loss", "--workdir", trained, "--config.model.d_model=64"])
    assert "config.model.d_model" in err and "not the model" in err


def test_damaged_json_files_are_named(trained, tmp_path, capsys):
    workdir = _copy(trained, tmp_path)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write('{"model": {')
    err = _one_line(capsys, ["val-loss", "--workdir", workdir])
    assert f"{workdir}/config.json is not valid JSON (line 1" in err
    legacy = os.path.join(workdir, "metrics.jsonl")  # a run from before segments, killed mid-append
    with open(legacy, "w") as f:
        f.write(json.dumps({"step": 1, "split": "train", "loss": 6.0}) + '\n{"step": 7, "spl')
    assert [r["step"] for r in read_metrics(workdir, "train")] == [1, 2, 4, 6]  # unfinished row skipped
    segment = os.path.join(workdir, "metrics", "99999999999999999999-000000.jsonl")
    with open(segment, "w") as f:  # segments are written whole: a bad line there is damage, named
        f.write("garbage\n" + json.dumps({"step": 9, "split": "train"}) + "\n")
    with pytest.raises(MetricsFileError, match=r"99999999999999999999-000000.jsonl line 1 is not valid JSON"):
        read_metrics(workdir)


def test_misused_arguments_fail_in_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert "is a file, not a folder" in _one_line(capsys, ["train", "--config", TINY, "--workdir",
                                                           str(tmp_path / "afile")])
    assert "has no variants" in _one_line(capsys, ["train", "--config", TINY + ":runlocal", "--workdir",
                                                   str(tmp_path / "w")])
    (tmp_path / "empty").mkdir()
    assert "holds no model config" in _one_line(capsys, ["params", "--models-dir", str(tmp_path / "empty")])
    assert "is not a folder" in _one_line(capsys, ["params", "--models-dir", str(tmp_path / "missing")])


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("TIEFLAX_DEBUG", "1")
    with pytest.raises(ConfigError, match="config.train.seq_len"):
        main(["train", "--config", TINY, "--workdir", str(tmp_path / "w"), "--config.train.seq_len=0"])
    monkeypatch.delenv("TIEFLAX_DEBUG")
    with pytest.raises(ConfigError):
        main(["train", "--debug", "--config", TINY, "--workdir", str(tmp_path / "w"), "--config.train.seq_len=0"])


def test_the_final_train_loss_spans_the_last_interval_across_restarts():
    """log_every=10: stopped at 13 (rows 10 and 13), resumed; a killed attempt had logged 17 (stale)."""
    rows = [{"step": 10, "ce_loss": 9.0, "interval_steps": 10}, {"step": 13, "ce_loss": 3.0, "interval_steps": 3},
            {"step": 17, "ce_loss": 100.0, "interval_steps": 4}, {"step": 20, "ce_loss": 1.0, "interval_steps": 7}]
    assert final_interval_loss(rows, 20, 10, fallback=-1.0) == pytest.approx((3 * 3.0 + 7 * 1.0) / 10)
    assert final_interval_loss(rows[:1], 10, 10, fallback=-1.0) == 9.0
    assert final_interval_loss([{"step": 20, "ce_loss": 1.0}], 20, 10, fallback=-1.0) == -1.0  # old rows
