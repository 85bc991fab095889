"""tieflax prepare's settings: ``--finalize`` takes what the shard builds recorded (build.json) and refuses
an --out with no started store at once, and a finished store asked for with other settings is refused
naming them. Each refusal is one line, exit 1, and leaves the folder's files and bytes as they were."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from tieflax.data import default_data_config
from tieflax.data import store as st
from tieflax.data.sources import load_documents

FLAGS = ["--config.data.source=files", "--config.data.tokenizer.vocab_size=300", "--config.model.vocab_size=300",
         "--config.data.val_fraction=0.5"]


def _corpus(folder) -> str:
    c = default_data_config()
    c.source = "python_stdlib"
    c.python_stdlib.max_files = 4
    folder.mkdir()
    for i, d in enumerate(load_documents(c)):
        (folder / f"{i}.txt").write_text(d.text)
    return str(folder)


def _argv(out, *extra) -> list[str]:
    return ["prepare", "--config", "configs/experiments/tiny.py", "--out", str(out), *extra]


def _tokenising(corpus: str, *extra) -> list[str]:
    return [*FLAGS, f"--config.data.files.paths={corpus}/*.txt", *extra]


def snapshot(folder) -> dict | None:
    """Every file and folder under ``folder`` -> the sha256 of its bytes (folders: None); None if absent."""
    if not os.path.exists(folder):
        return None
    seen = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            seen[os.path.relpath(os.path.join(root, d), folder) + "/"] = None
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                seen[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return seen


def _run(capsys, argv) -> tuple[int, list[str], float]:
    from tieflax.cli import main

    capsys.readouterr()
    t0 = time.perf_counter()
    code = main(argv)
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert not [line for line in err if "Traceback" in line], err
    return code, err, took


def _refused(capsys, argv, folder) -> str:
    """Runs ``argv``: exit 1, one line on stderr, ``folder`` unchanged; returns the line."""
    before = snapshot(folder)
    code, err, took = _run(capsys, argv)
    assert code == 1 and len(err) == 1 and err[0].startswith("tieflax prepare: "), (code, err)
    assert snapshot(folder) == before
    print(f"refused in {took:.2f} s: {err[0]}")
    return err[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A store finished from two shares (--shard-mb 0.004: several input shards) and a --finalize that
    repeats no tokenising flag, as README's example."""
    from tieflax.cli import main

    root = tmp_path_factory.mktemp("prep")
    corpus = _corpus(root / "corpus")
    out = root / "store"
    for i in range(2):
        assert main(_argv(out, *_tokenising(corpus), "--shard-mb", "0.004", "--shard", f"{i}/2")) == 0
    assert not (out / "manifest.json").exists() and (out / "build.json").exists()
    return corpus, out


@pytest.mark.parametrize("where", ["missing", "empty", "tokenizer only"])
def test_finalize_on_an_out_with_no_started_store_is_one_line_and_creates_nothing(tmp_path, capsys, where):
    """It trained a BPE on the whole corpus before refusing, and left a build.json (with the default
    shard size) that made the real prepare refuse with 'started with other settings'."""
    out = tmp_path / "out"
    if where != "missing":
        out.mkdir()
    if where == "tokenizer only":   # a prepare stopped before it recorded its settings
        (out / "tokenizer.json").write_text("{}")
    corpus = _corpus(tmp_path / "corpus")
    for extra in ([], _tokenising(corpus, "--shard-mb", "0.004")):
        line = _refused(capsys, _argv(out, *extra, "--finalize"), out)
        assert line == (f"tieflax prepare: --finalize: {out} holds no started token store (no build.json): run "
                        f"`tieflax prepare --config ... --out {out} --shard I/N` on every host first (or, on one "
                        "machine, without --finalize)")
    assert os.path.exists(out) == (where != "missing")


def test_finalize_of_a_store_whose_shards_were_never_tokenised_writes_nothing(finished, tmp_path, capsys):
    _, done = finished
    out = tmp_path / "started"
    out.mkdir()
    for name in ("build.json", "tokenizer.json"):   # a prepare stopped before its first input shard
        (out / name).write_bytes((done / name).read_bytes())
    line = _refused(capsys, _argv(out, "--finalize"), out)
    assert line == (f"tieflax prepare: token store {out}: no input shard has been tokenised yet; run tieflax "
                    "prepare (with each --shard i/N) before finalizing")


def test_finalize_on_a_fresh_gs_out_creates_no_object(gcs, capsys):
    bucket = gcs.new_bucket()
    out = f"{bucket}/corpus"
    code, err, _ = _run(capsys, _argv(out, "--finalize"))
    assert code == 1 and err == [f"tieflax prepare: --finalize: {out} holds no started token store (no build.json): "
                                 f"run `tieflax prepare --config ... --out {out} --shard I/N` on every host first "
                                 "(or, on one machine, without --finalize)"], err
    assert gcs.objects(bucket) == []


def test_finalize_takes_the_recorded_settings_and_refuses_a_flag_that_differs(finished, capsys):
    corpus, out = finished
    line = _refused(capsys, _argv(out, *_tokenising(corpus, "--config.data.tokenizer.vocab_size=320",
                                                    "--config.data.val_fraction=0.4"), "--shard-mb", "8",
                                  "--finalize"), out)
    assert line == (f"tieflax prepare: token store {out} was started with other settings (shard_bytes: 4194 -> "
                    "8388608; split.val_fraction: 0.5 -> 0.4; tokenizer.vocab_size: 300 -> 320): rerun with the "
                    "settings it was started with, or use another --out")
    line = _refused(capsys, _argv(out, "--config.data.source=files", f"--config.data.files.paths={corpus}/0.txt",
                                  "--finalize"), out)
    assert line == (f"tieflax prepare: token store {out} was started with other settings (data.files.paths: "
                    f"'{corpus}/*.txt' -> '{corpus}/0.txt'): rerun with the settings it was started with, or use "
                    "another --out")
    # README's example: only --config and --out (tiny.py's own data section is kjv with 8,192 tokens)
    code, err, took = _run(capsys, _argv(out, "--finalize"))
    assert code == 0, err
    manifest = st.read_manifest(str(out))
    assert manifest["vocab_size"] == 300 and manifest["input_shards"] >= 2
    print(f"--finalize without the tokenising flags: {took:.2f} s")


def test_a_finished_store_asked_for_with_other_settings_is_refused_naming_them(finished, capsys):
    corpus, out = finished
    if not (out / "manifest.json").exists():   # run alone: finalize it here
        assert _run(capsys, _argv(out, "--finalize"))[0] == 0
    cases = [(["--config.data.tokenizer.min_frequency=3", "--config.data.tokenizer.vocab_size=320"],
              "tokenizer.min_frequency: 2 -> 3; tokenizer.vocab_size: 300 -> 320"),
             (["--config.data.val_fraction=0.4"], "split.val_fraction: 0.5 -> 0.4"),
             (["--shard-mb", "1"], "shard_bytes: 4194 -> 1048576"),
             ([f"--config.data.files.paths={corpus}/0.txt"], f"data.files.paths: '{corpus}/*.txt' -> '{corpus}/0.txt'")]
    for extra, differ in cases:
        for finalize in ([], ["--finalize"]):
            line = _refused(capsys, _argv(out, *_tokenising(corpus), *extra, *finalize), out)
            assert line == (f"tieflax prepare: token store {out} was started with other settings ({differ}): "
                            "rerun with the settings it was started with, or use another --out"), line
    # the same settings (given again, or for --finalize left out): nothing to do, exit 0, nothing written
    digest = st.read_manifest(str(out))["digest"]
    for argv in (_argv(out, *_tokenising(corpus)), _argv(out, *_tokenising(corpus), "--shard-mb", "0.004"),
                 _argv(out, "--finalize")):
        before = snapshot(out)
        code, err, _ = _run(capsys, argv)
        assert code == 0 and err == [f"tieflax prepare: {out} is already a finished token store (digest "
                                     f"{digest[:16]}); nothing to do"], err
        assert snapshot(out) == before
