"""``prepare_dataset``: corpus -> tokenizer -> cached, content-hashed token files -> a PreparedDataset.

Runs once per workdir and is cheap afterwards: the default corpus (the King James Bible) is read,
split, tokenised and counted in a few seconds on a laptop CPU, with no network.

Cache layout, under ``data.cache_dir`` (default ``<workdir>/data_cache``)::

    <source>-<key16>/
        train.npy          [N_train] uint16 (uint32 when V > 65536): the train stream [EOS d EOS ... EOS]
        val.npy            [N_val]   same, held-out documents
        token_counts.npy   [V] int64: unigram counts of train.npy (EOS included)
        meta.json          the full key, sizes, document counts and names of the held-out documents

``key`` is a SHA-256 over the documents' text, the tokenizer's JSON, the split settings and the file
format version, so a changed corpus or tokenizer gets a new folder and never reads stale ids. A folder
whose files do not match its ``meta.json`` is reported as corrupt with the fix (delete it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import ml_collections
import numpy as np
from tokenizers import Tokenizer

from tieflax.data import tokenizer as tokenizer_lib
from tieflax.data.config import DataError, validate_data_config
from tieflax.data.sources import Document, load_documents

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the stream layout changes: old caches then get new keys
SPLITS = ("train", "val")


@dataclasses.dataclass(frozen=True)
class PreparedDataset:
    """A tokenised corpus ready for :func:`tieflax.data.make_loader`.

    Attributes:
      train_tokens, val_tokens: ``[N] uint16|uint32`` read-only memmaps of the split streams, documents
        joined as ``[EOS d0 EOS d1 ... EOS]`` (with a BOS: ``[BOS d0 EOS BOS d1 EOS ...]``).
      token_counts: ``[vocab_size] int64`` unigram counts of the train stream, markers included (for
        frequency analyses; ids the train split never uses count 0).
      vocab_size: ids the tokenizer emits; equals the model's vocab size (checked).
      eos_id: the id that ends documents (and opens them when there is no BOS).
      bos_id: the id that opens documents, or None (then EOS does).
      tokenizer: the ``tokenizers.Tokenizer`` (None for pre-tokenised data given without one).
      data_dir: the folder holding the token files, ``token_counts.npy`` and ``meta.json``.
      info: the metadata (source, key, token and document counts per split).
      document_masking, predict_first_token, read_threads, prefetch_buffer_size: loader settings
        from the data config, applied by ``make_loader``.
    """
    train_tokens: np.ndarray = dataclasses.field(repr=False)
    val_tokens: np.ndarray = dataclasses.field(repr=False)
    token_counts: np.ndarray = dataclasses.field(repr=False)
    vocab_size: int
    eos_id: int
    tokenizer: Tokenizer | None = dataclasses.field(repr=False)
    data_dir: Path
    info: dict = dataclasses.field(repr=False)
    document_masking: bool = True
    predict_first_token: bool = True
    read_threads: int = 2
    prefetch_buffer_size: int = 256
    bos_id: int | None = None

    def tokens(self, split: str) -> np.ndarray:
        """The ``[N]`` stream of ``split`` ('train' or 'val')."""
        if split not in SPLITS:
            raise DataError(f"split {split!r} is not one of {SPLITS}.")
        return self.train_tokens if split == "train" else self.val_tokens


def prepare_dataset(data_config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                    vocab_size: int) -> PreparedDataset:
    """Builds (first run) or opens (later runs) the dataset ``data_config`` describes.

    Args:
      data_config: ``config.data`` (see :func:`tieflax.data.default_data_config`).
      workdir: the run's folder; the tokenizer is saved there as ``tokenizer.json``.
      vocab_size: the model's vocabulary size; must equal the tokenizer's.

    Raises:
      DataError: for any bad input, naming it and the fix.
    """
    c = data_config
    validate_data_config(c)
    workdir = Path(workdir).expanduser()
    cache_root = Path(c.cache_dir).expanduser() if c.cache_dir else workdir / "data_cache"
    if c.source == "tokens":
        from tieflax.data.token_files import prepare_token_files  # pylint: disable=import-outside-toplevel
        return prepare_token_files(c, workdir, cache_root, vocab_size=vocab_size)

    docs = load_documents(c)
    train_docs, val_docs = split_documents(docs, c.val_fraction, c.split_seed, c.max_val_documents,
                                           where=f"data.source = {c.source!r}")
    tok = resolve_tokenizer(c, workdir, train_docs)
    tokenizer_lib.check_vocab_size(tokenizer_lib.tokenizer_vocab_size(tok), vocab_size,
                                   where=f"tokenizer {workdir / tokenizer_lib.TOKENIZER_FILE}",
                                   allow_smaller_tokenizer=bool(c.tokenizer.path))
    eos_id = tokenizer_lib.eos_id_of(tok, c.tokenizer.eos_token)
    bos_id = tokenizer_lib.bos_id_of(tok, c.tokenizer.bos_token)
    key = cache_key(docs, tok, c)
    data_dir = cache_root / f"{c.source}-{key[:16]}"
    if not (data_dir / "meta.json").exists():
        build_cache(data_dir, key, tok, eos_id, bos_id, vocab_size, train_docs, val_docs,
                    source=c.source)
    train, val, counts, info = open_cache(data_dir, key=key, vocab_size=vocab_size)
    return PreparedDataset(train, val, counts, vocab_size, eos_id, tok, data_dir, info,
                           bos_id=bos_id, **loader_settings(c))


def loader_settings(c: ml_collections.ConfigDict) -> dict:
    return dict(document_masking=c.document_masking, predict_first_token=c.predict_first_token,
                read_threads=c.read_threads, prefetch_buffer_size=c.prefetch_buffer_size)


def split_indices(num_docs: int, val_fraction: float, seed: int, max_val: int = 0, *,
                  where: str) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and val document indices: ``ceil(val_fraction * n)`` documents held out whole.

    Which ones depends only on ``num_docs`` and ``seed``. Needs at least one document on each side.
    """
    n_val = int(np.ceil(val_fraction * num_docs))
    if max_val:
        n_val = min(n_val, max_val)
    if num_docs < 2 or n_val >= num_docs:
        raise DataError(
            f"{where} has {num_docs} document(s); the validation split holds out whole documents, so "
            "it needs at least one for each split. Add documents, lower data.val_fraction, or for "
            "one long file set data.files.split_on (e.g. '\\n\\n').")
    perm = np.random.default_rng(seed).permutation(num_docs)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def split_documents(docs: list[Document], val_fraction: float, seed: int, max_val: int = 0, *,
                    where: str) -> tuple[list[Document], list[Document]]:
    """Train and val documents, each in corpus order (see :func:`split_indices`)."""
    train_idx, val_idx = split_indices(len(docs), val_fraction, seed, max_val, where=where)
    return [docs[i] for i in train_idx], [docs[i] for i in val_idx]


def resolve_tokenizer(c: ml_collections.ConfigDict, workdir: Path,
                      train_docs: list[Document]) -> Tokenizer:
    """The run's tokenizer: ``<workdir>/tokenizer.json`` if present, else the given or a trained one.

    A given tokenizer (``data.tokenizer.path``) is copied into the workdir; a workdir copy that differs
    from it is an error, since the workdir's checkpoints were trained on the copy's ids.
    """
    saved = workdir / tokenizer_lib.TOKENIZER_FILE
    if c.tokenizer.path:
        given = tokenizer_lib.load_tokenizer(c.tokenizer.path)
        if saved.exists():
            if tokenizer_lib.tokenizer_digest(tokenizer_lib.load_tokenizer(saved)) != \
                    tokenizer_lib.tokenizer_digest(given):
                raise DataError(
                    f"{saved} differs from data.tokenizer.path = {c.tokenizer.path!r}: this workdir "
                    "was trained with the former. Use a new workdir, or delete the workdir copy if "
                    "no checkpoint depends on it.")
        else:
            tokenizer_lib.save_tokenizer(given, saved)
        return given
    if saved.exists():
        tok = tokenizer_lib.load_tokenizer(saved)
        got = tokenizer_lib.tokenizer_vocab_size(tok)
        if got != c.tokenizer.vocab_size:
            raise DataError(
                f"{saved} has {got} tokens but data.tokenizer.vocab_size = {c.tokenizer.vocab_size}. "
                f"Set data.tokenizer.vocab_size = {got} to keep it, or delete it (and the run's "
                "checkpoints) to train a new one.")
        return tok
    log.info("training a %d-token byte-level BPE on %d documents", c.tokenizer.vocab_size,
             len(train_docs))
    tok = tokenizer_lib.train_bpe((d.text for d in train_docs), vocab_size=c.tokenizer.vocab_size,
                                  eos_token=c.tokenizer.eos_token,
                                  min_frequency=c.tokenizer.min_frequency, length=len(train_docs))
    tokenizer_lib.save_tokenizer(tok, saved)
    return tok


def cache_key(docs: list[Document], tok: Tokenizer, c: ml_collections.ConfigDict) -> str:
    """SHA-256 of everything the token files depend on (text, tokenizer, split, format)."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, "val_fraction": c.val_fraction,
                         "split_seed": c.split_seed, "max_val": c.max_val_documents,
                         "eos": c.tokenizer.eos_token, "bos": c.tokenizer.bos_token},
                        sort_keys=True).encode())
    h.update(tokenizer_lib.tokenizer_digest(tok).encode())
    for d in docs:
        h.update(d.name.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
        h.update(d.text.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def encode_stream(tok: Tokenizer, docs: list[Document], eos_id: int, dtype: np.dtype,
                  bos_id: int | None = None, chunk: int = 512) -> np.ndarray:
    """``[EOS d0 EOS d1 ... EOS]``, or ``[BOS d0 EOS BOS d1 EOS ...]`` with a BOS, as one ``[N] dtype``.

    The tokenizer's own post-processor (which may add BOS) is not applied: packing owns the markers.
    """
    return join_documents((np.asarray(enc.ids, dtype)
                           for i in range(0, len(docs), chunk)
                           for enc in tok.encode_batch_fast([d.text for d in docs[i:i + chunk]],
                                                            add_special_tokens=False)),
                          eos_id, bos_id, dtype)


def join_documents(docs, eos_id: int, bos_id: int | None, dtype: np.dtype) -> np.ndarray:
    """Token arrays -> ``[EOS d0 EOS ... EOS]`` (no BOS) or ``[BOS d0 EOS BOS d1 EOS ...]``."""
    eos = np.array([eos_id], dtype)
    if bos_id is None:
        parts = [p for d in docs for p in (eos, d)] + [eos]
    else:
        bos = np.array([bos_id], dtype)
        parts = [p for d in docs for p in (bos, d, eos)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def build_cache(data_dir: Path, key: str, tok: Tokenizer, eos_id: int, bos_id: int | None,
                vocab_size: int,
                train_docs: list[Document], val_docs: list[Document], *, source: str) -> None:
    """Tokenises both splits into ``data_dir``, atomically: a crash never leaves a half-built folder."""
    dtype = token_dtype(vocab_size)
    tmp = data_dir.with_name(f".{data_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    info = {"format": FORMAT_VERSION, "key": key, "source": source, "vocab_size": vocab_size,
            "eos_id": eos_id, "bos_id": bos_id, "dtype": dtype.name}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        stream = encode_stream(tok, docs, eos_id, dtype, bos_id)
        np.save(tmp / f"{split}.npy", stream)
        info[f"{split}_tokens"] = int(len(stream))
        info[f"{split}_documents"] = len(docs)
        if split == "train":
            np.save(tmp / "token_counts.npy", count_tokens(stream, vocab_size, where=str(data_dir)))
    info["val_document_names"] = [d.name for d in val_docs]
    (tmp / "meta.json").write_text(json.dumps(info, indent=1))
    try:
        os.replace(tmp, data_dir)
    except OSError:  # another process finished first; its folder has the same content
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tokenised %s: %d train / %d val tokens -> %s", source, info["train_tokens"],
             info["val_tokens"], data_dir)


def count_tokens(stream: np.ndarray, vocab_size: int, *, where: str,
                 chunk: int = 1 << 24) -> np.ndarray:
    """``[vocab_size] int64`` counts of each id in ``stream``, read in chunks (memmaps stay lazy)."""
    counts = np.zeros(vocab_size, np.int64)
    for i in range(0, len(stream), chunk):
        part = np.asarray(stream[i:i + chunk])
        if len(part) and int(part.max()) >= vocab_size:
            raise DataError(f"{where} holds token id {int(part.max())} >= vocab_size {vocab_size}: the "
                            "files were tokenised with a larger vocabulary; fix the vocab size.")
        counts += np.bincount(part, minlength=vocab_size).astype(np.int64)
    return counts


def open_cache(data_dir: Path, *, key: str | None, vocab_size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Memmaps of ``data_dir``'s files after checking them against its ``meta.json``."""
    def corrupt(why: str) -> DataError:
        return DataError(f"data cache {data_dir} is stale or corrupt ({why}): delete that folder and "
                         "it is rebuilt on the next run.")
    try:
        info = json.loads((data_dir / "meta.json").read_text())
        train = np.load(data_dir / "train.npy", mmap_mode="r")
        val = np.load(data_dir / "val.npy", mmap_mode="r")
        counts = np.load(data_dir / "token_counts.npy")
    except (OSError, ValueError) as e:
        raise corrupt(f"cannot read it: {e}") from e
    if info.get("format") != FORMAT_VERSION:
        raise corrupt(f"format {info.get('format')}, expected {FORMAT_VERSION}")
    if key is not None and info.get("key") != key:
        raise corrupt("its key does not match the corpus and tokenizer")
    if (len(train), len(val)) != (info["train_tokens"], info["val_tokens"]):
        raise corrupt(f"token files hold {len(train)}/{len(val)} tokens, meta.json says "
                      f"{info['train_tokens']}/{info['val_tokens']}")
    if counts.shape != (vocab_size,) or int(counts.sum()) != len(train):
        raise corrupt("token_counts.npy does not match train.npy")
    return train, val, counts, info
