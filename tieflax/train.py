"""Training: ``train_and_evaluate(config, workdir)``, one readable loop in sections.

    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny     # rerun to resume
    tieflax eval --workdir /tmp/tiny

or from Python / a notebook::

    from tieflax.config import load_config
    from tieflax.train import train_and_evaluate
    result = train_and_evaluate(load_config("configs/experiments/tiny.py"), "/tmp/tiny")

The same code runs one CPU process or a pod: parameters, optimizer state and batches are laid out on a
``(data, fsdp, tensor)`` mesh by the logical-axis rules of ``tieflax.sharding``; the loss is the fused,
vocabulary-parallel cross-entropy from the hidden states and the (tied or untied) head matrix.

Tied models are differentiated *untied*, as ``tieflax.model.tie`` describes: the untied view of the
parameters, the gradient twin of the model, and the fold of the two gradients back into the tied matrix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tieflax.data.store import StoreChanged
from tieflax.run import checkpoints as ckpt
from tieflax.run import identity, layout
from tieflax.run.layout import TOKENIZER_FILE
from tieflax import flops
from tieflax import sharding as shd
from tieflax.config import model_config, validate_config
from tieflax import storage
from tieflax.run.console import Console, device_memory
from tieflax.run.metrics import MetricWriter, metric_files, read_metrics
from tieflax.run.profiler import ProfileWindow
from tieflax.run.trackers import check_installed, open_trackers
from tieflax.model import ConfigError, ModelConfig, TransformerLM
from tieflax.model.params import param_report
from tieflax.model.tie import fold_tied_gradient, gradient_twin, untied_view
from tieflax.optim import make_optimizer
from tieflax.errors import Interrupted, UserError

log = logging.getLogger(__name__)
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions")


class TrainingError(UserError, RuntimeError):
    """Training stopped on purpose (non-finite loss, invalid labels); the message says why and what to do."""


# ================================================================================================ checks

def check_fits_mesh(config: ml_collections.ConfigDict, mc: ModelConfig, mesh_sizes: dict[str, int],
                    process_count: int) -> None:
    """Fails before anything compiles when the config cannot be laid out on the mesh, naming the field."""
    t = config.train
    data, fsdp, tensor = (mesh_sizes[a] for a in shd.MESH_AXES)

    def need(ok: bool, field: str, message: str):
        if not ok:
            raise ConfigError(f"{field}: {message}")

    need(t.grad_accum_steps >= 1, "config.train.grad_accum_steps", f"must be >= 1, got {t.grad_accum_steps}")
    need(t.global_batch_size % t.grad_accum_steps == 0, "config.train.global_batch_size",
         f"{t.global_batch_size} is not divisible by grad_accum_steps={t.grad_accum_steps}")
    micro = t.global_batch_size // t.grad_accum_steps
    need(micro % (data * fsdp) == 0, "config.train.global_batch_size",
         f"a micro-batch of {micro} sequences (global_batch_size / grad_accum_steps) cannot be split over "
         f"the data*fsdp = {data}*{fsdp} = {data * fsdp} batch shards; use a multiple of {data * fsdp}")
    need(t.global_batch_size % process_count == 0, "config.train.global_batch_size",
         f"{t.global_batch_size} is not divisible by the {process_count} processes")
    need(mc.padded_vocab % tensor == 0, "config.model.vocab_pad_multiple",
         f"the padded vocabulary {mc.padded_vocab} does not split over tensor={tensor} shards; use a "
         f"vocab_pad_multiple that is a multiple of 128 * {tensor}")
    for field, size in (("n_heads", mc.n_heads), ("n_kv_heads", mc.kv_heads), ("d_ff", mc.d_ff)):
        need(size % tensor == 0, f"config.model.{field}",
             f"{size} is not divisible by the tensor axis ({tensor}); lower config.mesh.tensor")
    need(mc.d_model % fsdp == 0, "config.mesh.fsdp",
         f"d_model={mc.d_model} is not divisible by fsdp={fsdp}")
    need(mc.position != "learned" or t.seq_len <= mc.max_seq_len, "config.train.seq_len",
         f"{t.seq_len} exceeds the learned position table (config.model.max_seq_len={mc.max_seq_len})")
    need(t.loss_impl in ("fused", "dense"), "config.train.loss_impl",
         f"{t.loss_impl!r} is not 'fused' or 'dense'")
    need(t.num_steps >= 1, "config.train.num_steps", f"must be >= 1, got {t.num_steps}")
    for field in ("log_every", "checkpoint_every", "eval_every", "keep_checkpoints"):
        need(t[field] >= 1, f"config.train.{field}", f"must be >= 1, got {t[field]}")


# ================================================================================================ model

@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything the loop needs that does not change during training."""
    model_config: ModelConfig
    mesh: Mesh
    model: TransformerLM          # the configured model (tied or not), on the mesh
    grad_model: TransformerLM     # untied twin used for differentiation (== model when untied)
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: Any          # unboxed tree of NamedSharding, like the train state
    abstract_state: Any           # unboxed tree of ShapeDtypeStruct carrying those shardings
    init_state: Callable          # rng -> sharded train state
    init_opt_state: Callable      # params -> sharded optimizer state (fresh start from given params)


def _strip_boxes(tree: Any) -> Any:
    """Removes logical-axis boxes. Unlike ``nn.unbox`` it adds no sharding constraint (the shardings are
    set explicitly through ``out_shardings``), so it also works on abstract values."""
    from flax.core import meta  # noqa: PLC0415

    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box)


def build(config: ml_collections.ConfigDict, mesh: Mesh) -> Setup:
    mc = model_config(config)
    model = TransformerLM(mc, mesh=mesh)
    grad_model = gradient_twin(model)
    init_model = TransformerLM(mc)  # no mesh: init is a tiny forward pass, parameters are identical
    tx, schedule = make_optimizer(config.train)

    def init_boxed(rng):
        rngs = {"params": rng}
        if mc.head_rng_stream != "params":
            rngs[mc.head_rng_stream] = jax.random.fold_in(rng, 1)
        params = init_model.init(rngs, jnp.zeros((1, config.train.seq_len), jnp.int32))["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    abstract_boxed = jax.eval_shape(init_boxed, jax.random.key(0))
    shardings = shd.logical_shardings(abstract_boxed, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            _strip_boxes(abstract_boxed), shardings)
    init_state = jax.jit(lambda rng: _strip_boxes(init_boxed(rng)), out_shardings=shardings)
    init_opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])
    return Setup(mc, mesh, model, grad_model, tx, schedule, shardings, abstract, init_state, init_opt_state)


# ================================================================================================ update

def _loss_options(c: ml_collections.ConfigDict, *, train: bool) -> dict:
    return dict(z_loss=c.z_loss if train else 0.0, label_smoothing=c.label_smoothing if train else 0.0,
                token_block=c.loss_token_block or None, vocab_block=c.loss_vocab_block or None)


def make_train_step(config: ml_collections.ConfigDict, s: Setup) -> Callable:
    """(state, batch) -> (state, metrics); jitted with shardings, the state donated.

    batch: ``{inputs, targets, segment_ids, positions}`` [B, T] int32, B = global batch, sharded over
    (data, fsdp). The loss is the mean over targets >= 0 of the whole batch (micro-batches included),
    plus z-loss. A step whose loss or gradient is not finite, or whose labels are out of vocabulary,
    leaves the state unchanged and raises a flag the loop checks at log and checkpoint steps.
    """
    c = config.train
    tied = s.model_config.tie_embeddings
    accum = c.grad_accum_steps
    if c.loss_impl == "dense":  # the baseline: full logits (tieflax.ops.reference.dense_cross_entropy)
        method, options = TransformerLM.dense_loss, dict(z_loss=c.z_loss, label_smoothing=c.label_smoothing)
    else:
        method, options = TransformerLM.loss, _loss_options(c, train=True)
    mesh = s.mesh

    def micro_loss(gparams, mb, n_tokens):
        loss, aux = s.grad_model.apply({"params": gparams}, mb["inputs"], mb["targets"], mb["positions"],
                                       mb["segment_ids"], method=method, **options)
        valid = (mb["targets"] >= 0) & (mb["targets"] < s.model_config.vocab_size)
        stats = dict(z_loss=aux["z_loss"].sum(), correct=(aux["correct"] & valid).sum(),
                     invalid_labels=aux["invalid_label_count"])
        return loss.sum() / n_tokens, stats

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state, batch):
        params = state["params"]
        gparams = untied_view(params) if tied else params
        n_tokens = jnp.maximum((batch["targets"] >= 0).sum(), 1).astype(jnp.float32)
        if accum == 1:
            (loss, stats), grads = grad_fn(gparams, batch, n_tokens)
        else:
            # Micro-batch k takes rows k, k + accum, ...: every device holds an equal share of each one,
            # so the split needs no data movement.
            def split(x):
                x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
                return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, shd.BATCH_AXES)))

            def body(carry, mb):
                (l, st), g = grad_fn(gparams, mb, n_tokens)
                acc_l, acc_st, acc_g = carry
                return (acc_l + l, jax.tree.map(jnp.add, acc_st, st), jax.tree.map(jnp.add, acc_g, g)), None

            zeros = (jnp.zeros((), jnp.float32),
                     dict(z_loss=jnp.zeros((), jnp.float32), correct=jnp.zeros((), jnp.int32),
                          invalid_labels=jnp.zeros((), jnp.int32)),
                     jax.tree.map(jnp.zeros_like, gparams))
            (loss, stats, grads), _ = jax.lax.scan(body, zeros, jax.tree.map(split, batch))

        metrics = {}
        if tied:
            grads, parts = fold_tied_gradient(grads, input_grad_scale=c.get("tied_input_grad_scale", 1.0))
            g_lookup, g_head = parts["lookup"], parts["head"]  # grad_norm/embed_lookup: the scaled path
            metrics["grad_norm/embed_lookup"] = optax.tree.norm(g_lookup)
            metrics["grad_norm/embed_head"] = optax.tree.norm(g_head)
            metrics["grad_norm/embed"] = optax.tree.norm(grads["embed"]["embedding"])
        else:
            metrics["grad_norm/embed_in"] = optax.tree.norm(grads["embed"]["embedding"])
            metrics["grad_norm/head_out"] = optax.tree.norm(grads["lm_head"]["embedding"])
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = s.tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)

        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (stats["invalid_labels"] == 0)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        new_state = {"step": state["step"] + 1, "params": keep(new_params, params),
                     "opt_state": keep(opt_state, state["opt_state"])}
        z = stats["z_loss"] / n_tokens
        metrics.update({
            "loss": loss, "ce_loss": loss - z, "z_loss": z, "accuracy": stats["correct"] / n_tokens,
            "grad_norm": grad_norm, "param_norm": optax.tree.norm(params),
            "learning_rate": s.schedule(state["step"]), "tokens": n_tokens,
            "invalid_labels": stats["invalid_labels"], "nonfinite": (~ok & (stats["invalid_labels"] == 0)),
        })
        return new_state, metrics

    batch_shardings = {k: shd.batch_sharding(mesh) for k in BATCH_KEYS}
    return jax.jit(step, in_shardings=(s.state_shardings, batch_shardings),
                   out_shardings=(s.state_shardings, shd.replicated(mesh)), donate_argnums=(0,))


# ================================================================================================ evals

def make_eval_step(config: ml_collections.ConfigDict, s: Setup) -> Callable:
    """(params, batch) -> {loss_sum, tokens, correct}: plain cross-entropy (no z-loss, no smoothing)."""
    options = _loss_options(config.train, train=False)

    def step(params, batch):
        loss, aux = s.model.apply({"params": params}, batch["inputs"], batch["targets"], batch["positions"],
                                  batch["segment_ids"], method=TransformerLM.loss, **options)
        valid = (batch["targets"] >= 0) & (batch["targets"] < s.model_config.vocab_size)
        return {"loss_sum": loss.sum(), "tokens": valid.sum(), "correct": (aux["correct"] & valid).sum(),
                "invalid_labels": aux["invalid_label_count"]}

    batch_shardings = {k: shd.batch_sharding(s.mesh) for k in BATCH_KEYS}
    return jax.jit(step, in_shardings=(s.state_shardings["params"], batch_shardings),
                   out_shardings=shd.replicated(s.mesh))


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
    for out in jax.device_get(outs):
        for k in totals:
            totals[k] += out[k]
    if totals["invalid_labels"]:
        raise TrainingError(f"validation data has {totals['invalid_labels']} labels >= config.model."
                            f"vocab_size={config.model.vocab_size}; the tokenizer and the model disagree.")
    n = max(int(totals["tokens"]), 1)
    loss = float(totals["loss_sum"]) / n
    return {"loss": loss, "perplexity": _perplexity(loss), "accuracy": totals["correct"] / n, "tokens": n}


def _perplexity(loss: float) -> float:
    return float(math.exp(min(loss, 700.0)))


# ================================================================================================ helpers

class _StopSignal:
    """SIGTERM, or a first SIGINT (Ctrl-C), is recorded so the loop can finish the step, checkpoint and
    exit (SIGTERM: 0, SIGINT: 130 by :class:`Interrupted`); a second SIGINT stops at once, raising
    :class:`Interrupted` where the program is (``at_step``: the last step trained). ``progress()`` gives
    the step reached. Restores the previous handlers on close."""

    def __init__(self, progress: Callable[[], int] | None = None):
        self.requested = False
        self.signum: int | None = None
        self._progress = progress
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            for s in self._previous:  # once: the clean-up on the way out (lock, last save) runs whole
                signal.signal(s, signal.SIG_IGN)
            try:
                step = self._progress() if self._progress else None
            except NameError:  # before the loop's first step
                step = None
            e = Interrupted(signal.SIGINT, "stopped at once by a second SIGINT"
                            + (f" at step {step}" if step is not None else "")
                            + ": the steps after the last finished checkpoint are lost; rerun the same "
                            "command to resume from that checkpoint")
            e.at_step = step
            raise e
        if not self.requested:
            self.signum = signum
        self.requested = True
        if signum == signal.SIGINT:
            import sys  # noqa: PLC0415

            print("tieflax: SIGINT (Ctrl-C): saving a checkpoint after this step, then exiting; Ctrl-C again "
                  "stops at once, losing the steps since the last checkpoint", file=sys.stderr, flush=True)

    def close(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def _stop_everywhere(local: bool) -> bool:
    """True if any process saw SIGTERM (all processes must stop at the same step)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return bool(np.max(multihost_utils.process_allgather(np.int32(local))))


class ProcessesStopped(ckpt.CheckpointError):
    """A save failed on some process and every process stopped at the same step. Orbax's save thread may
    still wait for the failed process at its commit barrier: the command exits without joining it."""


def _settle_saves(saves: ckpt.SaveWatch) -> None:
    """Multi-process: waits until the pending save has ended on every process, all processes polling
    together, and raises on all of them as soon as it failed on any. (A blocking wait would hang: the
    healthy processes' saves wait for the failed one at orbax's commit barrier.)"""
    from tieflax import distributed  # noqa: PLC0415

    while True:
        _raise_if_any_failed(saves.failure(wait=False), saves)
        if not distributed.any_process(saves.pending is not None):
            return
        time.sleep(0.05)


def _raise_if_any_failed(error: Exception | None, saves: ckpt.SaveWatch) -> None:
    """Every process calls this at the same step: all raise the first failing process's error, or none."""
    from tieflax import distributed  # noqa: PLC0415

    message = distributed.first_failure(str(error) if error is not None else None, "save")
    if message is not None:
        saves.abandon()
        raise ProcessesStopped(message) from error


def _close_all(*closers: Callable[[], Any]) -> None:
    """Calls every closer; raises the first failure, unless an exception is already propagating."""
    import sys  # noqa: PLC0415

    first = None
    for close in closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001
            first = first or e
    if first is not None and sys.exc_info()[1] is None:
        raise first


def _summarise(buffer: list[dict]) -> dict[str, float]:
    """Means of a log interval's per-step metrics (counts summed); fetched from device in one transfer."""
    rows = jax.device_get(buffer)
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    out["invalid_labels"] = float(sum(r["invalid_labels"] for r in rows))
    out["nonfinite"] = float(sum(r["nonfinite"] for r in rows))
    out["perplexity"] = _perplexity(out["ce_loss"])
    return out


def _diagnostics_fn():
    """``tieflax.analysis.training_diagnostics`` when that module provides it, else None."""
    try:
        from tieflax import analysis  # noqa: PLC0415

        return getattr(analysis, "training_diagnostics", None)
    except ImportError:
        return None


def setup_mesh(config: ml_collections.ConfigDict) -> Mesh:
    mesh = shd.mesh_from_config(config.mesh)
    check_fits_mesh(config, model_config(config), dict(mesh.shape), jax.process_count())
    return mesh


# ================================================================================================ the run

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       allow_change: tuple[str, ...] = ()) -> dict[str, Any]:
    """Trains ``config`` in ``workdir`` (resuming from its newest readable checkpoint) and evaluates.

    The config is validated before anything is written; the workdir is locked for the run (a second
    training there refuses) and a workdir whose import was interrupted is refused. A workdir that holds
    a run is continued only with the result fields and data it trained with (``tieflax.run.identity``):
    ``allow_change`` names the fields (or sections, e.g. ``"data"``) that may change on purpose, each
    change recorded as a config-history entry.

    Returns ``{'step', 'final_train_loss', 'final_train_perplexity', 'final_val_loss',
    'final_val_perplexity', 'params': {...counts...}, 'tokens_per_second', 'metrics_path', 'workdir',
    'preempted'}``. Raises ``ConfigError`` before compiling when the config does not fit the mesh, and
    ``TrainingError`` on a non-finite loss or invalid labels (the last good checkpoint is kept).
    """
    from tieflax.run.destinations import check_no_partial_import  # noqa: PLC0415
    from tieflax.run.lock import workdir_lock  # noqa: PLC0415

    workdir = storage.resolve(workdir)  # a malformed URL is refused here, before any work
    validate_config(config)
    check_no_partial_import(workdir)
    with workdir_lock(workdir, "train", enabled=jax.process_index() == 0) as held:
        return _train_and_evaluate(config, workdir, held, tuple(allow_change))


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, held,
                        allow_change: tuple[str, ...]) -> dict[str, Any]:
    from tieflax.data import make_loader, prepare_dataset, to_global_batch  # noqa: PLC0415

    t = config.train
    is_main = jax.process_index() == 0
    check_installed(t.trackers)  # a missing tracker package fails before any work, on every process

    # ---------------------------------------------------------------------------------------- mesh
    mc = model_config(config)
    report = param_report(mc).as_dict()
    mesh = setup_mesh(config)
    resume = identity.check_resume(workdir, config, allow_change=allow_change)  # before anything is written

    # ---------------------------------------------------------------------------------------- input
    prepared = prepare_dataset(config.data, workdir, vocab_size=mc.vocab_size)
    tokenizer_json = prepared.tokenizer.to_str() if prepared.tokenizer is not None else None
    data = identity.data_record(prepared.info, tokenizer_json)
    identity.check_data(workdir, data, resume)
    tokenizer_path = layout.path(workdir, TOKENIZER_FILE)
    if is_main and tokenizer_json is not None and not storage.is_file(tokenizer_path):
        storage.write_text(tokenizer_path, tokenizer_json)
    train_loader = make_loader(prepared, "train", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                               seed=config.seed)

    # ------------------------------------------------------------------------- model, sharding, update
    # The rules map the logical names of parameters and activations onto the mesh; inside the mesh
    # context the activations' `with_logical_constraint`s take effect.
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        train_step = make_train_step(config, s)
        eval_step = make_eval_step(config, s)

        # ------------------------------------------------------------------------------ checkpoint
        manager = ckpt.make_manager(workdir, keep=t.keep_checkpoints)
        say = (lambda line: print(f"tieflax: {line}", flush=True)) if is_main else (lambda line: None)
        start, state = ckpt.restore_newest_readable(manager, workdir, s.abstract_state, train_loader, say=say)
        if start is not None:
            say(f"resuming from step {start} ({ckpt.CHECKPOINT_DIR}/{start})")
        elif ckpt.has_initial_params(workdir):
            params = ckpt.load_initial_params(workdir, s.abstract_state["params"])
            state = {"step": jax.device_put(jnp.zeros((), jnp.int32), s.state_shardings["step"]),
                     "params": params, "opt_state": s.init_opt_state(params)}
            start = 0
            say(f"starting from {ckpt.INITIAL_PARAMS_DIR}/ (imported or converted parameters) at step 0: a fresh "
                "optimizer state and schedule, and the data from its first batch")
        else:
            state = s.init_state(jax.random.key(config.seed))
            start = 0
        identity.record(workdir, config, data, resume, start)  # config.json once; a change as a history entry
        if resume.changed and not resume.before_first_step:
            say(f"changed on purpose from step {start} on ({identity.CONFIG_HISTORY_DIR}/): "
                + "; ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in resume.changed.items()))

        # ------------------------------------------------------------------- console, trackers, profiler
        console = Console(t.console, t.num_steps, start, enabled=is_main)
        say = console.event
        writer = MetricWriter(workdir, enabled=is_main, trackers=open_trackers(
            t.trackers, workdir, config, enabled=is_main, say=say))
        profiler = ProfileWindow(t.profile_steps, workdir, enabled=is_main, say=say)
        tasks = None
        if t.eval_tasks:  # lm-eval on the live parameters (an unknown task fails here, before training)
            from tieflax.eval.tasks import TrainingTasks  # noqa: PLC0415

            tasks = TrainingTasks(config, mc, prepared.tokenizer, mesh, workdir, write=is_main)
        step_model_flops = flops.step_flops(mc, t.global_batch_size, t.seq_len).train
        stop = _StopSignal(progress=lambda: step)
        diagnostics = _diagnostics_fn() if t.analyze_every else None
        if diagnostics is not None and jax.process_count() > 1:
            # The diagnostics read whole matrices on the host, which one process of many does not hold.
            log.warning("config.train.analyze_every is ignored in multi-process runs; analyse checkpoints "
                        "with `tieflax analyze` instead")
            diagnostics = None
        if is_main and start == 0:
            writer.write_text("config", "```\n" + config.to_json_best_effort(indent=2) + "\n```")

        # ------------------------------------------------------------------------------------ loop
        buffer: list[dict] = []
        last = {"loss": float("nan"), "ce_loss": float("nan")}
        val = None
        preempted = False
        # Step time is the wall time between two log intervals' device syncs, less the time spent on
        # evaluations, scoring and diagnostics in between (``paused``); the first interval after a start
        # includes compilation and is not a throughput.
        timing = {"t0": None, "tokens": 0.0, "seconds": 0.0, "paused": 0.0, "started": time.perf_counter()}
        step = start
        saves = ckpt.SaveWatch(manager)
        announced = {"step": None}  # the save whose end is still to be reported

        @contextlib.contextmanager
        def paused():
            began = time.perf_counter()
            try:
                yield
            finally:
                timing["paused"] += time.perf_counter() - began

        def note_saved():
            """One line once the save in flight has ended (a failed one raised before this)."""
            if announced["step"] is not None and saves.pending != announced["step"]:
                console.progress(f"checkpoint of step {announced['step']} saved: "
                                 f"{ckpt.CHECKPOINT_DIR}/{announced['step']}")
                announced["step"] = None

        def health_check(summary: dict, at_step: int):
            if summary["invalid_labels"]:
                raise TrainingError(
                    f"step {at_step}: {int(summary['invalid_labels'])} target labels are >= config.model."
                    f"vocab_size={mc.vocab_size}; the data's tokenizer and the model disagree. Last good "
                    f"checkpoint: {manager.latest_step()}.")
            if summary["nonfinite"]:
                raise TrainingError(
                    f"step {at_step}: the loss or gradient became NaN/Inf (last logged loss "
                    f"{summary['loss']}). Training stopped; the last good checkpoint is step "
                    f"{manager.latest_step()}. Lower config.train.learning_rate, raise warmup_steps or "
                    "set config.train.z_loss.")

        def flush(at_step: int) -> dict:
            nonlocal buffer
            rows = buffer
            summary = _summarise(buffer)  # waits for the interval's last step
            now = time.perf_counter()
            first = None
            if timing["t0"] is not None:  # the first interval includes compilation: not a throughput
                tokens = len(buffer) * t.global_batch_size * t.seq_len
                seconds = max(now - timing["t0"] - timing["paused"], 1e-9)
                timing["seconds"] += seconds
                timing["tokens"] += tokens
                summary["step_time"] = seconds / len(buffer)
                summary["tokens_per_second"] = tokens / seconds
                summary["tokens_per_second_per_device"] = tokens / seconds / jax.device_count()
                # model TFLOP/s per device, and MFU where the devices' peak is known (tieflax/flops.py)
                summary.update(flops.throughput(step_model_flops, seconds / len(buffer), jax.devices()))
            else:
                first = now - timing["started"]
            summary.update(device_memory(jax.local_devices()))  # where the backend reports it
            buffer = []
            health_check(summary, at_step)
            # `interval_steps`: how many steps the row averages, so the final loss can span a restart
            row = {k: v for k, v in summary.items() if k != "tokens"}
            writer.write(at_step, {**row, "interval_steps": len(rows)})
            console.interval(at_step, summary, first_seconds=first, steps=len(rows))
            return summary

        try:
            while step < t.num_steps:
                profiler.before(step + 1)
                with profiler.step(step + 1):
                    batch = to_global_batch(next(train_loader), mesh)
                    state, metrics = train_step(state, batch)
                buffer.append(metrics)
                step += 1
                if profiler.ends_at(step):  # the traced steps end on the device; writing the trace is no step
                    jax.block_until_ready(state)
                    with paused():
                        profiler.after(step, state)
                console.update(1)
                at_log = step % t.log_every == 0 or step == t.num_steps
                at_ckpt = step % t.checkpoint_every == 0 or step == t.num_steps
                if jax.process_count() == 1 or at_log or at_ckpt:
                    preempted = _stop_everywhere(stop.requested)
                if at_log or at_ckpt or preempted:
                    last = flush(step)  # also the health check: never checkpoint a bad state
                # A failed background save stops the run here, not hundreds of steps on; with several
                # processes, a save that failed on any one of them stops every one at the same step.
                if jax.process_count() == 1:
                    saves.check(step)
                elif at_ckpt or preempted:
                    _settle_saves(saves)  # before orbax starts the next save (it would wait for this one)
                elif at_log:
                    _raise_if_any_failed(saves.failure(wait=False), saves)
                note_saved()
                held.check()  # the workdir's lease (object stores) is still this run's
                if (at_ckpt or preempted) and jax.process_count() == 1:
                    saves.start(step, state, train_loader)
                elif at_ckpt or preempted:  # a save refused at its start on any process stops every one
                    try:
                        saves.start(step, state, train_loader)
                        refused = None
                    except ckpt.CheckpointError as e:
                        refused = e
                    _raise_if_any_failed(refused, saves)
                if at_ckpt or preempted:
                    note_saved()  # starting this save waited for the one before
                    announced["step"] = step
                if diagnostics is not None and step % t.analyze_every == 0:
                    with paused():
                        scalars = diagnostics(state["params"], prepared.token_counts)
                    writer.write(step, {k.removeprefix("diag/"): v for k, v in scalars.items()}, split="diag")
                if step % t.eval_every == 0 or step == t.num_steps:
                    with paused():
                        val = run_eval(eval_step, state["params"], prepared, config, mesh)
                    writer.write(step, val, split="val")
                if (at_log or preempted) and jax.process_count() == 1:
                    writer.flush()  # one metrics segment per log period
                elif at_log or preempted:
                    # A bucket that stops answering fails process 0's metrics write (at the storage deadline)
                    # while the others go on to the next collective and wait there (until JAX's heartbeat
                    # timeout, then a crash): one agreement here stops every process at this log step, each
                    # with the same line (tests/test_storage_deadline.py).
                    try:
                        writer.flush()
                        lost = None
                    except storage.StorageError as e:
                        lost = e
                    _raise_if_any_failed(lost, saves)
                if tasks is not None and not preempted and (
                        step == t.num_steps or (t.eval_tasks_every and step % t.eval_tasks_every == 0)):
                    with paused():  # after the flush: a run killed while scoring has logged this step
                        scores = tasks.score(state["params"], step)
                    writer.write(step, scores, split="tasks")
                    writer.flush()
                    say(f"tasks at step {step}: " + ", ".join(
                        f"{k} {v:.4f}" for k, v in scores.items() if not k.endswith("_stderr")))
                if at_log or at_ckpt or preempted:  # the next interval's time starts after this bookkeeping
                    timing["t0"], timing["paused"] = time.perf_counter(), 0.0
                if preempted:
                    if is_main:
                        print(f"tieflax: {stop.name} received; checkpoint saved at step {step}; exiting.",
                              flush=True)
                    break
            if jax.process_count() > 1:
                _settle_saves(saves)  # the last save, ended (or failed) on every process
        except StoreChanged as e:  # the token store was deleted or replaced under the run: say at which step
            raise e.at_step(step, manager.latest_step()) from None
        finally:
            # Every resource is closed; the first failure is raised unless one is already on its way
            # (a full disk also fails the metric files' close: the failed save is the error to report).
            _close_all(lambda: profiler.close(step), console.close, writer.close, saves.close,
                       stop.close)  # saves.close waits for the last save, raises its error (the OS error last)
        note_saved()

        if val is None and not preempted:
            val = run_eval(eval_step, state["params"], prepared, config, mesh)

    if preempted and stop.signum == signal.SIGINT:  # Ctrl-C: SIGTERM's twin, ending as the shell's 130
        raise Interrupted(signal.SIGINT, f"stopped by SIGINT (Ctrl-C): checkpoint saved at step {step}; rerun "
                                         f"the same command to resume from step {step}")
    if metric_files(workdir):  # the last interval's loss across restarts, from the logged rows
        logged = read_metrics(workdir, "train")
        fallback = logged[-1]["ce_loss"] if step == start and logged else last["ce_loss"]
        last = {**last, "ce_loss": final_interval_loss(logged, step, t.log_every, fallback=fallback)}
    tokens_per_second = timing["tokens"] / timing["seconds"] if timing["seconds"] else float("nan")
    return {
        "step": step,
        "final_train_loss": last["ce_loss"],
        "final_train_perplexity": _perplexity(last["ce_loss"]),
        "final_val_loss": val["loss"] if val else float("nan"),
        "final_val_perplexity": val["perplexity"] if val else float("nan"),
        "params": report,
        "tokens_per_second": tokens_per_second,
        "metrics_path": writer.path,
        "workdir": workdir,
        "preempted": preempted,
    }


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


def evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Validation loss and perplexity of ``workdir``'s latest checkpoint, on ``config``'s mesh.

    The mesh may differ from the one the run trained on: parameters restore onto this run's shardings.
    Returns ``{'step', 'loss', 'perplexity', 'accuracy', 'tokens'}``.
    """
    from tieflax.data import prepare_dataset  # noqa: PLC0415

    mc = model_config(config)
    mesh = setup_mesh(config)
    prepared = prepare_dataset(config.data, workdir, vocab_size=mc.vocab_size)
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        params, step = ckpt.restore_latest_params(workdir, s.abstract_state["params"])
        out = run_eval(make_eval_step(config, s), params, prepared, config, mesh)
    return {"step": step, **out}
