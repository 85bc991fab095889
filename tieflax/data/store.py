"""The token store: a tokenised corpus as tensorstore arrays, written by ``tieflax prepare``, read by training.

Layout of a store (a local folder, ``gs://bucket/prefix`` or ``s3://bucket/prefix``)::

    manifest.json              the commit, written last and only once (create-only): counts, dtype,
                               vocabulary, eos/bos, tokenizer digest, source, split rule, content digest
    tokenizer.json             the tokenizer the ids came from (trained, or a copy of data.tokenizer.path)
    build.json                 the build's settings, fixed by the first prepare (a resume must match them)
    <split>/tokens             zarr3 [N] uint16|uint32: the packed stream [EOS d0 EOS d1 ... EOS]
                               (with a BOS: [BOS d0 EOS BOS d1 EOS ...]), as tieflax.data.packing reads it
    <split>/doc_offsets        zarr3 [D+1] int64: document i is tokens[off[i]:off[i+1]] (its opening marker
                               first); off[D] is the closing EOS without a BOS, N with one
    train/token_counts         zarr3 [V] int64: unigram counts of train/tokens (diagnostics)
    parts/<k>.npy, ledger/<k>.json   the build's intermediate output (kept: the ledger of a resumable build)
    lock*.json                 a prepare at work (host, pid, heartbeat)

The arrays use zarr3's sharded codec: shards of ``SHARD_TOKENS`` ids (a shorter array: one shard of whole
chunks, the last padded past its end), each written whole by exactly one writer (no read-modify-write of a
shared object), holding raw inner chunks of ``CHUNK_TOKENS`` ids that a reader fetches by byte range. A
store without ``manifest.json`` is not a store: a reader refuses it, so nothing half-written is ever read.

The store proves its bytes (``manifest["checksums"] == "crc32c"``): every inner chunk and every shard
index carries a crc32c that tensorstore checks on each read, every inner chunk is stored (none left out
for equalling the fill value), and the manifest records per array the sha256 of its contents and the
size of each shard object. Opening an array checks that its objects exist with those sizes (one tiny
read each); reading checks the crc32c of what it reads. A missing, truncated or altered object is a
:class:`DataError` naming the store, the array, the object and the fix: never zeros, never a traceback.
Stores written before checksums (no ``checksums`` in the manifest) still read, with the existence of
their token and offset shards checked at open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import re

import numpy as np

from tieflax import storage
from tieflax.storage import lease
from tieflax.data.config import DataError, data_location

FORMAT = "tieflax-token-store/1"
SHARD_TOKENS = 1 << 24   # 32 MiB of uint16 per shard object: few objects, one writer each
CHUNK_TOKENS = 1 << 16   # 128 KiB read unit: a window costs at most two byte-range reads
READ_CACHE_BYTES = 256 << 20
LEASE_SECONDS = 120       # a lock whose heartbeat is older than this is a dead prepare's
SPLITS = ("train", "val")
CHECKSUMS = "crc32c"      # what new stores carry (manifest["checksums"]); tests set None to write an old store
ARRAYS = ("train/tokens", "train/doc_offsets", "val/tokens", "val/doc_offsets", "train/token_counts")


# ---------------------------------------------------------------------------------------------- arrays

def array_spec(path: str, *, shape: int | None = None, dtype: str | None = None,
               shard: int = SHARD_TOKENS, chunk: int = CHUNK_TOKENS) -> dict:
    """A tensorstore zarr3 spec at ``path``; with ``shape`` and ``dtype``, the metadata to create it
    (with :data:`CHECKSUMS`: a crc32c after each inner chunk, every inner chunk stored)."""
    spec = {"driver": "zarr3", "kvstore": storage.kvstore_spec(path)}
    if shape is not None:
        # A shard holds whole inner chunks (the sharding codec's rule), and the array's last shard and
        # its last chunk may reach past the array's end (zarr pads them; a chunk wholly past the end is
        # not stored). So the chunk keeps its size whatever the array's length: shrinking it to a divisor
        # of the length made a store of 410,236 ids (4 x a prime) one of 4-id chunks, each with its own
        # 4-byte crc32c and 16-byte index entry (3x the bytes, and slow to write and read).
        chunk = max(1, min(chunk, shape))
        shard = max(chunk, min(shard // chunk * chunk, -(-shape // chunk) * chunk))
        inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if CHECKSUMS:
            # The crc32c of an inner chunk travels with it: the byte-range read of one chunk checks it.
            inner.append({"name": "crc32c"})
            # A chunk equal to the fill value is stored too, so that a chunk absent from a shard is
            # damage (read with fill_missing_data_reads=False), not a chunk of zeros.
            spec["store_data_equal_to_fill_value"] = True
        spec["metadata"] = {
            "shape": [shape], "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [shard]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [chunk], "index_location": "start",  # a prefix range read, not a suffix one
                "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}]}}]}
    return spec


def create_array(path: str, shape: int, dtype: str, **kw):
    """A new array at ``path`` for the finalize to write whole, shard by shard; or the same array that a
    killed finalize left (its shape comes from the ledger), with its shard objects deleted."""
    import tensorstore as ts  # noqa: PLC0415

    # create or open, never delete_existing: a range delete on some object stores reaches past the prefix.
    try:
        arr = ts.open(array_spec(path, shape=shape, dtype=dtype, **kw), create=True, open=True).result()
    except ValueError as e:
        if not (str(e).startswith("FAILED_PRECONDITION") and "Mismatch" in str(e)):
            raise
        # e.g. a finalize of a tieflax before chunk checksums was killed, and a newer one resumes it
        raise DataError(f"{path} holds an array with another layout than tieflax prepare writes now (an "
                        "older tieflax's, or other settings): delete that folder and rerun tieflax prepare; it "
                        "writes the array again from the store's parts") from None
    # The last inner chunk of an array whose length it does not divide reaches past the end, so a write of
    # the last shard reads that chunk's stored bytes to keep its part past the end: a damaged object left
    # there (the store being rebuilt after damage) would fail the rebuild. Each object deleted by its key.
    kv = ts.KvStore.open(storage.kvstore_spec(path)).result()
    for done in [kv.write(f"c/{i}", None) for i in range(-(-shape // arr.chunk_layout.write_chunk.shape[0]))]:
        done.result()
    return arr


def open_array(path: str, *, cache_bytes: int = READ_CACHE_BYTES, checksums: bool = False):
    """A read-only tensorstore array; shard indexes and chunks are cached and never revalidated (a
    committed store never changes). With ``checksums`` (a store whose every chunk is stored), a missing
    shard or chunk raises instead of reading as the fill value."""
    import tensorstore as ts  # noqa: PLC0415

    spec = array_spec(path)
    spec["context"] = {"cache_pool": {"total_bytes_limit": cache_bytes}}
    spec["recheck_cached_data"] = "open"
    spec["recheck_cached_metadata"] = "open"
    if checksums:
        spec["fill_missing_data_reads"] = False
    return ts.open(spec, read=True).result()


def object_bytes(arr) -> list[int]:
    """The size of each shard object ``c/<i>`` of an array written with checksums, from its layout:
    a start index of 16 bytes per inner chunk plus a crc32c, then each inner chunk inside the array's
    bounds, whole (the last one padded) and followed by its crc32c. The builder checks these against
    the written objects (:func:`check_objects`) before it records them."""
    n, shard = arr.shape[0], arr.chunk_layout.write_chunk.shape[0]
    chunk, item = arr.chunk_layout.read_chunk.shape[0], arr.dtype.numpy_dtype.itemsize
    index = 16 * (shard // chunk) + 4
    return [index + -(-min(shard, n - a) // chunk) * (chunk * item + 4) for a in range(0, n, shard)]


def check_objects(store: str, name: str, sizes: list[int | None]) -> None:
    """Every shard object ``c/<i>`` of array ``name`` exists, of exactly ``sizes[i]`` bytes (None: any
    size); else the DataError of :func:`damaged`. One read of the last byte or so per object, all at
    once: cheap at every open, where reading the arrays whole would not be."""
    import tensorstore as ts  # noqa: PLC0415

    kv = ts.KvStore.open(storage.kvstore_spec(storage.join(store, *name.split("/")))).result()
    futures = [kv.read(f"c/{i}", byte_range=slice(0, 1) if size is None else slice(size - 1, None))
               for i, size in enumerate(sizes)]
    bad = []
    for i, (size, f) in enumerate(zip(sizes, futures)):
        try:
            r = f.result()
            problem = "is missing" if r.state == "missing" else None
            if problem is None and size is not None and len(r.value) != 1:
                problem = f"holds more than the {size} bytes manifest.json records"
        except ValueError as e:
            # The range starts past the object's end: OUT_OF_RANGE from a file; over HTTP the answer
            # to a range past the end is FAILED_PRECONDITION (a 416, or a Content-Range other than
            # asked). Any other failure (UNAVAILABLE, PERMISSION_DENIED) is not the store's damage.
            if not str(e).startswith(("OUT_OF_RANGE", "FAILED_PRECONDITION")):
                raise
            problem = "is truncated" + (f" (shorter than the {size} bytes manifest.json records)" if size else "")
        if problem:
            bad.append(f"object c/{i} {problem}")
    if bad:
        more = f" (and {len(bad) - 1} more of its {len(sizes)} objects)" if len(bad) > 1 else ""
        raise damaged(store, name, bad[0] + more, repairable=None not in sizes)


# tensorstore's status codes that mean "the bytes are not what was written" (others, e.g. UNAVAILABLE
# or PERMISSION_DENIED, are not the store's fault and propagate as they are).
_DAMAGE_CODES = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE")


def damaged(store: str, name: str, what: str, *, repairable: bool = True) -> DataError:
    """The one-line error for damaged array ``name`` of ``store``, with the fix. A store with checksums
    is rebuilt in place from the parts its build kept: without a manifest a prepare resumes, finds
    every part done, and finalize rewrites every array shard whole."""
    fix = (f"rebuild its arrays from the parts it kept: delete {manifest_path(store)} and rerun tieflax "
           f"prepare with the same config and --out {store}; or delete the store and prepare it again"
           if repairable else "delete the store and prepare it again")
    return DataError(f"token store {store}: array {name}: {what}: {fix}")


def damage_error(store: str, name: str, e: ValueError, *, repairable: bool = True) -> DataError | None:
    """``e`` (tensorstore's error reading array ``name``) as :func:`damaged`, or None if it is not
    damage. tensorstore names the object (``file ".../c/3"``, ``gs://.../c/3:``) and the reason."""
    text = str(e)
    if not text.startswith(_DAMAGE_CODES):
        return None
    where = re.findall(r'/(c/\d+)\b', text)  # the last: the store's own path may hold a "/c/1"
    where = f"object {where[-1]}" if where else "a chunk"
    if "igest mismatch" in text:
        what = f"{where} fails its crc32c checksum (its bytes changed after they were written)"
    elif text.startswith("NOT_FOUND") and "zarr.json" in text:
        what = "its metadata zarr.json is missing"
    elif text.startswith("NOT_FOUND"):
        what = f"{where} is missing"
    elif "size" in text:
        what = f"{where} is truncated"
    else:
        what = f"{where} cannot be decoded ({_first_line(text)})"
    return damaged(store, name, what, repairable=repairable)


def _first_line(text: str, limit: int = 200) -> str:
    text = text.splitlines()[0] if text else text
    return text if len(text) <= limit else text[:limit] + " ..."


def read_result(future, store: str, name: str, *, repairable: bool = True):
    """``future.result()``, with tensorstore's damage errors as :func:`damaged`'s one line."""
    try:
        return future.result()
    except ValueError as e:
        err = damage_error(store, name, e, repairable=repairable)
        if err is None:
            raise
        raise err from None


class StoreChanged(DataError):
    """The store was deleted or replaced while a run read it: what the run had read is not what the store
    holds now. ``at_step`` adds the step and the checkpoint kept (the trainer's line)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def at_step(self, step: int, last_checkpoint: int | None) -> "StoreChanged":
        kept = (f"its last checkpoint, step {last_checkpoint}, is kept" if last_checkpoint is not None else
                "no checkpoint had been saved yet")
        return StoreChanged(f"step {step}: {self.message}; training stopped and {kept}: put the store back "
                            "(or point data.tokens.path at it) and rerun the same command to resume, or train a "
                            "new run on the new store")


CHECK_SECONDS = 10.0  # how often a reader looks at the store's manifest (one small read)


class StoreGuard:
    """The manifest digest a reader opened the store with, compared with the store's now: at most every
    ``CHECK_SECONDS``, and at once after a failed read. Raises :class:`StoreChanged`."""

    def __init__(self, store: str, digest: str):
        import threading  # noqa: PLC0415

        self.store, self.digest = store, digest
        self._lock = threading.Lock()
        self._last = 0.0

    def check(self, *, now: bool = False) -> None:
        import time  # noqa: PLC0415

        t = time.monotonic()
        with self._lock:
            if not now and t - self._last < CHECK_SECONDS:
                return
            self._last = t
        try:
            raw = storage.read_bytes(manifest_path(self.store))
        except FileNotFoundError:
            raise StoreChanged(f"token store {self.store} was deleted while this run read it (its manifest.json "
                               "is gone)") from None
        try:
            digest = json.loads(raw).get("digest")
        except (ValueError, AttributeError):
            digest = None
        if digest != self.digest:
            raise StoreChanged(f"token store {self.store} was replaced while this run read it (manifest digest "
                               f"{self.digest[:16]} at the start, {str(digest)[:16]} now)")


class StoreTokens:
    """A split's ``[N]`` token stream read lazily from the store, usable where a memmap is.

    ``x[a:b]``, ``x[int_array]`` and ``len(x)`` behave as on a NumPy array; ``read_windows`` reads a
    batch of windows in one tensorstore batch (what :class:`tieflax.data.packing.PackedRows` uses), so
    a host fetches only the chunks its rows touch. A damaged chunk is a one-line DataError (see
    :func:`damaged`); grain's reader threads re-raise it as it is.
    """

    def __init__(self, array, store: str, name: str, *, repairable: bool = True, guard: StoreGuard | None = None):
        self._arr, self._store, self._name, self._repairable = array, store, name, repairable
        self._guard = guard
        self.path = storage.join(store, *name.split("/"))
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype.numpy_dtype)
        self.ndim = 1

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        with self._guarded():
            return np.asarray(read_result(self._arr[key].read(), self._store, self._name,
                                          repairable=self._repairable))

    @contextlib.contextmanager
    def _guarded(self):
        """A store deleted or replaced under the reader is said so (:class:`StoreChanged`), whether a read
        then fails (a missing chunk, an index out of the new shape) or not (the manifest checked every
        ``CHECK_SECONDS``)."""
        if self._guard is None:
            yield
            return
        self._guard.check()
        try:
            yield
        except StoreChanged:
            raise
        except Exception:  # noqa: BLE001
            self._guard.check(now=True)
            raise

    def __array__(self, dtype=None, copy=None):  # noqa: ARG002
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``[b, length]``: ``tokens[s : s + length]`` for each start ``s`` (reads past the end repeat the
        last token, as a clipped gather on a memmap does)."""
        import tensorstore as ts  # noqa: PLC0415

        n = len(self)
        starts = np.asarray(starts, np.int64)
        out = np.empty((len(starts), length), self.dtype)
        with self._guarded():
            with ts.Batch() as batch:
                futures = [self._arr[int(s):min(int(s) + length, n)].read(batch=batch) for s in starts]
            for r, (s, f) in enumerate(zip(starts, futures)):
                got = read_result(f, self._store, self._name, repairable=self._repairable)
                out[r, :len(got)] = got
                out[r, len(got):] = got[-1] if len(got) else 0
        return out

    def __repr__(self) -> str:
        return f"StoreTokens({self.path}, n={len(self)}, dtype={self.dtype.name})"


# ------------------------------------------------------------------------------------------- manifest

def manifest_path(store: str) -> str:
    return storage.join(store, "manifest.json")


def read_manifest(store: str) -> dict:
    """The committed manifest of ``store``; a DataError naming the store and the fix otherwise."""
    path = manifest_path(store)
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        busy = [n for n in storage.listdir(store) if n.startswith("lock")] if storage.is_dir(store) else []
        if busy:
            raise DataError(f"token store {store} is still being written by a tieflax prepare (no "
                            "manifest.json yet): wait for it to finish, or rerun the prepare to resume it"
                            ) from None
        if storage.exists(store):
            raise DataError(f"token store {store} has no manifest.json: its prepare never finished; "
                            "rerun tieflax prepare with --out pointing there to resume it") from None
        raise DataError(f"token store {store} does not exist: make it with tieflax prepare --config "
                        "CONFIG --out STORE, or fix data.tokens.path") from None
    try:
        manifest = json.loads(raw)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
        for split in SPLITS:
            int(manifest["splits"][split]["tokens"])
        for key in ("dtype", "vocab_size", "eos_id", "tokenizer_digest", "digest"):
            manifest[key]  # noqa: B018 (presence check)
        if manifest.get("checksums") is not None:  # absent: a store written before checksums
            if manifest["checksums"] != CHECKSUMS:
                raise ValueError(f"checksums {manifest['checksums']!r}, expected {CHECKSUMS!r}")
            for name in ARRAYS:
                [int(n) for n in manifest["arrays"][name]["objects"]]
                str(manifest["arrays"][name]["sha256"])
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"token store {store} has a damaged manifest.json ({e}): delete the store and "
                        "prepare it again") from None
    return manifest


@dataclasses.dataclass(frozen=True)
class TokenStore:
    """An opened store: its manifest and lazy arrays."""
    path: str
    manifest: dict

    @property
    def checksums(self) -> bool:
        """Whether the store's chunks carry crc32c checksums (stores written before them do not)."""
        return self.manifest.get("checksums") == CHECKSUMS

    def array(self, name: str):
        """Array ``name`` (e.g. ``'train/tokens'``) opened for reading, after checking that its shard
        objects exist with the sizes the manifest records. In a store without checksums only the token
        and offset shards are checked, for existence: its writer left out all-zero shards, which token
        counts may hold (a vocabulary's unused tail) but a token stream or offsets never do."""
        try:
            arr = open_array(storage.join(self.path, *name.split("/")), checksums=self.checksums)
        except ValueError as e:  # zarr.json missing or unreadable
            err = damage_error(self.path, name, e, repairable=self.checksums)
            if err is None:
                raise
            raise err from None
        if self.checksums:
            check_objects(self.path, name, self.manifest["arrays"][name]["objects"])
        elif not name.endswith("token_counts"):
            check_objects(self.path, name, [None] * -(-arr.shape[0] // arr.chunk_layout.write_chunk.shape[0]))
        return arr

    def tokens(self, split: str) -> StoreTokens:
        name = f"{split}/tokens"
        arr = self.array(name)
        want = self.manifest["splits"][split]["tokens"]
        if arr.shape[0] != want or np.dtype(arr.dtype.numpy_dtype).name != self.manifest["dtype"]:
            raise DataError(f"token store {self.path}: {split}/tokens holds {arr.shape[0]} "
                            f"{arr.dtype.numpy_dtype} ids but manifest.json says {want} "
                            f"{self.manifest['dtype']}: the store is damaged; delete it and prepare again")
        return StoreTokens(arr, self.path, name, repairable=self.checksums,
                           guard=StoreGuard(self.path, self.manifest["digest"]))

    def read(self, name: str) -> np.ndarray:
        """Array ``name`` whole."""
        return np.asarray(read_result(self.array(name)[:].read(), self.path, name, repairable=self.checksums))

    def doc_offsets(self, split: str) -> np.ndarray:
        return self.read(f"{split}/doc_offsets")

    def token_counts(self) -> np.ndarray:
        return self.read("train/token_counts")

    def verify(self) -> None:
        """Reads every array whole, shard by shard, and compares its sha256 with the manifest's: the
        full proof (every byte read), too slow to run at each open of a large store. A store without
        checksums has no digests to compare: only that it reads."""
        for name in ARRAYS:
            arr = self.array(name)
            digest = hashlib.sha256()
            n, step = arr.shape[0], arr.chunk_layout.write_chunk.shape[0]
            for a in range(0, n, step):   # the last shard may reach past the end: read to the end
                chunk = read_result(arr[a:min(a + step, n)].read(), self.path, name, repairable=self.checksums)
                digest.update(le_bytes(np.asarray(chunk)))
            if self.checksums and digest.hexdigest() != self.manifest["arrays"][name]["sha256"]:
                raise damaged(self.path, name, "its contents differ from the sha256 manifest.json records")

    def tokenizer_json(self) -> str:
        return storage.read_text(storage.join(self.path, "tokenizer.json"))


def le_bytes(x: np.ndarray) -> bytes:
    """The little-endian bytes of ``x``: what an array's recorded sha256 covers, on any host."""
    return np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes()


# What a token store's folder holds (this module, store_build.py), and the temporary names of its writes.
STORE_NAMES = frozenset({"manifest.json", "build.json", "inputs.json", "tokenizer.json", "parts", "ledger",
                         *SPLITS, "lock.json"})
_STORE_TEMPORARY = re.compile(r"lock-\d+-of-\d+\.json|\..+\.tmp|\.tieflax-write-probe-\d+")


def check_store_folder(out: str) -> str:
    """Before any work: ``out`` canonical (``data_location``: the name every part of a build writes
    under), new, empty or a token store (finished or not); a malformed URL, a file, or a folder holding
    anything a store does not (a run, a corpus, other files), is refused naming it."""
    try:
        out = data_location(out)
    except storage.StorageError as e:
        raise DataError(str(e)) from None
    if not storage.is_remote(out) and storage.exists(out) and not storage.is_dir(out):
        raise DataError(f"--out {out} is a file, not a folder: give the token store a folder of its own")
    other = [n for n in storage.listdir(out) if n not in STORE_NAMES and not _STORE_TEMPORARY.fullmatch(n)]
    if other:
        raise DataError(f"--out {out} holds {other[0]!r}, which a token store does not: give the store a new or "
                        "empty folder of its own (or the folder of the store this command started)")
    return out


def open_store(path: str) -> TokenStore:
    """The committed store at ``path`` (see :func:`read_manifest` for the refusals)."""
    try:
        path = data_location(path)
    except storage.StorageError as e:
        raise DataError(str(e)) from None
    return TokenStore(path, read_manifest(path))


# ---------------------------------------------------------------------------------------------- parts
# A part is one input shard's output: each split's document lengths and their tokens (no markers), as
# four .npy arrays in one object. Written whole by the one worker that tokenised it, then recorded in
# the ledger; the ledger entry is what says "done".

def part_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """Deterministic bytes of ``{train_lengths, train_tokens, val_lengths, val_tokens}``."""
    buf = io.BytesIO()
    for key in ("train_lengths", "train_tokens", "val_lengths", "val_tokens"):
        np.save(buf, arrays[key], allow_pickle=False)
    return buf.getvalue()


def read_part(store: str, k: int, *, digest: str | None = None) -> dict[str, np.ndarray]:
    """Part ``k``'s arrays; with ``digest`` (the ledger's), a part whose bytes differ is refused."""
    try:
        data = storage.read_bytes(part_path(store, k))
    except FileNotFoundError:
        data = b""
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise DataError(f"token store {store}: part {part_path(store, k)} is missing or differs from its "
                        f"ledger entry; delete {ledger_path(store, k)} and rerun tieflax prepare to redo it")
    buf = io.BytesIO(data)
    return {key: np.load(buf, allow_pickle=False)
            for key in ("train_lengths", "train_tokens", "val_lengths", "val_tokens")}


def part_path(store: str, k: int) -> str:
    return storage.join(store, "parts", f"{k:07d}.npy")


def ledger_path(store: str, k: int) -> str:
    return storage.join(store, "ledger", f"{k:07d}.json")


def finished_parts(store: str) -> dict[int, dict]:
    """Ledger: input shard -> its record (token/document counts, digest) for every finished part."""
    out = {}
    for name in storage.listdir(storage.join(store, "ledger")):
        if name.endswith(".json") and not name.startswith("."):
            out[int(name[:-5])] = json.loads(storage.read_text(storage.join(store, "ledger", name)))
    return out


# ---------------------------------------------------------------------------------------------- lease

class BuildLock(lease.Lease):
    """``lock[-i-of-n].json`` in the store while a prepare works on it: the same compare-and-set lease
    as a workdir's on a bucket (``tieflax.storage.lease``), renewed by a heartbeat. A second prepare finding a
    live lease refuses; a stale one (not renewed for ``LEASE_SECONDS``, or its process gone on this
    host) is taken over with a message."""

    def __init__(self, store: str, name: str = "lock.json"):
        path = storage.join(store, name)

        def refuse(holder: dict, age: float) -> DataError:
            return DataError(f"token store {store} is being written by another tieflax prepare (host "
                             f"{holder.get('host')}, pid {holder.get('pid')}, renewed {age:.0f} s ago): wait "
                             f"for it, or if it is dead delete {path} (it goes stale after {LEASE_SECONDS} s)")

        super().__init__(path, lease.holder_record(command="prepare"), refuse=refuse, owner=f"token store {store}",
                         heartbeat_seconds=LEASE_SECONDS / 4, lease_seconds=LEASE_SECONDS)


# ------------------------------------------------------------------------------------------- training

def open_store_dataset(c, workdir: str, *, vocab_size: int):
    """The :class:`tieflax.data.cache.PreparedDataset` of the store ``c.tokens.path`` (``data.source =
    'tokens'``): lazy splits, the store's tokenizer, checked against the model, the config and the run."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    from tieflax.data import tokenizer as tokenizer_lib  # noqa: PLC0415
    from tieflax.data.cache import PreparedDataset, loader_settings  # noqa: PLC0415

    store = open_store(c.tokens.path)
    m = store.manifest
    tok = Tokenizer.from_str(store.tokenizer_json())
    if tokenizer_lib.tokenizer_digest(tok) != m["tokenizer_digest"]:
        raise DataError(f"token store {store.path}: tokenizer.json does not match manifest.json's digest; "
                        "the store is damaged: delete it and prepare it again")
    if c.tokenizer.path:
        with storage.local_copy(c.tokenizer.path) as local:
            given = tokenizer_lib.load_tokenizer(local)
        if tokenizer_lib.tokenizer_digest(given) != m["tokenizer_digest"]:
            raise DataError(f"token store {store.path} was made with another tokenizer than "
                            f"data.tokenizer.path = {c.tokenizer.path!r}: prepare a store with this "
                            "tokenizer, or drop data.tokenizer.path (the store carries its own)")
    saved = storage.join(workdir, tokenizer_lib.TOKENIZER_FILE)
    if storage.is_file(saved) and \
            Tokenizer.from_str(storage.read_text(saved)).to_str() != tok.to_str():
        raise DataError(f"{saved} differs from the tokenizer of token store {store.path}: this workdir was "
                        "trained on other ids. Use a new workdir, or the store made with that tokenizer")
    tokenizer_lib.check_vocab_size(m["vocab_size"], vocab_size, where=f"token store {store.path}",
                                   allow_smaller_tokenizer=True)
    for field, token, want in (("eos_token", c.tokenizer.eos_token, m["eos_id"]),
                               ("bos_token", c.tokenizer.bos_token, m["bos_id"])):
        got = (tokenizer_lib.eos_id_of if field == "eos_token" else tokenizer_lib.bos_id_of)(tok, token)
        if got != want:
            raise DataError(f"data.tokenizer.{field} = {token!r} (id {got}) but token store {store.path} "
                            f"marks documents with id {want}: set data.tokenizer.{field} as it was for "
                            "tieflax prepare")
    info = {"source": "tokens", "store": store.path, "key": m["digest"],
            **{f"{s}_{k}": m["splits"][s][k] for s in SPLITS for k in ("tokens", "documents")},
            "vocab_size": m["vocab_size"], "eos_id": m["eos_id"], "bos_id": m["bos_id"], "dtype": m["dtype"]}
    counts = store.token_counts()
    if counts.shape != (m["vocab_size"],) or int(counts.sum()) != m["splits"]["train"]["tokens"]:
        raise DataError(f"token store {store.path}: train/token_counts does not match manifest.json; the "
                        "store is damaged: delete it and prepare it again")
    return PreparedDataset(store.tokens("train"), store.tokens("val"), counts, m["vocab_size"], m["eos_id"], tok,
                           store.path, info, bos_id=m["bos_id"], **loader_settings(c))
