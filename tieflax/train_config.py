"""Every default of training (optimiser, schedule, loss, checkpoints, logging), in one place.

The experiment config holds this as ``config.train``. Model numerics live in ``config.model``: bf16
compute with fp32 parameters is ``model.dtype='bfloat16'`` (``model.param_dtype`` stays ``'float32'``).
The mesh is ``config.mesh``; the data pipeline is ``config.data``.
"""

from __future__ import annotations

import ml_collections

from tieflax.config_rules import INF, Range, check_section
from tieflax.errors import ConfigError


def default_train_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seq_len = 128
    c.global_batch_size = 16          # sequences per optimiser step, across all processes
    c.grad_accum_steps = 1            # micro-batches per step (global_batch_size must divide)
    c.num_steps = 1000
    c.learning_rate = 3e-3
    c.warmup_steps = 100
    c.min_lr_ratio = 0.1              # cosine decays to learning_rate * min_lr_ratio
    c.adam_b1 = 0.9
    c.adam_b2 = 0.95
    c.adam_eps = 1e-8
    c.weight_decay = 0.1
    c.decay_embeddings = False        # apply weight decay to embedding / head matrices
    c.embedding_optimizer = "adam"    # 'adam', or 'sgd': SGD + momentum 0.9 on embedding matrices (ablation)
    c.embedding_sgd_lr = 1.0          # peak rate of that SGD (same warmup and cosine as learning_rate)
    # Tied models: the lookup (input) path's gradient into the shared matrix is multiplied by this before
    # the two paths are summed (the intervention of Lopardo et al., arXiv 2603.26663); 1.0 = the plain
    # tied gradient, bit for bit. Untied models refuse any other value.
    c.tied_input_grad_scale = 1.0
    c.decay_norms_and_biases = False
    c.grad_clip_norm = 1.0
    c.z_loss = 0.0
    c.label_smoothing = 0.0
    c.loss_impl = "fused"             # 'fused' (blockwise, no logits) or 'dense' (full logits: baseline)
    # Fused cross-entropy tile [token block x vocab block]; 0 = the loss's default for the platform the
    # step is compiled for: 8192 x 256 on the XLA path (the cross-entropy sweep's fastest CPU setting,
    # benchmarks/README.md), the per-generation table of the Pallas kernel on a TPU (whose VMEM a
    # 8192-token tile would overflow).
    c.loss_token_block = 0
    c.loss_vocab_block = 0
    c.eval_every = 200
    c.eval_batches = 8
    c.log_every = 10
    c.checkpoint_every = 200
    c.keep_checkpoints = 3
    c.analyze_every = 0               # diagnostics interval in steps; 0 = off
    # What the console shows while training (tieflax.run.console): 'lines' (one line per log interval:
    # step, loss, learning rate, step time, tokens/s and TFLOP/s per device, MFU, memory; one line per
    # checkpoint save), 'bar' (a tqdm progress bar), 'auto' (lines when stdout is not a terminal, else the
    # bar with the lines above it) or 'quiet' (neither: the command's final line). Resume, preemption and
    # failures get their one line in every mode.
    c.console = "auto"
    # Where the logged scalars go besides metrics/ (tieflax.run.trackers): 'tensorboard' (tensorboardX,
    # <workdir>/tensorboard/) and 'wandb' (Weights & Biases, the `wandb` extra; WANDB_MODE=offline works
    # without network). Only process 0 logs.
    c.trackers = ("tensorboard",)
    c.wandb_project = "tieflax"
    c.wandb_entity = ""               # "" = the W&B default entity
    c.wandb_name = ""                 # "" = the workdir's name
    c.wandb_group = ""
    c.wandb_tags = ()
    # (start, stop): a JAX profiler trace of steps start..stop (1-based, inclusive) into <workdir>/profile/,
    # for TensorBoard's profile plugin / xprof; () = off.
    c.profile_steps = ()
    # lm-eval tasks scored on the live parameters during training (tieflax.eval.tasks; the `eval` extra):
    # every eval_tasks_every steps (0 = at the last step only) and at the last step; results in metrics/
    # (split 'tasks'), every tracker and <workdir>/lm_eval/step_<n>/.
    c.eval_tasks = ()
    c.eval_tasks_every = 0
    c.eval_tasks_include_path = ""    # a local folder of task YAMLs
    c.eval_tasks_limit = 0.0          # items per task: 0 = every item, < 1 a fraction, else a count
    c.eval_tasks_num_fewshot = -1     # -1 = the task's own
    c.eval_tasks_batch_size = 0       # generation rows per batch; 0 = one per data x fsdp shard
    c.eval_tasks_token_budget = 4096  # tokens per log-likelihood batch
    return c


# Range of every numeric field (``tieflax.config_rules.Range``: lowest, highest, lowest allowed itself,
# highest allowed itself, why), and the fields that take one of a few values. Checked when a command opens
# its config, so a bad value never reaches the data cache, config.json or a trace.
RANGES = {
    "seq_len": Range(1, INF, True, True, "tokens per row"),
    "global_batch_size": Range(1, INF, True, True, "sequences per optimiser step"),
    "grad_accum_steps": Range(1, INF, True, True, "micro-batches per step"),
    "num_steps": Range(1, INF, True, True, "optimiser steps of the run"),
    "learning_rate": Range(0.0, INF, False, True, "a non-positive rate trains uphill or not at all"),
    "warmup_steps": Range(0, INF, True, True, "0 = no warmup"),
    "min_lr_ratio": Range(0.0, 1.0, True, True, "the cosine's end as a fraction of learning_rate"),
    "adam_b1": Range(0.0, 1.0, True, False, "Adam's first-moment decay"),
    "adam_b2": Range(0.0, 1.0, True, False, "Adam's second-moment decay"),
    "adam_eps": Range(0.0, INF, False, True, "Adam's denominator guard"),
    "weight_decay": Range(0.0, INF, True, True, "0 = none"),
    "grad_clip_norm": Range(0.0, INF, True, True, "0 = no clipping"),
    "z_loss": Range(0.0, INF, True, True, "0 = none"),
    "label_smoothing": Range(0.0, 1.0, True, False, "the probability moved to the uniform distribution"),
    "tied_input_grad_scale": Range(0.0, INF, False, True, "the factor on a tied matrix's lookup-path gradient; 1 = none"),
    "loss_token_block": Range(0, INF, True, True, "tokens per tile of the fused loss; 0 = the platform's default"),
    "loss_vocab_block": Range(0, INF, True, True, "vocabulary rows per tile of the fused loss; 0 = the default"),
    "eval_every": Range(1, INF, True, True, "steps between evaluations"),
    "eval_batches": Range(0, INF, True, True, "0 = the whole validation split"),
    "log_every": Range(1, INF, True, True, "steps between logged rows"),
    "checkpoint_every": Range(1, INF, True, True, "steps between checkpoints"),
    "keep_checkpoints": Range(1, INF, True, True, "checkpoints kept"),
    "analyze_every": Range(0, INF, True, True, "0 = off"),
    "eval_tasks_every": Range(0, INF, True, True, "steps between lm-eval scorings; 0 = at the last step only"),
    "eval_tasks_limit": Range(0.0, INF, True, True, "items per task: 0 = every item, < 1 a fraction, else a count"),
    "eval_tasks_num_fewshot": Range(-1, INF, True, True, "-1 = the task's own"),
    "eval_tasks_batch_size": Range(0, INF, True, True, "0 = one row per data x fsdp shard"),
    "eval_tasks_token_budget": Range(1, INF, True, True, "tokens per log-likelihood batch"),
}
CHOICES = {"loss_impl": ("fused", "dense"), "console": ("auto", "lines", "bar", "quiet")}
TRACKERS = ("tensorboard", "wandb")


# Every default of this section, for a hand-built section that lacks a field (``train_value``).
_DEFAULTS = default_train_config().to_dict()


def train_value(c: ml_collections.ConfigDict, field: str):
    """``c.<field>``, or its default from ``default_train_config`` (the one place defaults live) when a
    hand-built ``config.train`` lacks it."""
    return c[field] if field in c else _DEFAULTS[field]


def validate_train_config(c: ml_collections.ConfigDict) -> None:
    """Fails naming ``config.train.<field>``, its range or choices and a fix, for any value out of them
    (the tables ``RANGES`` and ``CHOICES``, checked by ``tieflax.config_rules.check_section``); then the
    fields a table cannot state (``_validate_observers``)."""
    check_section("config.train", c, RANGES, CHOICES)
    _validate_observers(c)


def _names(value) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(v, str) and v.strip() for v in value)


def _validate_observers(c: ml_collections.ConfigDict) -> None:
    """Trackers, W&B names, the profiler window and the in-training tasks (types and ranges)."""
    trackers = train_value(c, "trackers")
    if not _names(trackers) or any(t not in TRACKERS for t in trackers) or len(set(trackers)) < len(trackers):
        raise ConfigError(f"config.train.trackers = {trackers!r}: give a tuple of distinct names from {TRACKERS}, "
                          "e.g. --config.train.trackers='(\"tensorboard\", \"wandb\")', or () for none.")
    for field in ("wandb_project", "wandb_entity", "wandb_name", "wandb_group", "eval_tasks_include_path"):
        if field in c and not isinstance(c[field], str):
            raise ConfigError(f"config.train.{field} = {c[field]!r} must be a string.")
    if "wandb_tags" in c and not (c.wandb_tags == () or _names(c.wandb_tags)):
        raise ConfigError(f"config.train.wandb_tags = {c.wandb_tags!r}: give a tuple of strings, e.g. "
                          "'(\"tied\", \"d64\")'.")
    window = train_value(c, "profile_steps")
    ok = isinstance(window, (tuple, list)) and (len(window) == 0 or (
        len(window) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in window)
        and 1 <= window[0] <= window[1]))
    if not ok:
        raise ConfigError(f"config.train.profile_steps = {window!r}: give (start, stop) with 1 <= start <= stop "
                          "(steps start..stop are traced), e.g. --config.train.profile_steps='(5, 7)', or () "
                          "for no trace.")
    tasks = train_value(c, "eval_tasks")
    if not (tasks == () or _names(tasks)) or isinstance(tasks, str):
        raise ConfigError(f"config.train.eval_tasks = {tasks!r}: give a tuple of lm-eval task names, e.g. "
                          "'(\"arc_easy\",)', or () for none.")
