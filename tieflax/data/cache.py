"""The token cache's format, owned here: file layout, ``meta.json``, content digests, and reading it back.

A cache folder (``<cache_dir>/<source>-<key16>``)::

    train.npy          [N_train] uint16 (uint32 when V > 65536): the train stream [EOS d EOS ... EOS]
    val.npy            [N_val]   same, held-out documents
    token_counts.npy   [V] int64: unigram counts of train.npy (EOS included)
    meta.json          format, key, sizes, document counts, and a content digest of each file

Folders are written under a temporary name and renamed when complete (``write_cache``), so a crash never
leaves half a cache. ``open_cache`` checks every file against ``meta.json`` at each start: lengths, the
counts' sum, and a content digest (BLAKE2b of the whole file up to 64 MiB; above that, of 256 blocks of
256 KiB spread over it, plus its size), so ids rewritten in place are caught at a cost of milliseconds
for the default corpus. ``tieflax.data.prepare`` (text corpora) and ``tieflax.data.token_files``
(pre-tokenised files) both write and read caches through this module only.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import logging
import os
import shutil
from pathlib import Path

import ml_collections
import numpy as np
from tokenizers import Tokenizer

from tieflax import storage
from tieflax.data.config import DataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the stream layout or meta.json changes: old caches then get new keys
SPLITS = ("train", "val")
WHOLE_FILE_DIGEST_BYTES = 64 << 20
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 256, 256 << 10


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


def cache_path(base, *parts):
    """``base/parts``: a ``Path`` for a local cache (as before), a string URL for one on a bucket."""
    if storage.is_remote(str(base)):
        return storage.join(str(base), *parts)
    return Path(base).expanduser().joinpath(*parts)


def is_committed(data_dir) -> bool:
    """A cache folder is complete once its ``meta.json`` exists (written last)."""
    return storage.is_file(str(cache_path(data_dir, "meta.json")))


def load_array(path) -> np.ndarray:
    """A cache array: memory-mapped when local, read whole into memory from a bucket."""
    if storage.is_remote(str(path)):
        return np.load(io.BytesIO(storage.read_bytes(str(path))), allow_pickle=False)
    return np.load(path, mmap_mode="r")


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


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def join_documents(docs, eos_id: int, bos_id: int | None, dtype: np.dtype) -> np.ndarray:
    """Token arrays -> ``[EOS d0 EOS ... EOS]`` (no BOS) or ``[BOS d0 EOS BOS d1 EOS ...]``."""
    eos = np.array([eos_id], dtype)
    if bos_id is None:
        parts = [p for d in docs for p in (eos, d)] + [eos]
    else:
        bos = np.array([bos_id], dtype)
        parts = [p for d in docs for p in (bos, d, eos)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


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


def file_digest(path) -> str:
    """BLAKE2b of the file (whole up to 64 MiB; else of 256 evenly spread 256 KiB blocks and the size)."""
    if storage.is_remote(str(path)):
        return bytes_digest(storage.read_bytes(str(path)))
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_DIGEST_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            for i in range(SAMPLE_BLOCKS):
                f.seek((size - SAMPLE_BLOCK_BYTES) * i // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


def bytes_digest(data: bytes) -> str:
    """:func:`file_digest` of a file holding ``data``."""
    size = len(data)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    if size <= WHOLE_FILE_DIGEST_BYTES:
        h.update(data)
    else:
        for i in range(SAMPLE_BLOCKS):
            at = (size - SAMPLE_BLOCK_BYTES) * i // (SAMPLE_BLOCKS - 1)
            h.update(data[at:at + SAMPLE_BLOCK_BYTES])
    return h.hexdigest()


def write_cache(data_dir, info: dict, arrays: dict[str, np.ndarray]) -> None:
    """Writes ``arrays`` (name -> array, saved as ``<name>.npy``) and ``meta.json`` (``info`` plus their
    digests) into ``data_dir`` atomically: locally a temporary folder renamed when complete; on a bucket
    (no rename) whole objects with ``meta.json`` written last, so an unfinished folder is never read."""
    if storage.is_remote(str(data_dir)):
        digests = {}
        for name, array in arrays.items():
            buf = io.BytesIO()
            np.save(buf, array)
            digests[f"{name}.npy"] = bytes_digest(buf.getvalue())
            storage.write_bytes(storage.join(data_dir, f"{name}.npy"), buf.getvalue())
        storage.write_text(storage.join(data_dir, "meta.json"),
                           json.dumps({**info, "format": FORMAT_VERSION, "digests": digests}, indent=1))
        return
    tmp = data_dir.with_name(f".{data_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    digests = {}
    path = tmp
    try:
        for name, array in arrays.items():
            path = tmp / f"{name}.npy"
            np.save(path, array)
            digests[f"{name}.npy"] = file_digest(path)
        path = tmp / "meta.json"
        path.write_text(json.dumps({**info, "format": FORMAT_VERSION, "digests": digests}, indent=1))
    except OSError as e:  # a full disk: the half-written folder goes (it holds space), the error names the file
        shutil.rmtree(tmp, ignore_errors=True)
        code = e.errno
        if code is None:  # numpy's short write ("N requested and M written"): no room left for the rest
            code = errno.ENOSPC if shutil.disk_usage(tmp.parent).free < (1 << 20) else errno.EIO
        raise OSError(code, os.strerror(code), str(data_dir / path.name)) from None
    try:
        os.replace(tmp, data_dir)
    except OSError:  # another process finished first; its folder has the same content
        shutil.rmtree(tmp, ignore_errors=True)


def check_digests(data_dir, info: dict, names) -> None:
    """Raises DataError when a file's content differs from the digest ``meta.json`` recorded."""
    for name in names:
        want = info.get("digests", {}).get(name)
        if want is None or file_digest(cache_path(data_dir, name)) != want:
            raise DataError(f"data cache {data_dir} is stale or corrupt ({name} does not match the digest in "
                            "meta.json: it was changed after it was written): delete that folder and it is "
                            "rebuilt on the next run.")


def open_cache(data_dir, *, key: str | None, vocab_size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """``data_dir``'s arrays (memmaps locally; in memory from a bucket) after checking them against its
    ``meta.json``."""
    def corrupt(why: str) -> DataError:
        return DataError(f"data cache {data_dir} is stale or corrupt ({why}): delete that folder and "
                         "it is rebuilt on the next run.")
    try:
        info = json.loads(storage.read_text(str(cache_path(data_dir, "meta.json"))))
        train = load_array(cache_path(data_dir, "train.npy"))
        val = load_array(cache_path(data_dir, "val.npy"))
        counts = np.asarray(load_array(cache_path(data_dir, "token_counts.npy")))
    except (OSError, ValueError, storage.StorageError) as e:
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
    check_digests(data_dir, info, ("train.npy", "val.npy", "token_counts.npy"))
    return train, val, counts, info
