"""Analysis: the pure measures of embeddings and gradients (the study that applies them is tieflax.study).

    from tieflax.analysis import training_diagnostics
    scalars = training_diagnostics(params, token_counts, lookup_grad=g_in, head_grad=g_out)

Each diagnostic is a pure function of parameters (and data statistics) whose docstring states its
definition; see ``frequency``, ``geometry``, ``gradients`` and ``softmax``; ``literature`` and ``lens`` (the
tuned lens, trained as Belrose et al. train it) hold the measures of this year's claims.
"""

from tieflax.analysis.diagnostics import embedding_diagnostics, flatten, training_diagnostics
from tieflax.analysis.frequency import frequency_buckets, frequency_norm
from tieflax.analysis.geometry import (anisotropy, effective_rank, in_out_similarity, isotropy_score,
                                       linear_cka, mean_pairwise_cosine, pairwise_cosines, row_cosines)
from tieflax.analysis.gradients import gradient_interference, split_embedding_gradients
from tieflax.analysis.softmax import softmax_diagnostics, softmax_statistics

__all__ = [
    "anisotropy", "effective_rank", "embedding_diagnostics", "flatten", "frequency_buckets",
    "frequency_norm", "gradient_interference", "in_out_similarity", "isotropy_score", "linear_cka",
    "mean_pairwise_cosine", "pairwise_cosines", "row_cosines", "softmax_diagnostics", "softmax_statistics",
    "split_embedding_gradients", "training_diagnostics",
]
