"""tieflax: tied vs untied input/output embeddings in JAX/Flax language models."""

__version__ = "0.1.0"
