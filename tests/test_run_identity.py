"""A run is one thing: every resume, with or without ``--config``, is held to the run's record
(``tieflax.run.identity``). A changed result field or changed data is refused in one line before anything
is written; ``--allow-change`` continues the run and records the change as a numbered history entry;
memory, placement and cadence are free; config.json is never rewritten."""

from __future__ import annotations

import json
import os

import pytest

from cli_support import one_line
from run_identity_support import STEPS, copy_run, finished, run_config  # noqa: F401 (fixture)
from tieflax.cli import main
from tieflax.run import identity, record, saved_config
from tieflax.run.layout import CONFIG_FILE, CONFIG_HISTORY_DIR, DATA_RECORD_FILE
from tieflax.train import train_and_evaluate


@pytest.mark.parametrize("override, field, saved, new", [
    ("--config.data.val_fraction=0.3", "data.val_fraction", "0.2", "0.3"),
    ("--config.data.source=files", None, None, None),  # refused by validation: files.paths is empty
    ("--config.train.learning_rate=0.001", "train.learning_rate", "0.01", "0.001"),
    ("--config.seed=7", "seed", "0", "7"),
])
def test_a_changed_result_field_is_refused_in_one_line_and_nothing_is_written(finished, tmp_path, capsys,  # noqa: F811
                                                                             override, field, saved, new):
    run = copy_run(finished, tmp_path / "run")
    before = {n: open(os.path.join(run, n), "rb").read() for n in (CONFIG_FILE, DATA_RECORD_FILE)}
    listing = sorted(os.listdir(run))
    err = one_line(capsys, ["train", "--workdir", run, override])
    if field:
        assert f"{field} {saved} -> {new}" in err and f"--allow-change {field}" in err, err
    assert {n: open(os.path.join(run, n), "rb").read() for n in before} == before  # byte-identical
    assert sorted(os.listdir(run)) == listing and not os.path.exists(os.path.join(run, CONFIG_HISTORY_DIR))


def test_allow_change_trains_on_and_the_history_holds_both_configs(finished, tmp_path, capsys):  # noqa: F811
    run = copy_run(finished, tmp_path / "run")
    original = open(os.path.join(run, CONFIG_FILE), "rb").read()
    capsys.readouterr()
    assert main(["train", "--workdir", run, "--config.train.num_steps=6", "--config.train.learning_rate=0.001",
                 "--allow-change", "train.num_steps", "--allow-change", "train.learning_rate"]) == 0
    out = capsys.readouterr().out
    assert f"resuming from step {STEPS}" in out and "changed on purpose from step 4 on" in out, out
    assert json.loads(out.strip().splitlines()[-1])["step"] == 6
    assert open(os.path.join(run, CONFIG_FILE), "rb").read() == original  # never rewritten
    (entry,) = record.history(run)
    assert entry["number"] == 1 and entry["step"] == STEPS and entry["reason"] == "--allow-change"
    assert entry["changed"] == {"train.learning_rate": [0.01, 0.001], "train.num_steps": [4, 6]}
    assert json.loads(original)["train"]["learning_rate"] == 0.01  # both configs are in the run
    assert entry["config"]["train"]["learning_rate"] == 0.001
    assert saved_config.load_workdir_config(run).train.num_steps == 6  # the config in force
    assert record.history_lines(run) == [
        "config changed at step 4 (--allow-change): train.learning_rate 0.01 -> 0.001; train.num_steps 4 -> 6"]
    # A rerun with no argument is the same (changed) run: finished, nothing new recorded.
    assert main(["train", "--workdir", run]) == 0
    assert "finished before, at step 6 (checkpoints/6): nothing to train" in capsys.readouterr().out
    assert len(record.history(run)) == 1


def test_memory_placement_and_cadence_are_free(finished, tmp_path, capsys):  # noqa: F811
    run = copy_run(finished, tmp_path / "run")
    original = open(os.path.join(run, CONFIG_FILE), "rb").read()
    assert main(["train", "--workdir", run, "--config.model.remat=full", "--config.train.log_every=1",
                 "--config.train.checkpoint_every=1", "--config.mesh.data=2", "--config.mesh.fsdp=4",
                 "--config.data.read_threads=1"]) == 0
    assert "finished before, at step 4 (checkpoints/4): nothing to train" in capsys.readouterr().out
    assert open(os.path.join(run, CONFIG_FILE), "rb").read() == original
    assert record.history(run) == []


def test_data_that_changed_under_the_same_config_is_refused(micro_data, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: " + " ".join(f"w{(i * j) % 97}" for j in range(60))
                                  for i in range(40)))
    config = run_config(micro_data)
    config.data.source, config.data.files.paths, config.data.files.split_on = "files", [str(corpus)], "\n\n"
    config.data.python_stdlib.max_files = 0  # the files source does not read it
    run = str(tmp_path / "run")
    train_and_evaluate(config, run)
    saved = record.read_data_record(run)
    assert saved["source"] == "files" and saved["key"]

    with open(corpus, "a") as f:  # the same path and settings, other content
        f.write("\n\nanother document appended after the run trained")
    with pytest.raises(identity.RunChanged, match=r"trained on other data \(saved -> now: data \(key\) "):
        train_and_evaluate(config, run)
    assert record.read_data_record(run) == saved
    # Two differences (a setting and the data) are named in one refusal, not one per rerun.
    config.train.learning_rate = 0.002
    with pytest.raises(identity.RunChanged) as refused:
        train_and_evaluate(config, run)
    assert "train.learning_rate 0.01 -> 0.002" in str(refused.value) and "data (key)" in str(refused.value)
    config.train.learning_rate = 0.01
    train_and_evaluate(config, run, allow_change=("data",))  # on purpose: recorded with the new key
    (entry,) = record.history(run)
    assert entry["data"]["key"] != saved["key"]
    assert entry["changed"] == {"data (key)": [saved["key"], entry["data"]["key"]]}  # what changed, said
    (line,) = record.history_lines(run)
    assert line.startswith("config changed at step 4 (--allow-change): data (key) "), line


def test_imported_parameters_take_training_settings_before_their_first_step(finished, tmp_path, capsys):  # noqa: F811
    untied = str(tmp_path / "untied")
    assert main(["convert", "--untie", "--workdir", finished, "--out", untied]) == 0
    err = one_line(capsys, ["train", "--workdir", untied, "--config.model.d_ff=128"])
    assert "model.d_ff 64 -> 128" in err and "tieflax convert" in err, err
    assert main(["train", "--workdir", untied, "--config.train.learning_rate=0.003"]) == 0
    (entry,) = record.history(untied)
    assert entry["step"] == 0 and entry["reason"] == "set before the first step"
    # Now it has trained: the same override is held to the record like any other run's.
    assert main(["train", "--workdir", untied, "--config.train.learning_rate=0.003"]) == 0
    err = one_line(capsys, ["train", "--workdir", untied, "--config.train.learning_rate=0.01"])
    assert "train.learning_rate 0.003 -> 0.01" in err, err


def test_a_folder_without_a_run_is_one_line(tmp_path, capsys):
    err = one_line(capsys, ["train", "--workdir", str(tmp_path / "nothing")])
    assert "config.json does not exist" in err and "--config" in err, err


def test_a_bucket_run_resumes_with_no_argument_and_so_does_an_untied_copy(finished, gcs, capsys):  # noqa: F811
    """``tieflax train --workdir gs://B/run`` reads the run's config from the bucket (no --config)."""
    bucket = gcs.new_bucket()
    untied = f"{bucket}/untied"
    assert main(["convert", "--untie", "--workdir", finished, "--out", untied]) == 0
    capsys.readouterr()
    assert main(["train", "--workdir", untied]) == 0
    out = capsys.readouterr().out
    assert "starting from initial_params/" in out and json.loads(out.strip().splitlines()[-1])["step"] == STEPS
    assert main(["train", "--workdir", untied]) == 0  # finished: says so, trains nothing
    assert f"finished before, at step {STEPS} (checkpoints/{STEPS}): nothing to train" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- the record proves itself

@pytest.fixture(scope="module")
def changed_twice(finished, tmp_path_factory):  # noqa: F811
    """A run with two history entries (learning rate, then steps), checkpoints naming the second."""
    run = copy_run(finished, tmp_path_factory.mktemp("changed") / "run")
    assert main(["train", "--workdir", run, "--config.train.num_steps=6", "--config.train.learning_rate=0.001",
                 "--allow-change", "train.num_steps,train.learning_rate"]) == 0
    assert main(["train", "--workdir", run, "--config.train.num_steps=8", "--allow-change", "train.num_steps"]) == 0
    assert [e["number"] for e in record.history(run)] == [1, 2]
    return run


def _damage(path: str, how: str) -> None:
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        text = open(path, "rb").read()
        open(path, "wb").write(text[: len(text) // 2])
    else:  # a hand edit that still parses: another learning rate or another key
        entry = json.loads(open(path).read())
        target = entry.get("config", entry).get("train", entry)
        target["learning_rate" if "learning_rate" in target else "key"] = 0.5
        open(path, "w").write(json.dumps(entry, indent=1))


@pytest.mark.parametrize("how", ["delete", "truncate", "edit"])
@pytest.mark.parametrize("name", [CONFIG_FILE, DATA_RECORD_FILE, f"{CONFIG_HISTORY_DIR}/1.json",
                                  f"{CONFIG_HISTORY_DIR}/2.json"])
def test_a_deleted_truncated_or_edited_record_file_is_one_line_naming_it(changed_twice, tmp_path, capsys, name, how):
    """Before the chain, a deleted or edited entry silently became the settings in force (steps trained at
    an older or a hand-written learning rate), a truncated one was named by line and column only."""
    run = copy_run(changed_twice, tmp_path / "run")
    _damage(os.path.join(run, name), how)
    with pytest.raises(record.RecordBroken) as broken:
        saved_config.load_workdir_config(run)
    line = str(broken.value)
    assert os.path.join(run, name) in line and "restore it" in line and "--allow-change" in line, line
    listing = sorted(os.listdir(run))
    err = one_line(capsys, ["train", "--workdir", run])
    assert os.path.join(run, name) in err, err
    err = one_line(capsys, ["train", "--workdir", run, "--config.train.num_steps=8"])
    assert os.path.join(run, name) in err, err
    assert sorted(os.listdir(run)) == listing  # nothing written


def test_a_deleted_history_folder_or_config_without_history_is_refused(finished, changed_twice, tmp_path):  # noqa: F811
    run = copy_run(changed_twice, tmp_path / "history")
    import shutil

    shutil.rmtree(os.path.join(run, CONFIG_HISTORY_DIR))
    with pytest.raises(record.RecordBroken, match=r"config_history/2.json is missing \(checkpoints/8 names"):
        saved_config.load_workdir_config(run)
    plain = copy_run(finished, tmp_path / "plain")  # no history: the checkpoint names config.json itself
    _damage(os.path.join(plain, CONFIG_FILE), "edit")
    with pytest.raises(record.RecordBroken, match=r"config.json was edited \(its digest differs from the one "
                                                     r"checkpoints/4 names\)"):
        saved_config.load_workdir_config(plain)


def test_config_json_missing_from_a_trained_run_is_not_a_fresh_run(micro_data, finished, tmp_path, capsys):  # noqa: F811
    """It used to resume with whatever the command line said and write a new config.json claiming those
    as the run's starting settings, with a history entry of no change."""
    run = copy_run(finished, tmp_path / "run")
    os.remove(os.path.join(run, CONFIG_FILE))
    # Another learning rate than the run's 0.01: the one of test_allow_change_trains_on's resume, so the 6-step
    # train step trained below is the program that test compiled (the suite's compilation cache holds it).
    config = run_config(micro_data, learning_rate=0.001)
    with pytest.raises(record.RecordBroken, match="config.json is missing, yet the run has trained"):
        train_and_evaluate(config, run)
    assert not os.path.exists(os.path.join(run, CONFIG_FILE))
    # The fix it names: go on from the last checkpoint with this config, a new entry that says so.
    config.train.num_steps = 6
    result = train_and_evaluate(config, run, allow_change=("train.num_steps",))
    assert result["step"] == 6 and not os.path.exists(os.path.join(run, CONFIG_FILE))
    (entry,) = record.history(run)
    assert entry["step"] == STEPS and "config.json is missing" in entry["restarted"], entry
    assert saved_config.load_workdir_config(run).train.learning_rate == 0.001
    assert record.history_lines(run)[0].startswith("config record restarted at step 4 (")
    assert main(["train", "--workdir", run]) == 0  # and it resumes from its record again
    assert "finished before, at step 6 (checkpoints/6): nothing to train" in capsys.readouterr().out


def test_allow_change_names_real_fields_only(finished, tmp_path, capsys):  # noqa: F811
    run = copy_run(finished, tmp_path / "run")
    err = one_line(capsys, ["train", "--workdir", run, "--config.train.learning_rate=0.001",
                            "--allow-change", "train.learning_rat"])
    assert "--allow-change 'train.learning_rat' is not a field" in err, err
    assert not os.path.exists(os.path.join(run, CONFIG_HISTORY_DIR))


def test_a_run_written_before_the_chain_resumes_and_says_so_once(changed_twice, tmp_path, caplog):
    """No digests anywhere (entries without 'previous', checkpoints naming no entry): accepted as before."""
    run = copy_run(changed_twice, tmp_path / "run")
    for n in (1, 2):
        path = os.path.join(run, CONFIG_HISTORY_DIR, f"{n}.json")
        entry = json.loads(open(path).read())
        del entry["previous"]
        open(path, "w").write(json.dumps(entry, indent=1, sort_keys=True))
    for step in os.listdir(os.path.join(run, "checkpoints")):
        path = os.path.join(run, "checkpoints", step, record.CHECKPOINT_METADATA_FILE)
        meta = json.loads(open(path).read())
        meta.get("custom_metadata", {}).pop(record.RECORD_KEY, None)
        open(path, "w").write(json.dumps(meta))
    with caplog.at_level("WARNING", logger=record.__name__):
        assert saved_config.load_workdir_config(run).train.num_steps == 8
        assert saved_config.load_workdir_config(run).train.num_steps == 8
    said = [r for r in caplog.records if "before the run's record carried digests" in r.getMessage()]
    assert len(said) == 1, caplog.records


def test_check_resume_reads_the_record_once_and_checks_that_snapshot(tmp_path, monkeypatch):
    """One read of each file of the record (the files together, then the listings), then pure checks: a
    resume, a refusal and a fresh run each ask for config.json once (it was read twice, and the record's
    folders listed again to tell whether the run had trained)."""
    from tieflax import storage
    from tieflax.config import default_config
    from tieflax.run.layout import RunDir

    workdir = str(tmp_path / "run")
    config = default_config()
    saved_config.save_config(workdir, config, claim=True)
    storage.write_text(storage.join(workdir, "metrics", "s-0.jsonl"), "{}\n")  # it has trained
    asked = []
    for name in ("read_bytes", "read_many", "listdir", "exists", "is_file"):
        real = getattr(storage, name)
        monkeypatch.setattr(storage, name, lambda p, _real=real: asked.extend([p] if isinstance(p, str) else p)
                            or _real(p))
    assert identity.check_resume(RunDir.at(workdir), config).changed == {}
    changed = default_config()
    changed.seed = config.seed + 1
    with pytest.raises(identity.RunChanged, match="seed"):
        identity.check_resume(RunDir.at(workdir), changed)
    assert identity.check_resume(RunDir.at(str(tmp_path / "new")), config).fresh
    config_file = os.path.join(workdir, CONFIG_FILE)
    assert asked.count(config_file) == 2 and asked.count(os.path.join(workdir, "metrics")) == 2, asked
    assert asked.count(os.path.join(str(tmp_path / "new"), CONFIG_FILE)) == 1


def test_every_reader_refuses_a_broken_record_naming_the_training_command_that_mends_it(finished, tmp_path, capsys):  # noqa: F811
    """val-loss and sample offered only the training command's flags (--config FILE --allow-change FIELD),
    which they do not take; each reader now says it cannot mend the record and names the command that can."""
    run = copy_run(finished, tmp_path / "run")
    _damage(os.path.join(run, CONFIG_FILE), "edit")
    listing = sorted(os.listdir(run))
    for argv in (["sample", "--workdir", run, "--prompt", "In"], ["val-loss", "--workdir", run],
                 ["analyze", "--workdir", run, "--no-plots"],
                 ["convert", "--untie", "--workdir", run, "--out", str(tmp_path / "untied")]):
        err = one_line(capsys, argv)
        assert f"{os.path.join(run, CONFIG_FILE)} was edited" in err, err
        assert f"`tieflax {argv[0]}` reads the record as it is" in err, err
        assert f"tieflax train --workdir {run} --config FILE --allow-change FIELD" in err, err
    assert sorted(os.listdir(run)) == listing and not os.path.exists(tmp_path / "untied")  # nothing written


def test_sample_refuses_a_tokenizer_json_the_record_does_not_name(finished, tmp_path, capsys):  # noqa: F811
    """sample decoded with a hand-edited tokenizer.json without a word: the ids the model learned became
    other text. Reformatting it (the same values) is still the run's tokenizer."""
    from tieflax.run.run import Run

    run = copy_run(finished, tmp_path / "run")
    path = os.path.join(run, "tokenizer.json")
    tok = json.loads(open(path).read())
    open(path, "w").write(json.dumps(tok, indent=4))
    assert Run.read(run, command="sample").tokenizer() is not None  # reformatted: the same tokenizer
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer
    open(path, "w").write(json.dumps(tok))
    err = one_line(capsys, ["sample", "--workdir", run, "--prompt", "In", "--max-new-tokens", "2"])
    assert f"{path} is not the tokenizer the run's record names ({DATA_RECORD_FILE} names tokenizer" in err, err
    assert f"tieflax train --workdir {run} --allow-change data" in err, err
