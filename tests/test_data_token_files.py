"""Pre-tokenised sources: .npy and .bin used in place, ArrayRecord converted, documents held out whole."""

import numpy as np
import pytest

from tieflax.data import DataError, default_data_config, make_loader, prepare_dataset
from tieflax.data.token_files import write_sidecar, write_token_file

V, EOS = 100, 1


def docs(n=20, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, V, rng.integers(3, 30)).astype(np.uint16) for _ in range(n)]


def stream_of(documents):
    parts = []
    for d in documents:
        parts += [[EOS], d]
    return np.concatenate(parts + [[EOS]]).astype(np.uint16)


def tokens_config(train, val=""):
    c = default_data_config()
    c.source = "tokens"
    c.tokens.train_path = str(train)
    c.tokens.val_path = str(val)
    c.tokens.vocab_size = V
    c.tokens.eos_id = EOS
    c.val_fraction = 0.2
    return c


def as_doc_set(stream):
    cuts = np.flatnonzero(np.asarray(stream) == EOS)
    return sorted(tuple(stream[a + 1:b]) for a, b in zip(cuts[:-1], cuts[1:]))


def test_npy_with_val_file_is_used_in_place(tmp_path):
    train, val = stream_of(docs()), stream_of(docs(4, seed=1))
    np.save(tmp_path / "train.npy", train)
    np.save(tmp_path / "val.npy", val)
    p = prepare_dataset(tokens_config(tmp_path / "train.npy", tmp_path / "val.npy"), tmp_path / "w",
                        vocab_size=V)
    assert isinstance(p.train_tokens, np.memmap) and str(p.train_tokens.filename) == str(tmp_path / "train.npy")
    np.testing.assert_array_equal(p.val_tokens, val)
    np.testing.assert_array_equal(p.token_counts, np.bincount(train, minlength=V))
    assert p.tokenizer is None and p.eos_id == EOS
    assert next(make_loader(p, "train", seq_len=16, global_batch_size=2, seed=0))["inputs"].shape == (2, 16)


@pytest.mark.parametrize("fmt", ["bin", "array_record"])
def test_without_val_file_whole_documents_are_held_out(tmp_path, fmt):
    documents = docs()
    if fmt == "bin":
        write_token_file(tmp_path / "all.bin", stream_of(documents), vocab_size=V)
    else:
        from array_record.python.array_record_module import ArrayRecordWriter
        writer = ArrayRecordWriter(str(tmp_path / "all.array_record"), "group_size:1")
        for d in documents:
            writer.write(d.tobytes())
        writer.close()
        write_sidecar(tmp_path / "all.array_record", np.uint16, V)
    p = prepare_dataset(tokens_config(tmp_path / f"all.{fmt}"), tmp_path / "w", vocab_size=V)
    train, val = as_doc_set(p.train_tokens), as_doc_set(p.val_tokens)
    assert len(val) == 4 and len(train) == 16  # ceil(0.2 * 20) documents held out
    assert sorted(train + val) == sorted(tuple(d) for d in documents)  # each document exactly once


def test_array_record_with_bos_holds_out_whole_bos_documents(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter
    documents, bos = docs(10), 0
    writer = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
    for d in documents:
        writer.write(d.tobytes())
    writer.close()
    write_sidecar(tmp_path / "d.array_record", np.uint16, V)
    c = tokens_config(tmp_path / "d.array_record")
    c.tokens.bos_id = bos
    p = prepare_dataset(c, tmp_path / "w", vocab_size=V)
    assert p.bos_id == bos
    got = []
    for stream in (np.asarray(p.train_tokens), np.asarray(p.val_tokens)):
        opens, ends = np.flatnonzero(stream == bos), np.flatnonzero(stream == EOS)
        assert len(opens) == len(ends) and (opens < ends).all() and stream[-1] == EOS
        got += [tuple(stream[a + 1:b]) for a, b in zip(opens, ends)]
    assert sorted(got) == sorted(tuple(d) for d in documents)
    assert len(np.flatnonzero(np.asarray(p.val_tokens) == bos)) == 2  # ceil(0.2 * 10) held out


def test_bad_token_files_name_the_fix(tmp_path):
    np.save(tmp_path / "t.npy", stream_of(docs()))
    with pytest.raises(DataError, match="vocab_size = 64 does not match the tokenizer's 100"):
        prepare_dataset(tokens_config(tmp_path / "t.npy"), tmp_path / "w", vocab_size=64)
    with pytest.raises(DataError, match="train_path = '.*missing.npy' does not exist"):
        prepare_dataset(tokens_config(tmp_path / "missing.npy"), tmp_path / "w", vocab_size=V)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty.bin' is empty"):
        prepare_dataset(tokens_config(tmp_path / "empty.bin"), tmp_path / "w", vocab_size=V)
    big = stream_of(docs())
    big[5] = 250
    np.save(tmp_path / "big.npy", big)
    with pytest.raises(DataError, match="token id 250 >= vocab_size 100"):
        prepare_dataset(tokens_config(tmp_path / "big.npy"), tmp_path / "w", vocab_size=V)
    c = tokens_config(tmp_path / "t.npy")
    c.tokens.eos_id = -1
    with pytest.raises(DataError, match="data.tokens.eos_id"):
        prepare_dataset(c, tmp_path / "w", vocab_size=V)


def test_a_bin_file_without_its_dtype_and_vocabulary_is_refused(tmp_path):
    """uint32 ids read with a guessed uint16 dtype trained on garbage; the sidecar now says how to read."""
    ids = stream_of(docs()).astype(np.uint32)
    ids.tofile(tmp_path / "t.bin")  # raw bytes, no sidecar
    with pytest.raises(DataError, match="has no sidecar t.bin.json"):
        prepare_dataset(tokens_config(tmp_path / "t.bin"), tmp_path / "w", vocab_size=V)
    write_token_file(tmp_path / "t.bin", ids, vocab_size=V)
    p = prepare_dataset(tokens_config(tmp_path / "t.bin"), tmp_path / "w", vocab_size=V)
    assert p.train_tokens.dtype == np.uint32 and as_doc_set(np.concatenate([p.train_tokens, p.val_tokens]))
    c = tokens_config(tmp_path / "t.bin")
    c.tokens.dtype = "uint16"
    with pytest.raises(DataError, match="says the ids are uint32"):
        prepare_dataset(c, tmp_path / "w", vocab_size=V)
    write_sidecar(tmp_path / "t.bin", np.uint32, 2 * V)
    with pytest.raises(DataError, match="vocabulary of 200"):
        prepare_dataset(tokens_config(tmp_path / "t.bin"), tmp_path / "w", vocab_size=V)


def test_a_cache_rewritten_in_place_with_valid_ids_is_detected(tmp_path):
    """Same length, same sum, every id valid: only the content digest can tell."""
    documents = docs()
    np.save(tmp_path / "t.npy", stream_of(documents))
    c = tokens_config(tmp_path / "t.npy")
    p = prepare_dataset(c, tmp_path / "w", vocab_size=V)
    train = np.load(p.data_dir / "train.npy")
    i = int(np.flatnonzero((train[:-1] > 2) & (train[1:] > 2) & (train[:-1] != train[1:]))[0])
    train[i], train[i + 1] = train[i + 1], train[i]  # a swap keeps length, sum and counts
    np.save(p.data_dir / "train.npy", train)
    with pytest.raises(DataError, match="train.npy does not match the digest"):
        prepare_dataset(c, tmp_path / "w", vocab_size=V)
