"""Byte-level BPE tokenizers (Hugging Face ``tokenizers``): train, save, load, and check against a model.

A trained tokenizer is saved as ``<workdir>/tokenizer.json`` and reused on every later run in that
workdir, so a run's token ids never change under it. To retrain, delete that file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Iterable, Iterator

import ml_collections
import tokenizers
from tokenizers import Tokenizer

from tieflax import storage
from tieflax.data.config import DataError

TOKENIZER_FILE = "tokenizer.json"
log = logging.getLogger(__name__)


# The trainer's cost grows with its longest word: one whitespace-free megabyte (a minified file, a base64
# blob, 1 MB of "a") made no progress for minutes. Runs of non-space (or of space) characters longer than
# this are cut into pieces of this length before the trainer sees them (each piece a text of its own, so
# no separator is learnt); encoding is unchanged. Recorded in a token store's build.json.
MAX_PIECE_CHARS = 1024
_LONG_RUN = re.compile(r"\S{%d,}|\s{%d,}" % (MAX_PIECE_CHARS + 1, MAX_PIECE_CHARS + 1))


def capped_pieces(texts: Iterable[str], stats: dict | None = None) -> Iterator[str]:
    """``texts`` with every run of more than :data:`MAX_PIECE_CHARS` non-space (or space) characters cut
    into pieces of that length, each yielded alone; ``stats["runs_cut"]`` counts the runs cut."""
    stats = {} if stats is None else stats
    stats.setdefault("runs_cut", 0)
    for text in texts:
        at = 0
        for m in _LONG_RUN.finditer(text):
            stats["runs_cut"] += 1
            if m.start() > at:
                yield text[at:m.start()]
            for a in range(m.start(), m.end(), MAX_PIECE_CHARS):
                yield text[a:min(a + MAX_PIECE_CHARS, m.end())]
            at = m.end()
        if at == 0:
            yield text
        elif at < len(text):
            yield text[at:]


def train_bpe(texts: Iterable[str], *, vocab_size: int, eos_token: str,
              min_frequency: int = 2, length: int | None = None, stats: dict | None = None) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) of exactly ``vocab_size`` ids trained on ``texts``.

    ``eos_token`` is the only special token and gets id 0. Every byte has a token, so any text
    encodes. Training is deterministic for a given input order. A corpus too small to learn
    ``vocab_size`` distinct merges is an error, since the model's vocabulary would not match.

    Runs longer than :data:`MAX_PIECE_CHARS` are cut first (``stats["runs_cut"]``). The trainer runs in a
    child process fed through a pipe (``tieflax.data.workers``): the Rust trainer never returns to Python
    while it works, so in this process a SIGTERM or Ctrl-C could not stop it; here it stops it at once
    (the child is killed), and the child dies with this process.
    """
    from tieflax.data import workers  # noqa: PLC0415

    stats = {} if stats is None else stats
    stats["max_piece_chars"] = MAX_PIECE_CHARS
    tok = Tokenizer.from_str(workers.run_bpe_trainer(
        capped_pieces(texts, stats), vocab_size=vocab_size, eos_token=eos_token, min_frequency=min_frequency,
        length=length))
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise DataError(
            f"the corpus is too small to train a BPE of data.tokenizer.vocab_size = {vocab_size}: it "
            f"yields only {got} tokens. Lower data.tokenizer.vocab_size (and the model's vocab size) to "
            f"{got}, lower data.tokenizer.min_frequency, or add text.")
    return tok


def save_tokenizer(tok: Tokenizer, path) -> None:
    """Writes ``tok`` to ``path`` whole (through ``tieflax.storage``: a temporary file renamed locally, one
    object on a bucket), so concurrent processes never read half a file. The bytes ``tok.save`` writes."""
    storage.write_text(str(path), tok.to_str(pretty=True))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` (ours, or a published one such as Llama-3's; local or on a
    bucket), read through ``tieflax.storage``."""
    path = str(path)
    if not storage.is_file(path):
        raise DataError(f"tokenizer file {path} does not exist: fix data.tokenizer.path, or leave it "
                        "empty to train a BPE on the corpus.")
    try:
        return Tokenizer.from_str(storage.read_text(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"tokenizer file {path} is not a valid tokenizer.json ({e}); replace it or "
                        "delete it to retrain.") from e


def tokenizer_vocab_size(tok: Tokenizer) -> int:
    """Ids the tokenizer can emit, special tokens included (Llama-3: 128,256)."""
    return tok.get_vocab_size(with_added_tokens=True)


def tokenizer_digest(tok: Tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON: changes whenever any id could change."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def eos_id_of(tok: Tokenizer, eos_token: str) -> int:
    """The id of ``eos_token``, or a :class:`DataError` naming the field to fix."""
    eos = tok.token_to_id(eos_token)
    if eos is None:
        special = [t.content for t in tok.get_added_tokens_decoder().values()][:8]
        raise DataError(f"the tokenizer has no token data.tokenizer.eos_token = {eos_token!r}; set it "
                        f"to one of its special tokens, e.g. {special}.")
    return eos


def bos_id_of(tok: Tokenizer, bos_token: str) -> int | None:
    """The id of ``bos_token``, None when it is '' (no BOS), or a :class:`DataError`."""
    if not bos_token:
        return None
    bos = tok.token_to_id(bos_token)
    if bos is None:
        special = [t.content for t in tok.get_added_tokens_decoder().values()][:8]
        raise DataError(f"the tokenizer has no token data.tokenizer.bos_token = {bos_token!r}; set it "
                        f"to one of its special tokens, e.g. {special}, or to '' for none.")
    return bos


def check_vocab_size(tokenizer_vocab: int, model_vocab: int, *, where: str,
                     allow_smaller_tokenizer: bool = False) -> None:
    """The model's vocabulary must be the tokenizer's: a clear error otherwise.

    ``allow_smaller_tokenizer``: a published model's embedding is often padded past its tokenizer (Qwen2.5:
    151,665 tokens in a 151,936-row embedding); the extra rows are never an input or a target.
    """
    if tokenizer_vocab == model_vocab or (allow_smaller_tokenizer and tokenizer_vocab < model_vocab):
        return
    raise DataError(
        f"the model's vocab_size = {model_vocab} does not match the tokenizer's {tokenizer_vocab} "
        f"({where}). Set the model's vocab_size to {tokenizer_vocab}, or change the tokenizer "
        "(data.tokenizer.vocab_size / data.tokenizer.path; delete <workdir>/tokenizer.json to "
        "retrain it).")


def bpe_key(c: ml_collections.ConfigDict, texts: Iterable[str]) -> str:
    """SHA-256 of everything a trained BPE depends on: its texts in order, the trainer's settings and the
    ``tokenizers`` version (another version may learn other merges)."""
    h = hashlib.sha256(json.dumps({"tokenizers": tokenizers.__version__, "vocab_size": c.tokenizer.vocab_size,
                                   "min_frequency": c.tokenizer.min_frequency, "eos": c.tokenizer.eos_token,
                                   "max_piece_chars": MAX_PIECE_CHARS}, sort_keys=True).encode())
    for text in texts:
        h.update(text.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def resolve_tokenizer(c: ml_collections.ConfigDict, workdir,
                      train_docs: list, *, shared_cache=None) -> Tokenizer:
    """The run's tokenizer: ``<workdir>/tokenizer.json`` if present, else the given or a trained one.

    A given tokenizer (``data.tokenizer.path``) is copied into the workdir; a workdir copy that differs
    from it is an error, since the workdir's checkpoints were trained on the copy's ids. With a data cache
    shared by runs (``shared_cache``, see :func:`tieflax.data.config.shared_cache_dir`), a trained BPE is
    also kept there as ``bpe-<key16>.json`` (:func:`bpe_key`) and the next run on the same texts and
    settings copies it instead of training: training is deterministic, so the ids are the same.
    """
    saved = storage.join(str(workdir), TOKENIZER_FILE)  # the workdir as prepare_dataset resolved it
    if c.tokenizer.path:
        given = load_tokenizer(c.tokenizer.path)
        if storage.is_file(str(saved)):
            if tokenizer_digest(load_tokenizer(saved)) != \
                    tokenizer_digest(given):
                raise DataError(
                    f"{saved} differs from data.tokenizer.path = {c.tokenizer.path!r}: this workdir "
                    "was trained with the former. Use a new workdir, or delete the workdir copy if "
                    "no checkpoint depends on it.")
        else:
            save_tokenizer(given, saved)
        return given
    if storage.is_file(str(saved)):
        tok = load_tokenizer(saved)
        got = tokenizer_vocab_size(tok)
        if got != c.tokenizer.vocab_size:
            raise DataError(
                f"{saved} has {got} tokens but data.tokenizer.vocab_size = {c.tokenizer.vocab_size}. "
                f"Set data.tokenizer.vocab_size = {got} to keep it, or delete it (and the run's "
                "checkpoints) to train a new one.")
        return tok
    cached = None
    if shared_cache is not None:
        cached = storage.join(str(shared_cache), f"bpe-{bpe_key(c, (d.text for d in train_docs))[:16]}.json")
        if storage.is_file(cached):
            tok = load_tokenizer(cached)
            log.info("the %d-token byte-level BPE of these documents is in the data cache: %s",
                     c.tokenizer.vocab_size, cached)
            save_tokenizer(tok, saved)
            return tok
    log.info("training a %d-token byte-level BPE on %d documents", c.tokenizer.vocab_size,
             len(train_docs))
    tok = train_bpe((d.text for d in train_docs), vocab_size=c.tokenizer.vocab_size,
                                  eos_token=c.tokenizer.eos_token,
                                  min_frequency=c.tokenizer.min_frequency, length=len(train_docs))
    save_tokenizer(tok, saved)
    if cached is not None:
        save_tokenizer(tok, cached)  # whole or absent (see save_tokenizer): a concurrent run reads either
    return tok
