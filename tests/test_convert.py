"""``tieflax convert`` end to end: import a tied HF model, untie it, train it, export it, tie it back.

One chain of workdirs is built once per module (import -> untie -> ``tieflax train`` a few steps ->
export) and each test checks one link of it. Training runs the real trainer on a small pre-tokenised
corpus of counting sequences, which a tiny model learns within a few steps.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import jax.numpy as jnp  # noqa: E402

from tieflax.cli import main  # noqa: E402
from tieflax.run.checkpoints import load_latest_params  # noqa: E402
from tieflax.config import model_config  # noqa: E402
from tieflax.run.metrics import read_metrics  # noqa: E402
from tieflax.model import TransformerLM  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread():
    """torch (the Hugging Face models built, loaded and run here) on one thread: its idle workers spin on a
    loaded machine (tests/train_support.py's torch_one_thread)."""
    from train_support import torch_one_thread

    with torch_one_thread():
        yield

V, STEPS = 100, 8
TRAIN = ["--config.data.source=tokens", "--config.data.tokens.vocab_size=100", "--config.data.tokens.eos_id=0",
         "--config.train.seq_len=16", "--config.train.global_batch_size=8", f"--config.train.num_steps={STEPS}",
         "--config.train.warmup_steps=1", "--config.train.learning_rate=0.01", "--config.train.log_every=1",
         "--config.train.eval_every=1000", "--config.train.eval_batches=1", "--config.train.weight_decay=0.0",
         "--config.train.checkpoint_every=1000", "--config.train.loss_token_block=64",
         "--config.train.loss_vocab_block=128"]


def _counting_corpus(path: str) -> str:
    """EOS-separated documents that count upwards (mod 99) from a random start: easy to learn."""
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[0], (rng.integers(0, 99) + np.arange(40)) % 99 + 1]) for _ in range(200)]
    np.save(path, np.concatenate(docs + [[0]]).astype(np.uint16))
    return path


def _params(workdir):
    return load_latest_params(workdir)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Folders: hf (tied llama), imported, untied (trained STEPS steps), hf_out (exported)."""
    root = tmp_path_factory.mktemp("convert")
    d = {k: str(root / k) for k in ("hf", "imported", "untied", "hf_out")}
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(d["hf"])
    corpus = _counting_corpus(str(root / "corpus.npy"))
    assert main(["convert", "--from-hf", d["hf"], "--workdir", d["imported"]]) == 0
    d["untie_initial"] = _params(d["imported"])[1]
    assert main(["convert", "--untie", "--workdir", d["imported"], "--out", d["untied"],
                 f"--config.data.tokens.train_path={corpus}", *TRAIN]) == 0
    d["untied_initial"] = _params(d["untied"])[1]
    assert main(["train", "--workdir", d["untied"]]) == 0  # continues from the converted parameters
    assert main(["convert", "--to-hf", "--workdir", d["untied"], "--out", d["hf_out"]]) == 0
    return d


def test_import_keeps_the_tie(chain):
    config, params, step = _params(chain["imported"])
    assert step == 0 and config.model.tie_embeddings and "lm_head" not in params
    assert os.path.isfile(os.path.join(chain["imported"], "hf_files", "generation_config.json"))


def test_untie_copies_the_embedding(chain):
    params = chain["untied_initial"]
    np.testing.assert_array_equal(params["lm_head"]["embedding"], params["embed"]["embedding"])
    np.testing.assert_array_equal(params["embed"]["embedding"], chain["untie_initial"]["embed"]["embedding"])
    with open(os.path.join(chain["untied"], "surgery.json")) as f:
        assert json.load(f)["action"] == "untie"


def test_untied_training_diverges_the_matrices_and_lowers_the_loss(chain):
    config, params, step = _params(chain["untied"])
    assert step == STEPS and not config.model.tie_embeddings
    w_in, w_out = (np.asarray(params[k]["embedding"][:V], np.float64) for k in ("embed", "lm_head"))
    assert np.linalg.norm(w_in - w_out) / np.linalg.norm(w_in) > 1e-3  # they now train separately
    losses = [row["ce_loss"] for row in read_metrics(chain["untied"], split="train")]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1, losses


def test_trained_export_matches_tieflax_in_transformers(chain):
    config, params, _ = _params(chain["untied"])
    tokens = np.random.default_rng(1).integers(0, V, (2, 10))
    mine = np.asarray(TransformerLM(model_config(config)).apply({"params": params}, jnp.asarray(tokens)))[..., :V]
    model = transformers.AutoModelForCausalLM.from_pretrained(chain["hf_out"], attn_implementation="eager").eval()
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("source", ["input", "output", "mean"])
def test_tie_reports_what_was_discarded(chain, tmp_path, capsys, source):
    out = str(tmp_path / "tied")
    assert main(["convert", "--tie", source, "--workdir", chain["untied"], "--out", out]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == source and report["relative_distance_in_out"] > 1e-3
    assert report["discarded"] == {"input": "output matrix (lm_head)", "output": "input matrix (embed)",
                                   "mean": "the difference between the two matrices"}[source]
    config, params, step = _params(out)
    assert step == 0 and config.model.tie_embeddings and "lm_head" not in params
    _, untied, _ = _params(chain["untied"])
    w_in, w_out = untied["embed"]["embedding"], untied["lm_head"]["embedding"]
    want = {"input": w_in, "output": w_out, "mean": (w_in + w_out) / 2}[source]
    np.testing.assert_allclose(params["embed"]["embedding"], want, rtol=0, atol=1e-7)


def _fails(capsys, argv, match) -> str:
    """The command fails with one line on stderr, ``tieflax convert: ...``, matching ``match``."""
    capsys.readouterr()
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tieflax {argv[0]}: "), err
    assert re.search(match, err), err
    return err


def test_bad_requests_fail_clearly(chain, tmp_path, capsys):
    _fails(capsys, ["convert", "--tie", "mean", "--workdir", chain["imported"], "--out", str(tmp_path / "a")],
           "is already tied .*use --untie")
    _fails(capsys, ["convert", "--untie", "--workdir", chain["untied"], "--out", str(tmp_path / "b")],
           "is already untied .*use --tie input")
    _fails(capsys, ["convert", "--untie", "--workdir", chain["imported"], "--out", chain["imported"]],
           "is --workdir .* itself: write to a new folder")
    _fails(capsys, ["convert", "--from-hf", chain["hf"], "--workdir", str(tmp_path / "c"),
                    "--config.model.tie_embeddings=False"], "tie_embeddings")
    _fails(capsys, ["convert", "--untie", "--workdir", chain["imported"], "--out", str(tmp_path / "d"),
                    "--config.model.vocab_pad_multiple=256"], "vocab_pad_multiple")
    _fails(capsys, ["convert", "--to-hf", "--workdir", chain["untied"]], "--out is required")
    assert not any(os.path.exists(tmp_path / n) for n in "abcd")  # nothing was written by a refusal


def test_convert_never_writes_into_a_run_without_overwrite(chain, tmp_path, capsys):
    """Importing or converting onto a run replaced its config.json; the next train ignored the import."""
    config_json = os.path.join(chain["untied"], "config.json")
    before = open(config_json).read()
    _fails(capsys, ["convert", "--from-hf", chain["hf"], "--workdir", chain["untied"]], "holds a run.*--overwrite")
    _fails(capsys, ["convert", "--untie", "--workdir", chain["imported"], "--out", chain["untied"]],
           "holds a run.*--overwrite")
    _fails(capsys, ["convert", "--to-hf", "--workdir", chain["imported"], "--out", chain["untied"]],
           "holds a tieflax run")
    assert open(config_json).read() == before and read_metrics(chain["untied"], split="train")
    copy = str(tmp_path / "copy")
    shutil.copytree(chain["imported"], copy)
    os.makedirs(os.path.join(copy, "checkpoints"))  # as if it had trained
    assert main(["convert", "--from-hf", chain["hf"], "--workdir", copy, "--overwrite"]) == 0
    assert not os.path.exists(os.path.join(copy, "checkpoints")) and _params(copy)[2] == 0
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n or ".replaced-" in n]


def test_an_interrupted_import_is_refused_by_train(chain, tmp_path, capsys):
    """kill -9 during an import left config.json and a half-written initial_params; train started from
    random weights. Now the import is written beside the workdir and renamed when complete."""
    target = tmp_path / "run"
    (tmp_path / ".run.partial-4242" / "initial_params").mkdir(parents=True)  # what a kill -9 leaves
    err = _fails(capsys, ["train", "--workdir", str(target), "--config",
                          os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tiny.py")],
                 "did not finish")
    assert ".run.partial-4242" in err and not target.exists()
    shutil.copytree(chain["imported"], target)
    _fails(capsys, ["train", "--workdir", str(target)], r"\.run\.partial-4242")
    shutil.rmtree(target)  # rerunning the import clears what the interrupted one left
    assert main(["convert", "--from-hf", chain["hf"], "--workdir", str(target)]) == 0
    assert not (tmp_path / ".run.partial-4242").exists() and _params(str(target))[2] == 0
    (target / "initial_params.orbax-checkpoint-tmp-17").mkdir()  # orbax's own temporary name
    _fails(capsys, ["train", "--workdir", str(target)], r"initial_params\.orbax-checkpoint-tmp-17")


def test_a_busy_destination_is_refused(chain, tmp_path, capsys):
    import socket

    out = tmp_path / "busy"
    out.mkdir()
    (out / "tieflax.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                  "command": "train", "since": "now"}))
    _fails(capsys, ["convert", "--untie", "--workdir", chain["imported"], "--out", str(out), "--overwrite"],
           f"in use by `tieflax train` .*PID {os.getppid()}")


def test_damaged_or_unsafe_hf_folders_name_the_file(chain, tmp_path, capsys):
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "pytorch_model.bin").write_bytes(b"not read")
    _fails(capsys, ["convert", "--from-hf", str(pickles), "--workdir", str(tmp_path / "a")], "pickled weights")
    truncated = tmp_path / "truncated"
    shutil.copytree(chain["hf"], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _fails(capsys, ["convert", "--from-hf", str(truncated), "--workdir", str(tmp_path / "b")],
           "model.safetensors is not a readable safetensors file")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_import_points_training_at_the_checkpoints_tokenizer(chain, tmp_path):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(chain["hf"], hf)
    (hf / "tokenizer.json").write_text('{"stand-in": true}')
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    assert main(["convert", "--from-hf", str(hf), "--workdir", str(tmp_path / "w")]) == 0
    config, _, _ = load_latest_params(str(tmp_path / "w"))
    assert config.data.tokenizer.path == str(tmp_path / "w" / "tokenizer.json")
    assert config.data.tokenizer.eos_token == "<|end|>"
    assert (tmp_path / "w" / "hf_files" / "tokenizer_config.json").is_file()


def _snapshot(folder) -> dict:
    return {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(folder) for f in files}


def test_overwrite_never_deletes_the_source_another_run_or_through_a_link(chain, tmp_path, capsys):
    """`convert --scan-layers --workdir P/run --out P --overwrite` deleted P/run (and a run training in
    P/runA); a link --out pointing at --workdir was not refused either and left a stale lock."""
    import socket

    p = tmp_path / "P"
    run = p / "run"
    shutil.copytree(chain["untied"], run)
    before = _snapshot(run)
    _fails(capsys, ["convert", "--scan-layers", "--workdir", str(run), "--out", str(p), "--overwrite"],
           "contains --workdir .*would delete the source")
    shutil.copytree(chain["imported"], p / "runA")
    (p / "runA" / "tieflax.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                          "command": "train", "since": "now"}))
    _fails(capsys, ["convert", "--untie", "--workdir", str(p / "runA"), "--out", str(p / "runA" / "sub")],
           "lies inside --workdir")
    link = tmp_path / "link"
    link.symlink_to(run)
    _fails(capsys, ["convert", "--scan-layers", "--workdir", str(run), "--out", str(link), "--overwrite"],
           r"\(a link to .*\) is --workdir")
    outer = tmp_path / "outer"
    shutil.copytree(p / "runA", outer / "runA")
    _fails(capsys, ["convert", "--scan-layers", "--workdir", str(run), "--out", str(outer), "--overwrite"],
           "contains the run .*runA")
    _fails(capsys, ["convert", "--from-hf", chain["hf"], "--workdir", str(tmp_path), "--overwrite"],
           "contains the run")
    assert _snapshot(run) == before and "tieflax.lock" not in os.listdir(run)
    assert (p / "runA" / "config.json").exists() and (outer / "runA" / "config.json").exists()


def test_layout_conversion_says_what_it_resets_and_train_says_so(chain, tmp_path, capsys):
    out = tmp_path / "scanned"
    assert main(["convert", "--scan-layers", "--workdir", chain["untied"], "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == STEPS and "no parameter" in report["discarded"]
    for what in ("step", "optimizer state", "schedule", "data position"):
        assert what in report["reset"]
    assert json.load(open(out / "surgery.json"))["reset"] == report["reset"]
    config, params, step = _params(str(out))
    assert step == 0 and config.model.scan_layers


def test_an_interrupted_surgery_leaves_no_partial_folder_and_no_lock(chain, tmp_path, capsys, monkeypatch):
    from tieflax.run import checkpoints as ckpt
    from tieflax.cli import Interrupted

    def interrupted(*args, **kwargs):
        raise Interrupted(15)

    monkeypatch.setattr(ckpt, "save_initial_params", interrupted)
    assert main(["convert", "--untie", "--workdir", chain["imported"], "--out", str(tmp_path / "new")]) == 143
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # no partial folder, no workdir, no lock


def test_convert_to_and_from_a_bucket(chain, gcs, capsys):
    """Surgery, export and import with gs:// paths: written in place behind an incomplete marker (there is
    no rename on an object store), which is gone once the command finishes; the same parameters come back."""
    from tieflax import storage
    from tieflax.run.layout import INCOMPLETE_MARKER
    from tieflax.run.destinations import check_no_partial_import

    bucket = gcs.new_bucket()
    untied, hf, back = f"{bucket}/untied", f"{bucket}/hf", f"{bucket}/back"
    assert main(["convert", "--untie", "--workdir", chain["imported"], "--out", untied]) == 0
    assert main(["convert", "--to-hf", "--workdir", untied, "--out", hf]) == 0
    assert main(["convert", "--from-hf", hf, "--workdir", back]) == 0
    names = gcs.objects(bucket, "")
    assert not [n for n in names if INCOMPLETE_MARKER in n or "tieflax.lock" in n], names
    assert {"hf/config.json", "hf/model.safetensors", "untied/surgery.json"} <= set(names)
    _, want, _ = _params(chain["imported"])
    _, got, step = _params(back)
    assert step == 0
    np.testing.assert_array_equal(got["lm_head"]["embedding"], want["embed"]["embedding"])
    capsys.readouterr()
    _fails(capsys, ["convert", "--untie", "--workdir", chain["imported"], "--out", untied, "--overwrite"],
           "not empty: on an object store .*no rename")
    storage.write_text(f"{untied}/{INCOMPLETE_MARKER}", "as a kill -9 leaves it")
    with pytest.raises(Exception, match="did not finish"):
        check_no_partial_import(untied)


# ------------------------------------------------------------------------ exports are destinations too
def _sha(folder) -> dict:
    import hashlib

    return {os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(folder) for f in files}


def test_an_export_never_writes_over_the_folder_the_run_was_imported_from(chain, tmp_path, capsys):
    """`convert --from-hf A`, train, `--to-hf --out A` replaced A's model.safetensors (exit 0, no --overwrite
    needed). The import records A (imported_from.json, carried by surgery); an export is refused into A,
    a link to it, a folder holding it or a folder inside it, with or without --overwrite; A stays byte for
    byte as it was, although it looks like an export (config.json + model.safetensors)."""
    hf = tmp_path / "A"
    shutil.copytree(chain["hf"], hf)
    run = str(tmp_path / "imp")
    assert main(["convert", "--from-hf", str(hf), "--workdir", run]) == 0
    assert json.load(open(os.path.join(run, "imported_from.json"))) == {"hf_dir": str(hf)}
    untied = str(tmp_path / "untied")
    assert main(["convert", "--untie", "--workdir", run, "--out", untied]) == 0   # surgery carries the record
    before = _sha(hf)
    (tmp_path / "link").symlink_to(hf)
    for workdir in (run, untied):
        for out, extra, what in ((hf, [], "is"), (hf, ["--overwrite"], "is"), (tmp_path / "link", ["--overwrite"], "is"),
                                 (tmp_path, ["--overwrite"], "holds"), (hf / "sub", [], "lies inside")):
            err = _fails(capsys, ["convert", "--to-hf", "--workdir", workdir, "--out", str(out), *extra],
                         f"--out {re.escape(str(out))} {what} the Hugging Face folder {re.escape(str(hf))} that the "
                         f"run {re.escape(workdir)} comes from \\(imported_from.json\\)")
            assert ("--overwrite does not change this" in err) == bool(extra)
            assert _sha(hf) == before
    assert sorted(os.listdir(tmp_path)) == ["A", "imp", "link", "untied"]


def test_an_export_into_a_non_empty_folder_needs_overwrite_and_then_nothing_old_survives(chain, tmp_path, capsys):
    """A foreign config.json was overwritten (exit 0); run B's sharded export into run A's unsharded one
    kept A's model.safetensors, which transformers loaded under B's config. Now a non-empty --out is
    refused without --overwrite, and with it the folder is replaced whole, either way round."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"mine": 1}')
    _fails(capsys, ["convert", "--to-hf", "--workdir", chain["untied"], "--out", str(foreign)],
           r"is not empty \(config.json\): pass --overwrite")
    assert (foreign / "config.json").read_text() == '{"mine": 1}'
    x = str(tmp_path / "x")
    assert main(["convert", "--to-hf", "--workdir", chain["imported"], "--out", x]) == 0
    _fails(capsys, ["convert", "--to-hf", "--workdir", chain["untied"], "--out", x, "--max-shard-gb", "0.00001"],
           r"is not empty \(config.json, generation_config.json, model.safetensors\): pass --overwrite")
    assert main(["convert", "--to-hf", "--workdir", chain["untied"], "--out", x, "--max-shard-gb", "0.00001",
                 "--overwrite"]) == 0
    names = os.listdir(x)
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names and len(names) > 4
    np.testing.assert_array_equal(_hf_embedding(x), _hf_embedding(chain["hf_out"]))
    assert main(["convert", "--to-hf", "--workdir", chain["imported"], "--out", x, "--overwrite"]) == 0
    assert sorted(os.listdir(x)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def _hf_embedding(folder) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return model.get_input_embeddings().weight.detach().numpy()


def test_an_incomplete_export_is_refused_by_import(chain, tmp_path, capsys):
    """An export that is being written or was interrupted (the bucket's marker object; a local partial
    folder) is refused in one line instead of being imported."""
    from tieflax.run.layout import INCOMPLETE_MARKER

    marked = tmp_path / "marked"
    shutil.copytree(chain["hf_out"], marked)
    (marked / INCOMPLETE_MARKER).write_text("an export is writing this folder")
    _fails(capsys, ["convert", "--from-hf", str(marked), "--workdir", str(tmp_path / "a")],
           f"{re.escape(str(marked))} is an incomplete export \\({INCOMPLETE_MARKER} is there")
    partial = tmp_path / ".export.partial-4242"
    shutil.copytree(chain["hf_out"], partial)
    _fails(capsys, ["convert", "--from-hf", str(partial), "--workdir", str(tmp_path / "b")],
           "is the partial folder of an export or import that did not finish")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_signal_at_any_moment_of_an_export_leaves_the_old_export_or_the_new(chain, tmp_path):
    """SIGTERM and SIGINT sent to `tieflax convert --to-hf --overwrite` (untied run, ~10 shard files) over
    the tied run's unsharded export, at random moments of its writing phase (after it takes the lock in
    --out): a stopped export left shard 1 and B's config among A's files, or a lone config.json. Each
    time --out holds exactly the old files or the new ones (byte for byte), nothing beside it, and
    transformers loads that model; into a new folder, nothing or the new export. Five moments here;
    tools/export_signals.py sends 20 of each signal."""
    import hashlib
    import random
    import signal
    import subprocess
    import sys
    import time

    from train_support import REPO, subprocess_env

    def files(folder):
        return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
                for n in sorted(os.listdir(folder))}

    shard = "0.000004"   # ~4 KiB: each tensor its own file
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    assert main(["convert", "--to-hf", "--workdir", chain["imported"], "--out", old]) == 0
    assert main(["convert", "--to-hf", "--workdir", chain["untied"], "--out", new, "--max-shard-gb", shard]) == 0
    refs = {"old": (files(old), _hf_embedding(old)), "new": (files(new), _hf_embedding(new))}
    out = tmp_path / "x" / "export"
    rng = random.Random(35)
    runs = [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGINT, True),
            (signal.SIGINT, False)]   # the last into a new folder: it kept a lone config.json
    for signum, over_old in runs:
        shutil.rmtree(out, ignore_errors=True)
        if over_old:
            shutil.copytree(old, out)
        proc = subprocess.Popen([sys.executable, "-m", "tieflax.cli", "convert", "--to-hf", "--workdir",
                                 chain["untied"], "--out", str(out), "--overwrite", "--max-shard-gb", shard],
                                cwd=REPO, env=subprocess_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        while not (out / "tieflax.lock").exists() and proc.poll() is None:
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, 0.5))   # from the lock to the exit: ~0.55 s (tools/export_signals.py)
        if proc.poll() is None:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, 128 + signum, -signum), err
        if not over_old and not out.exists():
            assert os.listdir(out.parent) == [] and proc.returncode == 128 + signum
            continue   # stopped before it finished: nothing at all, no lone config.json
        assert os.listdir(out.parent) == ["export"], os.listdir(out.parent)   # no partial folder, no lock
        held = files(out)
        which = [k for k, (f, _) in refs.items() if f == held]
        assert which, sorted(held)
        np.testing.assert_array_equal(_hf_embedding(str(out)), refs[which[0]][1])
        assert "tieflax.lock" not in held
