"""Exact parameter accounting from the real Flax parameter tree, with nothing materialised.

Counts come from ``jax.eval_shape`` of the model's ``init`` (shapes only). Vocabulary padding is excluded
by reading each parameter's logical axes: a dimension named ``vocab`` counts V rows, not V_pad. So the
tied and untied variants of one config differ by exactly V x d, and published totals are reproduced.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tieflax.model.config import ModelConfig
from tieflax.model.transformer import TransformerLM


def abstract_params(config: ModelConfig) -> dict:
    """The boxed parameter tree of ``config`` as ShapeDtypeStructs (``nn.Partitioned`` keeps axis names)."""
    # Traced with the einsum attention: no kernel owns a parameter, and 'auto' without a mesh traces the
    # TPU kernel too (lax.platform_dependent), half of a small model's abstract init (0.039 -> 0.018 CPU-s).
    # tests/test_params.py compares the counts with the configured model's own tree.
    model = TransformerLM(config.replace(attention="xla"))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def _leaf_count(leaf, vocab: int, padded_vocab: int) -> int:
    names = leaf.names if isinstance(leaf, nn.Partitioned) else ()
    shape = list(nn.unbox(leaf).shape)
    for axis, name in enumerate(names):
        if name == "vocab":
            shape[axis] = shape[axis] // padded_vocab * vocab
    return math.prod(shape)


def count_params(params: dict, config: ModelConfig) -> int:
    """Parameters of a (boxed, abstract or concrete) tree, excluding vocabulary padding rows."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return sum(_leaf_count(leaf, config.vocab_size, config.padded_vocab) for leaf in leaves)


@dataclasses.dataclass(frozen=True)
class ParamReport:
    """Counts for one config, as configured and with the tie switch flipped."""

    name: str
    family: str
    tied: bool
    d_model: int
    vocab_size: int
    total: int                 # as configured
    total_tied: int
    total_untied: int
    embedding_matrix: int      # one V x d (V x embed_dim when decoupled) matrix

    @property
    def share_tied(self) -> float:
        """Fraction of a tied model's parameters in its one embedding matrix."""
        return self.embedding_matrix / self.total_tied

    @property
    def share_untied(self) -> float:
        """Fraction of an untied model's parameters in its two embedding matrices."""
        return 2 * self.embedding_matrix / self.total_untied

    @property
    def non_embedding(self) -> int:
        return self.total_tied - self.embedding_matrix

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(share_tied=self.share_tied, share_untied=self.share_untied, non_embedding=self.non_embedding)
        return out


@functools.lru_cache(maxsize=256)
def _untied_counts(untied: ModelConfig) -> tuple[int, int]:
    """(total, the LM head's own matrix) of an untied config, from its one parameter tree. Cached: the
    counts depend on the config alone, and a study asks for the same few configs again and again (the
    parameter-matched search, its report, its tests); a tree is traced, not built, yet costs a model's
    trace (0.07-0.13 CPU-s for a 2-layer model)."""
    tree = abstract_params(untied)
    return count_params(tree, untied), count_params(tree["lm_head"]["embedding"], untied)


def param_report(config: ModelConfig, name: str = "") -> ParamReport:
    """Counts both variants from the untied model's own parameter tree: the tied model is that tree without
    ``lm_head/embedding``, its own V x E matrix (a decoupled width's ``out_proj`` is in ``embed`` when tied,
    in ``lm_head`` when untied: one parameter either way). So the V x d difference is measured from the
    tree, not assumed; tests/test_params.py compares it with the tied model's own tree for every
    published model. One trace instead of one per variant: a training run reports at its end."""
    untied_total, head = _untied_counts(config.replace(tie_embeddings=False, head_init_std=0.0, head_init="normal"))
    totals = {True: untied_total - head, False: untied_total}
    return ParamReport(name=name or config.family, family=config.family, tied=config.tie_embeddings,
                       d_model=config.d_model, vocab_size=config.vocab_size,
                       total=totals[config.tie_embeddings], total_tied=totals[True],
                       total_untied=totals[False],
                       embedding_matrix=config.vocab_size * (config.embed_dim or config.d_model))


def format_table(reports: list[ParamReport]) -> str:
    """A Markdown table: total as configured, one V x d matrix, embedding share tied and untied."""
    header = ("| model | d_model | vocab | configured | total params | one V x d matrix "
              "| embedding share, tied | embedding share, untied |")
    rule = "|---|---:|---:|:---:|---:|---:|---:|---:|"
    rows = [header, rule]
    for r in reports:
        rows.append(f"| {r.name} | {r.d_model:,} | {r.vocab_size:,} | {'tied' if r.tied else 'untied'} "
                    f"| {r.total:,} | {r.embedding_matrix:,} | {100 * r.share_tied:.1f}% "
                    f"| {100 * r.share_untied:.1f}% |")
    return "\n".join(rows)
