"""The tied-vs-untied study behind ``tieflax compare``: variants, training, checkpoint analyses, report.

Variants (``config.compare.variants``), all on the same data, tokenizer, seeds and token budget; for a
given seed every variant sees the same batches in the same order and draws its init from the same key:

- ``tied``: the config with ``tie_embeddings=True``.
- ``untied``: the same body, its own head: ``V x d`` more parameters. Matched on *non-embedding*
  parameters.
- ``untied_matched``: Chung et al.'s design: the same body (d_model, layers, d_ff unchanged), untied
  embeddings of a narrower width ``E = model.embed_dim`` with projections to and from d_model, E chosen
  so that the *total* parameter count is the tied model's.
- ``untied_width`` / ``untied_depth``: untied at the tied total by narrowing d_model (and d_ff) or by
  dropping layers: the body shrinks, so these confound tying with capacity; reported separately.
- Mechanism ablations, each one switch on top of ``tied`` or ``untied``: ``*_embed_decay`` (weight
  decay on the embedding matrices), ``*_rsqrt_logits`` (logits x 1/sqrt(d)), ``*_head_bias`` (a
  logit bias) and ``*_embed_sgd`` (embedding matrices trained by SGD with momentum instead of Adam:
  ``config.train.embedding_optimizer``; its rate ``embedding_sgd_lr`` is not tuned here).
- ``tied_input_grad_scaled``: the intervention of Lopardo et al. (arXiv 2603.26663): ``tied`` with the
  lookup path's gradient into the tied matrix multiplied by ``compare.input_grad_scale``
  (``config.train.tied_input_grad_scale``), so the report shows whether the unembedding bias, the path
  ratio, the lens and the loss move as the paper says.

After training, the study compares every tied matrix with the untied runs' two matrices
(:func:`alignment_study`: the unembedding bias); the report opens with the literature table
(``tieflax.study.literature``).
"""

from __future__ import annotations

import copy
import functools
import json
import time

import ml_collections

from tieflax import storage
from tieflax.run.layout import ANALYSIS_DIR, RunDir
from tieflax import strict_json as jsonable
from tieflax.config import section_with_defaults
from tieflax.data.config import shared_cache_dir
from tieflax.errors import ConfigError
from tieflax.model.params import param_report
from tieflax.study.provenance import carried_seconds, code_commit, provenance

# Variants a user can name; DEFAULT_VARIANTS is what `tieflax compare` trains unless told otherwise.
MATCHED = ("untied_matched", "untied_width", "untied_depth")
ABLATIONS = {  # name -> (tied?, config changes): one mechanism switched on top of tied or untied
    "tied_embed_decay": (True, {"train.decay_embeddings": True}),
    "untied_embed_decay": (False, {"train.decay_embeddings": True}),
    "tied_rsqrt_logits": (True, {"model.logit_scale_rsqrt_d": True}),
    "untied_rsqrt_logits": (False, {"model.logit_scale_rsqrt_d": True}),
    "tied_head_bias": (True, {"model.head_bias": True}),
    "untied_head_bias": (False, {"model.head_bias": True}),
    "tied_embed_sgd": (True, {"train.embedding_optimizer": "sgd"}),
    "untied_embed_sgd": (False, {"train.embedding_optimizer": "sgd"}),
}
INTERVENTIONS = ("tied_input_grad_scaled",)  # tied, lookup-path gradient x compare.input_grad_scale
VARIANTS = ("tied", "untied", *MATCHED, *ABLATIONS, *INTERVENTIONS)
DEFAULT_VARIANTS = ("tied", "untied", "untied_matched")
MATCH_STRATEGIES = ("embed_dim", "width", "depth")


def default_compare_config() -> ml_collections.ConfigDict:
    """``config.compare``: what the study trains and how much it analyses."""
    c = ml_collections.ConfigDict()
    c.variants = DEFAULT_VARIANTS
    c.seeds = (0, 1, 2)          # paired: a seed fixes the init key and the data order of every variant
    c.analysis_points = 2        # checkpoints kept per run (the last is analysed against the init)
    c.grad_batches = 4           # held-out batches the gradient measures average over (K)
    c.val_batches = 0            # validation batches for the loss and contextual anisotropy (0 = the whole split)
    c.analysis_sequences = 16    # sequences per gradient batch (analysis runs unsharded on one device)
    c.n_bins = 8                 # equal-token-mass frequency bins (rarest first)
    c.max_rows = 1024            # row sample for the spectral anisotropy measures (0 = every row)
    c.bootstrap = 2000           # bootstrap replicates per interval
    # The literature measures (tieflax.study.literature): the tuned lens's fit, the neighbours compared.
    c.lens_fit_tokens = 8192     # held-out positions the tuned lens's translators fit on (0 = no lens)
    c.lens_score_tokens = 8192   # held-out tokens it scores, whole documents (0 = the whole second half)
    c.lens_steps = 250           # the tuned lens's SGD steps (the tuned-lens package's default)
    c.lens_batch_tokens = 128    # positions per step, drawn from the fit positions (the package: 2**18 tokens)
    c.knn = 10                   # k of the nearest-neighbour overlap (unembedding bias)
    c.input_grad_scale = 5.0     # the factor of the 'tied_input_grad_scaled' variant (> 0)
    # Benchmark tasks (tieflax.study.tasks): lm-eval task names scored on each run's final checkpoint.
    c.tasks = ()                 # () = off; e.g. ('arc_easy', 'hellaswag') (the `eval` extra)
    c.task_include_path = ""     # a folder of extra task YAMLs ("" = lm-eval's registry only)
    c.task_num_fewshot = -1      # -1 = each task's own setting
    c.task_limit = 0.0           # items per task (a fraction if < 1; 0 = every item)
    c.task_batch_size = 0        # sequences per generation batch (0 = one per data x fsdp shard)
    c.task_token_budget = 4096   # tokens per loglikelihood batch
    return c


# Counts of config.compare and their least value (what each means, for the error line).
_COUNTS = {"analysis_points": 1, "grad_batches": 1, "val_batches": 0, "analysis_sequences": 1, "n_bins": 1,
           "max_rows": 0, "bootstrap": 1, "lens_fit_tokens": 0, "lens_score_tokens": 0, "lens_steps": 1,
           "lens_batch_tokens": 1, "knn": 1}
_COUNTS_WHY = {"analysis_points": "checkpoints kept per run", "grad_batches": "held-out batches of the gradient "
               "measures", "val_batches": "0 = the whole split", "analysis_sequences": "sequences per gradient batch",
               "n_bins": "frequency bins", "max_rows": "0 = every row", "bootstrap": "replicates per interval",
               "lens_fit_tokens": "0 = no lens", "lens_score_tokens": "0 = the whole second half",
               "lens_steps": "the tuned lens's SGD steps", "lens_batch_tokens": "positions per tuned-lens step",
               "knn": "neighbours compared"}


def compare_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config.compare`` completed with the defaults; errors name the bad field."""
    cc = section_with_defaults(config, "compare", default_compare_config())
    bad = [v for v in cc.variants if v not in VARIANTS]
    if bad or not cc.variants:
        what = f"{', '.join(map(repr, bad))} unknown; " if bad else ""
        raise ConfigError(f"config.compare.variants = {tuple(cc.variants)}: {what}choose a non-empty subset "
                               f"of {VARIANTS}")
    if "tied" not in cc.variants:
        raise ConfigError(f"config.compare.variants = {tuple(cc.variants)} must include 'tied': every "
                               "comparison is paired against it; add it, e.g. ('tied', 'untied')")
    refuse_repeats("config.compare.variants", cc.variants, "each variant is trained once per seed")
    if not cc.seeds:
        raise ConfigError("config.compare.seeds is empty: give at least one seed, e.g. (0, 1, 2)")
    for name, low in _COUNTS.items():  # before the first run trains: a bad count fails here, not at the report
        value = cc[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"config.compare.{name} = {value!r}: must be a whole number >= {low} "
                                   f"({_COUNTS_WHY[name]})")
    vocab = config.model.vocab_size if "model" in config else None
    if vocab is not None and cc.n_bins > vocab:
        raise ConfigError(f"config.compare.n_bins = {cc.n_bins}: more frequency bins than the {vocab} tokens of "
                               "the vocabulary; use at most that many (default 8)")
    if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**32 for s in cc.seeds):
        raise ConfigError(f"config.compare.seeds = {tuple(cc.seeds)!r}: give whole numbers in [0, 2**32)")
    refuse_repeats("config.compare.seeds", cc.seeds, "a repeated seed trains the same run again and counts "
                   "it as a second, independent one in every interval")
    if isinstance(cc.input_grad_scale, bool) or not isinstance(cc.input_grad_scale, (int, float)) \
            or not cc.input_grad_scale > 0:
        raise ConfigError(f"config.compare.input_grad_scale = {cc.input_grad_scale!r}: must be a number > 0 "
                               "(the factor on the tied matrix's lookup-path gradient), e.g. 5.0")
    if cc.lens_fit_tokens < 0 or cc.lens_score_tokens < 0 or cc.knn < 1:
        raise ConfigError(f"config.compare.lens_fit_tokens = {cc.lens_fit_tokens} and lens_score_tokens = "
                               f"{cc.lens_score_tokens} must be >= 0 (0 = no lens / every document of the "
                               f"scoring half), config.compare.knn = {cc.knn} >= 1")
    from tieflax.study.tasks import check_settings  # noqa: PLC0415

    check_settings(cc)
    return cc


def refuse_repeats(field: str, values, why: str, key=lambda v: v) -> None:
    """One line naming ``field`` when two of ``values`` are the same (``key`` says what counts as the
    same: the name a run folder gets), before anything trains."""
    seen: dict = {}
    for v in values:
        if key(v) in seen:
            same = "" if seen[key(v)] == v else f" (the same as {seen[key(v)]!r})"
            raise ConfigError(f"{field} = {tuple(values)!r} repeats {v!r}{same}: {why}; give each once")
        seen[key(v)] = v


def task_section(config) -> ml_collections.ConfigDict:
    """The task fields of ``config.compare`` (defaults where absent), checked: what ``tieflax sweep`` scores
    its runs with, so a sweep takes the same tasks as a compare of the same config."""
    from tieflax.study.tasks import check_settings  # noqa: PLC0415 (lm-eval is imported only when asked)

    cc = section_with_defaults(config, "compare", default_compare_config())
    check_settings(cc)
    return cc


# ------------------------------------------------------------------------------------- matched variant
@functools.lru_cache(maxsize=256)
def _untied_total(mc) -> int:
    return param_report(mc).total_untied


def matched_untied_config(mc, strategy: str = "embed_dim"):
    """(untied ModelConfig with total params ~= the tied model's, match info dict).

    ``embed_dim`` (Chung et al.): the body is unchanged; the untied matrices get the width E whose total
    (two V x E matrices and the two E x d projections) comes closest to the tied total. Totals are affine
    in E, so E is solved from two exact counts; one step of E is 2 (V + d) parameters, so the match is
    within half of that.

    ``width``: the largest d_model (a multiple of 2 x n_heads, so RoPE's head dimension stays even; d_ff
    scaled in proportion) whose untied total does not exceed the tied total, then d_ff solved exactly for
    the remainder. ``depth``: the most layers that fit, then d_ff solved the same way. The info dict holds
    both shapes, both totals and the relative mismatch.
    """
    if strategy not in MATCH_STRATEGIES:
        raise ConfigError(f"match strategy {strategy!r}: choose one of {MATCH_STRATEGIES}")
    base = mc.replace(tie_embeddings=True, head_init="normal", head_init_std=0.0)
    target = param_report(base).total_tied
    untied = base.replace(tie_embeddings=False)
    if strategy == "embed_dim":
        t1, t2 = _untied_total(untied.replace(embed_dim=1)), _untied_total(untied.replace(embed_dim=2))
        e = round((target - t1) / max(t2 - t1, 1)) + 1  # the nearest total (E is coarse: 2 (V + d) a step)
        if e < 1:
            raise ConfigError(f"no embedding width fits the untied model in {target:,} parameters")
        matched = untied.replace(embed_dim=int(e))
        total = _untied_total(matched)
        return matched, dict(strategy=strategy, target_total=target, matched_total=total,
                             relative_mismatch=(total - target) / target,
                             tied_shape=dict(d_model=mc.d_model, n_layers=mc.n_layers, d_ff=mc.d_ff, embed_dim=0),
                             matched_shape=dict(d_model=mc.d_model, n_layers=mc.n_layers, d_ff=mc.d_ff,
                                                embed_dim=int(e)))
    if strategy == "width":
        step = 8 if mc.head_dim else 2 * mc.n_heads
        d = (mc.d_model // step) * step
        while d > 0:
            cand = untied.replace(d_model=d, d_ff=max(1, round(mc.d_ff * d / mc.d_model)))
            if _untied_total(cand) <= target:
                break
            d -= step
        if d <= 0:
            raise ConfigError(f"no untied width of this model fits in {target:,} parameters (the two V x d "
                             "matrices alone exceed it); use the 'untied_depth' variant or a larger body")
    else:
        layers = mc.n_layers
        cand = untied
        while layers > 0 and _untied_total(cand := untied.replace(n_layers=layers)) > target:
            layers -= 1
        if layers == 0:
            raise ConfigError(
                f"an untied model needs {mc.vocab_size * mc.d_model:,} more parameters than the tied one, "
                f"more than {mc.n_layers} layers hold: even one layer exceeds the tied total {target:,}. "
                "Use the 'untied_width' or 'untied_matched' variant.")
    # Total parameters are affine in d_ff: solve for the d_ff that closes the gap.
    t0 = _untied_total(cand)
    t1 = _untied_total(cand.replace(d_ff=cand.d_ff + 1))
    d_ff = max(1, cand.d_ff + round((target - t0) / max(t1 - t0, 1)))
    matched = cand.replace(d_ff=d_ff)
    total = _untied_total(matched)
    info = dict(strategy=strategy, target_total=target, matched_total=total,
                relative_mismatch=(total - target) / target,
                tied_shape=dict(d_model=mc.d_model, n_layers=mc.n_layers, d_ff=mc.d_ff, embed_dim=0),
                matched_shape=dict(d_model=matched.d_model, n_layers=matched.n_layers, d_ff=matched.d_ff,
                                   embed_dim=0))
    return matched, info


def variant_configs(config: ml_collections.ConfigDict) -> tuple[dict[str, ml_collections.ConfigDict], dict]:
    """``({variant: full config}, {matched variant: match info})`` for ``config.compare.variants``."""
    from tieflax.config import model_config  # noqa: PLC0415

    cc = compare_config(config)
    mc = model_config(config).replace(embed_dim=0)
    out, infos = {}, {}
    for name in cc.variants:
        cfg = copy.deepcopy(config)
        cfg.model.embed_dim = 0
        tied = ABLATIONS[name][0] if name in ABLATIONS else name in ("tied", *INTERVENTIONS)
        cfg.model.tie_embeddings = tied
        if tied:
            cfg.model.head_init, cfg.model.head_init_std = "normal", 0.0  # meaningless when tied (validated)
        if name in MATCHED:
            strategy = {"untied_matched": "embed_dim", "untied_width": "width", "untied_depth": "depth"}[name]
            matched, infos[name] = matched_untied_config(mc, strategy)
            for key in ("d_model", "n_layers", "d_ff", "embed_dim"):
                cfg.model[key] = getattr(matched, key)
        for key, value in ABLATIONS.get(name, (None, {}))[1].items():
            section, field = key.split(".")
            cfg[section][field] = value
        if name == "tied_input_grad_scaled":
            cfg.train.tied_input_grad_scale = float(cc.input_grad_scale)
        model_config(cfg)  # validate now, naming the field
        out[name] = cfg
    return out, infos


@functools.lru_cache(maxsize=256)
def _counts(mc) -> tuple[int, int]:
    report = param_report(mc)
    return report.total_tied, report.total_untied


def param_counts(mc) -> dict:
    """``{'total', 'embedding', 'non_embedding'}`` of a config as configured (exact, from the param tree).

    Embedding parameters: the V x E (or V x d) matrices, one when tied, two when untied, plus the two
    E x d projections of a decoupled width; everything else (the body, norms, a head bias) is
    non-embedding, so ``tied`` and ``untied_matched`` share their non-embedding count.
    """
    total_tied, total_untied = _counts(mc.replace(tie_embeddings=True, head_init="normal", head_init_std=0.0))
    total = total_tied if mc.tie_embeddings else total_untied
    width = mc.embed_dim or mc.d_model
    emb = (1 if mc.tie_embeddings else 2) * mc.vocab_size * width + 2 * mc.embed_dim * mc.d_model
    return dict(total=total, embedding=emb, non_embedding=total - emb)


# -------------------------------------------------------------------------------------------- running
@functools.lru_cache(maxsize=8)
def _init_fn(mc):
    """``jax.jit(TransformerLM(mc).init)``, one per model config: a study's seeds of one variant share its
    traced and compiled program (a new jit per run traced it again, 0.4 CPU-s a run at the tiny sizes)."""
    import jax  # noqa: PLC0415

    from tieflax.model import TransformerLM  # noqa: PLC0415

    return jax.jit(TransformerLM(mc).init)


def _initial_params(mc, config):
    """The parameters the trainer starts from (same init call and key), for a step-0 analysis point."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    rngs = {"params": jax.random.key(config.seed)}
    if mc.head_rng_stream != "params":
        rngs[mc.head_rng_stream] = jax.random.fold_in(rngs["params"], 1)
    params = _init_fn(mc)(rngs, jnp.zeros((1, config.train.seq_len), jnp.int32))["params"]
    return jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))


def study_data(config: ml_collections.ConfigDict, run_dir: str, cc: ml_collections.ConfigDict) -> dict:
    """The held-out data every run is measured on (the same for every variant and seed).

    ``val_batches``: the whole validation split, unshuffled (``config.compare.val_batches`` > 0 keeps only
    that many batches); ``doc_ids``: each batch's document index per position; ``grad_batches``: the first
    ``grad_batches`` of them cut to ``analysis_sequences`` rows; ``counts``: train unigram counts.
    """
    import numpy as np  # noqa: PLC0415

    from tieflax.study.evidence import document_ids  # noqa: PLC0415
    from tieflax.data import make_loader, prepare_dataset  # noqa: PLC0415

    t = config.train
    prepared = prepare_dataset(config.data, run_dir, vocab_size=config.model.vocab_size)
    loader = make_loader(prepared, "val", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                         seed=config.seed, shuffle=False, num_epochs=1)
    batches = []
    whole = True
    for batch in loader:
        if cc.val_batches and len(batches) >= cc.val_batches:
            whole = False  # a batch was left out: not the whole split
            break
        batches.append({k: np.asarray(v) for k, v in dict(batch).items()})
    if not batches:
        raise ConfigError("the validation split is empty: raise config.data.val_fraction")
    opener = prepared.bos_id if getattr(prepared, "bos_id", None) is not None else prepared.eos_id
    ids = document_ids(np.concatenate([b["inputs"] for b in batches]), opener)
    doc_ids = np.split(ids, np.cumsum([len(b["inputs"]) for b in batches])[:-1])
    n_docs = int(max(i[b["targets"] >= 0].max() for i, b in zip(doc_ids, batches) if (b["targets"] >= 0).any())) + 1
    cut = lambda b: {k: v[:cc.analysis_sequences] for k, v in b.items()}  # noqa: E731
    info = getattr(prepared, "info", {}) or {}
    return dict(val_batches=batches, doc_ids=doc_ids, n_docs=n_docs,
                grad_batches=[cut(b) for b in batches[:cc.grad_batches]],
                counts=np.asarray(prepared.token_counts), data_dir=str(prepared.data_dir),
                train_tokens=int(np.asarray(prepared.token_counts).sum()), info=info, whole_split=whole)


def analyze_run(config: ml_collections.ConfigDict, run_dir: str, cc: ml_collections.ConfigDict, data: dict,
                with_arrays: bool = False, keep: dict | None = None) -> dict:
    """Measures a finished run's last checkpoint against its initial parameters (recomputed from the seed
    exactly as the trainer draws them). Writes ``run_dir/analysis/compare.json``; a rerun reuses it when
    it describes the same step and holds every measure (one written before the lens and the frequency-bin
    losses is measured again). ``keep``: filled with the run's embedding matrices (``final``, ``init``:
    ``{'input', 'output'}`` host arrays) when they are loaded here, for :func:`alignment_study`."""
    from tieflax.study.evidence import measure_run  # noqa: PLC0415
    from tieflax.study.analyze import analysis_loss_options, checkpoint_steps, load_params_at  # noqa: PLC0415
    from tieflax.config import model_config  # noqa: PLC0415

    path = RunDir.named(run_dir).file(ANALYSIS_DIR, "compare.json")
    steps = checkpoint_steps(run_dir)
    if storage.is_file(path):
        saved = jsonable.loads(storage.read_text(path))
        if saved.get("step") == steps[-1] and ("arrays" in saved) >= with_arrays and _current(saved, cc, steps):
            return saved
    mc = model_config(config)
    _, params, last = load_params_at(run_dir, steps[-1])
    init = _initial_params(mc, config)
    if keep is not None:
        keep.update(final=_embedding_rows(params), init=_embedding_rows(init))
    result = measure_run(mc, params, init, data["counts"],
                         val_batches=data["val_batches"], doc_ids=data["doc_ids"], n_docs=data["n_docs"],
                         grad_batches=data["grad_batches"], loss_options=analysis_loss_options(config),
                         n_bins=cc.n_bins, max_rows=cc.max_rows or None, with_arrays=with_arrays,
                         lens_fit_tokens=cc.lens_fit_tokens, lens_score_tokens=cc.lens_score_tokens,
                         lens_recipe=lens_recipe(cc))
    result.update(step=int(last), data_dir=data["data_dir"], measured_at=time.time())
    result["through"] = through_training(config, run_dir, cc, data, steps, result["val"])
    storage.write_text(path, jsonable.dumps(result))
    return jsonable.loads(jsonable.dumps(result))  # as a rerun reads it back (plain floats and lists)


def lens_recipe(cc) -> dict:
    """The tuned lens's training settings this study asks for (over ``tieflax.analysis.lens.RECIPE``)."""
    return dict(steps=int(cc.lens_steps), batch_tokens=int(cc.lens_batch_tokens))


def _current(saved: dict, cc, steps: list[int]) -> bool:
    """Whether a saved analysis holds every measure this study asks for, as it measures them now: the
    frequency-bin losses, the tuned lens trained by KL with these settings, and every kept checkpoint's
    held-out loss by bin (one written by an older tieflax is measured again)."""
    if "doc_bin_loss" not in saved.get("val", {}):
        return False
    lens = saved.get("lens")
    if cc.lens_fit_tokens and lens is None:
        return False
    if lens and "missing" not in lens and (lens.get("method") != "kl" or
                                          {k: lens["recipe"].get(k) for k in ("steps", "batch_tokens")}
                                          != lens_recipe(cc)):
        return False
    return [t["step"] for t in saved.get("through", [])] == [s for s in steps if s > 0]


def through_training(config, run_dir: str, cc, data: dict, steps: list[int], final_val: dict) -> list[dict]:
    """The held-out loss by (document, frequency bin) at every kept checkpoint of a run, oldest first:
    ``[{'step', 'loss', 'doc_bin_loss' [D][B]}]`` (the last is ``final_val``'s, measured once). What the
    rare-token gains over training (Leviathan, arXiv 2601.22040) are computed from."""
    from tieflax.study.analyze import analysis_loss_options, load_params_at  # noqa: PLC0415
    from tieflax.study.evidence import bin_losses  # noqa: PLC0415
    from tieflax.analysis import measures  # noqa: PLC0415
    from tieflax.config import model_config  # noqa: PLC0415

    mc = model_config(config)
    options = dict(analysis_loss_options(config), z_loss=0.0, label_smoothing=0.0)
    bins = measures.mass_bins(data["counts"], cc.n_bins)
    out = []
    steps = [s for s in steps if s > 0]  # step 0 (an init checkpoint) is no point of training
    for step in steps[:-1]:
        _, params, _ = load_params_at(run_dir, step)
        out.append(dict(step=int(step), **bin_losses(mc, params, data["val_batches"], data["doc_ids"],
                                                     data["n_docs"], options, bins, cc.n_bins)))
    out.append(dict(step=int(steps[-1]), loss=final_val["loss"], doc_bin_loss=final_val["doc_bin_loss"]))
    return out


def _embedding_rows(params: dict) -> dict:
    """``{'input', 'output'}`` embedding matrices of a parameter tree as host float32 arrays (one array
    twice when tied)."""
    import numpy as np  # noqa: PLC0415

    from tieflax.model.transformer import embedding_matrices  # noqa: PLC0415

    return {k: np.asarray(getattr(v, "value", v), np.float32) for k, v in embedding_matrices(params).items()}


def alignment_study(planned: list, cc, counts, kept: dict, log=print) -> dict:
    """The unembedding bias (Lopardo et al., arXiv 2603.26663) of every tied variant, seed by seed.

    For each tied-variant run (seed s) against the ``untied`` runs: how alike its matrix is to an untied
    input embedding and to an untied head (:func:`tieflax.analysis.literature.alignment`: linear CKA and
    the k-nearest-neighbour overlap over the rows of tokens seen in training), final and at init, against
    ``cross``: the untied run of the next seed (no init in common, the comparison the table judges) and
    ``same``: the untied run of the same seed (its input embedding starts as the very matrix the tied run
    starts from: the init pair shares every row). ``kept[(variant, seed)]``: matrices ``analyze_run``
    already loaded; others are read from the run's last checkpoint. Returns
    ``{variant: {seed: {'same': {'final', 'init'}, 'cross': {'final', 'init', 'untied_seed'}}}}``.
    """
    import numpy as np  # noqa: PLC0415

    from tieflax.analysis.literature import alignment_of, representation  # noqa: PLC0415
    from tieflax.config import model_config  # noqa: PLC0415
    from tieflax.study.analyze import checkpoint_steps, load_params_at  # noqa: PLC0415

    runs = {(name, int(seed)): (cfg, run_dir) for seed, name, cfg, run_dir in planned}
    seeds = [int(s) for s in cc.seeds]
    tied_variants = [v for v in dict.fromkeys(n for _, n, _, _ in planned)
                     if v != "untied" and runs[(v, seeds[0])][0].model.tie_embeddings]
    if "untied" not in {n for _, n, _, _ in planned} or not tied_variants:
        return {}

    def matrices(key):
        if not kept.get(key):
            cfg, run_dir = runs[key]
            mc = model_config(cfg)
            _, params, _ = load_params_at(run_dir, checkpoint_steps(run_dir)[-1])
            kept[key] = dict(final=_embedding_rows(params), init=_embedding_rows(_initial_params(mc, cfg)))
        return kept[key]

    rows = np.flatnonzero(np.asarray(counts) > 0)
    reps: dict = {}

    def rep(key, state, side):  # each matrix's centring and neighbours once
        if (key, state, side) not in reps:
            reps[(key, state, side)] = representation(matrices(key)[state][side], rows, cc.knn, cc.max_rows or None)
        return reps[(key, state, side)]

    out: dict = {}
    for variant in tied_variants:
        out[variant] = {}
        for i, seed in enumerate(seeds):
            entry = {}
            partners = [("same", seed)] + ([("cross", seeds[(i + 1) % len(seeds)])] if len(seeds) > 1 else [])
            for kind, useed in partners:
                entry[kind] = {state: alignment_of(rep((variant, seed), state, "input"),
                                                   rep(("untied", useed), state, "input"),
                                                   rep(("untied", useed), state, "output"))
                               for state in ("final", "init")}
                entry[kind]["untied_seed"] = useed
            out[variant][str(seed)] = entry
        for key in [k for k in reps if k[0][0] == variant]:
            del reps[key]  # a tied variant's matrices are compared once
    return out


def shared_tokenizer(config: ml_collections.ConfigDict, study: RunDir) -> str:
    """Prepares the data once in ``<study>/data`` (``study``: the compare's or sweep's folder) and returns
    the tokenizer every variant will use."""
    from tieflax.data import prepare_dataset  # noqa: PLC0415

    data_dir = study.file("data")
    if config.data.tokenizer.path:
        return config.data.tokenizer.path
    if config.data.source == "tokens":
        return ""
    prepare_dataset(config.data, data_dir, vocab_size=config.model.vocab_size)
    return storage.join(data_dir, "tokenizer.json")


def study_cache_dir(data: ml_collections.ConfigDict, study: RunDir) -> str:
    """The token cache a study's runs read: the one :func:`shared_tokenizer` prepared the data in
    (``data.cache_dir``, else ``$TIEFLAX_DATA_CACHE_DIR``, else ``<study>/data/data_cache``), so that no run
    tokenises the corpus again in a cache of its own."""
    return shared_cache_dir(data) or study.file("data", "data_cache")


def run_compare(config: ml_collections.ConfigDict, study: RunDir | str, *, log=print,
                retrain_changed: bool = False, command: str = "tieflax compare") -> dict:
    """Trains every variant and seed, analyses them and writes ``<study>/report.md``; returns the summary.

    ``study``: the compare's folder (``--workdir``): the command's ``RunDir``, or a path (a notebook's),
    resolved and checked here, once (``RunDir.of``); it may be a ``gs://`` prefix.
    Layout: ``<study>/<variant>/seed_<s>/`` (a normal tieflax workdir each: rerunning resumes),
    ``<study>/data/`` (the shared tokenizer and token cache; the token cache in ``data.cache_dir`` or
    ``$TIEFLAX_DATA_CACHE_DIR`` where one is set), ``<study>/summary.json``, ``report.md``,
    ``report.html`` (when markdown-it-py is installed) and the PNGs. ``log`` receives progress lines. A rerun reuses a run only if it was trained with
    the config it would be trained with now (``tieflax.study.resume``); ``retrain_changed`` trains
    the ones that differ again instead of refusing. ``command``: the command line, for the provenance
    (``tieflax.study.provenance``: kept as it was when a rerun trains nothing).
    """
    import jax  # noqa: PLC0415

    from tieflax.run.lock import hold  # noqa: PLC0415

    study = RunDir.of(study)  # canonical, once: every run, report and lock below takes it so
    cc = compare_config(config)  # every config error before anything is written
    if cc.tasks:
        from tieflax.study.tasks import check_settings  # noqa: PLC0415

        check_settings(cc, lookup=True)  # an unknown task fails now, not after hours of training
    variants, match = variant_configs(config)
    # One compare at a time in a workdir (each run's trainer locks its own folder as well).
    with hold(study, "compare", enabled=jax.process_index() == 0):
        return _run_compare(config, study, cc, variants, match, log=log, retrain_changed=retrain_changed,
                            command=command)


def _planned_runs(study: RunDir, cc, variants: dict, tokenizer: str | None) -> list[tuple]:
    """``[(seed, variant, config, run_dir), ...]`` in the compare's folder ``study``, seed-major: an interrupted study has every variant at
    the first seeds (paired)."""
    from tieflax.run.console import for_study  # noqa: PLC0415

    planned = []
    for seed in cc.seeds:
        for name, vcfg in variants.items():
            cfg = copy.deepcopy(vcfg)
            cfg.seed = int(seed)
            if tokenizer:
                cfg.data.tokenizer.path = tokenizer
            cfg.data.cache_dir = study_cache_dir(cfg.data, study)
            t = cfg.train
            t.checkpoint_every = max(1, t.num_steps // cc.analysis_points)
            t.keep_checkpoints = cc.analysis_points + 1
            t.console = for_study(t.console)  # the study prints one line per run (README): no interval lines
            planned.append((seed, name, cfg, study.file(name, f"seed_{seed}")))
    return planned


def _check_existing_runs(planned: list[tuple], is_main: bool, *, retrain_changed: bool, log) -> None:
    """Before training anything: every run already in the workdir must match the config it would get now.
    Process 0 checks (and removes, when asked); one collective gives every process its verdict."""
    from tieflax.hardware import distributed  # noqa: PLC0415
    from tieflax.study.resume import StudyMismatch, check_run_matches  # noqa: PLC0415

    error = None
    if is_main:
        try:
            for _, _, cfg, run_dir in planned:
                if check_run_matches(run_dir, cfg, retrain=retrain_changed):
                    log(f"{run_dir}: trained with a different config; training it again (--retrain-changed)")
        except StudyMismatch as e:
            error = str(e)
    error = distributed.first_failure(error, "compare-resume")
    if error is not None:
        raise StudyMismatch(error)


def _measured_now(analysis: dict | None, since: float) -> bool:
    """Whether a run's analysis was computed by this invocation (not reused from its compare.json)."""
    return bool(analysis) and analysis.get("measured_at", 0.0) >= since - 1.0


def _previous_summary(study: RunDir) -> dict | None:
    """The summary.json a previous invocation wrote in ``study`` (None: none, or unreadable)."""
    path = study.file("summary.json")
    try:
        return jsonable.loads(storage.read_text(path)) if storage.is_file(path) else None
    except (ValueError, OSError):
        return None


def _run_compare(config, study: RunDir, cc, variants: dict, match: dict, *, log, retrain_changed: bool,
                 command: str = "tieflax compare") -> dict:
    from tieflax.study.report import write_report  # noqa: PLC0415
    from tieflax.config import model_config  # noqa: PLC0415
    from tieflax.run.checkpoints import latest_step  # noqa: PLC0415
    from tieflax.run.metrics import read_metrics  # noqa: PLC0415
    from tieflax.train import train_and_evaluate  # noqa: PLC0415

    import jax  # noqa: PLC0415

    is_main = jax.process_index() == 0
    storage.makedirs(study.path)
    tokenizer = shared_tokenizer(config, study)
    runs, data = [], None
    kept: dict = {}  # (variant, seed) -> embedding matrices, for the unembedding-bias comparison
    total = len(variants) * len(cc.seeds)
    t_start = time.perf_counter()
    since = time.time()  # what an analysis's measured_at is compared with (wall clock)
    planned = _planned_runs(study, cc, variants, tokenizer)
    _check_existing_runs(planned, is_main, retrain_changed=retrain_changed, log=log)
    previous = _previous_summary(study) if is_main else None
    trained = 0
    for seed, name, cfg, run_dir in planned:
        # A run trained to its end before (a rerun of a finished or stopped study) is evaluated, not trained;
        # the trainer says so itself ("finished before ... nothing to train"), so this line does not.
        finished = latest_step(run_dir) == cfg.train.num_steps
        where = storage.join(name, f"seed_{seed}")
        log(f"[{len(runs) + 1}/{total}] {name} (seed {seed}) in {where}" + ("" if finished else ": training"))
        t0 = time.perf_counter()
        result = train_and_evaluate(cfg, run_dir)
        if result.get("preempted"):
            # SIGTERM: the run saved a checkpoint; stop here, and rerunning the command resumes.
            log(f"stopped by SIGTERM during {name} (seed {seed}); rerun the same command to resume")
            raise SystemExit(143)
        t1 = time.perf_counter()
        trained += not finished
        # Analysis and the report run on process 0 only; the others go on to the next run's training
        # and wait for it there.
        analysis = None
        if is_main:
            data = data or study_data(cfg, run_dir, cc)
            keep = kept.setdefault((name, int(seed)), {}) if name == "untied" or cfg.model.tie_embeddings else None
            analysis = analyze_run(cfg, run_dir, cc, data, with_arrays=seed == cc.seeds[0], keep=keep)
        scores = None
        if is_main and cc.tasks:
            from tieflax.study.tasks import score_run  # noqa: PLC0415

            scores = score_run(run_dir, cc, log=log)
        full = f", full split {analysis['val']['loss']:.4f}" if analysis else ""
        log(f"[{len(runs) + 1}/{total}] {name} seed {seed}: val loss {result['final_val_loss']:.4f}{full} "
            f"(train {t1 - t0:.0f} s, analysis {time.perf_counter() - t1:.0f} s)")
        seconds = dict(train=t1 - t0, analysis=time.perf_counter() - t1)
        carried = carried_seconds(previous, name, seed) if finished else None
        if carried:  # the run's own cost, as the study that trained (and first measured) it timed it
            seconds = dict(carried, analysis=seconds["analysis"] if _measured_now(analysis, since)
                           else carried.get("analysis", seconds["analysis"]))
        runs.append(dict(variant=name, seed=int(seed), run_dir=run_dir, result=result, analysis=analysis,
                         metrics=read_metrics(run_dir) if is_main else [], model=cfg.model.to_dict(),
                         tasks=scores,
                         train=cfg.train.to_dict(), params=param_counts(model_config(cfg)), seconds=seconds))
    alignment = alignment_study(planned, cc, data["counts"], kept) if is_main and data else {}
    kept.clear()
    origin = provenance(previous, runs, command, trained)
    if not trained and any(_measured_now(r["analysis"], since) for r in runs):
        origin["remeasured"] = dict(commit=code_commit(), date=time.strftime("%Y-%m-%d"))
    summary = dict(config=json.loads(config.to_json_best_effort()), compare=cc.to_dict(), match=match,
                   runs=runs, alignment=alignment, wall_seconds=time.perf_counter() - t_start, provenance=origin,
                   data=dict(train_tokens=data["train_tokens"], n_docs=data["n_docs"],
                             val_tokens=int(sum(sum(r["analysis"]["val"]["doc_tokens"]) for r in runs[:1])),
                             data_dir=data["data_dir"], whole_split=data["whole_split"]) if data else {})
    summary["report"] = write_report(summary, study.path) if is_main else None
    return summary
