"""Everything the study measures on one trained run (its final parameters against its initial ones).

``measure_run`` returns plain floats and lists (JSON-able), per run:

- ``val``: the loss summed per held-out document over the *whole* validation split (``doc_loss`` [D],
  ``doc_tokens`` [D], documents in split order, so runs on the same data pair document by document),
  ``loss`` (token-weighted mean) and the contextual anisotropy of the final hidden states (Ethayarajh:
  mean cosine between distinct scored positions), at the end and at init.
- ``matrices[side]`` for ``input`` (W_in) and ``output`` (W_out; the same matrix when tied): the
  frequency profile and unit-row anisotropy (:mod:`tieflax.analysis.measures`) at the end (``final``),
  at init (``init``) and for the row-shuffled control (``shuffled``), and the movement from init.
- ``gradient``: lookup and head gradients averaged over K held-out batches, their interference raw and
  Adam-preconditioned, a row-shuffled control, and magnitude-aware updated fractions; at the end and at
  init. For an untied model the same numbers are the control: what the two paths would do to one matrix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tieflax.analysis import measures
from tieflax.analysis.gradients import split_embedding_gradients


# ------------------------------------------------------------------------------------ validation
def document_ids(inputs: np.ndarray, opener_id: int) -> np.ndarray:
    """Document index of every position's *target*, for rows read in split order.

    inputs: [R, T] the input ids of every validation row, in order (unshuffled, one epoch). The split is
    one stream in which ``opener_id`` opens each document and every stream token is an input exactly once,
    so the target at a position belongs to the document whose opener is the last one at or before its
    input: ``cumsum(inputs == opener) - 1`` over the flattened rows. Returns int64 [R, T].
    """
    flat = np.asarray(inputs).reshape(-1)
    return (np.cumsum(flat == opener_id) - 1).reshape(np.shape(inputs))


@functools.lru_cache(maxsize=16)
def _val_fn(model_config, loss_options: tuple):
    """(params, batch) -> (per-token loss [B, T], sum of unit hidden states [d], sum of their squared
    norms, scored positions): one jitted program per config for every batch and both parameter sets."""
    from tieflax.model import TransformerLM

    model = TransformerLM(model_config)

    def fn(params, batch):
        args = (batch["inputs"], batch["targets"], batch.get("positions"), batch.get("segment_ids"))
        loss, _ = model.apply({"params": params}, *args, method=TransformerLM.loss, **dict(loss_options))
        hidden = model.apply({"params": params}, batch["inputs"], batch.get("positions"),
                             batch.get("segment_ids"), method=TransformerLM.hidden_states)
        h = hidden.reshape(-1, hidden.shape[-1]).astype(jnp.float32)
        keep = (batch["targets"].reshape(-1) >= 0).astype(jnp.float32)
        u = h / jnp.maximum(jnp.linalg.norm(h, axis=-1, keepdims=True), 1e-12) * keep[:, None]
        return jnp.where(batch["targets"] >= 0, loss, 0.0), u.sum(0), (u * u).sum(), keep.sum()

    return jax.jit(fn)


def validation(model_config, params: dict, batches: list[dict], doc_ids: list[np.ndarray], n_docs: int,
               loss_options: dict, init_params: dict | None = None, init_batches: int = 2) -> dict:
    """Per-document summed loss over ``batches`` (the whole validation split) and contextual anisotropy."""
    fn = _val_fn(model_config, tuple(sorted(loss_options.items())))
    doc_loss = np.zeros(n_docs)
    doc_tokens = np.zeros(n_docs)
    usum, sq, n = 0.0, 0.0, 0.0
    for batch, ids in zip(batches, doc_ids):
        loss, u, s, k = fn(params, batch)
        keep = np.asarray(batch["targets"]) >= 0
        doc_loss += np.bincount(ids[keep], weights=np.asarray(loss, np.float64)[keep], minlength=n_docs)
        doc_tokens += np.bincount(ids[keep], minlength=n_docs)
        usum, sq, n = usum + np.asarray(u, np.float64), sq + float(s), n + float(k)
    out = dict(doc_loss=doc_loss.tolist(), doc_tokens=doc_tokens.tolist(),
               loss=float(doc_loss.sum() / doc_tokens.sum()),
               context_cos=measures.mean_cosine_from_sum(usum, sq, int(n)))
    if init_params is not None:
        usum, sq, n = 0.0, 0.0, 0.0
        for batch in batches[:init_batches]:
            _, u, s, k = fn(init_params, batch)
            usum, sq, n = usum + np.asarray(u, np.float64), sq + float(s), n + float(k)
        out["context_cos_init"] = measures.mean_cosine_from_sum(usum, sq, int(n))
    return out


# -------------------------------------------------------------------------------------- matrices
def _matrices(params: dict) -> dict:
    w_in = params["embed"]["embedding"]
    return {"input": w_in, "output": params["lm_head"]["embedding"] if "lm_head" in params else w_in}


def matrix_measures(w, w0, counts, n_bins: int, max_rows: int | None, seed: int = 0) -> dict:
    """Profile and anisotropy of ``w`` (final), ``w0`` (init) and row-shuffled ``w``; movement w - w0."""
    v = counts.size
    perm = np.random.default_rng(seed + 1).permutation(v)
    wf, wi = measures.as_matrix(w, v), measures.as_matrix(w0, v)

    def both(m):
        return dict(profile=measures.frequency_profile(m, counts, n_bins),
                    aniso=measures.unit_anisotropy(m, counts, max_rows, seed))

    return dict(final=both(wf), init=both(wi), shuffled=both(wf[perm]),
                movement=measures.row_movement(wf, wi, counts, n_bins),
                movement_shuffled=measures.row_movement(wf[perm], wi[perm], counts, n_bins))


# -------------------------------------------------------------------------------------- gradients
def gradient_measures(model_config, params: dict, batches: list[dict], counts, n_bins: int,
                      loss_options: dict, seed: int = 0) -> dict:
    """Interference of the lookup and head paths on gradients averaged over ``batches`` (held out)."""
    v = counts.size
    gl = gh = nu = None
    for b in batches:
        lk, hd = split_embedding_gradients(model_config, params, b, **loss_options)
        lk, hd = measures.as_matrix(lk, v), measures.as_matrix(hd, v)
        gl = lk if gl is None else gl + lk
        gh = hd if gh is None else gh + hd
        nu = (lk + hd) ** 2 if nu is None else nu + (lk + hd) ** 2
    k = len(batches)
    gl, gh, nu = gl / k, gh / k, nu / k
    perm = np.random.default_rng(seed + 2).permutation(v)
    out = measures.accumulated_interference(gl, gh, nu, counts, n_bins)
    out["shuffled"] = measures.accumulated_interference(gl, gh[perm], nu, counts, n_bins)
    out["updated"] = measures.updated_fractions(gl, gh, counts, n_bins=n_bins)
    out["batches"] = k
    return out


def measure_run(model_config, params: dict, init_params: dict, counts, *, val_batches: list[dict],
                doc_ids: list[np.ndarray], n_docs: int, grad_batches: list[dict], loss_options: dict,
                n_bins: int = 8, max_rows: int | None = 1024, with_arrays: bool = False) -> dict:
    """Every measurement of one run (see the module docstring). ``counts``: [V] train unigram counts."""
    counts = np.asarray(counts)
    eval_options = dict(loss_options, z_loss=0.0, label_smoothing=0.0)
    out = dict(tied="lm_head" not in params)
    out["val"] = validation(model_config, params, val_batches, doc_ids, n_docs, eval_options, init_params)
    final, init = _matrices(params), _matrices(init_params)
    sides = ("input",) if out["tied"] else ("input", "output")
    out["matrices"] = {s: matrix_measures(final[s], init[s], counts, n_bins, max_rows) for s in sides}
    if out["tied"]:
        out["matrices"]["output"] = out["matrices"]["input"]
    out["gradient"] = dict(
        final=gradient_measures(model_config, params, grad_batches, counts, n_bins, loss_options),
        init=gradient_measures(model_config, init_params, grad_batches, counts, n_bins, loss_options))
    if with_arrays:
        v = counts.size
        out["arrays"] = dict(counts=counts.tolist(), **{
            f"{key}_{s}": np.linalg.norm(measures.as_matrix(m, v) - (measures.as_matrix(init[s], v)
                                                                  if key == "move" else 0), axis=1).tolist()
            for s in ("input", "output") for key, m in (("norm", final[s]), ("move", final[s]))})
    return out
