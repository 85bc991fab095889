"""Diagnostics of a trained run: any checkpoint of a workdir, with its data's token counts and batches.

``analyze_workdir(run_dir)`` is what ``tieflax analyze`` runs: it reads the latest (or a given)
checkpoint's parameters, the unigram counts of the run's train split, one train batch (for the gradient
split) and a few validation batches (for the softmax statistics), and returns every diagnostic.
Everything runs on the host's default device without a mesh: analysis models are small enough, and for
pod-sized ones ``max_rows`` bounds the pairwise and spectral work.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from tieflax import storage
from tieflax.run import identity
from tieflax.run.layout import ANALYSIS_DIR, RunDir
from tieflax import strict_json as jsonable
from tieflax.errors import UserError
from tieflax.analysis.diagnostics import embedding_diagnostics
from tieflax.analysis.frequency import as_matrix
from tieflax.analysis.geometry import pairwise_cosines, row_cosines
from tieflax.analysis.gradients import split_embedding_gradients
from tieflax.analysis.softmax import softmax_diagnostics


# ------------------------------------------------------------------------------------------ checkpoints
def checkpoint_steps(run_dir: RunDir | str) -> list[int]:
    """Steps with a complete checkpoint in ``run_dir`` (ascending; empty when none): a ``RunDir``, or the
    path of a study's run (resolved and checked here, once)."""
    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415

    run_dir = RunDir.of(run_dir)
    if not storage.is_dir(ckpt.checkpoint_dir(run_dir)):
        return []
    # This process's own reader: compare analyses on process 0 alone (a manager of every process would
    # wait at orbax's barrier for the others, which are training the next run).
    with ckpt.read_manager(run_dir, this_process_only=True) as manager:
        return sorted(manager.all_steps())


def load_params_at(run_dir: RunDir | str, step: int | None = None) -> tuple[Any, dict, int]:
    """``(config, params, step)`` of ``run_dir``'s checkpoint ``step`` (latest when None); params as host
    NumPy arrays. ``run_dir``: a ``RunDir``, or the path of a study's run (resolved and checked here, once).

    Only the parameters are read (a partial restore of the ``state`` item), never the optimizer state.
    """
    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415

    run_dir = RunDir.of(run_dir)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"{run_dir.path!r} has no checkpoint; train first (tieflax train --workdir ...)")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"{run_dir.path!r} has no checkpoint at step {step}; it has steps {steps}")
    return ckpt.load_latest_params(run_dir, step)


# --------------------------------------------------------------------------------------------- batches
def analysis_data(config, run_dir: RunDir | str, n_val_batches: int = 2, max_sequences: int = 0) -> dict:
    """``{'token_counts' [V] int64, 'train_batch', 'val_batches'}`` for the data of the run in ``run_dir``
    (its tokenizer and token cache; a ``RunDir`` or a path), as host NumPy.

    The train batch is the first of the run's own shuffle (seed ``config.seed``): the same batch for every
    checkpoint and every variant of a comparison, so their gradients are comparable. ``max_sequences``
    (0 = all) keeps only the first sequences of each batch: analysis runs on one device, unsharded, so a
    pod-sized global batch must be cut down.
    """
    from tieflax.data import make_loader, prepare_dataset  # noqa: PLC0415

    t = config.train
    prepared = prepare_dataset(config.data, str(run_dir), vocab_size=config.model.vocab_size)
    train = make_loader(prepared, "train", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                        seed=config.seed)
    train_batch = dict(next(iter(train)))
    val = make_loader(prepared, "val", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                      seed=config.seed, shuffle=False, num_epochs=1)
    val_batches = []
    for batch in val:
        if len(val_batches) >= n_val_batches:
            break
        val_batches.append(dict(batch))
    if max_sequences:
        cut = lambda b: {k: np.asarray(v)[:max_sequences] for k, v in b.items()}  # noqa: E731
        train_batch, val_batches = cut(train_batch), [cut(b) for b in val_batches]
    return dict(token_counts=np.asarray(prepared.token_counts), train_batch=train_batch,
                val_batches=val_batches, data_dir=str(prepared.data_dir))


# ------------------------------------------------------------------------------------------- analysis
@functools.lru_cache(maxsize=16)
def _softmax_fn(model_config, token_block: int):
    """One jitted (params, batch) -> (lse [N], summed probabilities [V_pad]) per config: the forward pass
    and the blockwise softmax statistics compile together, once for every checkpoint of a run."""
    from tieflax.analysis.softmax import block_statistics  # noqa: PLC0415
    from tieflax.model import TransformerLM, head_loss_kwargs  # noqa: PLC0415

    model = TransformerLM(model_config)
    kw = head_loss_kwargs(model_config)

    def fn(params, batch):
        hidden, weight, bias = model.apply({"params": params}, batch["inputs"], batch.get("positions"),
                                           batch.get("segment_ids"), method=TransformerLM.features)
        return block_statistics(hidden.reshape(-1, hidden.shape[-1]), weight, bias, token_block=token_block,
                                vocab_size=model_config.vocab_size, logit_scale=kw["logit_scale"],
                                softcap=kw["softcap"])

    return jax.jit(fn)


def softmax_analysis(model_config, params: dict, batches: list[dict], token_counts,
                     n_buckets: int = 4, token_block: int = 1024) -> dict:
    """:func:`softmax_diagnostics` over ``batches`` (targets < 0 excluded from the per-token numbers)."""
    if not batches:
        raise ValueError("softmax_analysis needs at least one batch; the validation split is empty")
    fn = _softmax_fn(model_config, token_block)
    lses, targets = [], []
    prob_sum = np.zeros(model_config.vocab_size, np.float64)
    n_positions = 0
    for b in batches:
        lse, probs = fn(params, b)
        t = np.asarray(b["targets"]).reshape(-1)
        lse = np.asarray(lse, np.float64)
        lses.append(lse[t >= 0])
        targets.append(t[t >= 0])
        # Mean probability over every position (a position's distribution exists whether or not its
        # target is scored).
        prob_sum += np.asarray(probs, np.float64)[:model_config.vocab_size]
        n_positions += t.size
    out = softmax_diagnostics(np.concatenate(lses), prob_sum / n_positions, token_counts,
                              np.concatenate(targets), n_buckets)
    out["tokens"] = int(sum(len(x) for x in lses))
    return out


COS_BINS = np.linspace(-1.0, 1.0, 81)


def _cos_hist(w, vocab_size: int, max_rows: int | None, seed: int) -> list[int]:
    """Histogram (counts over ``COS_BINS``) of pairwise row cosines: small to store, enough to plot."""
    return np.histogram(pairwise_cosines(w, vocab_size, max_rows, seed), bins=COS_BINS)[0].tolist()


def analyze_params(model_config, params: dict, token_counts, *, train_batch: dict | None = None,
                   val_batches: list[dict] | None = None, loss_options: dict | None = None,
                   n_buckets: int = 4, max_rows: int | None = 2048, seed: int = 0,
                   with_arrays: bool = False) -> dict:
    """Every diagnostic of one set of parameters, nested (see :func:`embedding_diagnostics`), plus
    ``softmax`` (when ``val_batches``) and ``gradient`` (when ``train_batch``: the split gradient of that
    batch's mean loss). ``with_arrays`` adds ``arrays``: per-row data for plots (norms, counts, histograms of
    sampled pairwise cosines, row cosines of W_in and W_out), as lists.
    """
    counts = np.asarray(token_counts)
    lookup = head = None
    if train_batch is not None:
        lookup, head = split_embedding_gradients(model_config, params, train_batch, **(loss_options or {}))
    out = embedding_diagnostics(params, counts, lookup_grad=lookup, head_grad=head, n_buckets=n_buckets,
                                max_rows=max_rows, seed=seed)
    if val_batches:
        out["softmax"] = softmax_analysis(model_config, params, val_batches, counts, n_buckets)
    if with_arrays:
        v = counts.size
        w_in = params["embed"]["embedding"]
        w_out = params["lm_head"]["embedding"] if "lm_head" in params else w_in
        arrays = dict(counts=counts.tolist(),
                      norm_input=np.linalg.norm(as_matrix(w_in, v), axis=1).tolist(),
                      norm_output=np.linalg.norm(as_matrix(w_out, v), axis=1).tolist(),
                      cos_bins=COS_BINS.tolist(),
                      cos_hist_input=_cos_hist(w_in, v, max_rows, seed),
                      cos_hist_output=_cos_hist(w_out, v, max_rows, seed))
        if "lm_head" in params:
            arrays["row_cos_in_out"] = row_cosines(w_in, w_out, v).tolist()
        if lookup is not None:
            gl, gh = as_matrix(lookup, v), as_matrix(head, v)
            arrays["grad_norm_lookup"] = np.linalg.norm(gl, axis=1).tolist()
            arrays["grad_norm_head"] = np.linalg.norm(gh, axis=1).tolist()
        out["arrays"] = arrays
    return out


def analyze_workdir(run_dir: RunDir | str, *, step: int | None = None, n_val_batches: int = 2, n_buckets: int = 4,
                    max_rows: int | None = 2048, out_dir: str | None = None, plots: bool = True) -> dict:
    """Diagnostics of ``run_dir``'s checkpoint ``step`` (latest when None), written as JSON (and PNGs).
    ``run_dir``: the command's ``RunDir`` (``Run.read``'s), or a path (a notebook's), resolved and checked
    here, once.

    Writes ``<out_dir or run_dir/analysis>/step_<step>.json`` (without the per-row arrays) and, with
    ``plots``, ``step_<step>_norm_vs_frequency.png`` and ``step_<step>_cosines.png``. Returns the
    dict, with arrays, and ``paths``.
    """
    from tieflax.config import model_config as to_model_config  # noqa: PLC0415

    run_dir = RunDir.of(run_dir)  # the run folder canonical, once: the result names it so
    workdir = run_dir.path
    vocab = identity.load_workdir_config(run_dir).model.vocab_size
    if n_buckets > vocab:  # before the checkpoint and the data are read
        raise UserError(f"--buckets {n_buckets}: more frequency buckets than the {vocab} tokens of the run's "
                        f"vocabulary ({workdir}); use at most {vocab} (default 4)")
    config, params, step = load_params_at(run_dir, step)
    mc = to_model_config(config)
    data = analysis_data(config, run_dir, n_val_batches)
    result = analyze_params(mc, params, data["token_counts"], train_batch=data["train_batch"],
                            val_batches=data["val_batches"], loss_options=analysis_loss_options(config),
                            n_buckets=n_buckets, max_rows=max_rows, with_arrays=True)
    result.update(step=int(step), workdir=workdir, data_dir=data["data_dir"],
                  config_history=identity.history_lines(run_dir))  # when and how its config changed
    out_dir = out_dir or run_dir.file(ANALYSIS_DIR)
    storage.makedirs(out_dir)
    paths = {"json": storage.join(out_dir, f"step_{step}.json")}
    storage.write_text(paths["json"], jsonable.dumps(without_arrays(result), indent=1))
    if plots:
        from tieflax.analysis import plots as plotting  # noqa: PLC0415

        name = "tied" if result["tied"] else "untied"
        paths["norm_vs_frequency"] = plotting.norm_vs_frequency(
            {name: result}, storage.join(out_dir, f"step_{step}_norm_vs_frequency.png"))
        paths["cosines"] = plotting.cosine_histograms(
            {name: result}, storage.join(out_dir, f"step_{step}_cosines.png"))
    result["paths"] = paths
    return result


def analysis_loss_options(config) -> dict:
    """The training loss's block sizes (and z-loss / smoothing), so the gradient is the trained one's."""
    t = config.train
    return dict(z_loss=t.z_loss, label_smoothing=t.label_smoothing, token_block=t.loss_token_block or None,
                vocab_block=t.loss_vocab_block or None)


def without_arrays(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "arrays"}
