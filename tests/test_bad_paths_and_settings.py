"""Bad input is one line before any work, and loses nothing (issue 53): a bucket URL with its colon or a slash
missing (``gs:bkt/x``, ``gs//bkt/x``) trained into a local folder named after it, with exit 0; a bad
storage or checkpoint deadline was refused at the second checkpoint, losing the steps since the first; a
bad ``TIEFLAX_GPU_XLA_FLAGS`` was a traceback at ``import tieflax``, ``--help`` included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cli_support import COMPARE, SCALING, TINY, one_line
from train_support import config_overrides, micro_config, subprocess_env
from tieflax import cli, storage
from tieflax.hardware import gpu_flags

TYPOS = ("gs:bkt/x", "gs//bkt/x", "s3:bkt/x", "s3//bkt/x")


# ------------------------------------------------------------------------------------ bucket URL typos

@pytest.mark.parametrize("typo", TYPOS)
def test_a_bucket_url_with_its_colon_or_a_slash_missing_is_refused_and_its_local_twin_is_not(tmp_path,
                                                                                             monkeypatch, typo):
    """Refused by the path layer's one check, naming the URL meant; the same name written as a local folder
    (``./gs:bkt/x``, ``./gs//bkt/x``) and a plain ``gs/bkt`` stay local paths."""
    scheme = typo[:2]
    with pytest.raises(storage.StorageError, match=f"slash missing: write {scheme}://bkt/x "):
        storage.resolve(typo)
    with pytest.raises(storage.StorageError, match=f"write {scheme}://bkt/x/\\*.txt "):
        storage.glob(f"{typo}/*.txt")  # data.files.paths: a URL to fix, not a pattern that matches nothing
    monkeypatch.chdir(tmp_path)
    assert storage.resolve(f"./{typo}") == os.path.join(str(tmp_path), typo.replace("//", "/"))
    assert storage.resolve(f"{scheme}/bkt") == str(tmp_path / scheme / "bkt")


@pytest.fixture
def nothing_written_here(tmp_path, monkeypatch):
    """The test runs in an empty folder; a write under it through the path layer fails the test at once (the
    command went on to work there: the bug), and the folder is still empty at the end. Workdirs the test
    names outside it (``../w``) may be written."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)

    def guarded(write):
        def guard(path, *args, **kwargs):
            if not storage.is_remote(str(path)) and os.path.abspath(str(path)).startswith(str(here)):
                raise AssertionError(f"the command started work under {path}")
            return write(path, *args, **kwargs)
        return guard

    for name in ("write_bytes", "write_text", "create_new", "makedirs", "upload_file"):
        monkeypatch.setattr(storage, name, guarded(getattr(storage, name)))
    yield here
    assert os.listdir(here) == []


# Every command's path arguments, and the config fields that name a store, a cache or data files.
PATH_ARGUMENTS = {
    "train --workdir": lambda p: ["train", "--config", TINY, "--workdir", p],
    "compare --workdir": lambda p: ["compare", "--config", COMPARE, "--workdir", p],
    "sweep --workdir": lambda p: ["sweep", "--config", SCALING + ":smoke", "--workdir", p],
    "val-loss --workdir": lambda p: ["val-loss", "--workdir", p],
    "evaluate --workdir": lambda p: ["evaluate", "--workdir", p, "--tasks", "arc_easy"],
    "evaluate --output": lambda p: ["evaluate", "--workdir", "w", "--tasks", "arc_easy", "--output", p],
    "sample --workdir": lambda p: ["sample", "--workdir", p, "--prompt", "hi"],
    "analyze --workdir": lambda p: ["analyze", "--workdir", p],
    "convert --untie --out": lambda p: ["convert", "--untie", "--workdir", "w", "--out", p],
    "convert --to-hf --out": lambda p: ["convert", "--to-hf", "--workdir", "w", "--out", p],
    "convert --from-hf": lambda p: ["convert", "--from-hf", p, "--workdir", "w"],
    "prepare --out": lambda p: ["prepare", "--config", TINY, "--out", p],
    "data.files.paths": lambda p: ["train", "--config", TINY, "--workdir", "../w", "--config.data.source=files",
                                   f"--config.data.files.paths=('{p}/*.txt',)"],
    "data.cache_dir": lambda p: ["train", "--config", TINY, "--workdir", "../w", f"--config.data.cache_dir={p}"],
    "data.tokens.path": lambda p: ["train", "--config", TINY, "--workdir", "../w", "--config.data.source=tokens",
                                   f"--config.data.tokens.path={p}"],
}


@pytest.mark.parametrize("where", sorted(PATH_ARGUMENTS))
def test_every_command_refuses_a_bucket_url_typo_in_one_line_before_any_work(nothing_written_here, capsys,
                                                                            where):
    """Each path argument with one of the four typos in turn: exit 1, one line naming the URL meant, and
    nothing written (before: ``train --workdir gs:bkt/x`` trained into ./gs:bkt/x and exited 0)."""
    typo = TYPOS[sorted(PATH_ARGUMENTS).index(where) % len(TYPOS)]
    err = one_line(capsys, PATH_ARGUMENTS[where](typo))
    assert f": {typo}" in err and f"looks like a {typo[:2]}:// URL with a colon or slash missing: write " \
        f"{typo[:2]}://bkt/x" in err, err


# ------------------------------------------------------------------------------ environment settings

BAD_SETTINGS = [(storage.DEADLINE_ENV, v) for v in ("0", "-5", "abc", "nan", "inf")] + [
    ("TIEFLAX_CHECKPOINT_DEADLINE_S", v) for v in ("0", "-5", "abc", "nan", "inf")] + [
    ("TIEFLAX_COLLECTIVE_DEADLINE_S", v) for v in ("0", "abc")] + [(gpu_flags.ENV, "bogus")]


def test_the_deadline_settings_are_refused_where_they_are_read_too(monkeypatch):
    """The checkpoint layer reads its deadline through the path layer (one parser, one name), and still
    refuses a bad value as a CheckpointError where a library caller meets it."""
    from tieflax.run import checkpoints

    assert checkpoints.SAVE_DEADLINE_ENV == storage.CHECKPOINT_DEADLINE_ENV
    monkeypatch.setenv(storage.CHECKPOINT_DEADLINE_ENV, "-5")
    with pytest.raises(checkpoints.CheckpointError, match="TIEFLAX_CHECKPOINT_DEADLINE_S='-5': give the time"):
        checkpoints.save_deadline_seconds()
    monkeypatch.setenv(storage.CHECKPOINT_DEADLINE_ENV, "60")
    monkeypatch.setenv(storage.DEADLINE_ENV, "90")
    assert checkpoints.save_deadline_seconds() == 90  # never less than the storage deadline


def test_a_bad_gpu_flags_choice_adds_nothing_at_import_and_is_refused_at_a_commands_start(monkeypatch):
    """``apply`` runs as the console starts (``prepare_process``), before a command can say one line: it must
    not raise there (before: UserError, a traceback at ``import tieflax``, where it ran then)."""
    environ = {gpu_flags.ENV: "bogus", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert gpu_flags.apply(environ) == []
    assert environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    monkeypatch.setenv(gpu_flags.ENV, "bogus")
    with pytest.raises(cli.BadSetting, match="TIEFLAX_GPU_XLA_FLAGS='bogus' is not a choice"):
        cli.check_settings()


@pytest.mark.parametrize("variable, value", BAD_SETTINGS)
def test_a_bad_setting_stops_training_before_its_first_step_in_one_line(micro_data, tmp_path, monkeypatch, capsys,
                                                                        variable, value):
    """Exit 2 (the command did not start, as for a bad argument), one line naming the variable, the value
    and what it takes; no workdir. Before: the deadlines were read at the second checkpoint (a micro run
    of 12 steps, checkpoints every 5: exit 1 at step 10, steps 6-10 lost), the GPU flags at import (a
    traceback)."""
    monkeypatch.setenv(variable, value)
    workdir = tmp_path / "run"
    config = micro_config(micro_data, num_steps=12)
    err = one_line(capsys, ["train", "--config", TINY, "--workdir", str(workdir), *config_overrides(config)], code=2)
    assert f"tieflax train: {variable}={value!r}" in err, err
    assert ("in seconds, a number above 0" if "DEADLINE" in variable else "one of off, recommended") in err, err
    assert not workdir.exists()


# One call of every command, with paths that do not exist: a setting is refused before any of them is read.
EVERY_COMMAND = {
    "params": ["--config", "none.py"], "train": ["--config", "none.py", "--workdir", "w"],
    "val-loss": ["--workdir", "w"], "compare": ["--config", "none.py", "--workdir", "w"],
    "analyze": ["--workdir", "w"], "sweep": ["--config", "none.py", "--workdir", "w"],
    "convert": ["--untie", "--workdir", "w", "--out", "o"], "plan": ["--config", "none.py", "--topology", "cpu"],
    "evaluate": ["--workdir", "w", "--tasks", "arc_easy"], "sample": ["--workdir", "w", "--prompt", "hi"],
    "prepare": ["--config", "none.py", "--out", "o"],
}


@pytest.mark.parametrize("variable, value", [BAD_SETTINGS[2], BAD_SETTINGS[5], BAD_SETTINGS[-2], BAD_SETTINGS[-1]])
def test_every_command_checks_the_settings_at_its_start(nothing_written_here, monkeypatch, capsys, variable,
                                                        value):
    assert set(EVERY_COMMAND) == set(cli.COMMANDS)  # a new command is added here too
    monkeypatch.setenv(variable, value)
    for command, arguments in EVERY_COMMAND.items():
        err = one_line(capsys, [command, *arguments], code=2)
        assert err.startswith(f"tieflax {command}: {variable}={value!r}"), err


def test_a_bad_gpu_flags_choice_lets_help_and_import_work_and_a_command_says_one_line():
    """In fresh processes (the console applies the choice as it starts): ``--help`` and ``import tieflax`` work as
    without the variable, and a command stops in one line, exit 2 (before: an 11-line traceback, exit 1, for
    each of the three)."""
    env = subprocess_env(1, **{gpu_flags.ENV: "bogus"})
    tieflax = [sys.executable, "-m", "tieflax.cli"]
    for argv, code in ((tieflax + ["--help"], 0), (tieflax + ["train", "--help"], 0),
                       ([sys.executable, "-c", "import tieflax"], 0), (tieflax + ["params", "--config", TINY], 2)):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == code and "Traceback" not in proc.stderr, (argv, proc.stderr)
        if code == 2:
            assert proc.stderr.strip().splitlines() == [
                "tieflax params: TIEFLAX_GPU_XLA_FLAGS='bogus' is not a choice: set it to one of off, recommended "
                "(or leave it unset: off)"], proc.stderr
