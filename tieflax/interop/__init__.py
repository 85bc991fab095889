"""Interoperability with other checkpoint formats: Hugging Face ``transformers`` (``tieflax.interop.hf``)."""

from tieflax.interop.hf import load_hf_checkpoint, save_hf_checkpoint
from tieflax.interop.hf_config import MODEL_TYPES, UnsupportedHFConfig, config_from_hf, config_to_hf

__all__ = ["MODEL_TYPES", "UnsupportedHFConfig", "config_from_hf", "config_to_hf", "load_hf_checkpoint",
           "save_hf_checkpoint"]
