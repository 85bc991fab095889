"""Pure measures for the 2026 claims the study answers (``tieflax compare``'s "From the literature" table).
One concern's two sides: the measures here (arrays in, numbers out); their table, intervals and verdicts in
``tieflax.study.literature``.

- **Unembedding bias** (Lopardo et al., arXiv 2603.26663): how alike a tied matrix is to an untied
  model's input embedding and to its head: linear CKA over the vocabulary rows
  (:func:`compare`, the formula of :func:`tieflax.analysis.geometry.linear_cka`) and the overlap of each
  row's k nearest neighbours (:func:`knn_overlap`); :func:`alignment` gives both for one tied matrix
  against one untied pair.
- **Which path drives the tied matrix** (same paper): the ratio of the head path's gradient norm to the
  lookup path's over training, early and late (:func:`path_ratio`), from the trainer's logged
  ``grad_norm/embed_head`` and ``grad_norm/embed_lookup``.
- **Lens by layer** (tuned lens, Belrose et al., arXiv 2303.08112): how much a range of layers lowers a
  lens's loss (:func:`layer_contribution`); the translators themselves are trained as Belrose et al. train
  them, by KL to the model's final distribution (:mod:`tieflax.analysis.lens`).
- **Rare-token gains** (Leviathan, arXiv 2601.22040): per-document loss by equal-token-mass bin of the
  target token (:func:`bin_sums`); the share the rarest bins carry is a ratio of sums
  (:func:`tieflax.analysis.stats.two_level_ratio`).

Every function computes in float64 on the host and reads only what it is given.
"""

from __future__ import annotations

import math

import numpy as np

from tieflax.analysis.frequency import as_matrix
from tieflax.analysis.geometry import sample_rows

HEAD_KEY, LOOKUP_KEY = "grad_norm/embed_head", "grad_norm/embed_lookup"


# --------------------------------------------------------------------------------- unembedding bias
def _unit(w: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(w, axis=1, keepdims=True)
    return w / np.where(n > 0, n, 1.0)


def nearest_neighbours(matrix, k: int = 10, queries: np.ndarray | None = None, block: int = 1024) -> np.ndarray:
    """Indices [q, k] of the ``k`` rows of ``matrix`` [n, d] with the largest cosine to each query row (a row
    is never its own neighbour), nearest first; ``queries``: row indices (default every row). Ties are
    broken by the lower index, so the result is deterministic. Cosines in float32 (the order of two
    neighbours closer than float32 resolves is not a property of the matrix)."""
    u = _unit(as_matrix(matrix)).astype(np.float32)
    n = len(u)
    if not 1 <= k < n:
        raise ValueError(f"k={k} nearest neighbours need 1 <= k < n = {n} rows")
    q = np.arange(n) if queries is None else np.asarray(queries)
    out = np.empty((len(q), k), np.int64)
    for start in range(0, len(q), block):
        idx = q[start:start + block]
        sim = u[idx] @ u.T                               # [b, n]
        sim[np.arange(len(idx)), idx] = -np.inf          # not its own neighbour
        cand = np.sort(np.argpartition(-sim, k, axis=1)[:, :k + 1], axis=1)   # k + 1 candidates, by index
        order = np.argsort(-np.take_along_axis(sim, cand, axis=1), axis=1, kind="stable")  # ties: lower index
        out[start:start + len(idx)] = np.take_along_axis(cand, order, axis=1)[:, :k]
    return out


def representation(matrix, rows=None, k: int = 10, max_rows: int | None = 1024, seed: int = 0) -> dict:
    """What :func:`compare` needs of one matrix, computed once: its ``rows`` (token ids; default every
    row) centred (linear CKA) and the ``k`` nearest neighbours of a fixed sample of ``max_rows`` query rows
    (``seed``; the same queries for every matrix of the same row count)."""
    w = as_matrix(matrix)
    if rows is not None:
        w = w[np.asarray(rows)]
    queries = sample_rows(len(w), max_rows, seed)
    centred = w - w.mean(0)
    return dict(centred=centred, gram=float(np.linalg.norm(centred.T @ centred)), queries=queries,
                neighbours=nearest_neighbours(w, k, queries), k=int(k), n=int(len(w)))


def compare(a: dict, b: dict) -> dict:
    """Linear CKA (:func:`tieflax.analysis.geometry.linear_cka`, the same formula) and the k-nearest-
    neighbour overlap (:func:`knn_overlap`) of two :func:`representation` s of the same rows."""
    if a["n"] != b["n"] or a["k"] != b["k"] or not np.array_equal(a["queries"], b["queries"]):
        raise ValueError("the two representations must hold the same rows, queries and k")
    den = a["gram"] * b["gram"]
    cka = float(np.linalg.norm(b["centred"].T @ a["centred"]) ** 2 / den) if den > 0 else float("nan")
    hits = (a["neighbours"][:, :, None] == b["neighbours"][:, None, :]).sum((1, 2))
    return dict(cka=cka, knn=float(hits.mean() / a["k"]))


def knn_overlap(a, b, k: int = 10, max_rows: int | None = 1024, seed: int = 0) -> float:
    """Mean over query rows of ``|N_a(i) & N_b(i)| / k``: the share of each row's ``k`` nearest neighbours
    (cosine) that two representations of the same rows agree on. 1 = the same neighbourhoods; two unrelated
    matrices give about ``k / (n - 1)``. Query rows: a fixed sample of ``max_rows`` (``seed``); neighbours
    are searched among every row."""
    x, y = as_matrix(a), as_matrix(b)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"the two matrices must hold the same rows, got {x.shape[0]} and {y.shape[0]}")
    return compare(representation(x, None, k, max_rows, seed), representation(y, None, k, max_rows, seed))["knn"]


def alignment_of(tied: dict, untied_input: dict, untied_output: dict) -> dict:
    """:func:`alignment` from :func:`representation` s (each matrix's work done once)."""
    i, o = compare(tied, untied_input), compare(tied, untied_output)
    out = dict(cka_input=i["cka"], cka_output=o["cka"], knn_input=i["knn"], knn_output=o["knn"])
    out["cka_diff"] = out["cka_output"] - out["cka_input"]
    out["knn_diff"] = out["knn_output"] - out["knn_input"]
    out.update(rows=tied["n"], k=tied["k"], knn_chance=tied["k"] / (tied["n"] - 1))
    return out


def alignment(tied, untied_input, untied_output, rows=None, k: int = 10, max_rows: int | None = 1024,
              seed: int = 0) -> dict:
    """How alike ``tied`` is to an untied model's input embedding and to its head, over the same ``rows``
    (token ids; default every row): ``cka_input``, ``cka_output``, ``knn_input``, ``knn_output`` and the
    differences ``cka_diff`` / ``knn_diff`` = like the head - like the input (> 0: the tied matrix is more
    like a head). ``knn_chance``: what two unrelated matrices overlap by, ``k / (n - 1)``."""
    rep = lambda m: representation(m, rows, k, max_rows, seed)  # noqa: E731
    return alignment_of(rep(tied), rep(untied_input), rep(untied_output))


# ------------------------------------------------------------------------------ which path drives
def path_ratio(rows: list[dict], num_steps: int, frac: float = 0.1) -> dict:
    """The head path's gradient norm over the lookup path's, from a tied run's logged training rows.

    ``rows``: metric rows (``step``, :data:`HEAD_KEY`, :data:`LOOKUP_KEY`; each the mean over its log
    interval). Returns ``steps`` and ``log_ratio`` (natural log of head / lookup per logged row),
    ``early`` (mean log ratio over the rows of the first ``frac`` of ``num_steps``; the first row when no
    row falls there), ``late`` (the rows after ``(1 - frac) num_steps``; else the last row) and
    ``early_rows`` / ``late_rows``. A log ratio > 0: the head path's gradient is the larger. NaN (and no
    rows) when the run logged no tied gradient norms.
    """
    pts = sorted((int(r["step"]), float(r[HEAD_KEY]), float(r[LOOKUP_KEY])) for r in rows
                 if HEAD_KEY in r and LOOKUP_KEY in r and r.get("split", "train") == "train")
    pts = [(s, h, g) for s, h, g in pts if h > 0 and g > 0 and math.isfinite(h) and math.isfinite(g)]
    if not pts:
        return dict(steps=[], log_ratio=[], early=float("nan"), late=float("nan"), early_rows=0, late_rows=0)
    steps = [s for s, _, _ in pts]
    logs = [math.log(h / g) for _, h, g in pts]
    early = [x for s, x in zip(steps, logs) if s <= frac * num_steps] or logs[:1]
    late = [x for s, x in zip(steps, logs) if s > (1 - frac) * num_steps] or logs[-1:]
    return dict(steps=steps, log_ratio=logs, early=float(np.mean(early)), late=float(np.mean(late)),
                early_rows=len(early), late_rows=len(late))


# ----------------------------------------------------------------------------------------- lenses
def layer_contribution(doc_loss: list, first: int, last: int) -> np.ndarray:
    """Per document, how much the layers ``first+1 .. last`` lower a lens's summed loss:
    ``doc_loss[first] - doc_loss[last]`` ([L+1][D] per-layer summed losses -> [D])."""
    d = np.asarray(doc_loss, np.float64)
    return d[first] - d[last]


# ------------------------------------------------------------------------------------ rare tokens
def bin_sums(losses, targets, doc_ids, token_bins, n_docs: int, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Summed loss and scored tokens per (document, frequency bin of the target): ``[D, B]`` each.

    ``losses`` [...] per-token loss, ``targets`` [...] target ids (< 0 ignored), ``doc_ids`` [...] the
    document of each position, ``token_bins`` [V] the bin of every token id (:func:`mass_bins`)."""
    y = np.asarray(targets).reshape(-1)
    keep = y >= 0
    cell = np.asarray(doc_ids).reshape(-1)[keep] * n_bins + np.asarray(token_bins)[y[keep]]
    loss = np.bincount(cell, weights=np.asarray(losses, np.float64).reshape(-1)[keep], minlength=n_docs * n_bins)
    tokens = np.bincount(cell, minlength=n_docs * n_bins).astype(np.float64)
    return loss.reshape(n_docs, n_bins), tokens.reshape(n_docs, n_bins)
