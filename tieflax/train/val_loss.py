"""The validation loss (what ``tieflax val-loss`` prints; "validate" elsewhere means checking a config):
the mean cross-entropy of a run's parameters on the validation split (``run_eval``), of a run's latest
checkpoint (``evaluate_run``), and the final interval's training loss across restarts."""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import Mesh

from tieflax.hardware import distributed
from tieflax import sharding as shd
from tieflax.config import model_config
from tieflax.run import checkpoints as ckpt
from tieflax.run.layout import RunDir
from tieflax.train.step import TrainingError, build, make_eval_step, setup_mesh


def run_eval(eval_step: Callable, params: Any, prepared, config: ml_collections.ConfigDict,
             mesh: Mesh) -> dict[str, float]:
    """Mean validation cross-entropy over ``config.train.eval_batches`` batches (0 = the whole split)."""
    from tieflax.data import make_loader, to_global_batch  # noqa: PLC0415

    t = config.train
    loader = make_loader(prepared, "val", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                         seed=config.seed, shuffle=False, num_epochs=1)
    totals = {"loss_sum": 0.0, "tokens": 0, "correct": 0, "invalid_labels": 0}
    outs = []
    for i, batch in enumerate(loader):
        if t.eval_batches and i >= t.eval_batches:
            break
        outs.append(eval_step(params, to_global_batch(batch, mesh)))
        if len(outs) > 1:
            # Each batch's collectives span the processes: waiting on the one before (one batch stays in
            # flight behind it) bounds the wait batch by batch, so a host that stopped arriving is named
            # instead of every other host waiting forever in the final read.
            with distributed.waiting_for_others(f"validation batch {len(outs) - 1}"):
                jax.block_until_ready(outs[-2])
    with distributed.waiting_for_others("the validation's last batch"):
        outs = jax.device_get(outs)
    for out in outs:
        for k in totals:
            totals[k] += out[k]
    if totals["invalid_labels"]:
        raise TrainingError(f"validation data has {totals['invalid_labels']} labels >= config.model."
                            f"vocab_size={config.model.vocab_size}; the tokenizer and the model disagree.")
    n = max(int(totals["tokens"]), 1)
    loss = float(totals["loss_sum"]) / n
    return {"loss": loss, "perplexity": perplexity(loss), "accuracy": totals["correct"] / n, "tokens": n}


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(700) so a diverged loss gives a float, not an overflow."""
    return float(math.exp(min(loss, 700.0)))


def final_interval_loss(rows: list[dict], step: int, log_every: int, *, fallback: float) -> float:
    """Mean cross-entropy over the steps of the last log interval ending at ``step``, from the logged
    rows: a run stopped (SIGTERM) and resumed inside that interval logged it as several rows, each with
    ``interval_steps``, and their step-weighted mean is the loss an uninterrupted run reports. Rows are
    followed back from ``step``, so rows of an abandoned attempt (killed before its checkpoint) are
    skipped."""
    by_step = {r["step"]: r for r in rows}
    boundary = ((step - 1) // log_every) * log_every
    total = count = 0.0
    at = step
    while at > boundary:
        row = by_step.get(at)
        if row is None or "interval_steps" not in row or "ce_loss" not in row:
            return fallback
        total += float(row["ce_loss"]) * row["interval_steps"]
        count += row["interval_steps"]
        at -= int(row["interval_steps"])
    return total / count if count and at == boundary else fallback


def evaluate_run(config: ml_collections.ConfigDict, where: RunDir | str) -> dict[str, Any]:
    """Validation loss and perplexity of the run's latest checkpoint, on ``config``'s mesh. ``where``: the
    run (``Run.read(...).dir``), or its path (resolved and checked here).

    The mesh may differ from the one the run trained on: parameters restore onto this run's shardings.
    Returns ``{'step', 'loss', 'perplexity', 'accuracy', 'tokens'}``.
    """
    from tieflax.data import prepare_dataset  # noqa: PLC0415

    where = RunDir.of(where)
    mc = model_config(config)
    mesh = setup_mesh(config)
    prepared = prepare_dataset(config.data, where.path, vocab_size=mc.vocab_size)
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        params, step = ckpt.restore_latest_params(where, s.abstract_state["params"])
        out = run_eval(make_eval_step(config, s), params, prepared, config, mesh)
    return {"step": step, **out}
