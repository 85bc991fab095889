"""Where a destructive step may write (tieflax/destinations.py): never the source, a folder holding it, a
folder inside it, another run or a locked folder, links resolved. Folders only; nothing trains."""

from __future__ import annotations

import json
import os

import pytest

from tieflax.run.destinations import check_destination
from tieflax.run.layout import LOCK_FILE, WorkdirError


def _run(folder, lock=False):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "checkpoints").mkdir()
    if lock:
        (folder / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": 1, "command": "train"}))
    return folder


@pytest.fixture()
def tree(tmp_path):
    """P/run (the source), P/runA (another run, training), P/other (plain files)."""
    p = tmp_path / "P"
    _run(p / "run")
    _run(p / "runA", lock=True)
    (p / "other").mkdir()
    (p / "other" / "notes.txt").write_text("mine")
    return p


@pytest.mark.parametrize("out, overwrite, expected", [
    ("run", False, "is --workdir .* itself"),
    (".", True, "contains --workdir .*would delete the source"),
    (".", False, "contains --workdir"),
    ("run/sub", True, "lies inside --workdir"),
    ("runA/sub", False, "lies inside the run .*runA"),
])
def test_the_source_and_other_runs_are_refused(tree, out, overwrite, expected):
    with pytest.raises(WorkdirError, match=expected):
        check_destination(str(tree / out), sources=[("--workdir", str(tree / "run"))], overwrite=overwrite)


def test_a_folder_holding_another_run_is_refused_with_overwrite(tree, tmp_path):
    outer = tmp_path / "outer"
    _run(outer / "deep" / "runB")
    with pytest.raises(WorkdirError, match="contains the run .*runB.*--overwrite would delete it"):
        check_destination(str(outer), sources=[("--workdir", str(tree / "run"))], overwrite=True)
    (outer / "deep" / "runB" / "config.json").unlink()
    (outer / "deep" / "runB" / "checkpoints").rmdir()
    (outer / "deep" / "runB" / LOCK_FILE).write_text("{}")  # a locked folder counts as a run
    with pytest.raises(WorkdirError, match="contains the run"):
        check_destination(str(outer), sources=[("--workdir", str(tree / "run"))], overwrite=True)


def test_links_are_resolved(tree, tmp_path):
    link = tmp_path / "link_to_run"
    link.symlink_to(tree / "run")
    with pytest.raises(WorkdirError, match=r"\(a link to .*run\) is --workdir"):
        check_destination(str(link), sources=[("--workdir", str(tree / "run"))], overwrite=True)
    parent_link = tmp_path / "link_to_P"
    parent_link.symlink_to(tree)
    with pytest.raises(WorkdirError, match="contains --workdir"):
        check_destination(str(parent_link), sources=[("--workdir", str(tree / "run"))], overwrite=True)


def test_a_plain_new_folder_or_a_previous_output_is_fine(tree, tmp_path):
    src = [("--workdir", str(tree / "run"))]
    assert check_destination(str(tmp_path / "new"), sources=src, overwrite=False) == str(tmp_path / "new")
    previous = _run(tmp_path / "previous")  # replacing a run itself is what --overwrite is for
    check_destination(str(previous), sources=src, overwrite=True)
    check_destination(str(tree / "other"), sources=src, overwrite=True)
    assert os.path.exists(tree / "other" / "notes.txt")  # a check never deletes


def test_remote_prefixes_are_compared_as_prefixes():
    src = [("--workdir", "gs://b/P/run")]
    with pytest.raises(WorkdirError, match="contains --workdir"):
        check_destination("gs://b/P", sources=src, overwrite=False)
    with pytest.raises(WorkdirError, match="is --workdir"):
        check_destination("gs://b/P/run/", sources=src, overwrite=False)


def test_a_lone_config_json_is_not_a_run(tmp_path):
    """A Hugging Face folder (config.json + safetensors) above the destination is not a run."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "config.json").write_text("{}")
    check_destination(str(tmp_path / "models" / "export"), sources=[("--workdir", str(tmp_path / "run"))],
                      overwrite=True)


@pytest.mark.parametrize("exchange", [True, False])
def test_publishing_over_a_folder_never_leaves_it_missing(tmp_path, monkeypatch, exchange):
    """Replacing a folder by a complete one: one atomic swap where the kernel has it (renameat2), else
    two renames, and a signal (an exception) between them puts the old folder back."""
    from tieflax.errors import Interrupted
    from tieflax.run import destinations

    out, partial = tmp_path / "out", tmp_path / ".out.partial-1"
    for folder, text in ((out, "old"), (partial, "new")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    if not exchange:
        monkeypatch.setattr(destinations, "_exchange", lambda a, b: False)
        real_replace, calls = os.replace, []

        def replace(src, dst):
            calls.append(src)
            if len(calls) == 2:   # after the old folder moved aside, before the new one moved in
                raise Interrupted(15)
            real_replace(src, dst)

        monkeypatch.setattr(destinations.os, "replace", replace)
        with pytest.raises(Interrupted):
            destinations.publish(str(partial), str(out), overwrite=True)
        assert (out / "config.json").read_text() == "old"
        monkeypatch.setattr(destinations.os, "replace", real_replace)
    used = []
    swap = destinations._exchange
    monkeypatch.setattr(destinations, "_exchange", lambda a, b: used.append(swap(a, b)) or used[-1])
    destinations.publish(str(partial), str(out), overwrite=True)
    assert (out / "config.json").read_text() == "new" and os.listdir(tmp_path) == ["out"]
    if exchange and used != [True]:
        pytest.skip("this kernel or file system has no renameat2(RENAME_EXCHANGE): the two renames were used")
