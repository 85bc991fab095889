"""``prepare_dataset``: corpus -> tokenizer -> cached, content-hashed token files -> a PreparedDataset.

Runs once per workdir and is cheap afterwards: the default corpus (the King James Bible) is read,
split, tokenised and counted in a few seconds on a laptop CPU, with no network.

The cache (under ``data.cache_dir``, else ``$TIEFLAX_DATA_CACHE_DIR``, else ``<workdir>/data_cache``) is
``<source>-<key16>/``, in the format that ``tieflax.data.cache`` owns and checks (content digests
included). ``key`` is a SHA-256 over the documents' text, the tokenizer's JSON, the split settings and
the file format version, so a changed corpus or tokenizer gets a new folder and never reads stale ids.
A folder whose files do not match its ``meta.json`` is reported as corrupt with the fix (delete it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import ml_collections
import numpy as np
from tokenizers import Tokenizer

from tieflax.data import tokenizer as tokenizer_lib
from tieflax.data.cache import (FORMAT_VERSION, SPLITS, PreparedDataset, count_tokens,  # noqa: F401
                                cache_path, is_committed, join_documents, loader_settings, open_cache,
                                split_indices, token_dtype, write_cache)
from tieflax.data.config import DataError, data_location, shared_cache_dir, validate_data_config  # noqa: F401
from tieflax.data.sources import Document, load_documents
from tieflax.data.token_files import prepare_token_files
from tieflax.data.tokenizer import resolve_tokenizer  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)



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
    if c.source == "tokens" and c.tokens.path:  # a token store (tieflax prepare): read in place
        from tieflax.data.store import open_store_dataset  # noqa: PLC0415

        return open_store_dataset(c, str(workdir), vocab_size=vocab_size)
    # a local workdir/cache stays a Path (memmapped files); a bucket one is a URL (see cache.cache_path)
    workdir = cache_path(data_location(str(workdir)))
    shared = shared_cache_dir(c)
    cache_root = cache_path(data_location(shared) if shared else cache_path(workdir, "data_cache"))
    if c.source == "tokens":
        return prepare_token_files(c, workdir, cache_root, vocab_size=vocab_size)

    docs = load_documents(c)
    train_docs, val_docs = split_documents(docs, c.val_fraction, c.split_seed, c.max_val_documents,
                                           where=f"data.source = {c.source!r}")
    tok = tokenizer_lib.resolve_tokenizer(c, workdir, train_docs, shared_cache=cache_root if shared else None)
    tokenizer_lib.check_vocab_size(tokenizer_lib.tokenizer_vocab_size(tok), vocab_size,
                                   where=f"tokenizer {cache_path(workdir, tokenizer_lib.TOKENIZER_FILE)}",
                                   allow_smaller_tokenizer=bool(c.tokenizer.path))
    eos_id = tokenizer_lib.eos_id_of(tok, c.tokenizer.eos_token)
    bos_id = tokenizer_lib.bos_id_of(tok, c.tokenizer.bos_token)
    key = cache_key(docs, tok, c)
    data_dir = cache_path(cache_root, f"{c.source}-{key[:16]}")
    if not is_committed(data_dir):
        build_cache(data_dir, key, tok, eos_id, bos_id, vocab_size, train_docs, val_docs,
                    source=c.source)
    train, val, counts, info = open_cache(data_dir, key=key, vocab_size=vocab_size)
    return PreparedDataset(train, val, counts, vocab_size, eos_id, tok, data_dir, info,
                           bos_id=bos_id, **loader_settings(c))


def split_documents(docs: list[Document], val_fraction: float, seed: int, max_val: int = 0, *,
                    where: str) -> tuple[list[Document], list[Document]]:
    """Train and val documents, each in corpus order (see :func:`split_indices`)."""
    train_idx, val_idx = split_indices(len(docs), val_fraction, seed, max_val, where=where)
    return [docs[i] for i in train_idx], [docs[i] for i in val_idx]


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


def build_cache(data_dir, key: str, tok: Tokenizer, eos_id: int, bos_id: int | None,
                vocab_size: int,
                train_docs: list[Document], val_docs: list[Document], *, source: str) -> None:
    """Tokenises both splits into ``data_dir`` (atomically, with digests: see ``tieflax.data.cache``)."""
    dtype = token_dtype(vocab_size)
    info = {"key": key, "source": source, "vocab_size": vocab_size, "eos_id": eos_id, "bos_id": bos_id,
            "dtype": dtype.name}
    arrays = {}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        arrays[split] = encode_stream(tok, docs, eos_id, dtype, bos_id)
        info[f"{split}_tokens"] = int(len(arrays[split]))
        info[f"{split}_documents"] = len(docs)
    arrays["token_counts"] = count_tokens(arrays["train"], vocab_size, where=str(data_dir))
    info["val_document_names"] = [d.name for d in val_docs]
    write_cache(data_dir, info, arrays)
    log.info("tokenised %s: %d train / %d val tokens -> %s", source, info["train_tokens"],
             info["val_tokens"], data_dir)
