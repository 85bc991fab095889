"""All embedding diagnostics of one set of parameters: a flat scalar dict for training logs, a full one
for ``tieflax analyze`` and the compare report.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tieflax.analysis.frequency import check_counts, frequency_norm
from tieflax.analysis.geometry import anisotropy, in_out_similarity
from tieflax.analysis.gradients import gradient_interference


def _matrices(params: dict) -> tuple[Any, Any, bool]:
    if "embed" not in params or "embedding" not in params["embed"]:
        raise ValueError("params have no 'embed/embedding'; pass the model's parameter tree "
                         "(variables['params']), not the whole variables dict or a sub-tree")
    w_in = params["embed"]["embedding"]
    tied = "lm_head" not in params
    return w_in, (w_in if tied else params["lm_head"]["embedding"]), tied


def embedding_diagnostics(params: dict, token_counts, *, lookup_grad=None, head_grad=None,
                          n_buckets: int = 4, max_rows: int | None = 2048, seed: int = 0) -> dict:
    """Every parameter-level diagnostic, nested: ``{'tied', 'input', 'output', 'in_out', 'gradient'}``.

    ``input`` / ``output``: :func:`frequency_norm` and :func:`anisotropy` of W_in / W_out (for a tied model
    both describe the one matrix). ``in_out``: :func:`in_out_similarity` (untied models only).
    ``gradient``: :func:`gradient_interference`, when both gradients are given.
    """
    counts = check_counts(token_counts)
    w_in, w_out, tied = _matrices(params)
    v = counts.size
    out: dict[str, Any] = dict(tied=tied)
    sides = [("input", w_in)] + ([] if tied else [("output", w_out)])
    for name, w in sides:
        out[name] = dict(frequency_norm(w, counts, n_buckets), **anisotropy(w, v, max_rows, seed))
    if tied:
        out["output"] = out["input"]
    else:
        out["in_out"] = in_out_similarity(w_in, w_out, v)
    if (lookup_grad is None) != (head_grad is None):
        raise ValueError("pass both lookup_grad and head_grad (the two halves of the split gradient), or neither")
    if lookup_grad is not None:
        out["gradient"] = gradient_interference(lookup_grad, head_grad, counts, n_buckets)
    return out


def flatten(tree: dict, prefix: str = "") -> dict[str, float]:
    """Nested dicts of floats and lists -> ``{'a/b': x, 'a/c/0': y}``; booleans become 0/1."""
    flat: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "/"))
        elif isinstance(value, (list, tuple, np.ndarray)):
            for i, item in enumerate(value):
                flat[f"{name}/{i}"] = float(item)
        else:
            flat[name] = float(value)
    return flat


def training_diagnostics(params: dict, token_counts, *, lookup_grad=None, head_grad=None,
                         n_buckets: int = 4, max_rows: int | None = 1024, seed: int = 0
                         ) -> dict[str, float]:
    """Cheap embedding diagnostics for training logs: a flat ``{'diag/...': float}`` dict.

    Args:
      params: the model's unboxed parameter tree (``state.params``; tied or untied). Matrices are copied
        to the host in float64, so call it every ``config.train.analyze_every`` steps, not every step.
      token_counts: ``[V] int64`` unigram counts of the train split (``PreparedDataset.token_counts``).
        ``V`` decides which rows are valid: rows >= V (vocabulary padding) are ignored.
      lookup_grad, head_grad: optional, ``[V_pad, d]``, the two halves of this step's embedding gradient
        (before clipping and the optimiser): for a tied model the gradient of ``embed`` and of
        ``lm_head`` when the model is applied untied to ``untie(params)`` (they sum to the tied
        gradient; ``split_embedding_gradients`` computes them); for an untied model the gradients of
        ``embed/embedding`` and ``lm_head/embedding``. Without them the ``diag/gradient/*`` keys are
        absent.
      n_buckets: frequency buckets (rarest = 0). max_rows: row sample for pairwise/spectral statistics.

    Keys (each a float; lists become ``.../0``, ``.../1``... by bucket): ``diag/{input,output}/spearman``
    (row norm vs frequency), ``mean_norm``, ``bucket_norm/b``, ``mean_cosine``, ``isotropy``,
    ``effective_rank``; ``diag/in_out/{row_cosine_mean,row_cosine_median,cka}`` (untied);
    ``diag/gradient/{rows_lookup,rows_head,cosine_mean,conflict_fraction,norm_ratio_median,head_share,
    matrix_cosine,bucket_cosine/b,bucket_norm_ratio/b,...}``. NaN where undefined (e.g. no row updated by
    both paths). For a tied model ``diag/output/*`` repeats ``diag/input/*``.
    """
    tree = embedding_diagnostics(params, token_counts, lookup_grad=lookup_grad, head_grad=head_grad,
                                 n_buckets=n_buckets, max_rows=max_rows, seed=seed)
    tree.pop("tied")
    for side in ("input", "output"):
        tree[side] = {k: v for k, v in tree[side].items() if k != "bucket_log10_freq"}  # constant in time
    return flatten(tree, "diag/")
