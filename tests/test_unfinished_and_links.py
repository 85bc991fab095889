"""Issue 53, nothing silent: a first checkpoint that never finished (a run killed with -9 while writing
it, on a bucket) is not taken for a run written before the record carried digests, and the rerun says in
one line that it starts over from step 0; a --to-hf --overwrite export into a symlinked --out leaves no
lock behind."""

from __future__ import annotations

import json
import logging
import os

import pytest

from train_support import REPO, config_overrides, micro_config
from tieflax import storage
from tieflax.cli import main
from tieflax.run import checkpoints as ckpt
from tieflax.run import record
from tieflax.run.layout import LOCK_FILE
from tieflax.train import train_and_evaluate


def _as_killed_while_writing(run: str, step: int) -> None:
    """``checkpoints/<step>`` as a kill -9 leaves it mid-save. On Cloud Storage orbax writes into the
    numbered folder itself: no commit_success.txt yet, and its step metadata without the custom metadata
    that finalising the save writes. Locally it writes into a temporary folder it never renamed."""
    folder = storage.join(ckpt.checkpoint_dir(run), str(step))
    if not storage.is_remote(run):
        os.rename(folder, f"{folder}.orbax-checkpoint-tmp-1765101234")
        return
    storage.delete(storage.join(folder, "commit_success.txt"))
    meta_path = storage.join(folder, record.CHECKPOINT_METADATA_FILE)
    meta = json.loads(storage.read_bytes(meta_path))
    meta.pop("custom_metadata", None)
    storage.write_text(meta_path, json.dumps(meta))


@pytest.mark.parametrize("where", ["gs", "local"])
def test_an_unfinished_first_checkpoint_is_not_legacy_and_the_rerun_says_it_starts_over(
        where, gcs, micro_data, tmp_path, capsys, caplog):
    # One save, at step 20 (the run's first and last): the first checkpoint is what the kill interrupts, and
    # a second one, saved only to be deleted, cost a save in each run (and another in the rerun).
    config = micro_config(micro_data, num_steps=20)
    config.train.log_every, config.train.checkpoint_every = 5, 20
    run = gcs.new_bucket() + "/runs/unfinished" if where == "gs" else str(tmp_path / "unfinished")
    assert main(["train", "--config", f"{REPO}/configs/experiments/tiny.py", "--workdir", run,
                 *config_overrides(config)]) == 0
    _as_killed_while_writing(run, 20)  # the kill came during the first save
    storage.forget_listings(run)

    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--workdir", run]) == 0
    out = capsys.readouterr()
    said = out.out + out.err + caplog.text
    assert "trusted as it is" not in said, said
    line = "starting from step 0: checkpoint 20 (checkpoints/20) was never finished: the run was stopped while saving it"
    assert line in said, said
    assert json.loads(out.out.strip().splitlines()[-1])["step"] == 20


def test_an_overwriting_export_into_a_linked_out_replaces_the_linked_folder_and_leaves_no_lock(
        micro_data, tmp_path, capsys):
    """`convert --to-hf --overwrite --out latest`, latest a link to an earlier export: the link is followed
    (the folder it names is replaced whole, the link names the new export), and no lock is left behind."""
    config = micro_config(micro_data, num_steps=20)   # the run of the test above: its programs are in the cache
    config.train.log_every, config.train.checkpoint_every = 5, 20  # the export reads the last checkpoint only
    run = str(tmp_path / "run")
    train_and_evaluate(config, run)
    v1, latest = tmp_path / "v1", tmp_path / "latest"
    assert main(["convert", "--to-hf", "--workdir", run, "--out", str(v1)]) == 0
    (v1 / "model.safetensors").write_bytes(b"an earlier export")
    latest.symlink_to(v1, target_is_directory=True)

    capsys.readouterr()
    assert main(["convert", "--to-hf", "--workdir", run, "--out", str(latest), "--overwrite"]) == 0
    out = capsys.readouterr()
    assert os.path.realpath(v1) in out.out + out.err, out
    assert LOCK_FILE not in os.listdir(v1), os.listdir(v1)
    assert latest.is_symlink() and os.path.realpath(latest) == os.path.realpath(v1)
    assert (v1 / "model.safetensors").read_bytes() != b"an earlier export"
    assert sorted(os.listdir(tmp_path)) == ["latest", "run", "v1"], os.listdir(tmp_path)
