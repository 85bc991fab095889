"""Building a token store (``tieflax prepare``): stream a corpus through a tokenizer in worker processes.

    manifest = build_store(config.data, "gs://bucket/corpus", workers=8)
    # on several machines: build_store(..., shard=(i, n)) on each, then build_store(..., finalize_only=True)

1. The tokenizer: ``data.tokenizer.path`` copied into the store, or a byte-level BPE trained on the train
   documents (streamed) and saved there; a resumed build reuses the store's copy.
2. Tokenise: the corpus is read as a stream of documents (``sources.iter_documents``) and cut into input
   shards of about ``shard_bytes`` of text. Each shard goes to one worker process, which tokenises it
   with the batched fast tokenizer (one thread per worker: N workers = N cores), writes its part and
   then its ledger entry. A resumed build skips every shard the ledger lists, so a killed prepare loses
   at most the shards in flight. At most ``2 * workers`` shards are in flight: memory stays bounded
   whatever the corpus size.
3. Finalize: the parts, in order, become each split's packed stream and document offsets, written
   shard by shard (each array shard by one writer); ``manifest.json`` is created last, once.

The split holds out whole documents: document ``i`` (in corpus order) is held out when a hash of
``(data.split_seed, i)`` falls below ``data.val_fraction``. A shard decides alone, so machines agree
without talking, and adding documents at the end never moves earlier ones.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import time
from typing import Callable, Iterable, Iterator

import ml_collections
import numpy as np

from tieflax import storage
from tieflax.data import store as st
from tieflax.data import tokenizer as tokenizer_lib
from tieflax.data.cache import token_dtype
from tieflax.data.config import DataError, validate_data_config
from tieflax.data.sources import expand_paths, iter_documents
from tieflax.data.workers import worker_pool

log = logging.getLogger(__name__)

SPLIT_RULE = "splitmix64(split_seed, document index) / 2**64 < val_fraction"
DEFAULT_SHARD_BYTES = 8 << 20


def is_val(index: np.ndarray, seed: int, val_fraction: float) -> np.ndarray:
    """``[n] bool``: which documents (global corpus indices) the split holds out (see module doc)."""
    with np.errstate(over="ignore"):
        z = np.asarray(index, np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < val_fraction


# --------------------------------------------------------------------------------------------- workers

_WORKER: dict = {}


def _init_worker(tokenizer_json: str, store: str, val_fraction: float, split_seed: int, dtype: str):
    # One tokenizer thread per worker process: parallelism comes from the processes, which scale
    # without the GIL or rayon's pool fighting over the same cores.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer  # noqa: PLC0415

    _WORKER.update(tok=Tokenizer.from_str(tokenizer_json), store=store, val_fraction=val_fraction,
                   split_seed=split_seed, dtype=np.dtype(dtype))


def tokenise_part(k: int, first_doc: int, texts: list[str]) -> tuple[int, int, float]:
    """Input shard ``k`` (documents ``first_doc, ...``) -> its part and ledger entry in the store.

    Returns ``(k, tokens, cpu seconds)``.
    """
    c0 = time.process_time()
    w = _WORKER
    encs = w["tok"].encode_batch_fast(texts, add_special_tokens=False)
    ids = [np.asarray(e.ids, w["dtype"]) for e in encs]
    val = is_val(first_doc + np.arange(len(texts)), w["split_seed"], w["val_fraction"])
    arrays = {}
    for split, mask in (("train", ~val), ("val", val)):
        chosen = [a for a, m in zip(ids, mask) if m]
        arrays[f"{split}_lengths"] = np.array([len(a) for a in chosen], np.int64)
        arrays[f"{split}_tokens"] = np.concatenate(chosen) if chosen else np.zeros(0, w["dtype"])
    data = st.part_bytes(arrays)
    storage.write_bytes(st.part_path(w["store"], k), data)
    record = {"first_doc": first_doc, "documents": len(texts), "digest": hashlib.sha256(data).hexdigest()}
    for split in st.SPLITS:
        record[split] = {"documents": len(arrays[f"{split}_lengths"]),
                         "tokens": int(arrays[f"{split}_lengths"].sum())}
    storage.write_text(st.ledger_path(w["store"], k), json.dumps(record))  # the ledger says: done
    return k, int(sum(len(a) for a in ids)), time.process_time() - c0


def _started() -> int:
    time.sleep(0.2)  # held, so that each of the first submissions needs a process of its own
    return os.getpid()


def _start_workers(pool: cf.ProcessPoolExecutor, workers: int) -> None:
    """Starts every worker now, with ``TIEFLAX_DATA_WORKER=1`` in their environment only: they skip
    importing grain and JAX with the ``tieflax.data`` package (seconds each); see its docstring."""
    saved = os.environ.get("TIEFLAX_DATA_WORKER")
    os.environ["TIEFLAX_DATA_WORKER"] = "1"
    try:
        cf.wait([pool.submit(_started) for _ in range(workers)])  # spawns on demand: one per busy submit
    finally:
        if saved is None:
            os.environ.pop("TIEFLAX_DATA_WORKER", None)
        else:
            os.environ["TIEFLAX_DATA_WORKER"] = saved


# ------------------------------------------------------------------------------------------- the build

def build_store(c: ml_collections.ConfigDict, out: str, *, workers: int = 1, shard: tuple[int, int] = (0, 1),
                finalize_only: bool = False, shard_bytes: int | None = None,
                progress: Callable[[str], None] | None = None, stats: dict | None = None,
                model_vocab_size: int | None = None, flags: Iterable[str] | None = None,
                executor=None) -> dict | None:
    """Builds (or resumes) the token store ``out`` from the data config ``c``.

    ``executor``: what tokenises the input shards instead of a pool of ``workers`` processes here (then
    unused): ``prepare_ray.RayTasks()``, tasks on a Ray cluster. Its ``begin()`` is called before the
    tokenizer is trained or read, and the executor itself as ``executor(c, out, tok, settings, say=...)`` ->
    ``{"tokens", "worker_cpu_s"}``, as :func:`_tokenise`; the store is the same to the byte.

    Returns the manifest, or None after a ``shard=(i, n)`` with ``n > 1`` (its share done; finalize
    with ``finalize_only=True`` once every share is). A store with a manifest is returned as it is when
    ``c`` asks for the settings it was built with (else refused naming each one): a finished store is
    never rewritten. ``shard_bytes`` None: the store's recorded one (``DEFAULT_SHARD_BYTES`` for a new store).

    ``finalize_only`` takes the settings the shard builds recorded (``build.json``); ``flags``, the data
    config keys the user set (``tokenizer.vocab_size``, ``files.paths``...), are checked against them
    (None: every field of ``c``). An ``out`` without ``build.json`` is refused; nothing is written then.
    """
    i, n = shard
    if not 0 <= i < n:
        raise DataError(f"--shard {i}/{n}: the index must lie in [0, {n}).")
    if workers < 1:
        raise DataError(f"--workers {workers}: use at least 1.")
    if executor is not None and (n > 1 or finalize_only):
        raise DataError("--ray schedules every input shard over the cluster and finalizes: drop --shard and "
                        "--finalize (they are for building without Ray, one share per machine)")
    if not finalize_only:   # a finalize reads the recorded settings, not the config's data section
        _check_config(c)
    say = progress or (lambda text: None)
    out = st.check_store_folder(out)
    started = _started_settings(out)
    finished = storage.is_file(st.manifest_path(out))
    if finalize_only:
        if started is None:
            raise DataError(f"--finalize: {out} holds no started token store (no build.json): run `tieflax prepare "
                            f"--config ... --out {out} --shard I/N` on every host first (or, on one machine, "
                            "without --finalize)")
        settings = _finalize_settings(c, out, started, None if flags is None else set(flags), shard_bytes)
        if model_vocab_size is not None and "vocab_size" in settings:
            tokenizer_lib.check_vocab_size(settings["vocab_size"], model_vocab_size,
                                           where="the tokenizer of tieflax prepare", allow_smaller_tokenizer=True)
    elif finished:   # read-only: the store's tokenizer (or the given one), never a trained one
        tok = _given_or_stored_tokenizer(c, out)
        if tok is None:
            raise DataError(f"token store {out} has a manifest.json but no tokenizer.json: it is damaged; delete "
                            "it and prepare it again")
        if shard_bytes is None and started is not None:
            shard_bytes = started.get("shard_bytes", DEFAULT_SHARD_BYTES)
        _refuse_other_settings(out, started or {}, _settings(c, tok, shard_bytes or DEFAULT_SHARD_BYTES))
    if finished:
        manifest = st.read_manifest(out)
        say(f"{out} is already a finished token store (digest {manifest['digest'][:16]}); nothing to do")
        return manifest
    if finalize_only:
        _check_parts(out)   # before the lock: a refusal writes nothing
    try:
        storage.check_writable(out)
    except storage.StorageError as e:
        raise DataError(str(e)) from None
    storage.makedirs(out)
    with st.BuildLock(out, "lock.json" if n == 1 else f"lock-{i}-of-{n}.json"):
        stats = {} if stats is None else stats
        if not finalize_only:
            settings = _tokenise_step(c, out, say, stats, workers=workers, shard=shard, shard_bytes=shard_bytes,
                                      model_vocab_size=model_vocab_size, executor=executor)
        if n > 1 and not finalize_only:
            return None
        t0 = time.perf_counter()
        manifest = finalize(out, settings, say=say)
        stats["finalize_s"] = time.perf_counter() - t0
        return manifest


def _tokenise_step(c, out: str, say, stats: dict, *, workers: int, shard: tuple[int, int], shard_bytes: int | None,
                   model_vocab_size: int | None, executor) -> dict:
    """Steps 1 and 2 of the module doc (under the build's lock): the tokenizer, the settings fixed in
    ``build.json``, then this machine's input shards tokenised in the pool or by ``executor``. Returns the settings;
    ``stats`` gets the counts and timings."""
    if executor is not None:   # e.g. a local Ray starts while the tokenizer is trained (seconds each)
        executor.begin()
    tok = _store_tokenizer(c, out, say)
    if model_vocab_size is not None:
        tokenizer_lib.check_vocab_size(tokenizer_lib.tokenizer_vocab_size(tok), model_vocab_size,
                                       where="the tokenizer of tieflax prepare", allow_smaller_tokenizer=True)
    settings = _check_settings(c, out, tok, shard_bytes)
    t0 = time.perf_counter()
    c0 = time.process_time()
    if executor is not None:
        stats.update(executor(c, out, tok, settings, say=say))
    else:
        stats.update(_tokenise(c, out, tok, settings, workers=workers, shard=shard,
                               shard_bytes=settings["shard_bytes"], say=say))
    stats["tokenise_s"] = time.perf_counter() - t0
    stats["main_cpu_s"] = time.process_time() - c0
    return settings


def _check_config(c) -> None:
    """The data section a tokenising prepare reads: text, and a glob that matches (now, not after a BPE)."""
    validate_data_config(c)
    if c.source == "tokens":
        raise DataError("tieflax prepare tokenises text: set data.source to kjv, python_stdlib, files or "
                        "hf (data.source = 'tokens' is what reads the store it makes).")
    if c.max_val_documents:
        raise DataError("data.max_val_documents is not used by tieflax prepare (the store holds out "
                        "documents by hash); set it to 0 and lower data.val_fraction instead.")
    if c.source == "files":
        paths = c.files.paths
        expand_paths([paths] if isinstance(paths, (str, os.PathLike)) else list(paths))


def _given_or_stored_tokenizer(c, out: str):
    """Read-only: the given tokenizer (a store started with another is refused), else the store's copy,
    else None (a BPE is still to be trained)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    path = storage.join(out, "tokenizer.json")
    existing = storage.read_text(path) if storage.is_file(path) else None
    if c.tokenizer.path:
        with storage.local_copy(c.tokenizer.path) as local:
            given = tokenizer_lib.load_tokenizer(local)
        if existing is not None and Tokenizer.from_str(existing).to_str() != given.to_str():
            raise DataError(f"token store {out} was started with another tokenizer than "
                            f"data.tokenizer.path = {c.tokenizer.path!r}: use another --out, or delete it")
        return given
    return None if existing is None else Tokenizer.from_str(existing)


def _store_tokenizer(c, out: str, say):
    """The store's tokenizer: the given one (a store started with another is refused) or a trained one."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    path = storage.join(out, "tokenizer.json")
    existing = storage.is_file(path)
    tok = _given_or_stored_tokenizer(c, out)
    if tok is None:
        say(f"training a {c.tokenizer.vocab_size}-token byte-level BPE on the train documents")
        texts = (d.text for k, d in enumerate(iter_documents(c))
                 if not is_val(np.array([k]), c.split_seed, c.val_fraction)[0])
        cut: dict = {}
        tok = tokenizer_lib.train_bpe(texts, vocab_size=c.tokenizer.vocab_size, eos_token=c.tokenizer.eos_token,
                                      min_frequency=c.tokenizer.min_frequency, stats=cut)
        if cut.get("runs_cut"):
            say(f"cut {cut['runs_cut']} runs of over {cut['max_piece_chars']} characters without a space (or of "
                "spaces) into pieces for the BPE's training (a minified file or a blob would stall it); the "
                "documents are tokenised whole")
    if not existing and not storage.create_new(path, tok.to_str().encode()):
        if Tokenizer.from_str(storage.read_text(path)).to_str() != tok.to_str():  # another shard's
            raise DataError(f"token store {out}: another prepare saved a different tokenizer.json; "
                            "give every machine the same data.tokenizer.path")
    return tok


def source_description(c) -> dict:
    desc = {"source": c.source}
    if c.source in ("python_stdlib", "files", "hf"):
        desc[c.source] = c[c.source].to_dict()
    return json.loads(json.dumps(desc, default=str))


def _settings_tokenizer(c) -> dict:
    """How the tokenizer was made: a given file (its digest in build.json is what counts) or trained here,
    whose settings a resumed build must share (it reuses the store's tokenizer.json and would ignore them)."""
    return ({"given": "data.tokenizer.path"} if c.tokenizer.path else
            {"trained": "byte-level BPE", "vocab_size": c.tokenizer.vocab_size,
             "min_frequency": c.tokenizer.min_frequency, "max_piece_chars": tokenizer_lib.MAX_PIECE_CHARS})


def _settings(c, tok, shard_bytes: int) -> dict:
    """What ``build.json`` records of a build of ``c`` with the tokenizer ``tok``."""
    vocab = tokenizer_lib.tokenizer_vocab_size(tok)
    made = _settings_tokenizer(c)
    return {
        "format": st.FORMAT, "data": source_description(c),
        "tokenizer_digest": tokenizer_lib.tokenizer_digest(tok), "vocab_size": vocab,
        "eos_id": tokenizer_lib.eos_id_of(tok, c.tokenizer.eos_token),
        "bos_id": tokenizer_lib.bos_id_of(tok, c.tokenizer.bos_token),
        "dtype": token_dtype(vocab).name, "shard_bytes": shard_bytes,
        "split": {"rule": SPLIT_RULE, "val_fraction": c.val_fraction, "split_seed": c.split_seed},
        "tokenizer": {**made, "eos_token": c.tokenizer.eos_token, "bos_token": c.tokenizer.bos_token},
    }


# What build.json records that a finished store's manifest also holds (a store finished before build.json).
_MANIFEST_SETTINGS = ("format", "data", "tokenizer_digest", "vocab_size", "eos_id", "bos_id", "dtype", "split")


def _started_settings(out: str) -> dict | None:
    """Read-only: the settings ``out`` was started with (``build.json``; for a finished store without one,
    what its manifest records), or None where no build was started."""
    path = storage.join(out, "build.json")
    if storage.is_file(path):
        return json.loads(storage.read_text(path))
    if storage.is_file(st.manifest_path(out)):
        manifest = st.read_manifest(out)
        return {k: manifest[k] for k in _MANIFEST_SETTINGS if k in manifest}
    return None


def _refuse_other_settings(out: str, started: dict, now: dict) -> None:
    """One line naming every field of ``now`` that differs from ``started`` (fields that ``started``, an
    older store's record, lacks are not compared)."""
    differ = _differences(started, {k: v for k, v in now.items() if k in started})
    if differ:
        raise DataError(f"token store {out} was started with other settings ({'; '.join(differ)}): rerun "
                        "with the settings it was started with, or use another --out")


def _check_settings(c, out: str, tok, shard_bytes: int | None) -> dict:
    """``build.json``: fixed by the first prepare of ``out``; a resume with other settings is refused.
    ``shard_bytes`` None: the recorded one (a new store: ``DEFAULT_SHARD_BYTES``)."""
    settings = _settings(c, tok, DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes)
    path = storage.join(out, "build.json")
    if not storage.create_new(path, json.dumps(settings, indent=1).encode()):
        started = json.loads(storage.read_text(path))
        if shard_bytes is None and "shard_bytes" in started:
            settings["shard_bytes"] = started["shard_bytes"]
        _refuse_other_settings(out, started, settings)
    return settings


def _plain(value):
    """A config value as build.json holds it (JSON: lists, not tuples; ConfigDicts as dicts)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    return json.loads(json.dumps(value, default=str))


def _finalize_settings(c, out: str, started: dict, flags: set[str] | None, shard_bytes: int | None) -> dict:
    """A finalize writes what the shard builds recorded (``started``); each data config key in ``flags``
    that the user set (None: all of ``c``) and ``shard_bytes`` (when given) must agree with it."""
    now = json.loads(json.dumps(started))   # a copy, changed where the user set a flag
    if flags is None:
        tok = _given_or_stored_tokenizer(c, out)
        if tok is None:
            raise DataError(f"--finalize: token store {out} holds no tokenizer.json: run tieflax prepare (with "
                            "each --shard i/N) before finalizing")
        now = _settings(c, tok, started.get("shard_bytes", DEFAULT_SHARD_BYTES) if shard_bytes is None
                        else shard_bytes)
    else:
        if "tokenizer" in flags or "tokenizer.path" in flags:
            _given_or_stored_tokenizer(c, out)   # another tokenizer than the store's: refused naming it
            if "tokenizer" in now and (bool(c.tokenizer.path) != ("given" in now["tokenizer"])):
                made = _settings_tokenizer(c)   # given <-> trained: every field of how it was made differs
                now["tokenizer"] = {**made, **{k: now["tokenizer"][k] for k in ("eos_token", "bos_token")
                                               if k in now["tokenizer"]}}
        for key in sorted(flags):
            head, _, rest = key.partition(".")
            if head == "source" and not rest and "data" in now:
                now["data"]["source"] = c.source
            elif head in ("python_stdlib", "files", "hf") and "data" in now:
                if not rest:
                    now["data"][head] = _plain(c[head])
                    continue
                *parents, leaf = rest.split(".")
                node, value = now["data"].setdefault(head, {}), c[head]
                for part in parents:
                    node, value = node.setdefault(part, {}), value[part]
                node[leaf] = _plain(value[leaf])
            elif head in ("val_fraction", "split_seed") and not rest and "split" in now:
                now["split"][head] = _plain(c[head])
            elif head == "tokenizer" and rest in ("vocab_size", "min_frequency", "eos_token", "bos_token") \
                    and "tokenizer" in now and (rest.endswith("_token") or "trained" in now["tokenizer"]):
                now["tokenizer"][rest] = _plain(c.tokenizer[rest])   # a given tokenizer ignores the BPE's
        if shard_bytes is not None and "shard_bytes" in now:
            now["shard_bytes"] = shard_bytes
    _refuse_other_settings(out, started, now)
    return started


def _check_parts(out: str) -> dict:
    """Read-only, before a finalize: every input shard is tokenised. Returns ``inputs.json``."""
    try:
        inputs = json.loads(storage.read_text(storage.join(out, "inputs.json")))
    except FileNotFoundError:
        raise DataError(f"token store {out}: no input shard has been tokenised yet; run tieflax prepare "
                        "(with each --shard i/N) before finalizing") from None
    ledger = st.finished_parts(out)
    missing = [k for k in range(inputs["input_shards"]) if k not in ledger]
    if missing:
        raise DataError(f"token store {out}: {len(missing)} of {inputs['input_shards']} input shards are not "
                        f"tokenised yet (e.g. {missing[:4]}); run the remaining tieflax prepare --shard i/N "
                        "before finalizing")
    return inputs


def _differences(started, now, prefix: str = "") -> list[str]:
    """``'field: saved -> new'`` for every leaf that differs (nested dicts followed, keys sorted)."""
    if isinstance(started, dict) and isinstance(now, dict):
        return [d for k in sorted(set(started) | set(now), key=str)
                for d in _differences(started.get(k), now.get(k), f"{prefix}{k}.")]
    return [] if started == now else [f"{prefix.rstrip('.')}: {started!r} -> {now!r}"]


def cut_shards(items: Iterable, size: Callable[[object], int], shard_bytes: int) -> Iterator[tuple[int, list]]:
    """The input shards of a stream of ``items``: ``(index of the shard's first item, [items])``, each shard
    closed once its items' sizes add up to ``shard_bytes`` or more, the last with what is left.

    The one rule both executors cut by: the pool cuts the documents (size: characters of text), the Ray
    plan their lengths alone (``prepare_ray``); shard ``k`` holds the same documents either way, so its
    part, and the store's digest, are the same."""
    batch: list = []
    first = total = 0
    for item in items:
        batch.append(item)
        total += size(item)
        if total >= shard_bytes:
            yield first, batch
            first, batch, total = first + len(batch), [], 0
    if batch:
        yield first, batch


def _text_size(doc) -> int:
    return len(doc.text)


def worker_setup(c, out: str, tok, settings: dict) -> tuple:
    """The arguments of :func:`_init_worker`: what every worker (a pool process, a Ray task) tokenises with."""
    return tok.to_str(), out, c.val_fraction, c.split_seed, settings["dtype"]


def _tokenise(c, out: str, tok, settings: dict, *, workers: int, shard: tuple[int, int], shard_bytes: int,
              say) -> dict:
    """Streams the corpus into input shards and tokenises this machine's unfinished ones in a pool of
    ``workers`` processes; returns the tokens it tokenised and the workers' CPU seconds (``tokens``,
    ``worker_cpu_s``)."""
    i, n = shard
    done = set(st.finished_parts(out))
    pending: set = set()
    stats = {"parts": 0, "tokens": 0, "cpu": 0.0, "t0": time.perf_counter(), "last": 0.0, "skipped": 0}

    def collect(block: bool):
        ready, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED if block else cf.ALL_COMPLETED,
                           timeout=None if block else 0)
        for f in ready:
            pending.discard(f)
            count_part(stats, *f.result())
        now = time.perf_counter()
        if now - stats["last"] > 2.0:
            stats["last"] = now
            rate = stats["tokens"] / max(now - stats["t0"], 1e-9)
            say(f"tokenised {stats['parts']} input shards ({stats['skipped']} done before), "
                f"{stats['tokens'] / 1e6:.2f}M tokens, {rate / 1e6:.2f}M tokens/s")

    # Workers die with this process (a kill -9 leaves none behind) and are killed when the block fails.
    shards = docs = 0
    with worker_pool(workers, _init_worker, worker_setup(c, out, tok, settings)) as pool:
        _start_workers(pool, workers)
        for first, batch in cut_shards(iter_documents(c), _text_size, shard_bytes):
            k, shards, docs = shards, shards + 1, first + len(batch)
            if k % n != i:
                continue
            if k in done:
                stats["skipped"] += 1
                continue
            while len(pending) >= 2 * workers:  # bounded: at most 2 shards per worker in memory
                collect(block=True)
            pending.add(pool.submit(tokenise_part, k, first, [d.text for d in batch]))
        while pending:
            collect(block=True)
    record_inputs(c, out, shards, docs)
    say(finished_line(stats, f"{workers} workers"))
    return {"tokens": stats["tokens"], "worker_cpu_s": stats["cpu"]}


def count_part(stats: dict, k: int, tokens: int, cpu: float) -> None:
    """Adds one finished input shard (what :func:`tokenise_part` returned) to a build's running counts."""
    del k
    stats["parts"] += 1
    stats["tokens"] += tokens
    stats["cpu"] += cpu


def finished_line(stats: dict, who: str) -> str:
    """The line that ends the tokenising step: shards, tokens, rate, and who did it (``who``)."""
    wall = time.perf_counter() - stats["t0"]
    return (f"tokenised {stats['parts']} input shards ({stats['skipped']} done before): {stats['tokens']:,} tokens "
            f"in {wall:.1f} s, {stats['tokens'] / max(wall, 1e-9) / 1e6:.2f}M tokens/s ({who})")


def record_inputs(c, out: str, shards: int, docs: int) -> None:
    """``inputs.json``: how many input shards and documents the corpus has, fixed by the first build that
    read it whole; a later build that counts others is refused (the corpus changed), as is an empty one."""
    if docs == 0:
        raise DataError(f"data.source = {c.source!r} produced no documents: the corpus is empty; check "
                        "its settings (paths, dataset, text field).")
    inputs = {"input_shards": shards, "documents": docs}
    path = storage.join(out, "inputs.json")
    if not storage.create_new(path, json.dumps(inputs).encode()):
        if json.loads(storage.read_text(path)) != inputs:
            raise DataError(f"token store {out}: the corpus changed since this store was started "
                            f"({json.loads(storage.read_text(path))} before, {inputs} now); use another --out")


# ------------------------------------------------------------------------------------------- finalize

def finalize(out: str, settings: dict, *, say=lambda text: None) -> dict:
    """Parts -> each split's stream, document offsets and counts; then ``manifest.json``, created once."""
    inputs = _check_parts(out)
    ledger = st.finished_parts(out)
    parts = [ledger[k] for k in range(inputs["input_shards"])]
    eos, bos, dtype, vocab = settings["eos_id"], settings["bos_id"], np.dtype(settings["dtype"]), settings["vocab_size"]
    splits = {}
    for split in st.SPLITS:
        docs = sum(p[split]["documents"] for p in parts)
        if docs == 0:
            raise DataError(f"token store {out}: the {split} split has no documents ({inputs['documents']} in "
                            "all); add documents or raise data.val_fraction")
        tokens = sum(p[split]["tokens"] for p in parts) + (2 * docs if bos is not None else docs + 1)
        splits[split] = {"tokens": tokens, "documents": docs}
    counts = np.zeros(vocab, np.int64)
    arrays = {}  # name -> (the opened array, sha256 of its contents)
    for split in st.SPLITS:
        with _writing(out, split):
            arrays.update(_write_split(out, split, splits[split], parts, eos, bos, dtype,
                                       counts if split == "train" else None))
        say(f"wrote {split}: {splits[split]['tokens']:,} tokens, {splits[split]['documents']:,} documents")
    with _writing(out, "train/token_counts"):
        arr = st.create_array(storage.join(out, "train", "token_counts"), vocab, "int64")
        arr[:].write(counts).result()
    arrays["train/token_counts"] = arr, hashlib.sha256(st.le_bytes(counts)).hexdigest()
    digest = hashlib.sha256(json.dumps({k: settings[k] for k in ("tokenizer_digest", "eos_id", "bos_id",
                                                                  "dtype", "split")}, sort_keys=True).encode())
    for p in parts:
        digest.update(p["digest"].encode())
    manifest = {**{k: settings[k] for k in ("format", "vocab_size", "eos_id", "bos_id", "dtype",
                                            "tokenizer_digest", "split", "data")},
                "splits": splits, "input_shards": inputs["input_shards"], "digest": digest.hexdigest(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if st.CHECKSUMS:
        manifest["checksums"] = st.CHECKSUMS
        manifest["arrays"] = {}
        for name in st.ARRAYS:
            arr, sha = arrays[name]
            sizes = st.object_bytes(arr)
            # The sizes come from the layout; the objects just written must match them before they are
            # recorded, or every later open would refuse a sound store.
            st.check_objects(out, name, sizes)
            manifest["arrays"][name] = {"sha256": sha, "objects": sizes}
    if not storage.create_new(st.manifest_path(out), json.dumps(manifest, indent=1).encode()):
        return st.read_manifest(out)  # another finalize committed first; same parts, same content
    say(f"committed {out} (digest {manifest['digest'][:16]})")
    return manifest


@contextlib.contextmanager
def _writing(out: str, name: str):
    """tensorstore's failed writes under ``out/name`` as the OS error they are (a full disk: ENOSPC, naming
    the file, which the console shows as one line with the fix), or a DataError naming the array."""
    try:
        yield
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        text = str(e)
        code = re.search(r"os_error_code='(\d+)'", text)
        where = re.search(r'local file "([^"]+)"', text)
        path = where.group(1) if where else storage.join(out, *name.split("/"))
        if code:
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None
        raise DataError(f"token store {out}: writing {name} failed ({text.splitlines()[0][:300]}): check the disk "
                        "or the bucket, then rerun tieflax prepare (finalize writes the arrays again from the "
                        "kept parts)") from None


def _write_split(out: str, split: str, info: dict, parts: list[dict], eos: int, bos: int | None,
                 dtype: np.dtype, counts: np.ndarray | None) -> dict:
    """One split's packed stream and offsets, buffered to whole array shards: each shard one write.
    Returns ``{name: (array, sha256 of what was written)}`` for ``<split>/tokens`` and ``<split>/doc_offsets``."""
    tokens = st.create_array(storage.join(out, split, "tokens"), info["tokens"], dtype.name)
    offsets = st.create_array(storage.join(out, split, "doc_offsets"), info["documents"] + 1, "int64")
    shard = tokens.chunk_layout.write_chunk.shape[0]
    buf: list[np.ndarray] = []
    buffered = written = 0
    doc_offsets = []
    sha = hashlib.sha256()

    def flush(final: bool):
        nonlocal buf, buffered, written
        if not buffered:
            return
        data = np.concatenate(buf)
        cut = len(data) if final else (len(data) // shard) * shard
        if cut:
            tokens[written:written + cut].write(data[:cut]).result()
            sha.update(st.le_bytes(data[:cut]))
            if counts is not None:
                counts[:] += np.bincount(data[:cut], minlength=len(counts))[:len(counts)]
            written += cut
        buf, buffered = ([data[cut:]] if cut < len(data) else []), len(data) - cut

    at = 0
    for k, p in enumerate(parts):
        if not p[split]["documents"]:
            continue
        part = st.read_part(out, k, digest=p["digest"])
        lengths, ids = part[f"{split}_lengths"], part[f"{split}_tokens"].astype(dtype, copy=False)
        per_doc = lengths + (2 if bos is not None else 1)
        starts = np.concatenate([[0], np.cumsum(per_doc)[:-1]]).astype(np.int64)
        stream = np.empty(int(per_doc.sum()), dtype)
        body = np.ones(len(stream), bool)
        body[starts] = False
        stream[starts] = eos if bos is None else bos
        if bos is not None:
            ends = starts + per_doc - 1
            body[ends] = False
            stream[ends] = eos
        stream[body] = ids
        doc_offsets.append(at + starts)
        at += len(stream)
        buf.append(stream)
        buffered += len(stream)
        if buffered >= shard:
            flush(final=False)
    if bos is None:
        buf.append(np.array([eos], dtype))
        buffered += 1
    flush(final=True)
    doc_offsets.append(np.array([at], np.int64))
    if written != info["tokens"]:
        raise DataError(f"token store {out}: wrote {written} {split} tokens but the ledger counts "
                        f"{info['tokens']}: the parts are damaged; delete the store and prepare again")
    doc_offsets = np.concatenate(doc_offsets)
    offsets[:].write(doc_offsets).result()
    return {f"{split}/tokens": (tokens, sha.hexdigest()),
            f"{split}/doc_offsets": (offsets, hashlib.sha256(st.le_bytes(doc_offsets)).hexdigest())}


def parse_shard(text: str) -> tuple[int, int]:
    """``'i/N'`` -> ``(i, N)``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise DataError(f"--shard {text!r}: write it as i/N, e.g. --shard 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise DataError(f"--shard {text!r}: need 0 <= i < N")
    return i, n


def print_progress(text: str) -> None:
    print(f"tieflax prepare: {text}", file=sys.stderr, flush=True)
