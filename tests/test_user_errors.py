"""One line for every user error of every command, one exit code per outcome, and signals that leave no
lock. Nothing here trains or compiles: each case fails before that, which is the point."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap

import numpy as np
import pytest

from cli_support import COMPARE, SCALING, TINY, one_line
from train_support import REPO
from tieflax import cli
from tieflax.cli import main
from tieflax.commands import flags
from tieflax.errors import UserError


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
    # Once found after training the first run (n_bins) or all of them (bootstrap, a traceback at the report).
    ("compare.n_bins=-1", "config.compare.n_bins = -1: must be a whole number >= 1"),
    ("compare.bootstrap=0", "config.compare.bootstrap = 0: must be a whole number >= 1"),
    ("compare.n_bins=100000", "more frequency bins than the"),
])
def test_compare_config_errors_are_one_line_and_leave_no_workdir(tmp_path, capsys, override, expected):
    workdir = tmp_path / "compare"
    err = one_line(capsys, ["compare", "--config", COMPARE, "--workdir", str(workdir), f"--config.{override}"])
    assert expected in err
    assert not workdir.exists()


def test_sweep_errors_are_one_line_and_name_the_choices(tmp_path, capsys):
    workdir = tmp_path / "sweep"
    err = one_line(capsys, ["sweep", "--config", SCALING, "--workdir", str(workdir),
                            "--config.sweep.variants=('tied', 'untyed')"])
    assert "'untyed' unknown" in err and "untied_width" in err
    err = one_line(capsys, ["sweep", "--config", SCALING + ":bogus", "--workdir", str(workdir)])
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
    assert "does not exist" in one_line(capsys, ["plan", "--config", str(tmp_path / "none.py"), "--topology",
                                                 "cpu"], code=2)
    err = one_line(capsys, ["plan", "--config", TINY, "--topology", "cpu", "--config.mesh.fsdp=3"], code=2)
    assert "config.mesh" in err and "does not divide" in err
    (tmp_path / "afile").write_text("x")
    err = one_line(capsys, ["plan", "--config", TINY, "--topology", "cpu", "--xla-dump",
                            str(tmp_path / "afile" / "dump")], code=2)
    assert "--xla-dump" in err and "not a writable folder" in err


def test_cudnn_attention_where_it_cannot_run_names_the_fix_for_that_target(capsys):
    from tieflax.ops.attention import check_platform

    with pytest.raises(UserError, match="compiled for a TPU: use 'splash'"):
        check_platform("cudnn", "tpu")
    with pytest.raises(UserError, match="runs on 'cpu'.*use 'auto' or 'xla'"):
        check_platform("cudnn", "cpu")
    check_platform("xla", "cpu")
    err = one_line(capsys, ["plan", "--config", TINY, "--topology", "cpu", "--config.model.attention=cudnn",
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
    err = one_line(capsys, argv, code=code)
    assert f"stopped by {signame}" in err and "rerun" in err
    assert os.listdir(workdir) == []  # the lock is gone
    after = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.unraisablehook
    assert after == before  # handlers restored


def test_a_folder_in_data_files_paths_says_folder_and_suggests_a_glob(tmp_path, capsys):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text")
    err = one_line(capsys, ["train", "--config", TINY, "--workdir", str(tmp_path / "w"),
                            "--config.data.source=files", f"--config.data.files.paths=('{tmp_path / 'texts'}',)"])
    assert "is a folder" in err and f"{tmp_path / 'texts'}/*.txt" in err


@pytest.mark.parametrize("command, config", [("compare", COMPARE), ("sweep", SCALING + ":smoke")])
def test_sigterm_during_a_studys_set_up_is_one_line_and_leaves_no_lock(tmp_path, command, config):
    """The real command in a subprocess, signalled as soon as it holds its study's lock (while it
    prepares the data): it exited 143 with no word and left tieflax.lock for the next run to take over."""
    import subprocess
    import time

    from train_support import subprocess_env

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
    err = one_line(capsys, ["train", "--config", TINY, "--workdir", str(tmp_path / "w"),
                            "--config.data.source=hf", "--config.data.hf.path=wikitext"])
    assert "huggingface.co cannot be reached (Network is unreachable)" in err and "HF_DATASETS_OFFLINE=1" in err
    assert time.time() - started < 20


# ------------------------------------------------------------------------- every value checked before work

def test_a_config_file_with_a_syntax_error_or_a_raising_get_config_is_one_line_naming_file_and_line(tmp_path,
                                                                                                     capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("from tieflax.config import default_config\n\ndef get_config(\n    return default_config()\n")
    err = one_line(capsys, ["params", "--config", str(broken)])
    assert f"config file '{broken}' line 3: syntax error" in err, err
    raising = tmp_path / "raising.py"
    raising.write_text("from tieflax.config import default_config\n\n\ndef get_config():\n"
                       "    c = default_config()\n    return c.model.no_such_field\n")
    err = one_line(capsys, ["train", "--config", str(raising), "--workdir", str(tmp_path / "run")])
    assert f"config file '{raising}' line 6: AttributeError" in err and "(in get_config())" in err, err
    importing = tmp_path / "importing.py"
    importing.write_text("import no_such_module_here\n")
    err = one_line(capsys, ["params", "--config", str(importing)])
    assert "line 1: ModuleNotFoundError" in err and "while it was imported" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, expected", [
    ("--config.mesh.data=3", "config.mesh data*fsdp*tensor = 3 but 8 devices are available"),
    ("--config.train.seq_len=4096", "config.train.seq_len = 4096 exceeds config.model.max_seq_len"),
    ("--config.train.profile_steps=(5, 100000)", "config.train.profile_steps = (5, 100000) lies outside the run's "
                                                 "steps"),
])
def test_values_that_do_not_fit_together_are_one_line_before_anything_is_written(tmp_path, capsys, override,
                                                                                  expected):
    """The mesh was a 25-line traceback (plan said it in one), seq_len above max_seq_len and a profiler
    window past the last step were accepted (no trace written, nothing said)."""
    workdir = tmp_path / "run"
    err = one_line(capsys, ["train", "--config", TINY, "--workdir", str(workdir), override])
    assert expected in err, err
    assert not workdir.exists() or not os.listdir(workdir)


def _argparse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv, expected", [
    (["analyze", "--workdir", "w", "--buckets", "0"], "argument --buckets: 0 must be >= 1"),
    (["analyze", "--workdir", "w", "--max-rows", "-5"], "argument --max-rows: -5 must be >= 0"),
    (["analyze", "--workdir", "w", "--val-batches", "-1"], "argument --val-batches: -1 must be >= 0"),
    (["convert", "--to-hf", "--workdir", "w", "--out", "o", "--max-shard-gb", "nan"], "--max-shard-gb: nan must be"),
    (["convert", "--to-hf", "--workdir", "w", "--out", "o", "--max-shard-gb", "0"], "--max-shard-gb: 0 must be"),
    (["convert", "--to-hf", "--workdir", "w", "--out", "o", "--max-shard-gb", "-1"], "--max-shard-gb: -1 must be"),
    (["prepare", "--config", TINY, "--out", ""], "argument --out: is empty"),
    (["train", "--config", TINY, "--workdir", " "], "argument --workdir: is empty"),  # was: train in the cwd
    (["convert", "--untie", "--workdir", "w", "--out", ""], "argument --out: is empty"),
])
def test_command_line_values_are_checked_while_parsing(capsys, argv, expected):
    assert expected in _argparse_error(capsys, argv)


@pytest.mark.parametrize("argv, command", [
    (["convert", "--to-hf", "--workdir", "w", "--out", "o", "--config.train.learning_rate=0.1"], "convert --to-hf"),
    (["sample", "--workdir", "w", "--prompt", "hi", "--config.seed=3"], "sample"),
    (["evaluate", "--workdir", "w", "--tasks", "arc_easy", "--config.seed=3"], "evaluate"),
])
def test_overrides_a_command_does_not_read_are_refused(capsys, argv, command):
    err = one_line(capsys, argv)
    assert f"{command} does not read --config.* overrides" in err, err


# Flags a command checks itself before any work, in its own words (prepare's check_arguments; evaluate's and
# sample's: tests/test_eval_harness.py sweeps them).
CHECKED_BEFORE_WORK = {("prepare", "--workers"), ("prepare", "--shard-mb"), *(
    ("evaluate", f) for f in ("--num-fewshot", "--limit", "--batch-size", "--token-budget", "--step")), *(
    ("sample", f) for f in ("--max-new-tokens", "--temperature", "--step"))}
SWEEP_VALUES = ("0", "-1", "nan", "inf", "1e30", "99999999999999999999", "abc", "")


def _numeric_flags():
    """(command, flag, argparse action) of every option whose value is a number, over every command."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for command, command_parser in sub.choices.items():
        for action in command_parser._actions:
            if action.option_strings and action.type not in (None, str, flags.location):
                yield command, action.option_strings[-1], action


def test_every_numeric_flag_of_every_command_is_checked_while_parsing(capsys):
    """A sweep of every command's numeric flags (zero, negative, nan, inf, huge, wrong type): each value is
    either taken (parsing only: in range) or refused by argparse naming the flag, never a traceback; and
    no flag is a bare int/float, which would let 0, -1 or nan through to the work."""
    flags = list(_numeric_flags())
    assert len(flags) >= 15, flags
    bare = [(c, f) for c, f, a in flags if a.type in (int, float) and (c, f) not in CHECKED_BEFORE_WORK]
    assert not bare, f"flags parsed without a range check: {bare}"
    parser = cli.build_parser()
    for command, flag, action in flags:
        if (command, flag) in CHECKED_BEFORE_WORK:
            continue
        for value in SWEEP_VALUES:
            try:
                parsed = action.type(value)
            except Exception as e:  # noqa: BLE001
                assert type(e).__name__ == "ArgumentTypeError", (command, flag, value, e)
                continue
            assert parsed == parsed and abs(parsed) != float("inf"), (command, flag, value)  # no nan, no inf
            assert parsed >= 0, (command, flag, value)
        with pytest.raises(SystemExit):  # and through the real parser: argparse's error, naming the flag
            parser.parse_args([command, *(["--config", TINY] if command != "params" else []), flag, "nan"])
        assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--workers", "--shard-mb"])
def test_prepares_own_checks_take_or_refuse_any_value_in_one_line(tmp_path, flag):
    import argparse

    from tieflax.commands.prepare import add_arguments, check_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for value in ("0", "-1", "nan", "inf", "1e30"):
        try:
            args = parser.parse_args(["--config", TINY, "--out", str(tmp_path / "store"), flag, value])
        except SystemExit:  # a wrong type: argparse's error
            continue
        with pytest.raises(UserError) if value != "1e30" else contextlib.nullcontext():
            check_arguments(args)


def test_every_config_field_takes_or_refuses_any_value_in_one_line():
    """Every field of every section (model, train, data, mesh, seed, compare) set to zero, negative, nan,
    inf, huge, a string, a tuple or a bool: the config is taken or refused with a UserError, never
    another exception (a traceback)."""
    import copy

    from tieflax.config import apply_override, load_config, validate_config
    from tieflax.study.compare import compare_config, default_compare_config

    base = load_config(TINY)
    base.compare = default_compare_config()

    def leaves(node, prefix=""):
        for key, value in node.items():
            if hasattr(value, "items"):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    fields = list(leaves(base))
    assert len(fields) > 100
    failures = []
    for field in fields:
        for value in ("0", "-1", "nan", "inf", "10**30", "'abc'", "(1, 2)", "True", "''"):
            config = copy.deepcopy(base)
            try:
                apply_override(config, f"{field}={value}")
                validate_config(config)
                compare_config(config)
            except UserError:
                pass
            except Exception as e:  # noqa: BLE001
                failures.append(f"{field}={value}: {type(e).__name__}: {e}")
    assert not failures, failures[:20]


def test_a_crash_in_native_code_prints_every_threads_python_stack(tmp_path):
    """A segmentation fault inside a command (here: a read of address 0 where the command would run) is not
    a bare signal: the process writes where each thread was in Python first, naming the frame that crashed."""
    import subprocess

    code = textwrap.dedent("""
        import ctypes, sys
        import tieflax.commands.plan as plan
        def crash_while_planning(args):
            ctypes.string_at(0)
        plan.run = crash_while_planning
        from tieflax.cli import main
        sys.exit(main(["plan", "--config", "configs/experiments/tiny.py", "--topology", "v5e:2x2"]))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert done.returncode == -signal.SIGSEGV, done.stderr[-2000:]
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr[-2000:]
    assert "crash_while_planning" in done.stderr, done.stderr[-2000:]
