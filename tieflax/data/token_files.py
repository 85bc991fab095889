"""Pre-tokenised data (``data.source = 'tokens'``): the pod-scale path, with no text and no tokenising.

A ``.bin`` or ``.array_record`` file must have a sidecar ``<file>.json`` holding its dtype and
vocabulary size (``write_token_file`` / ``write_sidecar`` write it); without one it is refused, since its
bytes do not say how to read them. A ``.npy`` header carries the dtype; its sidecar is optional.

Accepted files, each a flat stream in which ``eos_id`` separates documents (with ``bos_id`` set,
documents are ``[BOS d EOS]`` and BOS opens them):

- ``.npy``: memory-mapped in place (its own dtype);
- ``.bin``: raw little-endian ids, memory-mapped in place;
- ``.array_record``: one document per record, raw ids without markers;
  converted once into the cache as ``[EOS d0 EOS d1 ... EOS]`` (or ``[BOS d0 EOS ...]``).

With ``data.tokens.val_path`` both files are used in place and only ``token_counts.npy`` and
``meta.json`` go to the cache. Without it, whole documents (spans opened by EOS) are held out of the
train file and both splits are written to the cache once: give a val file to avoid that copy on large
data. Files are fingerprinted by path, size and modification time (hashing terabytes is not an
option), so replacing a file gets a new cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import ml_collections
import numpy as np

from tieflax.data import tokenizer as tokenizer_lib
from tieflax import storage
from tieflax.data.cache import (FORMAT_VERSION, PreparedDataset, cache_path, check_digests, count_tokens,
                                is_committed, join_documents, load_array, loader_settings, open_cache,
                                split_indices, write_cache)
from tieflax.data.config import DataError
from tieflax.data.tokenizer import resolve_tokenizer

SIDECAR_SUFFIX = ".json"  # <file>.json beside a token file: {"dtype": "uint16", "vocab_size": 32000}


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def write_token_file(path: str | os.PathLike, ids: np.ndarray, *, vocab_size: int) -> Path:
    """Writes ``ids`` (a flat ``[N]`` integer stream) as ``.npy`` or ``.bin`` (raw little-endian of its
    dtype) with the sidecar ``<file>.json`` that records its dtype and vocabulary size."""
    path, ids = Path(path), np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"token ids must be a flat integer array, got {ids.dtype} {ids.shape}")
    if path.suffix == ".npy":
        np.save(path, ids)
    elif path.suffix == ".bin":
        ids.astype(ids.dtype.newbyteorder("<")).tofile(path)
    else:
        raise DataError(f"{path}: write_token_file writes .npy or .bin files")
    write_sidecar(path, ids.dtype, vocab_size)
    return path


def write_sidecar(path: str | os.PathLike, dtype, vocab_size: int) -> Path:
    """``<file>.json`` recording a token file's dtype and vocabulary size (required for .bin and
    .array_record files, whose bytes do not say)."""
    out = sidecar_path(Path(path))
    out.write_text(json.dumps({"dtype": np.dtype(dtype).name, "vocab_size": int(vocab_size)}))
    return out


def file_dtype(path: Path, c: ml_collections.ConfigDict, vocab: int, field: str) -> str:
    """The ids' dtype of a token file, from its sidecar (required for .bin / .array_record; checked
    against ``data.tokens.dtype`` when that is set, and against the vocabulary)."""
    side = sidecar_path(path)
    if not side.is_file():
        if path.suffix == ".npy":
            return ""  # the .npy header carries the dtype; ids are range-checked against the vocabulary
        raise DataError(
            f"{field} = {str(path)!r} has no sidecar {side.name} saying its dtype and vocabulary, so its "
            "bytes cannot be read safely (uint32 ids read as uint16 are garbage): write it with "
            "tieflax.data.token_files.write_sidecar(path, dtype, vocab_size), e.g. "
            f'{{"dtype": "uint32", "vocab_size": {vocab}}}')
    try:
        meta = json.loads(side.read_text())
        dtype, side_vocab = np.dtype(meta["dtype"]).name, int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{side} is not a valid token-file sidecar ({e}): it must hold "
                        '{"dtype": "uint16", "vocab_size": N}') from None
    if c.tokens.dtype and np.dtype(c.tokens.dtype).name != dtype:
        raise DataError(f"data.tokens.dtype = {c.tokens.dtype!r} but {side.name} says the ids are {dtype}: "
                        "remove the setting (the sidecar is read) or fix the sidecar")
    if side_vocab != vocab:
        raise DataError(f"{side.name} says {path.name} was tokenised with a vocabulary of {side_vocab}, but "
                        f"data.tokens.vocab_size / the tokenizer gives {vocab}: use the matching tokenizer "
                        "or vocab_size")
    return dtype


def _fingerprint(paths: list[Path], c: ml_collections.ConfigDict, vocab: int, eos: int,
                 bos: int | None) -> str:
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps({"format": FORMAT_VERSION, "dtype": c.tokens.dtype or "sidecar", "vocab": vocab,
                         "eos": eos, "bos": bos, "val_fraction": c.val_fraction, "split_seed": c.split_seed,
                         "max_val": c.max_val_documents}, sort_keys=True).encode())
    return h.hexdigest()


def _check_file(path: str, field: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{field} = {path!r} does not exist: fix the path.")
    if p.stat().st_size == 0:
        raise DataError(f"{field} = {path!r} is empty: re-create it, or point {field} elsewhere.")
    return p


def read_array_record(path: Path, dtype: np.dtype | str, eos_id: int, bos_id: int | None) -> np.ndarray:
    """The joined stream (see ``join_documents``) of an ArrayRecord file of one document per record."""
    from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=import-outside-toplevel  # noqa: PLC0415
    reader = ArrayRecordReader(str(path))
    try:
        dtype = np.dtype(dtype)
        return join_documents((np.frombuffer(r, dtype) for r in reader.read_all()), eos_id, bos_id,
                              dtype)
    finally:
        reader.close()


def open_stream(path: Path, dtype: str, field: str) -> np.ndarray:
    """A read-only ``[N]`` view of a ``.npy`` or ``.bin`` token file (ArrayRecord: see above)."""
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
    elif path.suffix == ".bin":
        arr = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        if path.stat().st_size % arr.dtype.itemsize:
            raise DataError(f"{field} = {str(path)!r} is {path.stat().st_size} bytes, not a whole number of "
                            f"{np.dtype(dtype).name} ids: the file is truncated or its sidecar's dtype is wrong")
    else:
        raise DataError(f"{field} = {str(path)!r}: use a .npy, .bin or .array_record token file.")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{field} = {str(path)!r} holds a {arr.dtype} array of shape {arr.shape}; "
                        "expected a flat integer stream.")
    return arr


def split_stream(stream: np.ndarray, eos_id: int, bos_id: int | None, c: ml_collections.ConfigDict,
                 *, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Whole documents (spans opened by BOS, or by EOS without one) of ``stream`` held out as val."""
    starts = np.flatnonzero(np.asarray(stream) == (eos_id if bos_id is None else bos_id))
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    ends = np.append(starts[1:], len(stream))
    keep = ends - starts > 1  # a lone trailing EOS closes the last document; it is not one
    starts, ends = starts[keep], ends[keep]
    train_idx, val_idx = split_indices(len(starts), c.val_fraction, c.split_seed,
                                       c.max_val_documents, where=where)
    # Without BOS, EOS-opened spans need one more EOS to close the last; with BOS each span is closed.
    tail = [np.array([eos_id], stream.dtype)] if bos_id is None else []

    def gather(idx):
        return np.concatenate([stream[starts[i]:ends[i]] for i in idx] + tail)
    return gather(train_idx), gather(val_idx)


def prepare_token_files(c: ml_collections.ConfigDict, workdir, cache_root, *,
                        vocab_size: int) -> PreparedDataset:
    """The :class:`PreparedDataset` of pre-tokenised files (see the module docstring)."""
    if c.tokenizer.path:
        tok = resolve_tokenizer(c, workdir, [])
        vocab = tokenizer_lib.tokenizer_vocab_size(tok)
        eos_id = tokenizer_lib.eos_id_of(tok, c.tokenizer.eos_token)
        bos_id = tokenizer_lib.bos_id_of(tok, c.tokenizer.bos_token)
    else:
        tok, vocab, eos_id = None, c.tokens.vocab_size, c.tokens.eos_id
        bos_id = c.tokens.bos_id if c.tokens.bos_id >= 0 else None
    tokenizer_lib.check_vocab_size(vocab, vocab_size, where="data.tokens / data.tokenizer.path")
    paths = [_check_file(c.tokens.train_path, "data.tokens.train_path")]
    if c.tokens.val_path:
        paths.append(_check_file(c.tokens.val_path, "data.tokens.val_path"))
    dtypes = [file_dtype(p, c, vocab, f) for p, f in zip(paths, ("data.tokens.train_path",
                                                                "data.tokens.val_path"))]
    # the sidecars' dtypes are part of the key: a corrected sidecar must not reuse a cache read the old way
    key = hashlib.sha256((_fingerprint(paths, c, vocab, eos_id, bos_id) + ",".join(dtypes)).encode()).hexdigest()
    data_dir = cache_path(cache_root, f"tokens-{key[:16]}")
    convert = not c.tokens.val_path or any(p.suffix == ".array_record" for p in paths)

    if not is_committed(data_dir):
        streams = [_load(p, d, eos_id, bos_id, f) for p, d, f in zip(paths, dtypes, ("data.tokens.train_path",
                                                                                  "data.tokens.val_path"))]
        if not c.tokens.val_path:
            streams = list(split_stream(streams[0], eos_id, bos_id, c,
                                        where="data.tokens.train_path"))
        train, val = streams
        info = {"key": key, "source": "tokens", "vocab_size": vocab, "eos_id": eos_id, "bos_id": bos_id,
                "dtype": str(train.dtype), "train_tokens": int(len(train)), "val_tokens": int(len(val)),
                "files": [str(p) for p in paths], "copied": convert}
        arrays = {"token_counts": count_tokens(train, vocab, where=str(paths[0]))}
        count_tokens(val, vocab, where=str(paths[-1]))  # only to check its ids are in range
        if convert:
            arrays.update(train=np.asarray(train), val=np.asarray(val))
        write_cache(data_dir, info, arrays)

    if convert:
        train, val, counts, info = open_cache(data_dir, key=key, vocab_size=vocab)
    else:
        info = json.loads(storage.read_text(str(cache_path(data_dir, "meta.json"))))
        train = open_stream(paths[0], dtypes[0], "data.tokens.train_path")
        val = open_stream(paths[1], dtypes[1], "data.tokens.val_path")
        check_digests(data_dir, info, ("token_counts.npy",))
        counts = np.asarray(load_array(cache_path(data_dir, "token_counts.npy")))
        if int(counts.sum()) != len(train):
            raise DataError(f"data cache {data_dir} is stale or corrupt (token_counts.npy does not "
                            "match the train file): delete that folder and it is rebuilt.")
    return PreparedDataset(train, val, counts, vocab, eos_id, tok, data_dir, info, bos_id=bos_id,
                           **loader_settings(c))


def _load(path: Path, dtype: str, eos_id: int, bos_id: int | None, field: str) -> np.ndarray:
    if path.suffix == ".array_record":
        return read_array_record(path, dtype, eos_id, bos_id)
    return open_stream(path, dtype, field)
