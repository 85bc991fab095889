"""One line for every user error of every command, one exit code per outcome, and signals that leave no
lock. Nothing here trains or compiles: each case fails before that, which is the point."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import numpy as np
import pytest

from test_train_support import REPO
from tieflax import cli
from tieflax.cli import main
from tieflax.errors import UserError

COMPARE = os.path.join(REPO, "configs", "experiments", "tie_vs_untie.py")
SCALING = os.path.join(REPO, "configs", "experiments", "tie_scaling.py")
TINY = os.path.join(REPO, "configs", "experiments", "tiny.py")


def _one_line(capsys, argv, code=1) -> str:
    assert main(argv) == code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tieflax {argv[0]}: "), err
    return err


def test_every_error_type_of_the_package_is_a_user_error():
    from tieflax.run.checkpoints import CheckpointError, CheckpointMismatchError
    from tieflax.data.config import DataError
    from tieflax.interop.hf import DamagedCheckpoint, UnsafeCheckpoint
    from tieflax.interop.hf_config import UnsupportedHFConfig
    from tieflax.interop.hf_weights import CheckpointMismatch
    from tieflax.run.metrics import MetricsFileError
    from tieflax.model.config import ConfigError
    from tieflax.plan import PlanError
    from tieflax.storage import StorageError
    from tieflax.hardware.targets import TargetError
    from tieflax.train import TrainingError
    from tieflax.run.layout import WorkdirError

    for cls in (CheckpointError, CheckpointMismatchError, DataError, DamagedCheckpoint, UnsafeCheckpoint,
                UnsupportedHFConfig, CheckpointMismatch, MetricsFileError, ConfigError, PlanError, StorageError,
                TargetError, TrainingError, WorkdirError):
        assert issubclass(cls, UserError), cls
    # The console's catch list is that one type: a new subclass anywhere is one line without a change there.
    assert cli.one_line(type("NewError", (UserError,), {})("x (y): do z")) == "x (y): do z"
    assert cli.one_line(ValueError("a bug")) is None


@pytest.mark.parametrize("override, expected", [
    ("compare.variants=('tied', 'untyed')", "'untyed' unknown; choose a non-empty subset of"),
    ("compare.variants=('untied',)", "must include 'tied'"),
    ("compare.seeds=()", "config.compare.seeds is empty"),
    ("compare.bogus=1", "no field 'bogus' in config.compare"),
])
def test_compare_config_errors_are_one_line_and_leave_no_workdir(tmp_path, capsys, override, expected):
    workdir = tmp_path / "compare"
    err = _one_line(capsys, ["compare", "--config", COMPARE, "--workdir", str(workdir), f"--config.{override}"])
    assert expected in err
    assert not workdir.exists()


def test_sweep_errors_are_one_line_and_name_the_choices(tmp_path, capsys):
    workdir = tmp_path / "sweep"
    err = _one_line(capsys, ["sweep", "--config", SCALING, "--workdir", str(workdir),
                             "--config.sweep.variants=('tied', 'untyed')"])
    assert "'untyed' unknown" in err and "untied_width" in err
    err = _one_line(capsys, ["sweep", "--config", SCALING + ":bogus", "--workdir", str(workdir)])
    assert "'bogus'" in err and "'smoke'" in err and "'pod'" in err
    assert not workdir.exists()


def test_the_old_name_eval_runs_val_loss_and_says_the_new_name_in_one_line(tmp_path, capsys):
    """`tieflax eval` was renamed `tieflax val-loss` (beside `tieflax evaluate`, lm-eval): the old name works
    for a release, and says the new one first."""
    missing = tmp_path / "absent"
    for name in ("val-loss", "eval"):
        assert main([name, "--workdir", str(missing)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        if name == "eval":
            assert err[0] == cli.renamed_line("eval") and "`tieflax val-loss`" in err[0]
            err = err[1:]
        assert len(err) == 1 and err[0].startswith(f"tieflax {name}: {missing}/config.json does not exist"), err


def test_plan_exit_codes_tell_bad_input_from_does_not_fit(tmp_path, capsys):
    """0 fits, 1 does not fit (tests/test_plan.py), 2 bad input."""
    assert "does not exist" in _one_line(capsys, ["plan", "--config", str(tmp_path / "none.py"), "--topology",
                                                  "cpu"], code=2)
    err = _one_line(capsys, ["plan", "--config", TINY, "--topology", "cpu", "--config.mesh.fsdp=3"], code=2)
    assert "config.mesh" in err and "does not divide" in err
    (tmp_path / "afile").write_text("x")
    err = _one_line(capsys, ["plan", "--config", TINY, "--topology", "cpu", "--xla-dump",
                             str(tmp_path / "afile" / "dump")], code=2)
    assert "--xla-dump" in err and "not a writable folder" in err


def test_cudnn_attention_where_it_cannot_run_names_the_fix_for_that_target(capsys):
    from tieflax.ops.attention import check_platform

    with pytest.raises(UserError, match="compiled for a TPU: use 'splash'"):
        check_platform("cudnn", "tpu")
    with pytest.raises(UserError, match="runs on 'cpu'.*use 'auto' or 'xla'"):
        check_platform("cudnn", "cpu")
    check_platform("xla", "cpu")
    err = _one_line(capsys, ["plan", "--config", TINY, "--topology", "cpu", "--config.model.attention=cudnn",
                             "--config.model.dtype=bfloat16"], code=2)
    assert "NVIDIA GPU kernel" in err and "install" not in err


# ------------------------------------------------------------------------------------------- signals
SIGNAL_COMMAND = '''
"""A stand-in command: takes a workdir's lock, then receives a signal in the middle of its work, either in
its own code or inside a garbage-collector callback (where Python swallows a handler's exception)."""
import gc, os, signal, time
HELP = "test"

def add_arguments(parser):
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--signal", default="SIGTERM")
    parser.add_argument("--in-gc-callback", action="store_true")

def run(args):
    from tieflax.run.lock import workdir_lock
    signum = getattr(signal, args.signal)

    def signal_during_collection(phase, info):
        if phase == "start":
            gc.callbacks.remove(signal_during_collection)
            os.kill(os.getpid(), signum)
            sum(range(10_000))  # more bytecode in this callback: the handler runs here, not after it

    with workdir_lock(args.workdir, "compare"):
        if args.in_gc_callback:
            gc.callbacks.append(signal_during_collection)
            gc.collect()
        else:
            os.kill(os.getpid(), signum)
        for _ in range(100):
            time.sleep(0.05)  # the handler raises before this ends
    return 0
'''


@pytest.mark.parametrize("signame, code, where", [("SIGTERM", 143, "code"), ("SIGINT", 130, "code"),
                                                  ("SIGTERM", 143, "gc-callback")])
def test_a_signal_at_any_moment_is_one_line_an_exit_code_and_no_stale_lock(tmp_path, monkeypatch, capsys,
                                                                           signame, code, where):
    """Also when the signal lands in a garbage-collector callback (JAX registers one), where the handler's
    exception is swallowed: the signal is delivered again, the command stops as usual, and the swallowed
    exception's traceback is not printed."""
    (tmp_path / "signal_command.py").write_text(textwrap.dedent(SIGNAL_COMMAND))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "signaltest", "signal_command")
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.unraisablehook
    workdir = tmp_path / "w"
    workdir.mkdir()
    argv = ["signaltest", "--workdir", str(workdir), "--signal", signame] + (["--in-gc-callback"] * (where != "code"))
    err = _one_line(capsys, argv, code=code)
    assert f"stopped by {signame}" in err and "rerun" in err
    assert os.listdir(workdir) == []  # the lock is gone
    after = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.unraisablehook
    assert after == before  # handlers restored


def test_a_folder_in_data_files_paths_says_folder_and_suggests_a_glob(tmp_path, capsys):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text")
    err = _one_line(capsys, ["train", "--config", TINY, "--workdir", str(tmp_path / "w"),
                             "--config.data.source=files", f"--config.data.files.paths=('{tmp_path / 'texts'}',)"])
    assert "is a folder" in err and f"{tmp_path / 'texts'}/*.txt" in err


@pytest.mark.parametrize("command, config", [("compare", COMPARE), ("sweep", SCALING + ":smoke")])
def test_sigterm_during_a_studys_set_up_is_one_line_and_leaves_no_lock(tmp_path, command, config):
    """The real command in a subprocess, signalled as soon as it holds its study's lock (while it
    prepares the data): it exited 143 with no word and left tieflax.lock for the next run to take over."""
    import subprocess
    import time

    from test_train_support import subprocess_env

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # Enough distinct text for either study's BPE (vocabulary 8,192) to train for a few seconds: the
    # command is still setting up when the signal arrives, and a too-small corpus cannot end it first.
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    for i in range(40):
        words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(3000)]
        (corpus / f"d{i}.txt").write_text(" ".join(words))
    workdir = tmp_path / "study"
    cmd = [sys.executable, "-m", "tieflax.cli", command, "--config", config, "--workdir", str(workdir),
           "--config.data.source=files", f"--config.data.files.paths=('{corpus}/*.txt',)"]
    proc = subprocess.Popen(cmd, env=subprocess_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (workdir / "tieflax.lock").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # it did not stop: fail without leaving it training
            proc.kill()
    assert proc.returncode == 143, (out, err)
    assert err.strip().splitlines() == [f"tieflax {command}: stopped by SIGTERM; the workdir's lock is released "
                                        "and finished work is kept: rerun the same command to continue"], err
    assert not [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f == "tieflax.lock"]


def test_a_hub_dataset_without_a_network_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    """No retries for tens of seconds: the hub's reachability is checked first (here: refused)."""
    import socket
    import time

    def unreachable(address, timeout=None):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.time()
    err = _one_line(capsys, ["train", "--config", TINY, "--workdir", str(tmp_path / "w"),
                             "--config.data.source=hf", "--config.data.hf.path=wikitext"])
    assert "huggingface.co cannot be reached (Network is unreachable)" in err and "HF_DATASETS_OFFLINE=1" in err
    assert time.time() - started < 20
