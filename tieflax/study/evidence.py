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
- ``val.doc_bin_loss`` / ``val.doc_bin_tokens`` [D][B]: the same held-out loss split by the equal-token-mass
  bin of the target token (rare-token gains, Leviathan arXiv 2601.22040).
- ``lens``: held-out loss when the residual stream after each layer is read out through the final norm
  and the model's own head, plain (logit lens) and through a translator per layer (the tuned lens as
  Belrose et al. train it, by KL to the model's own final distribution, on the first half of the held-out
  documents, scored on the second): :func:`lens_measures`.
- :func:`bin_losses` (called by ``tieflax.study.compare.analyze_run`` at every kept checkpoint): the
  per-(document, frequency bin) held-out loss through training, for the rare-token gains over training.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tieflax.analysis import lens, literature, measures
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
    from tieflax.model import TransformerLM  # noqa: PLC0415

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
               loss_options: dict, init_params: dict | None = None, init_batches: int = 2,
               token_bins: np.ndarray | None = None, n_bins: int = 0) -> dict:
    """Per-document summed loss over ``batches`` (the whole validation split) and contextual anisotropy;
    with ``token_bins`` [V] (each token's frequency bin) also per (document, bin of the target token)."""
    fn = _val_fn(model_config, tuple(sorted(loss_options.items())))
    doc_loss = np.zeros(n_docs)
    doc_tokens = np.zeros(n_docs)
    bin_loss, bin_tokens = np.zeros((n_docs, n_bins)), np.zeros((n_docs, n_bins))
    usum, sq, n = 0.0, 0.0, 0.0
    for batch, ids in zip(batches, doc_ids):
        loss, u, s, k = fn(params, batch)
        keep = np.asarray(batch["targets"]) >= 0
        doc_loss += np.bincount(ids[keep], weights=np.asarray(loss, np.float64)[keep], minlength=n_docs)
        doc_tokens += np.bincount(ids[keep], minlength=n_docs)
        if token_bins is not None:
            bl, bt = literature.bin_sums(loss, batch["targets"], ids, token_bins, n_docs, n_bins)
            bin_loss, bin_tokens = bin_loss + bl, bin_tokens + bt
        usum, sq, n = usum + np.asarray(u, np.float64), sq + float(s), n + float(k)
    out = dict(doc_loss=doc_loss.tolist(), doc_tokens=doc_tokens.tolist(),
               loss=float(doc_loss.sum() / doc_tokens.sum()),
               context_cos=measures.mean_cosine_from_sum(usum, sq, int(n)))
    if token_bins is not None:
        out.update(doc_bin_loss=bin_loss.tolist(), doc_bin_tokens=bin_tokens.tolist())
    if init_params is not None:
        usum, sq, n = 0.0, 0.0, 0.0
        for batch in batches[:init_batches]:
            _, u, s, k = fn(init_params, batch)
            usum, sq, n = usum + np.asarray(u, np.float64), sq + float(s), n + float(k)
        out["context_cos_init"] = measures.mean_cosine_from_sum(usum, sq, int(n))
    return out


def bin_losses(model_config, params: dict, batches: list[dict], doc_ids: list[np.ndarray], n_docs: int,
               loss_options: dict, token_bins: np.ndarray, n_bins: int) -> dict:
    """The held-out loss of one checkpoint: ``loss`` (token mean) and ``doc_bin_loss`` [D][B] (summed per
    document and frequency bin of the target; the tokens per cell are the final checkpoint's
    ``doc_bin_tokens``, the same data)."""
    val = validation(model_config, params, batches, doc_ids, n_docs, loss_options, token_bins=token_bins,
                     n_bins=n_bins)
    return dict(loss=val["loss"], doc_bin_loss=val["doc_bin_loss"])


# ----------------------------------------------------------------------------------------- lenses
def _readout(module, x, targets, loss_options: dict):
    """(inside ``TransformerLM.apply``) per-token loss [B, T] of a residual stream read through the final
    norm and the model's own head (its logit scale, soft-cap and bias)."""
    from tieflax.model.transformer import head_loss_kwargs  # noqa: PLC0415
    from tieflax.ops.cross_entropy import cross_entropy  # noqa: PLC0415

    loss, _ = cross_entropy(module.final_norm(x), module.lm_head.weight(), targets,
                            bias=module.head_bias_or_none(), **head_loss_kwargs(module.config), **loss_options)
    return loss


def _readout_logits(module, x):
    """(inside ``TransformerLM.apply``) logits [n, V] of a residual stream [n, d] read through the final
    norm and the model's own head (its logit scale, soft-cap and bias), the vocabulary's columns only
    (padding columns cut off, not set to -inf, so a KL over them is finite)."""
    h = module.final_norm(x)[None]                  # the head reads [B, T, d]: here B = 1, T = the positions
    return module.lm_head(h, module.head_bias_or_none())[0, ..., :module.config.vocab_size]


@functools.lru_cache(maxsize=16)
def _lens_fns(model_config, loss_options: tuple):
    """(residuals(params, batch) -> [L+1, B, T, d] f32, readout(params, x [B, T, d], targets) -> per-token
    loss [B, T], 0 where ignored), jitted once per config: every layer and both lenses reuse one readout."""
    from tieflax.model import TransformerLM  # noqa: PLC0415

    model = TransformerLM(model_config)
    options = dict(loss_options)

    def residuals(params, batch):
        xs = model.apply({"params": params}, batch["inputs"], batch.get("positions"), batch.get("segment_ids"),
                         method=TransformerLM.residual_stream)
        return xs.astype(jnp.float32)

    def readout(params, x, targets):
        loss = model.apply({"params": params}, x.astype(jnp.dtype(model_config.dtype)), targets, options,
                           method=_readout)
        return jnp.where(targets >= 0, loss, 0.0)

    return jax.jit(residuals), jax.jit(readout)


def _logits_fn(model_config, params: dict):
    """The frozen readout the tuned lens is trained through: x [n, d] f32 -> logits [n, V] f32."""
    from tieflax.model import TransformerLM  # noqa: PLC0415

    model = TransformerLM(model_config)
    dtype = jnp.dtype(model_config.dtype)
    return lambda x: model.apply({"params": params}, x.astype(dtype), method=_readout_logits).astype(jnp.float32)


def _fit_positions(residuals, params, batches, doc_ids, first_scored: int, fit_tokens: int):
    """The residual streams at the first ``fit_tokens`` scored positions of documents ``[0, first_scored)``:
    (xs [L, n, d] layers 0..L-1, y [n, d] the final stream), float32 host arrays."""
    xs, ys = [], []
    have = 0
    for batch, ids in zip(batches, doc_ids):
        if have >= fit_tokens:
            break
        sel = (np.asarray(batch["targets"]) >= 0) & (ids < first_scored)
        if not sel.any():
            continue
        r = np.asarray(residuals(params, batch))[:, sel]            # [L+1, n, d]
        xs.append(r[:-1])
        ys.append(r[-1])
        have += sel.sum()
    if not xs:
        return None, None
    return np.concatenate(xs, axis=1)[:, :fit_tokens], np.concatenate(ys, axis=0)[:fit_tokens]


def lens_measures(model_config, params: dict, batches: list[dict], doc_ids: list[np.ndarray], n_docs: int,
                  final_doc_loss, loss_options: dict, fit_tokens: int = 8192, score_tokens: int = 0,
                  doc_tokens=None, recipe: dict | None = None) -> dict:
    """Logit lens and tuned lens by layer on the held-out split, per document.

    The documents are split in two halves in split order. On the first, one translator per layer l < L
    (the residual stream after l blocks) is trained as Belrose et al. train theirs
    (:func:`tieflax.analysis.lens.train_translators`: ``h + A h + b`` from zero, KL to the model's own final
    distribution, SGD with Nesterov momentum; ``recipe`` overrides :data:`tieflax.analysis.lens.RECIPE`)
    on at most ``fit_tokens`` of its positions, the first ones. The second half is scored, whole documents
    in split order until ``score_tokens`` scored tokens (0: every document of the half; ``doc_tokens`` [D]:
    the validation's scored tokens per document, which the cap counts). Layer 0 is the embedding output
    (before any block), layer L the model itself (``final_doc_loss``: the validation's per-document loss).

    Returns ``layers`` (L), ``fit_docs`` / ``score_docs`` (their counts), ``fit_tokens`` (positions trained
    on), ``doc_tokens`` [D] (scored tokens; 0 on the fitting half), ``logit`` and ``tuned`` [L+1][D] summed
    loss per document and layer, ``method`` ('kl'), ``recipe`` (the optimizer's settings) and ``kl`` [L]
    (each layer's KL from the final distribution on the training positions, after training); or
    ``missing`` (why nothing was measured) with too few documents or positions. The residual stream is
    ``TransformerLM.residual_stream`` (scanned layers or unrolled).
    """
    if n_docs < 2:
        return dict(missing=f"{n_docs} held-out document: the tuned lens trains on one half of the documents "
                            "and scores the other")
    residuals, readout = _lens_fns(model_config, tuple(sorted(loss_options.items())))
    n_layers = model_config.n_layers
    first_scored = n_docs - n_docs // 2          # documents [0, first_scored) train the lens, the rest are scored
    x, y = _fit_positions(residuals, params, batches, doc_ids, first_scored, fit_tokens)
    if x is None or len(y) < 2:
        return dict(missing=f"{0 if y is None else len(y)} positions in the training half of the documents: too "
                            "few to train a tuned lens")
    recipe = {**lens.RECIPE, **(recipe or {})}
    logits_fn = _logits_fn(model_config, params)
    translators, _ = lens.train_translators(x, y, logits_fn, **recipe)
    kl = [float(lens.kl_from_final(jax.nn.log_softmax(logits_fn(jnp.asarray(y)), -1),
                                   logits_fn(lens.translate(translators, i, jnp.asarray(x[i])))))
          for i in range(n_layers)]
    last_scored = n_docs  # documents [first_scored, last_scored) are scored
    if score_tokens and doc_tokens is not None:
        reached = np.cumsum(np.asarray(doc_tokens, np.float64)[first_scored:]) >= score_tokens
        last_scored = first_scored + (int(np.argmax(reached)) + 1 if reached.any() else n_docs - first_scored)
    sums = np.zeros((2, n_layers, n_docs))
    tokens = np.zeros(n_docs)
    for batch, ids in zip(batches, doc_ids):
        sel = (np.asarray(batch["targets"]) >= 0) & (ids >= first_scored) & (ids < last_scored)
        if not sel.any():
            continue
        xs = residuals(params, batch)
        for layer in range(n_layers):
            for k, h in enumerate((xs[layer], lens.translate(translators, layer, xs[layer]))):  # logit, tuned
                loss = np.asarray(readout(params, h, batch["targets"]), np.float64)
                sums[k, layer] += np.bincount(ids[sel], weights=loss[sel], minlength=n_docs)
        tokens += np.bincount(ids[sel], minlength=n_docs)
    scored = (np.arange(n_docs) >= first_scored) & (np.arange(n_docs) < last_scored)
    final = np.where(scored, np.asarray(final_doc_loss, np.float64), 0.0)
    return dict(layers=n_layers, fit_docs=int(first_scored), score_docs=int(last_scored - first_scored),
                fit_tokens=int(len(y)), doc_tokens=tokens.tolist(), logit=[*sums[0].tolist(), final.tolist()],
                tuned=[*sums[1].tolist(), final.tolist()], method="kl", recipe=recipe, kl=kl)


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
                n_bins: int = 8, max_rows: int | None = 1024, with_arrays: bool = False,
                lens_fit_tokens: int = 8192, lens_score_tokens: int = 0, lens_recipe: dict | None = None) -> dict:
    """Every measurement of one run (see the module docstring). ``counts``: [V] train unigram counts.
    ``lens_fit_tokens``: held-out positions the tuned lens fits on (0: no lens); ``lens_score_tokens``:
    about how many it scores (whole documents; 0: the whole second half of the documents); ``lens_recipe``:
    the tuned lens's optimizer settings over :data:`tieflax.analysis.lens.RECIPE`."""
    counts = np.asarray(counts)
    eval_options = dict(loss_options, z_loss=0.0, label_smoothing=0.0)
    out = dict(tied="lm_head" not in params)
    out["val"] = validation(model_config, params, val_batches, doc_ids, n_docs, eval_options, init_params,
                            token_bins=measures.mass_bins(counts, n_bins), n_bins=n_bins)
    if lens_fit_tokens:
        out["lens"] = lens_measures(model_config, params, val_batches, doc_ids, n_docs, out["val"]["doc_loss"],
                                    eval_options, fit_tokens=lens_fit_tokens, score_tokens=lens_score_tokens,
                                    doc_tokens=out["val"]["doc_tokens"], recipe=lens_recipe)
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
