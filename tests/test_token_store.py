"""The token store: tieflax prepare's output equals an in-process oracle, resumes from its ledger, splits
across machines, lives on gs://, trains bit-identically to token files, and refuses bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import pytest

from store_support import V, corpus_config
from tieflax import storage
from tieflax.data import DataError, default_data_config, make_loader, prepare_dataset
from tieflax.data import store as st
from tieflax.data.cache import join_documents
from tieflax.data.sources import load_documents
from tieflax.data.store_build import build_store, is_val


def store_config(path: str):
    c = corpus_config()
    c.source = "tokens"
    c.tokens.path = path
    return c


@pytest.fixture(scope="module")
def local_store(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("store") / "s")
    return out, build_store(corpus_config(), out, workers=2, shard_bytes=64 << 10)


def test_the_store_holds_the_packed_splits_of_an_in_process_oracle(local_store):
    out, manifest = local_store
    c = corpus_config()
    docs = load_documents(c)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(storage.read_text(storage.join(out, "tokenizer.json")))
    val = is_val(np.arange(len(docs)), c.split_seed, c.val_fraction)
    s = st.open_store(out)
    assert manifest["input_shards"] > 2  # several parts: the joins between them are exercised
    for split, mask in (("train", ~val), ("val", val)):
        chosen = [d.text for d, m in zip(docs, mask) if m]
        ids = [np.asarray(e.ids, np.uint16) for e in tok.encode_batch(chosen, add_special_tokens=False)]
        want = join_documents(ids, manifest["eos_id"], None, np.dtype(np.uint16))
        got = s.tokens(split)
        assert len(got) == len(want) == manifest["splits"][split]["tokens"]
        np.testing.assert_array_equal(got[:], want)
        off = s.doc_offsets(split)
        assert len(off) == len(chosen) + 1 and (want[off] == manifest["eos_id"]).all()
        np.testing.assert_array_equal(np.diff(off), [len(a) + 1 for a in ids])
    np.testing.assert_array_equal(s.token_counts(), np.bincount(s.tokens("train")[:], minlength=V))


def test_a_finished_store_is_never_rewritten(local_store):
    out, manifest = local_store
    before = os.stat(st.manifest_path(out)).st_mtime_ns
    assert build_store(corpus_config(), out, workers=1)["digest"] == manifest["digest"]
    assert os.stat(st.manifest_path(out)).st_mtime_ns == before


def test_shares_on_two_machines_then_finalize_and_a_resume_skip_finished_shards(local_store, tmp_path):
    out, manifest = local_store
    split = str(tmp_path / "split")
    assert build_store(corpus_config(), split, shard=(0, 2), shard_bytes=64 << 10) is None
    with pytest.raises(DataError, match="input shards are not tokenised yet"):
        build_store(corpus_config(), split, finalize_only=True, shard_bytes=64 << 10)
    done = {k: os.stat(st.part_path(split, k)).st_mtime_ns for k in st.finished_parts(split)}
    assert done and all(k % 2 == 0 for k in done)
    # a plain prepare resumes: it tokenises only the missing shards and commits the same content
    assert build_store(corpus_config(), split, shard_bytes=64 << 10)["digest"] == manifest["digest"]
    assert {k: os.stat(st.part_path(split, k)).st_mtime_ns for k in done} == done


def test_training_reads_the_store_and_two_processes_read_disjoint_windows_covering_the_epoch(local_store):
    out, manifest = local_store
    p = prepare_dataset(store_config(out), out + "_workdir", vocab_size=V)
    assert isinstance(p.train_tokens, st.StoreTokens) and p.eos_id == manifest["eos_id"]
    read: dict[int, list] = {0: [], 1: []}
    for proc in (0, 1):
        tokens = p.train_tokens
        original = tokens.read_windows

        def spy(starts, length, proc=proc, original=original):
            read[proc].extend(int(s) for s in starts)
            return original(starts, length)
        tokens.read_windows = spy
        try:
            batches = list(make_loader(p, "train", seq_len=32, global_batch_size=8, seed=3, num_epochs=1,
                                       process_index=proc, process_count=2))
        finally:
            del tokens.read_windows
        assert all(b["inputs"].shape == (4, 32) for b in batches)
    rows = -(-(len(p.train_tokens) - 1) // 32)
    a, b = set(read[0]), set(read[1])
    # padding rows (past the epoch) read window 0 as a placeholder; every real row is read exactly once
    assert not (a & b) - {0} and (a | b) == {r * 32 for r in range(rows)}
    assert len(read[0]) + len(read[1]) - (len(read[0]) - len(a)) - (len(read[1]) - len(b)) >= rows


def test_store_batches_equal_the_same_tokens_as_a_token_file(local_store, tmp_path):
    from tieflax.data.token_files import write_token_file
    out, manifest = local_store
    s = st.open_store(out)
    for split in ("train", "val"):
        write_token_file(tmp_path / f"{split}.bin", s.tokens(split)[:], vocab_size=manifest["vocab_size"])
    c = corpus_config()
    c.source, c.tokens.train_path, c.tokens.val_path = "tokens", str(tmp_path / "train.bin"), str(tmp_path / "val.bin")
    c.tokens.vocab_size, c.tokens.eos_id = manifest["vocab_size"], manifest["eos_id"]
    files = prepare_dataset(c, tmp_path / "w", vocab_size=V)
    store = prepare_dataset(store_config(out), str(tmp_path / "w2"), vocab_size=V)
    np.testing.assert_array_equal(files.token_counts, store.token_counts)
    for split in ("train", "val"):
        a = make_loader(files, split, seq_len=32, global_batch_size=8, seed=5, start_step=3)
        b = make_loader(store, split, seq_len=32, global_batch_size=8, seed=5, start_step=3)
        for _ in range(5):
            x, y = next(a), next(b)
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])
    # exact resume: a loader restored from a saved state continues with the same batches
    store = dataclasses.replace(store, read_threads=2)  # the default: grain's threads read ahead
    it = make_loader(store, "train", seq_len=32, global_batch_size=8, seed=7)
    for _ in range(3):
        next(it)
    state, want = it.get_state(), [next(it) for _ in range(3)]
    again = make_loader(store, "train", seq_len=32, global_batch_size=8, seed=7)
    again.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(again)["inputs"], w["inputs"])


def test_a_gs_store_equals_the_local_one(local_store, gcs):
    out, manifest = local_store
    remote = gcs.new_bucket() + "/corpus"
    got = build_store(corpus_config(), remote, workers=1, shard_bytes=64 << 10)
    assert got["digest"] == manifest["digest"] and got["splits"] == manifest["splits"]
    assert not [o for o in gcs.objects(remote.rsplit("/", 1)[0], "corpus/") if "lock" in o]
    a = make_loader(prepare_dataset(store_config(out), out + "_w", vocab_size=V), "train", seq_len=32,
                    global_batch_size=8, seed=1)
    b = make_loader(prepare_dataset(store_config(remote), remote + "_w", vocab_size=V), "train", seq_len=32,
                    global_batch_size=8, seed=1)
    for _ in range(3):
        x, y = next(a), next(b)
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert got["arrays"] == manifest["arrays"]  # the same bytes, the same object sizes
    # damage on a bucket: a short object is refused at open (the size check's range read runs past its
    # end), a deleted one while reading, each in one line naming the object
    key = storage.join(remote, "val", "tokens", "c", "0")
    sound = storage.read_bytes(key)
    storage.write_bytes(key, sound[:-100])
    with pytest.raises(DataError, match=f"^token store {remote}: array val/tokens: object c/0 is truncated "):
        st.open_store(remote).tokens("val")
    storage.write_bytes(key, sound)
    tokens = prepare_dataset(store_config(remote), remote + "_w", vocab_size=V).val_tokens  # opened before
    storage.delete(key)
    with pytest.raises(DataError, match=f"^token store {remote}: array val/tokens: object c/0 is missing: "):
        tokens[:8]


def test_jsonl_and_parquet_text_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"text": f"row {i} " * 30, "id": i} for i in range(30)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:15]) + "\n")
    pq.write_table(pa.table({"text": [r["text"] for r in rows[15:]]}), tmp_path / "b.parquet")
    c = default_data_config()
    c.source, c.files.paths = "files", [str(tmp_path / "*.jsonl"), str(tmp_path / "*.parquet")]
    assert [d.text for d in load_documents(c)] == [r["text"] for r in rows]
    c.files.text_field = "body"
    with pytest.raises(DataError, match="text_field = 'body' is not a field"):
        load_documents(c)


# ------------------------------------------------------------------------------------------ bad input

def other_tokenizer(path: str) -> None:
    from tieflax.data.tokenizer import train_bpe
    texts = [d.text for d in load_documents(corpus_config(5))]
    train_bpe(texts, vocab_size=300, eos_token="<|endoftext|>").save(path)


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_bad_stores_are_refused_in_one_line(local_store, tmp_path):
    out, manifest = local_store
    with pytest.raises(DataError, match="does not exist: make it with tieflax prepare") as e:
        prepare_dataset(store_config(str(tmp_path / "nowhere")), tmp_path / "w", vocab_size=V)
    one_line(e)
    half = tmp_path / "half"
    half.mkdir()
    (half / "build.json").write_text("{}")
    with pytest.raises(DataError, match="has no manifest.json: its prepare never finished") as e:
        prepare_dataset(store_config(str(half)), tmp_path / "w", vocab_size=V)
    one_line(e)
    (half / "lock.json").write_text(json.dumps({"host": "x", "pid": 1, "heartbeat": time.time()}))
    with pytest.raises(DataError, match="still being written by a tieflax prepare"):
        prepare_dataset(store_config(str(half)), tmp_path / "w", vocab_size=V)
    with pytest.raises(DataError, match="being written by another tieflax prepare"):
        build_store(corpus_config(), str(half))
    (half / "manifest.json").write_text('{"format": "tieflax-token-store/1", "splits": {}}')
    with pytest.raises(DataError, match="damaged manifest.json") as e:
        prepare_dataset(store_config(str(half)), tmp_path / "w", vocab_size=V)
    one_line(e)
    with pytest.raises(DataError, match=f"model's vocab_size = 256 does not match the tokenizer's {V}"):
        prepare_dataset(store_config(out), tmp_path / "w", vocab_size=256)
    other = tmp_path / "other_tokenizer.json"
    other_tokenizer(str(other))
    c = store_config(out)
    c.tokenizer.path = str(other)
    with pytest.raises(DataError, match="was made with another tokenizer") as e:
        prepare_dataset(c, tmp_path / "w", vocab_size=V)
    one_line(e)


def test_bad_corpora_are_refused_in_one_line(tmp_path):
    c = default_data_config()
    c.source, c.files.paths = "files", [str(tmp_path / "missing" / "*.txt")]
    with pytest.raises(DataError, match="matches no file") as e:
        build_store(c, str(tmp_path / "s1"))
    one_line(e)
    assert not (tmp_path / "s1").exists()
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    c.files.paths = [str(tmp_path / "empty.jsonl")]
    c.tokenizer.path = str(tmp_path / "tok.json")
    other_tokenizer(c.tokenizer.path)
    with pytest.raises(DataError, match="model's vocab_size = 256 does not match the tokenizer's 300") as e:
        build_store(c, str(tmp_path / "s3"), model_vocab_size=256)
    one_line(e)
    assert not (tmp_path / "s3" / "parts").exists()
    with pytest.raises(DataError, match="produced no documents") as e:
        build_store(c, str(tmp_path / "s2"))
    one_line(e)
    assert not (tmp_path / "s2" / "manifest.json").exists()


def test_tiny_trained_from_a_gs_store_and_from_token_files_has_identical_losses(local_store, gcs, tmp_path):
    # the local store gives these batches too (test_store_batches_equal_the_same_tokens_as_a_token_file)
    from train_support import micro_config
    from tieflax.data.token_files import write_token_file
    from tieflax.run.metrics import read_metrics
    from tieflax.train import train_and_evaluate
    out, manifest = local_store
    remote = gcs.new_bucket() + "/corpus"
    build_store(corpus_config(), remote, workers=1, shard_bytes=64 << 10)
    s = st.open_store(out)
    for split in ("train", "val"):
        write_token_file(tmp_path / f"{split}.bin", s.tokens(split)[:], vocab_size=manifest["vocab_size"])
    losses = {}
    for name in ("gs", "files"):
        config = micro_config(str(tmp_path), num_steps=4)
        config.train.update(log_every=1, checkpoint_every=100, eval_batches=1)
        config.data = corpus_config()
        config.data.source = "tokens"
        if name == "files":
            config.data.tokens.update(train_path=str(tmp_path / "train.bin"), val_path=str(tmp_path / "val.bin"),
                                      vocab_size=manifest["vocab_size"], eos_id=manifest["eos_id"])
        else:
            config.data.tokens.path = remote
        workdir = str(tmp_path / name)
        result = train_and_evaluate(config, workdir)
        losses[name] = [r["loss"] for r in read_metrics(workdir, "train")] + [result["final_val_loss"]]
    assert losses["gs"] == losses["files"], losses


def test_the_prepare_command_builds_reports_and_fails_in_one_line(tmp_path, capsys):
    from tieflax.cli import main
    for i, d in enumerate(load_documents(corpus_config(4))):
        (tmp_path / f"{i}.txt").write_text(d.text)
    base = ["prepare", "--config", "configs/experiments/tiny.py", "--config.data.source=files",
            "--config.data.tokenizer.vocab_size=300", "--config.model.vocab_size=300",
            "--config.data.val_fraction=0.5"]
    assert main(base + [f"--config.data.files.paths={tmp_path}/nothing*.txt", "--out", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tieflax prepare: data.files.paths entry '{tmp_path}/nothing*.txt' matches no file: check "
                   "the path (relative paths start from the current directory)."], err
    assert main(base + [f"--config.data.files.paths={tmp_path}/*.txt", "--out", str(tmp_path / "s")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"token store {tmp_path / 's'}: ") and "committed" in err
    assert st.open_store(str(tmp_path / "s")).manifest["vocab_size"] == 300


def test_an_hf_dataset_streams_into_a_store(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets", reason="the optional `datasets` extra is not installed")
    docs = load_documents(corpus_config(12))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d.text}) for d in docs))
    c = default_data_config()
    c.source, c.hf.path, c.hf.data_files, c.hf.max_documents = "hf", "json", str(tmp_path / "d.jsonl"), 0
    c.val_fraction = 0.3
    c.tokenizer.path = str(tmp_path / "tok.json")
    other_tokenizer(c.tokenizer.path)
    m = build_store(c, str(tmp_path / "s"))  # max_documents = 0: every row, streamed
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == len(docs)


# ------------------------------------------------------------------------------------- damaged bytes

def damaged_copy(out: str, tmp_path, array: str = "train/tokens", how: str = "flip") -> tuple[str, str]:
    """A copy of the store ``out`` whose array object ``<array>/c/0`` is deleted, truncated, or has one
    bit flipped in each of its inner chunks; returns ``(copy, the object's path)``."""
    import shutil
    copy = str(tmp_path / "damaged")
    shutil.copytree(out, copy)
    obj = os.path.join(copy, *array.split("/"), "c", "0")
    damage(obj, how)
    return copy, obj


def damage(obj: str, how: str) -> None:
    if how == "delete":
        os.remove(obj)
    elif how == "truncate":
        os.truncate(obj, os.path.getsize(obj) - 100)
    else:  # a bit in the middle of every inner chunk, found through the shard's start index
        data = bytearray(open(obj, "rb").read())
        meta = json.load(open(os.path.join(os.path.dirname(os.path.dirname(obj)), "zarr.json")))
        sharding = meta["codecs"][0]["configuration"]
        n = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // sharding["chunk_shape"][0]
        index = np.frombuffer(bytes(data[:16 * n]), "<u8").reshape(n, 2)
        for offset, nbytes in index:
            if offset != 2**64 - 1:
                data[int(offset + nbytes // 2)] ^= 0x10
        open(obj, "wb").write(bytes(data))


REASONS = {"delete": "object c/0 is missing", "truncate": "object c/0 is truncated",
           "flip": "object c/0 fails its crc32c checksum"}


@pytest.mark.parametrize("array, how", [("train/tokens", "delete"), ("train/tokens", "truncate"),
                                        ("train/tokens", "flip"), ("val/doc_offsets", "delete"),
                                        ("train/token_counts", "flip")])
def test_a_damaged_chunk_is_one_line_naming_the_store_the_array_and_the_fix(local_store, tmp_path, array, how):
    """Before checksums a deleted chunk read as zeros, altered bytes trained silently (or failed far off
    as "labels >= vocab_size") and a truncated one was a grain traceback."""
    out, manifest = local_store
    assert manifest["checksums"] == "crc32c" and set(manifest["arrays"]) == set(st.ARRAYS)
    copy, _ = damaged_copy(out, tmp_path, array, how)
    with pytest.raises(DataError) as e:  # missing or short: at open (sizes); altered: at the read
        store = st.open_store(copy)
        prepare_dataset(store_config(copy), tmp_path / "w", vocab_size=V)
        store.read(array)
    assert one_line(e) == (
        f"token store {copy}: array {array}: {REASONS[how]}"
        + (f" (shorter than the {manifest['arrays'][array]['objects'][0]} bytes manifest.json records)"
           if how == "truncate" else " (its bytes changed after they were written)" if how == "flip" else "")
        + f": rebuild its arrays from the parts it kept: delete {copy}/manifest.json and rerun tieflax prepare "
          f"with the same config and --out {copy}; or delete the store and prepare it again")
    # the fix works: the prepare resumes, every part is done, finalize rewrites the arrays
    os.remove(st.manifest_path(copy))
    again = build_store(corpus_config(), copy, workers=1, shard_bytes=64 << 10)
    assert again["digest"] == manifest["digest"] and again["arrays"] == manifest["arrays"]
    st.open_store(copy).verify()


@pytest.mark.parametrize("length", [410_236, 1_000_003])  # 4 x a prime; a prime
def test_an_array_of_any_length_keeps_its_chunk_size_and_is_rewritten_over_damage(tmp_path, length):
    """An array's inner chunk is CHUNK_TOKENS ids whatever its length, its last shard and chunk padded past
    the end: shrunk to a divisor of the length, a 410,236-id array (4 x a prime) had 4-id chunks, each with
    its own crc32c and index entry (3x the bytes). A finalize writing the array again over a damaged object
    (the padded last chunk's write reads what is stored) writes it whole."""
    path = str(tmp_path / "tokens")
    ids = (np.arange(length) % 5000).astype(np.uint16)
    arr = st.create_array(path, length, "uint16")
    arr[:].write(ids).result()
    assert arr.chunk_layout.read_chunk.shape[0] == st.CHUNK_TOKENS
    sizes = st.object_bytes(arr)
    assert [os.path.getsize(os.path.join(path, "c", str(i))) for i in range(len(sizes))] == sizes
    assert sum(sizes) < 2 * (length + st.CHUNK_TOKENS) + 1024   # the ids, the padded last chunk, an index
    damage(os.path.join(path, "c", "0"), "truncate")
    st.create_array(path, length, "uint16")[:].write(ids).result()
    np.testing.assert_array_equal(st.open_array(path, checksums=True)[:].read().result(), ids)


@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_damage_met_while_grain_reads_is_the_same_one_line(local_store, tmp_path, how):
    """The object goes bad after the store was opened (mid-training): grain's reader threads meet it
    and re-raise the DataError as it is, never zeros or a traceback of grain's."""
    out, _ = local_store
    copy, obj = damaged_copy(out, tmp_path, "val/doc_offsets", "delete")  # a copy; val/tokens still sound
    p = prepare_dataset(store_config(copy), tmp_path / "w", vocab_size=V)
    p = dataclasses.replace(p, read_threads=2)
    damage(os.path.join(copy, "val", "tokens", "c", "0"), how)
    it = make_loader(p, "val", seq_len=32, global_batch_size=8, seed=0)
    with pytest.raises(DataError) as e:
        next(it)
    assert one_line(e).startswith(f"token store {copy}: array val/tokens: {REASONS[how]}")
    assert "delete the store and prepare it again" in str(e.value)


def test_a_store_written_before_checksums_still_reads(local_store, tmp_path, monkeypatch):
    out, manifest = local_store
    old = str(tmp_path / "old")
    with monkeypatch.context() as m:
        m.setattr(st, "CHECKSUMS", None)  # the codec chain and manifest of stores written before checksums
        built = build_store(corpus_config(), old, workers=1, shard_bytes=64 << 10)
    assert "checksums" not in built and "arrays" not in built
    meta = json.load(open(os.path.join(old, "train", "tokens", "zarr.json")))
    assert [c["name"] for c in meta["codecs"][0]["configuration"]["codecs"]] == ["bytes"]
    s = st.open_store(old)
    assert not s.checksums
    s.verify()  # reads every array
    a = make_loader(prepare_dataset(store_config(old), tmp_path / "w", vocab_size=V), "train", seq_len=32,
                    global_batch_size=8, seed=2)
    b = make_loader(prepare_dataset(store_config(out), tmp_path / "w2", vocab_size=V), "train", seq_len=32,
                    global_batch_size=8, seed=2)
    for _ in range(3):
        np.testing.assert_array_equal(next(a)["inputs"], next(b)["inputs"])
    # a deleted token shard of an old store is refused at open too, rather than read as zeros
    os.remove(os.path.join(old, "train", "tokens", "c", "0"))
    with pytest.raises(DataError) as e:
        prepare_dataset(store_config(old), tmp_path / "w3", vocab_size=V)
    assert one_line(e) == (f"token store {old}: array train/tokens: object c/0 is missing: delete the store "
                           "and prepare it again")
    # a finalize of today's tieflax over arrays of the old layout (an old prepare killed before its
    # manifest) names the folder to delete; without them it writes the store anew, with checksums
    os.remove(st.manifest_path(old))
    with pytest.raises(DataError) as e:
        build_store(corpus_config(), old, workers=1, shard_bytes=64 << 10)
    assert one_line(e).startswith(f"{old}/train/tokens holds an array with another layout than tieflax prepare "
                                  "writes now (an older tieflax's, or other settings): delete that folder")
    for split in st.SPLITS:
        storage.rmtree(os.path.join(old, split))
    assert build_store(corpus_config(), old, workers=1, shard_bytes=64 << 10)["arrays"] == manifest["arrays"]


def test_tieflax_train_on_a_damaged_store_stops_in_one_line(local_store, tmp_path, capsys):
    from tieflax.cli import main
    out, _ = local_store
    copy, _ = damaged_copy(out, tmp_path, "train/tokens", "flip")  # passes the open's size check
    argv = ["train", "--config", "configs/experiments/tiny.py", "--workdir", str(tmp_path / "w"),
            "--config.data.source=tokens", f"--config.data.tokens.path={copy}", "--config.model.vocab_size=512",
            "--config.model.d_model=32", "--config.model.n_layers=1", "--config.model.n_heads=2",
            "--config.model.d_ff=64", "--config.model.max_seq_len=32", "--config.train.seq_len=32",
            "--config.train.global_batch_size=8", "--config.train.num_steps=2"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert not [line for line in err if "Traceback" in line or "grain" in line], err
    assert err[-1] == (f"tieflax train: token store {copy}: array train/tokens: object c/0 fails its crc32c "
                       "checksum (its bytes changed after they were written): rebuild its arrays from the parts it "
                       f"kept: delete {copy}/manifest.json and rerun tieflax prepare with the same config and --out "
                       f"{copy}; or delete the store and prepare it again"), err  # after the progress bar's lines


# ------------------------------------------------------------------- prepare: flags, --out, full disks
def _prepare_argv(tmp_path, out, *extra) -> list[str]:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i, d in enumerate(load_documents(corpus_config(4))):
            (corpus / f"{i}.txt").write_text(d.text)
    return ["prepare", "--config", "configs/experiments/tiny.py", "--config.data.source=files",
            f"--config.data.files.paths={corpus}/*.txt", "--config.data.tokenizer.vocab_size=300",
            "--config.model.vocab_size=300", "--config.data.val_fraction=0.5", "--out", str(out), *extra]


def _one_line_failure(capsys, argv, code: int = 1) -> str:
    from tieflax.cli import main

    capsys.readouterr()
    assert main(argv) == code
    lines = capsys.readouterr().err.strip().splitlines()   # progress lines, then the failure
    assert lines and all(line.startswith("tieflax prepare: ") for line in lines), lines
    return lines[-1]


def test_prepare_checks_every_flag_and_refuses_a_run_or_a_foreign_folder_before_work(tmp_path, capsys):
    """`prepare --out RUN` wrote a whole store into a run folder; bad numbers failed late or not at all.
    Each is one line before anything is read or written."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "a_file").write_text("x")
    cases = [(["--workers", "0"], tmp_path / "s", "--workers 0: use at least 1"),
             (["--shard-mb", "0"], tmp_path / "s", "--shard-mb 0: give the MiB of text per input shard"),
             (["--shard-mb", "nan"], tmp_path / "s", "--shard-mb nan"),
             (["--shard", "3/2"], tmp_path / "s", "--shard '3/2': need 0 <= i < N"),
             ([], run, f"--out {run} is a tieflax run folder"),
             ([], run / "store", f"--out {run / 'store'} lies inside the run {run}"),
             ([], hf, f"--out {hf} holds config.json, as a run or a checkpoint does"),
             ([], mine, f"--out {mine} holds 'notes.txt', which a token store does not"),
             ([], tmp_path / "a_file", "is a file, not a folder")]
    argv = _prepare_argv(tmp_path, tmp_path / "s")   # writes the corpus once
    before = sorted(os.listdir(tmp_path))
    for extra, out, message in cases:
        err = _one_line_failure(capsys, _prepare_argv(tmp_path, out, *extra))
        assert message in err, err
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(run) == ["checkpoints", "config.json"]
    assert os.listdir(mine) == ["notes.txt"] and os.listdir(hf) == ["config.json"] and argv


def test_a_rerun_with_other_tokenizer_settings_is_refused_naming_them(tmp_path, capsys):
    """build.json records how the store's tokenizer was made; an unfinished store's rerun with another
    data.tokenizer.vocab_size / min_frequency was accepted (the store kept its BPE) and is refused now."""
    from tieflax.cli import main

    out = tmp_path / "s"
    assert main(_prepare_argv(tmp_path, out)) == 0
    made = json.loads((out / "build.json").read_text())["tokenizer"]
    assert {k: made[k] for k in ("trained", "vocab_size", "min_frequency", "eos_token")} == {
        "trained": "byte-level BPE", "vocab_size": 300, "min_frequency": 2, "eos_token": "<|endoftext|>"}
    (out / "manifest.json").unlink()   # as if the first prepare had been stopped before it finished
    err = _one_line_failure(capsys, _prepare_argv(tmp_path, out, "--config.data.tokenizer.vocab_size=320",
                                                  "--config.data.tokenizer.min_frequency=3"))
    assert "was started with other settings (tokenizer.min_frequency: 2 -> 3; tokenizer.vocab_size: 300 -> 320)" in err
    assert not (out / "manifest.json").exists()
    assert main(_prepare_argv(tmp_path, out)) == 0   # the same settings finish it


def test_a_full_disk_in_each_phase_of_prepare_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """A full disk while tokenising said "point --workdir at another one" (prepare has none) and named no
    file; at finalize it was a 22-line traceback. Each phase now fails in one line naming the file and the
    fix, leaves no truncated file behind, and the rerun on a disk with room finishes the store."""
    import pickle

    from train_support import full_disk_at
    from tieflax.cli import main, one_line
    from tieflax.commands.prepare import FULL_DISK_FIX
    from tieflax.data import store_build

    out = tmp_path / "s"
    for name in ("tokenizer.json", "build.json"):   # before any worker starts
        with monkeypatch.context() as m:
            full_disk_at(m, str(out / name))
            err = _one_line_failure(capsys, _prepare_argv(tmp_path, out))
        assert err == f"tieflax prepare: No space left on device ({out / name}): {FULL_DISK_FIX}", err
        assert not (out / name).exists()   # no truncated file that a rerun would take for the real one
    # A worker's part: tokenise_part in this process (workers are spawned, out of a monkeypatch's reach);
    # its error crosses back to the main process pickled.
    tok = store_build.tokenizer_lib.train_bpe(["some text and more text"], vocab_size=260,
                                              eos_token="<|endoftext|>")
    store_build._init_worker(tok.to_str(), str(out), 0.5, 0, "uint16")
    with monkeypatch.context() as m:
        full_disk_at(m, str(out / "parts" / "*"))
        with pytest.raises(OSError) as e:
            store_build.tokenise_part(0, 0, ["a document", "another one"])
    part = str(out / "parts" / "0000000.npy")
    assert one_line(pickle.loads(pickle.dumps(e.value)), full_disk=FULL_DISK_FIX) == (
        f"No space left on device ({part}): {FULL_DISK_FIX}")
    # Finalize: tensorstore's own error, as a full local disk gives it (seen on a 3 MB tmpfs).
    real = store_build.st.create_array

    def full(path, *args, **kwargs):
        if path.endswith("tokens"):
            raise ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{path}/c/0": Failed writing: '
                             f'"{path}/c/0.__lock": Failed to write 2396060 bytes to file 3: No space left on '
                             "device [os_error_code='28']")
        return real(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(store_build.st, "create_array", full)
        err = _one_line_failure(capsys, _prepare_argv(tmp_path, out))
    assert err == f"tieflax prepare: No space left on device ({out / 'train' / 'tokens' / 'c' / '0'}): {FULL_DISK_FIX}"
    with monkeypatch.context() as m:
        full_disk_at(m, str(out / "manifest.json"))
        err = _one_line_failure(capsys, _prepare_argv(tmp_path, out))
    assert err == f"tieflax prepare: No space left on device ({out / 'manifest.json'}): {FULL_DISK_FIX}"
    assert not (out / "manifest.json").exists()
    assert main(_prepare_argv(tmp_path, out)) == 0 and st.open_store(str(out)).manifest["vocab_size"] == 300
