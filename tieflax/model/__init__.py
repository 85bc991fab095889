"""Models: ``TransformerLM`` and its ``ModelConfig``."""

from tieflax.model.config import ConfigError, ModelConfig
from tieflax.model.transformer import TransformerLM, embedding_matrices, head_loss_kwargs

__all__ = ["ConfigError", "ModelConfig", "TransformerLM", "embedding_matrices", "head_loss_kwargs"]
