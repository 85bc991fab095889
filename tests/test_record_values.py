"""The run's record is its values, and it names what belongs to it (``tieflax.run.identity``): a
reformatted record file (other indentation or key order, the same values) is the same record, a changed
value is still caught, and records digested over bytes (the previous version) still read; a checkpoint
copied in from another run is named as such in one line, never blamed on config.json, and no fix offered
trains on it; ``--allow-change train.num_steps`` below the step the run already reached is refused in one
line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from cli_support import one_line
from run_identity_support import STEPS, copy_run, finished, run_config  # noqa: F401 (fixture)
from tieflax.cli import main
from tieflax.run import identity, record, saved_config
from tieflax.run.layout import CHECKPOINT_DIR, CONFIG_FILE, CONFIG_HISTORY_DIR, DATA_RECORD_FILE
from tieflax.train import train_and_evaluate


def _reversed(value):
    """The same values, every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: _reversed(value[k]) for k in sorted(value, reverse=True)}
    return value


def _rewrite(path: str, value, **dump) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(value, **dump))


def _claims(run: str) -> list[str]:
    """The orbax metadata files of the run's checkpoints (their custom metadata names the record)."""
    top = os.path.join(run, CHECKPOINT_DIR)
    return [os.path.join(top, s, record.CHECKPOINT_METADATA_FILE) for s in os.listdir(top)]


@pytest.fixture(scope="module")
def changed(finished, tmp_path_factory):  # noqa: F811
    """A run with one history entry (steps 4 -> 6): entry 1 names config.json and data.json, the
    checkpoints name entry 1."""
    run = copy_run(finished, tmp_path_factory.mktemp("values") / "run")
    assert main(["train", "--workdir", run, "--config.train.num_steps=6", "--allow-change", "train.num_steps"]) == 0
    return run


def test_a_reformatted_record_is_the_same_record_and_a_changed_value_is_caught(changed, tmp_path, capsys):
    """A reformatted config.json read as "was edited" and blocked even val-loss. Runs written before the
    digests were over values (each file named by the sha256 of its bytes) still read."""
    run = copy_run(changed, tmp_path / "run")
    for name in (CONFIG_FILE, DATA_RECORD_FILE, f"{CONFIG_HISTORY_DIR}/1.json"):
        path = os.path.join(run, name)
        _rewrite(path, _reversed(json.loads(open(path).read())), indent=4)
    assert saved_config.load_workdir_config(run).train.num_steps == 6
    capsys.readouterr()
    assert main(["val-loss", "--workdir", run]) == 0
    assert main(["train", "--workdir", run]) == 0
    assert "finished before, at step 6 (checkpoints/6): nothing to train" in capsys.readouterr().out
    # A changed value is caught, however the file is written.
    path = os.path.join(run, CONFIG_FILE)
    value = json.loads(open(path).read())
    value["train"]["learning_rate"] = 0.02
    _rewrite(path, value, indent=2, sort_keys=True)
    err = one_line(capsys, ["val-loss", "--workdir", run])
    assert f"{path} was edited (its digest differs from the one {CONFIG_HISTORY_DIR}/1.json names)" in err, err


    _previous_version_digests_still_read(copy_run(changed, tmp_path / "legacy"))


def _previous_version_digests_still_read(run: str) -> None:
    raw = lambda name: open(os.path.join(run, name), "rb").read()  # noqa: E731
    entry_path = os.path.join(run, CONFIG_HISTORY_DIR, "1.json")
    entry = json.loads(raw(entry_path))
    entry["previous"] = {n: hashlib.sha256(raw(n)).hexdigest() for n in (CONFIG_FILE, DATA_RECORD_FILE)}
    _rewrite(entry_path, entry, indent=1, sort_keys=True)
    for path in _claims(run):  # the checkpoints saved under entry 1 (the older ones name config.json)
        meta = json.loads(raw(path))
        if meta["custom_metadata"][record.RECORD_KEY]["entry"] == 1:
            meta["custom_metadata"][record.RECORD_KEY] = {
                "entry": 1, "files": {f"{CONFIG_HISTORY_DIR}/1.json": hashlib.sha256(raw(entry_path)).hexdigest()}}
            _rewrite(path, meta)
    assert saved_config.load_workdir_config(run).train.num_steps == 6
    # Their digests are of the bytes as written: an edit is found (a reformatting too: the values are unknown)
    _rewrite(os.path.join(run, CONFIG_FILE), _reversed(json.loads(raw(CONFIG_FILE))), indent=4)
    with pytest.raises(record.RecordBroken, match="config.json was edited"):
        saved_config.load_workdir_config(run)


# ------------------------------------------------------------------------ what belongs to the run

@pytest.fixture(scope="module")
def other(micro_data, tmp_path_factory):
    """Another run: another learning rate, 6 steps (checkpoints 2, 4, 6)."""
    workdir = str(tmp_path_factory.mktemp("other") / "run")
    assert train_and_evaluate(run_config(micro_data, learning_rate=0.001, num_steps=6), workdir)["step"] == 6
    return workdir


@pytest.mark.parametrize("how", ["other settings", "same settings", "saved before run ids"])
def test_a_checkpoint_copied_from_another_run_is_named_as_such(finished, other, micro_data, tmp_path, capsys,  # noqa: F811
                                                               how):
    """It was blamed on config.json, whose printed fix (--allow-change) resumed on the other run's
    parameters; one from a run with the same settings was taken for the run's own. A checkpoint that names
    no run id (saved before ids) is told by the run's older checkpoints, which name the record as it is."""
    same_settings = how == "same settings"
    step = STEPS if same_settings else 6
    if same_settings:  # another run of the same config: its checkpoint replaces the run's own
        other = str(tmp_path / "twin")
        train_and_evaluate(run_config(micro_data), other)
    run = copy_run(finished, tmp_path / "run")
    foreign = os.path.join(run, CHECKPOINT_DIR, str(step))
    shutil.rmtree(foreign, ignore_errors=True)
    shutil.copytree(os.path.join(other, CHECKPOINT_DIR, str(step)), foreign)
    if how == "saved before run ids":
        path = os.path.join(foreign, record.CHECKPOINT_METADATA_FILE)
        meta = json.loads(open(path).read())
        meta["custom_metadata"][record.RECORD_KEY].pop("run_id", None)  # record.RUN_ID_KEY
        _rewrite(path, meta)
    listing = sorted(os.listdir(run))
    for argv in (["train", "--workdir", run], ["val-loss", "--workdir", run],
                 ["train", "--workdir", run, "--config.train.num_steps=8", "--allow-change", "train.num_steps"]):
        err = one_line(capsys, argv)
        assert f"{foreign} does not belong to this run's record" in err and "remove it" in err, err
        assert "--allow-change" not in err and CONFIG_FILE not in err, err
    assert sorted(os.listdir(run)) == listing  # nothing written
    shutil.rmtree(foreign)  # the fix it names
    assert main(["train", "--workdir", run]) == 0
    said = "resuming from step 2 (checkpoints/2)" if same_settings else f"finished before, at step {STEPS}"
    assert said in capsys.readouterr().out


# ------------------------------------------------------------------- num_steps below the step reached

def test_num_steps_below_the_step_the_run_reached_is_refused_in_one_line(changed, micro_data, tmp_path, capsys):
    """``--allow-change train.num_steps`` to 5 at step 6 was recorded as 6 -> 5 without a word."""
    run = copy_run(changed, tmp_path / "run")
    listing = sorted(os.listdir(os.path.join(run, CONFIG_HISTORY_DIR)))
    err = one_line(capsys, ["train", "--workdir", run, "--config.train.num_steps=5",
                            "--allow-change", "train.num_steps"])
    assert "train.num_steps 5 is below step 6" in err, err
    assert sorted(os.listdir(os.path.join(run, CONFIG_HISTORY_DIR))) == listing  # nothing recorded
    # The same after a restart of a broken record (config.json lost) from step 6
    os.remove(os.path.join(run, CONFIG_FILE))
    with pytest.raises(identity.RunChanged, match="train.num_steps 5 is below step 6"):
        train_and_evaluate(run_config(micro_data, num_steps=5), run, allow_change=("train.num_steps",))
    assert sorted(os.listdir(os.path.join(run, CONFIG_HISTORY_DIR))) == listing
