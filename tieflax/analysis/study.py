"""The tied-vs-untied study behind ``tieflax compare``: variants, training, checkpoint analyses, report.

Variants (``config.compare.variants``), all on the same data, tokenizer, seeds and token budget:

- ``tied``: the config with ``tie_embeddings=True``.
- ``untied``: the same body, its own head: ``V x d`` more parameters, equal non-embedding parameters.
- ``untied_matched``: untied with a narrower (``match='width'``) or shallower (``match='depth'``) body so
  that its *total* parameter count equals the tied model's (the comparison of Chung et al., 2021).
  The shape is found with exact parameter accounting (``param_report``), then ``d_ff`` is solved for the
  remainder, so the totals agree to within a few hundred parameters; the report states the match.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import time
from typing import Any

import ml_collections

from tieflax.model.params import param_report

VARIANTS = ("tied", "untied", "untied_matched")
MATCH_STRATEGIES = ("width", "depth")


def default_compare_config() -> ml_collections.ConfigDict:
    """``config.compare``: what the study trains and how much it analyses."""
    c = ml_collections.ConfigDict()
    c.variants = VARIANTS
    c.match = "width"            # how untied_matched sheds parameters: 'width' (d_model, d_ff) or 'depth'
    c.seeds = (0,)               # several seeds: the report gives mean and spread
    c.analysis_points = 4        # checkpoints analysed over training (gradient interference over time)
    c.analyze_init = True        # also analyse the initial parameters (step 0; one extra compile per variant)
    c.val_batches = 2            # validation batches for the softmax statistics
    c.analysis_sequences = 16    # sequences per analysis batch (analysis runs unsharded on one device)
    c.n_buckets = 4              # frequency buckets (rarest first)
    c.max_rows = 2048            # row sample for pairwise cosines / spectra (0 = every row)
    return c


def compare_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config.compare`` completed with the defaults; errors name the bad field."""
    cc = default_compare_config()
    if "compare" in config:
        unknown = sorted(set(config.compare.keys()) - set(cc.keys()))
        if unknown:
            raise ValueError(f"config.compare has unknown field(s) {unknown}; known: {sorted(cc.keys())}")
        cc.update(config.compare)
    bad = [v for v in cc.variants if v not in VARIANTS]
    if bad or not cc.variants:
        raise ValueError(f"config.compare.variants = {tuple(cc.variants)}: choose a non-empty subset of {VARIANTS}")
    if cc.match not in MATCH_STRATEGIES:
        raise ValueError(f"config.compare.match = {cc.match!r}: choose one of {MATCH_STRATEGIES}")
    if not cc.seeds:
        raise ValueError("config.compare.seeds is empty: give at least one seed, e.g. (0,)")
    if cc.analysis_points < 1:
        raise ValueError(f"config.compare.analysis_points = {cc.analysis_points}: must be >= 1")
    return cc


# ------------------------------------------------------------------------------------- matched variant
@functools.lru_cache(maxsize=256)
def _untied_total(mc) -> int:
    return param_report(mc).total_untied


def matched_untied_config(mc, strategy: str = "width"):
    """(untied ModelConfig with total params ~= the tied model's, match info dict).

    ``width``: the largest d_model (a multiple of 2 x n_heads, so RoPE's head dimension stays even; d_ff
    scaled in proportion) whose untied total does not exceed the tied total, then d_ff solved exactly for
    the remainder. ``depth``: the most layers that fit, then d_ff solved the same way. The info dict holds
    both shapes, both totals and the relative mismatch.
    """
    if strategy not in MATCH_STRATEGIES:
        raise ValueError(f"match strategy {strategy!r}: choose one of {MATCH_STRATEGIES}")
    base = mc.replace(tie_embeddings=True, head_init="normal", head_init_std=0.0)
    target = param_report(base).total_tied
    untied = base.replace(tie_embeddings=False)
    if strategy == "width":
        step = 8 if mc.head_dim else 2 * mc.n_heads
        d = (mc.d_model // step) * step
        while d > 0:
            cand = untied.replace(d_model=d, d_ff=max(1, round(mc.d_ff * d / mc.d_model)))
            if _untied_total(cand) <= target:
                break
            d -= step
        if d <= 0:
            raise ValueError(f"no untied width of this model fits in {target:,} parameters (the two V x d "
                             "matrices alone exceed it); use config.compare.match='depth' or a larger body")
    else:
        layers = mc.n_layers
        cand = untied
        while layers > 0 and _untied_total(cand := untied.replace(n_layers=layers)) > target:
            layers -= 1
        if layers == 0:
            raise ValueError(
                f"an untied model needs {mc.vocab_size * mc.d_model:,} more parameters than the tied one, "
                f"more than {mc.n_layers} layers hold: even one layer exceeds the tied total {target:,}. "
                "Use config.compare.match='width'.")
    # Total parameters are affine in d_ff: solve for the d_ff that closes the gap.
    t0 = _untied_total(cand)
    t1 = _untied_total(cand.replace(d_ff=cand.d_ff + 1))
    d_ff = max(1, cand.d_ff + round((target - t0) / max(t1 - t0, 1)))
    matched = cand.replace(d_ff=d_ff)
    total = _untied_total(matched)
    info = dict(strategy=strategy, target_total=target, matched_total=total,
                relative_mismatch=(total - target) / target,
                tied_shape=dict(d_model=mc.d_model, n_layers=mc.n_layers, d_ff=mc.d_ff),
                matched_shape=dict(d_model=matched.d_model, n_layers=matched.n_layers, d_ff=matched.d_ff))
    return matched, info


def variant_configs(config: ml_collections.ConfigDict) -> tuple[dict[str, ml_collections.ConfigDict], dict]:
    """``({variant: full config}, matched-variant info or {})`` for ``config.compare.variants``."""
    from tieflax.config import model_config

    cc = compare_config(config)
    mc = model_config(config)
    out, info = {}, {}
    for name in cc.variants:
        cfg = copy.deepcopy(config)
        cfg.model.tie_embeddings = name == "tied"
        if name == "tied":
            cfg.model.head_init, cfg.model.head_init_std = "normal", 0.0  # meaningless when tied (validated)
        if name == "untied_matched":
            matched, info = matched_untied_config(mc, cc.match)
            for key in ("d_model", "n_layers", "d_ff"):
                cfg.model[key] = getattr(matched, key)
        model_config(cfg)  # validate now, naming the field
        out[name] = cfg
    return out, info


# -------------------------------------------------------------------------------------------- running
def _initial_params(mc, config):
    """The parameters the trainer starts from (same init call and key), for a step-0 analysis point."""
    import jax
    import jax.numpy as jnp

    from tieflax.model import TransformerLM

    rngs = {"params": jax.random.key(config.seed)}
    if mc.head_rng_stream != "params":
        rngs[mc.head_rng_stream] = jax.random.fold_in(rngs["params"], 1)
    params = jax.jit(TransformerLM(mc).init)(rngs, jnp.zeros((1, config.train.seq_len), jnp.int32))["params"]
    return jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))


def analyze_run(config: ml_collections.ConfigDict, run_dir: str, cc: ml_collections.ConfigDict) -> dict:
    """Analyses a finished run: gradient interference at step 0 (``analyze_init``) and at each kept
    checkpoint, everything (with per-row arrays for the plots) at the last one. Writes
    ``run_dir/analysis/compare.json``."""
    from tieflax.analysis.workdir import (analysis_loss_options, analysis_data, analyze_params,
                                          checkpoint_steps, load_params_at, without_arrays)
    from tieflax.config import model_config

    mc = model_config(config)
    data = analysis_data(config, run_dir, cc.val_batches, cc.analysis_sequences)
    options = analysis_loss_options(config)
    kw = dict(n_buckets=cc.n_buckets, max_rows=cc.max_rows or None, loss_options=options)
    steps = checkpoint_steps(run_dir)
    over_time = []
    if cc.analyze_init:
        over_time.append((0, analyze_params(mc, _initial_params(mc, config), data["token_counts"],
                                            train_batch=data["train_batch"], **kw)))
    for step in steps[:-1]:
        _, params, _ = load_params_at(run_dir, step)
        over_time.append((step, analyze_params(mc, params, data["token_counts"],
                                               train_batch=data["train_batch"], **kw)))
    _, params, last = load_params_at(run_dir, steps[-1])
    final = analyze_params(mc, params, data["token_counts"], train_batch=data["train_batch"],
                           val_batches=data["val_batches"], with_arrays=True, **kw)
    over_time.append((last, final))
    result = dict(final=final, over_time=[(s, without_arrays(r)) for s, r in over_time], step=last,
                  data_dir=data["data_dir"])
    os.makedirs(os.path.join(run_dir, "analysis"), exist_ok=True)
    with open(os.path.join(run_dir, "analysis", "compare.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, default=float)
    return result


def shared_tokenizer(config: ml_collections.ConfigDict, workdir: str) -> str:
    """Prepares the data once in ``workdir/data`` and returns the tokenizer every variant will use."""
    from tieflax.data import prepare_dataset

    data_dir = os.path.join(workdir, "data")
    if config.data.tokenizer.path:
        return config.data.tokenizer.path
    if config.data.source == "tokens":
        return ""
    prepare_dataset(config.data, data_dir, vocab_size=config.model.vocab_size)
    return os.path.join(data_dir, "tokenizer.json")


def run_compare(config: ml_collections.ConfigDict, workdir: str, *, log=print) -> dict:
    """Trains every variant and seed, analyses them and writes ``workdir/report.md``; returns the summary.

    Layout: ``workdir/<variant>/seed_<s>/`` (a normal tieflax workdir each: rerunning resumes),
    ``workdir/data/`` (the shared tokenizer and token cache), ``workdir/summary.json``, ``report.md``,
    ``report.html`` (when markdown-it-py is installed) and the PNGs. ``log`` receives progress lines.
    """
    from tieflax.analysis.report import write_report
    from tieflax.config import model_config
    from tieflax.metrics import read_metrics
    from tieflax.train import train_and_evaluate

    import jax

    is_main = jax.process_index() == 0
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    cc = compare_config(config)
    variants, match = variant_configs(config)
    tokenizer = shared_tokenizer(config, workdir)
    runs = []
    total = len(variants) * len(cc.seeds)
    t_start = time.perf_counter()
    for name, vcfg in variants.items():
        for seed in cc.seeds:
            cfg = copy.deepcopy(vcfg)
            cfg.seed = int(seed)
            if tokenizer:
                cfg.data.tokenizer.path = tokenizer
            if not cfg.data.cache_dir:
                cfg.data.cache_dir = os.path.join(workdir, "data", "data_cache")
            t = cfg.train
            t.checkpoint_every = max(1, t.num_steps // cc.analysis_points)
            t.keep_checkpoints = cc.analysis_points + 1
            run_dir = os.path.join(workdir, name, f"seed_{seed}")
            log(f"[{len(runs) + 1}/{total}] training {name} (seed {seed}) in {run_dir}")
            t0 = time.perf_counter()
            result = train_and_evaluate(cfg, run_dir)
            if result.get("preempted"):
                # SIGTERM: the run saved a checkpoint; stop here, and rerunning the command resumes.
                log(f"stopped by SIGTERM during {name} (seed {seed}); rerun the same command to resume")
                raise SystemExit(143)
            log(f"[{len(runs) + 1}/{total}] {name}: val loss {result['final_val_loss']:.4f} "
                f"({time.perf_counter() - t0:.0f} s); analysing checkpoints")
            # Analysis and the report run on process 0 only; the others go on to the next run's training
            # and wait for it there.
            analysis = analyze_run(cfg, run_dir, cc) if is_main else None
            runs.append(dict(variant=name, seed=int(seed), run_dir=run_dir, result=result, analysis=analysis,
                             metrics=read_metrics(run_dir) if is_main else [], model=cfg.model.to_dict(),
                             params=param_report(model_config(cfg)).as_dict()))
    summary = dict(config=json.loads(config.to_json_best_effort()), compare=cc.to_dict(), match=match,
                   runs=runs, wall_seconds=time.perf_counter() - t_start)
    summary["report"] = write_report(summary, workdir) if is_main else None
    return summary


def to_jsonable(x: Any) -> Any:
    """Tuples -> lists and NumPy scalars -> floats, recursively (for summary.json)."""
    if isinstance(x, dict):
        return {k: to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        return x.item()
    return x
