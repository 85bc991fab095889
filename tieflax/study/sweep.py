"""``tieflax sweep``: tied vs untied across model sizes, each variant at its own best learning rate.

Procedure (``config.sweep``):

1. **Learning rate.** Every variant is trained at each of ``lrs`` at the size ``lr_size`` (an index into
   ``sizes``) with seed ``seeds[0]``; its best rate (lowest validation loss) is used at every size.
2. **Sizes x variants x seeds.** Every variant at every size and seed, at its best rate. Variants are
   defined per size exactly as in ``tieflax compare`` (``untied_matched``: same body, narrower embeddings,
   equal total; ``untied_width``: narrower body, equal total; ``untied``: same body, equal non-embedding).
3. **Curves.** Validation loss (the whole split) against total and against non-embedding parameters,
   mean over seeds with a bootstrap 95% interval.
4. **Crossover.** For each comparison (an untied variant minus tied, paired by seed at each size), the
   log10 parameter count where the difference changes sign, linearly interpolated between neighbouring
   sizes; its uncertainty comes from resampling seeds (the share of replicates that cross in range, and
   the 2.5-97.5% range of where they cross). "None in range" when the mean difference keeps one sign.

Layout: ``DIR/runs/<variant>/size_<i>/lr_<lr>/seed_<s>/`` (normal tieflax workdirs; each finished run
also leaves ``sweep_result.json``), ``DIR/sweep.json``, ``DIR/sweep_report.md`` and PNGs. ``--resume``
skips finished runs and continues unfinished ones from their checkpoints.
"""

from __future__ import annotations

import copy
import json
import math
import time
from typing import Callable

import ml_collections
import numpy as np

from tieflax import storage
from tieflax.run.layout import SWEEP_RESULT_FILE
from tieflax import strict_json as jsonable
from tieflax.analysis import stats as st
from tieflax.strict_json import to_jsonable
from tieflax.config import section_with_defaults
from tieflax.errors import ConfigError
from tieflax.run.layout import RunDir, WorkdirError

SWEEP_VARIANTS = ("tied", "untied", "untied_matched", "untied_width", "untied_depth")
RESULT = SWEEP_RESULT_FILE


def default_sweep_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.sizes = ((32, 1, 128, 2), (48, 2, 192, 4), (64, 2, 256, 4), (96, 3, 384, 4))  # d_model, layers, d_ff, heads
    c.variants = ("tied", "untied", "untied_matched", "untied_width")
    c.seeds = (0, 1)
    c.lrs = (3e-3, 1e-2, 3e-2)
    c.lr_size = 1
    c.bootstrap = 2000
    return c


def sweep_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config.sweep`` completed with defaults; errors name the field."""
    c = section_with_defaults(config, "sweep", default_sweep_config())
    if not c.sizes or any(len(s) != 4 for s in c.sizes):
        raise ConfigError("config.sweep.sizes must be a non-empty tuple of (d_model, n_layers, d_ff, n_heads)")
    bad = [v for v in c.variants if v not in SWEEP_VARIANTS]
    if bad or "tied" not in c.variants:
        what = f"{', '.join(map(repr, bad))} unknown; " if bad else "'tied' missing; "
        raise ConfigError(f"config.sweep.variants = {tuple(c.variants)}: {what}include 'tied' and choose "
                               f"from {SWEEP_VARIANTS}")
    if not c.seeds or not c.lrs:
        raise ConfigError("config.sweep.seeds and config.sweep.lrs must be non-empty")
    _check_seeds_and_rates(c)
    if not 0 <= c.lr_size < len(c.sizes):
        raise ConfigError(f"config.sweep.lr_size = {c.lr_size}: an index into config.sweep.sizes "
                         f"(0..{len(c.sizes) - 1})")
    return c


def _check_seeds_and_rates(c) -> None:
    """Seeds whole numbers in [0, 2**32) and learning rates finite numbers > 0, each given once (two rates
    that print alike share a run folder, ``lr_<rate:g>``): before the first run trains, naming the field."""
    from tieflax.study.compare import refuse_repeats  # noqa: PLC0415

    refuse_repeats("config.sweep.variants", c.variants, "each variant is trained once per size and seed")
    if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**32 for s in c.seeds):
        raise ConfigError(f"config.sweep.seeds = {tuple(c.seeds)!r}: give whole numbers in [0, 2**32)")
    refuse_repeats("config.sweep.seeds", c.seeds, "a repeated seed trains the same run again and counts it as "
                   "a second, independent one in every interval")
    bad = [lr for lr in c.lrs if isinstance(lr, bool) or not isinstance(lr, (int, float))
           or not (math.isfinite(lr) and lr > 0)]
    if bad:
        raise ConfigError(f"config.sweep.lrs = {tuple(c.lrs)!r}: {bad[0]!r} is not a learning rate; give finite "
                          "numbers > 0, e.g. (3e-3, 1e-2, 3e-2)")
    refuse_repeats("config.sweep.lrs", c.lrs, "each rate is one run folder (lr_<rate>) and one point of the "
                   "search", key=lambda lr: f"{lr:g}")


def size_config(config, size) -> ml_collections.ConfigDict:
    cfg = copy.deepcopy(config)
    d, layers, d_ff, heads = (int(x) for x in size)
    cfg.model.update(d_model=d, n_layers=layers, d_ff=d_ff, n_heads=heads)
    cfg.compare = ml_collections.ConfigDict()
    return cfg


def plan(config, sc) -> list[dict]:
    """Every run of the sweep, in order: the learning-rate runs first, then sizes x variants x seeds
    (``lr=None``: filled with the variant's best rate once the first phase is done)."""
    from tieflax.study.compare import variant_configs  # noqa: PLC0415

    runs = []
    for phase in ("lr", "main"):
        for i, size in enumerate(sc.sizes):
            if phase == "lr" and i != sc.lr_size:
                continue
            cfg = size_config(config, size)
            cfg.compare.variants = tuple(sc.variants)
            variants, infos = variant_configs(cfg)
            for name, vcfg in variants.items():
                for seed in (sc.seeds[:1] if phase == "lr" else sc.seeds):
                    for lr in (sc.lrs if phase == "lr" else (None,)):
                        runs.append(dict(phase=phase, size=i, variant=name, seed=int(seed), lr=lr, config=vcfg,
                                         match=infos.get(name)))
    return runs


def _run_dir(study: RunDir, r, lr) -> str:
    """The run folder of plan entry ``r`` at learning rate ``lr`` inside the sweep's folder ``study``."""
    return study.file("runs", r["variant"], f"size_{r['size']}", f"lr_{lr:g}", f"seed_{r['seed']}")


def _train(cfg, run_dir) -> dict:
    from tieflax.run.console import for_study  # noqa: PLC0415
    from tieflax.train import train_and_evaluate  # noqa: PLC0415

    cfg.train.console = for_study(cfg.train.console)  # the sweep prints one line per run
    return train_and_evaluate(cfg, run_dir)


def run_sweep(config: ml_collections.ConfigDict, study: RunDir | str, *, resume: bool = False, log=print,
              train: Callable[[ml_collections.ConfigDict, str], dict] = _train,
              retrain_changed: bool = False) -> dict:
    """Runs (or resumes) the sweep and writes its report; returns the summary. ``train(config, run_dir)``
    must return a dict with ``final_val_loss`` (the trainer's, on the whole split: ``eval_batches=0``).

    ``study``: the sweep's folder (``--workdir``): the command's ``RunDir``, or a path (a notebook's),
    resolved and checked here, once (``RunDir.of``); it may be a ``gs://`` prefix. On ``resume``, a run
    found in it is reused only if it was trained with the config it would get now
    (``tieflax.study.resume``); otherwise the sweep refuses naming the fields, or with ``retrain_changed``
    trains it again."""
    import jax  # noqa: PLC0415

    from tieflax.run.lock import hold  # noqa: PLC0415

    sc = sweep_config(config)
    study = RunDir.of(study)  # canonical, once: every run and lock below takes it so
    if storage.is_dir(study.file("runs")) and not resume:
        raise WorkdirError(f"{study} already holds a sweep; pass --resume to continue it, or use a new "
                           "--workdir")
    runs = plan(config, sc)  # every variant validated at every size before anything is written
    from tieflax.study.compare import task_section  # noqa: PLC0415
    from tieflax.study.tasks import check_settings  # noqa: PLC0415

    tc = task_section(config)   # config.compare.tasks: the same benchmark tasks a compare scores
    if tc.tasks:
        check_settings(tc, lookup=True)
    with hold(study, "sweep", enabled=jax.process_index() == 0):
        return _run_sweep(config, study, sc, runs, log=log, train=train, retrain_changed=retrain_changed,
                          tasks=tc if tc.tasks else None)


def _run_config(r: dict, lr: float, study: RunDir, tokenizer: str) -> ml_collections.ConfigDict:
    """Plan entry ``r``'s config at ``lr``: the whole split scored once, at the end; the shared tokenizer
    and the data cache it was prepared in (``tieflax.study.compare.study_cache_dir``)."""
    from tieflax.study.compare import study_cache_dir  # noqa: PLC0415

    cfg = copy.deepcopy(r["config"])
    cfg.seed = r["seed"]
    cfg.train.learning_rate = float(lr)
    cfg.train.eval_batches = 0           # the whole validation split
    cfg.train.eval_every = cfg.train.num_steps
    cfg.train.checkpoint_every = cfg.train.num_steps
    if tokenizer:
        cfg.data.tokenizer.path = tokenizer
    cfg.data.cache_dir = study_cache_dir(cfg.data, study)
    return cfg


def _run_sweep(config, study: RunDir, sc, runs: list[dict], *, log, train, retrain_changed: bool,
               tasks=None) -> dict:
    import jax  # noqa: PLC0415

    from tieflax.hardware import distributed  # noqa: PLC0415
    from tieflax.study.resume import StudyMismatch, check_run_matches, result_fields  # noqa: PLC0415
    from tieflax.study.compare import param_counts, shared_tokenizer  # noqa: PLC0415
    from tieflax.config import model_config  # noqa: PLC0415

    is_main = jax.process_index() == 0

    storage.makedirs(study.path)
    tokenizer = shared_tokenizer(config, study)
    best: dict[str, float] = {}
    done, t0 = [], time.perf_counter()
    for k, r in enumerate(runs):
        if r["phase"] == "main" and not best:
            best = best_learning_rates(done)
            log("best learning rates: " + ", ".join(f"{v} {lr:g}" for v, lr in best.items()))
        lr = r["lr"] if r["lr"] is not None else best[r["variant"]]
        run_dir = _run_dir(study, r, lr)
        path = storage.join(run_dir, RESULT)
        cfg = _run_config(r, lr, study, tokenizer)
        counts = param_counts(model_config(cfg))
        if any(d["run_dir"] == run_dir for d in done):  # the lr phase's seed at lr_size: reused
            continue
        res = jsonable.loads(storage.read_text(path)) if storage.is_file(path) else None
        # Process 0 checks the run against its config (and removes it when asked); one collective gives
        # every process the verdict.
        error, retrain = None, False
        if is_main:
            try:
                retrain = check_run_matches(run_dir, cfg, retrain=retrain_changed,
                                            saved_fields=(res or {}).get("config"))
            except StudyMismatch as e:
                error = str(e)
        error = distributed.first_failure(error, "sweep-resume")
        if error is not None:
            raise StudyMismatch(error)
        if retrain or (res is not None and not storage.is_file(path)):  # removed by process 0
            if retrain:
                log(f"{run_dir}: trained with a different config; training it again (--retrain-changed)")
            res = None
        if res is None:
            log(f"[{k + 1}/{len(runs)}] {r['phase']}: {r['variant']} size {r['size']} lr {lr:g} seed {r['seed']}")
            res = train(cfg, run_dir)
            if res.get("preempted"):
                log("stopped by SIGTERM; rerun with --resume to continue")
                raise SystemExit(143)
            # The fields it was trained with, for the check of a later --resume.
            res = dict(final_val_loss=float(res["final_val_loss"]), config=result_fields(cfg))
            if is_main:
                storage.write_text(path, jsonable.dumps(res))
        done.append(dict(phase=r["phase"], size=r["size"], variant=r["variant"], seed=r["seed"], lr=float(lr),
                         run_dir=run_dir, loss=res["final_val_loss"], params=counts, match=r["match"]))
    if not best:
        best = best_learning_rates(done)
    if tasks is not None and is_main:
        # Benchmark tasks on the runs the curves use (each variant's best rate); reused when already scored.
        from tieflax.study.tasks import compare_tasks, score_run  # noqa: PLC0415

        for d in done:
            if d["lr"] == best.get(d["variant"]):
                d["tasks"] = score_run(d["run_dir"], tasks, log=log)
    summary = dict(sweep=sc.to_dict(), best_lr=best, runs=done, wall_seconds=time.perf_counter() - t0,
                   config=json.loads(config.to_json_best_effort()))
    if tasks is not None and is_main:
        n_boot = sc.get("bootstrap", st.N_BOOT)
        summary["tasks"] = {i: compare_tasks([d for d in done if d["size"] == i and d.get("tasks")], n_boot)
                            for i in range(len(sc.sizes))}
    summary = to_jsonable(summary)
    if is_main:
        storage.write_text(study.file("sweep.json"), jsonable.dumps(summary))
    summary["report"] = write_sweep_report(summary, study.path) if is_main else None
    return summary


def best_learning_rates(done: list[dict]) -> dict[str, float]:
    """``{variant: lr}`` with the lowest validation loss among the learning-rate runs (NaN losses lose)."""
    best: dict[str, tuple[float, float]] = {}
    for d in done:
        if d["phase"] != "lr":
            continue
        loss = d["loss"] if math.isfinite(d["loss"]) else float("inf")
        if d["variant"] not in best or loss < best[d["variant"]][0]:
            best[d["variant"]] = (loss, d["lr"])
    return {v: lr for v, (_, lr) in best.items()}


# ------------------------------------------------------------------------------------------- analysis
def curves(summary: dict) -> dict[str, list[dict]]:
    """``{variant: [per size: {'size', 'total', 'non_embedding', 'losses': {seed: loss}, 'ci'}]}`` from the
    main-phase runs (the lr phase's run at the best rate counts as that seed's main run)."""
    best = summary["best_lr"]
    out: dict[str, dict[int, dict]] = {}
    for d in summary["runs"]:
        if d["lr"] != best.get(d["variant"]):
            continue
        point = out.setdefault(d["variant"], {}).setdefault(d["size"], dict(
            size=d["size"], total=d["params"]["total"], non_embedding=d["params"]["non_embedding"], losses={}))
        point["losses"][d["seed"]] = d["loss"]
    n_boot = summary["sweep"].get("bootstrap", st.N_BOOT)
    result = {}
    for v, points in out.items():
        result[v] = [dict(p, ci=st.bootstrap_ci(list(p["losses"].values()), n_boot=n_boot))
                     for _, p in sorted(points.items())]
    return result


def crossover(tied: list[dict], other: list[dict], x_key: str = "total", n_boot: int = 2000, seed: int = 0) -> dict:
    """Where ``other - tied`` (paired by seed at each size) changes sign, in log10 of ``x_key`` params.

    Returns ``mean_diff`` (per size), ``x`` (log10 of the *tied* model's count per size, the common axis),
    ``crossing`` (log10 params of the first sign change of the mean differences, or None), ``share``
    (fraction of seed-bootstrap replicates with a crossing in range) and ``lo``/``hi`` (2.5-97.5% of the
    replicates' crossings; NaN when fewer than 5% cross).
    """
    sizes = sorted(set(p["size"] for p in tied) & set(p["size"] for p in other))
    t = {p["size"]: p for p in tied}
    o = {p["size"]: p for p in other}
    seeds = sorted(set.intersection(*[set(t[s]["losses"]) & set(o[s]["losses"]) for s in sizes])) if sizes else []
    if len(sizes) < 2 or not seeds:
        nan = float("nan")
        return dict(sizes=sizes, mean_diff=[], x=[], crossing=None, share=nan, lo=nan, hi=nan, n_seeds=len(seeds))
    diff = np.array([[o[s]["losses"][k] - t[s]["losses"][k] for s in sizes] for k in seeds])  # [S, sizes]
    x = np.log10([t[s][x_key] for s in sizes])

    def first_cross(d):
        for i in range(len(d) - 1):
            if d[i] == 0:
                return float(x[i])
            if d[i] * d[i + 1] < 0:
                return float(x[i] + (x[i + 1] - x[i]) * d[i] / (d[i] - d[i + 1]))
        return None

    rng = np.random.default_rng(seed)
    reps = [first_cross(diff[rng.integers(0, len(seeds), len(seeds))].mean(0)) for _ in range(n_boot)]
    hits = np.array([r for r in reps if r is not None])
    share = len(hits) / n_boot
    lo, hi = (np.quantile(hits, [0.025, 0.975]) if share >= 0.05 else (float("nan"), float("nan")))
    return dict(sizes=sizes, mean_diff=diff.mean(0).tolist(), x=x.tolist(), crossing=first_cross(diff.mean(0)),
                share=float(share), lo=float(lo), hi=float(hi), n_seeds=len(seeds))


def _edge_note(summary: dict) -> str:
    """A warning when a variant's best rate is the grid's smallest or largest (its optimum may lie beyond)."""
    lrs = sorted(summary["sweep"]["lrs"])
    edge = [v for v, lr in summary["best_lr"].items() if len(lrs) > 1 and lr in (lrs[0], lrs[-1])]
    return (f" **At the edge of the grid:** {', '.join(f'`{v}`' for v in edge)}; widen `config.sweep.lrs`."
            if edge else "")


def write_sweep_report(summary: dict, out_dir: str) -> str:
    from tieflax.analysis import plots  # noqa: PLC0415

    cur = curves(summary)
    paths = {}
    for key, label in (("total", "total parameters"), ("non_embedding", "non-embedding parameters")):
        paths[key] = plots.loss_vs_params(
            {v: [(p[key], p["ci"]) for p in pts] for v, pts in cur.items()},
            storage.join(out_dir, f"loss_vs_{key}.png"), xlabel=label,
            title=f"validation loss vs {label}: mean over seeds, 95% bootstrap CI (n={len(summary['sweep']['seeds'])})")
    lines = ["# Tied vs untied across sizes: sweep report", "",
             f"Produced by `tieflax sweep` in {summary['wall_seconds'] / 60:.1f} minutes. Every variant trained "
             f"at its own best learning rate (from {tuple(summary['sweep']['lrs'])} at size "
             f"{summary['sweep']['lr_size']}, seed {summary['sweep']['seeds'][0]}): "
             + ", ".join(f"`{v}` {lr:g}" for v, lr in summary["best_lr"].items()) + "." + _edge_note(summary), "",
             "## Loss by size", "",
             "| variant | size | d_model, layers, d_ff, heads | total params | non-embedding | val loss [95% CI] (n) |",
             "|---|---:|---|---:|---:|---:|"]
    sizes = summary["sweep"]["sizes"]
    for v, pts in cur.items():
        for p in pts:
            ci = p["ci"]
            cell = (f"{ci['mean']:.4f} [{ci['lo']:.4f}, {ci['hi']:.4f}] ({ci['n']})" if math.isfinite(ci["lo"])
                    else f"{ci['mean']:.4f} ({ci['n']})")
            lines.append(f"| {v} | {p['size']} | {tuple(sizes[p['size']])} | {p['total']:,} "
                         f"| {p['non_embedding']:,} | {cell} |")
    lines += ["", "## Crossover", ""]
    n_boot = summary["sweep"].get("bootstrap", st.N_BOOT)
    for v, x_key, what in (("untied_matched", "total", "at equal total parameters, same body (Chung et al.)"),
                           ("untied_width", "total", "at equal total parameters, narrower body"),
                           ("untied", "non_embedding", "at equal non-embedding parameters")):
        if v not in cur or "tied" not in cur:
            continue
        c = crossover(cur["tied"], cur[v], x_key, n_boot)
        diffs = ", ".join(f"{d:+.4f}" for d in c["mean_diff"])
        if c["crossing"] is None:
            where = "none in range: the mean difference keeps one sign over every size"
        else:
            where = f"at about 10^{c['crossing']:.2f} {x_key.replace('_', '-')} parameters"
        unc = (f"{100 * c['share']:.0f}% of seed-bootstrap replicates cross in range"
               + (f", between 10^{c['lo']:.2f} and 10^{c['hi']:.2f}" if math.isfinite(c["lo"]) else ""))
        if c["n_seeds"] < 2:  # one seed resamples to itself: no uncertainty to state, no verdict
            unc = st.too_little(c["n_seeds"], "seed")
        lines.append(f"- `{v}` minus `tied` {what}: per size {diffs} (negative favours untied). Crossing: {where}; "
                     f"{unc}.")
    if summary.get("tasks"):
        from tieflax.study.report import _table  # noqa: PLC0415
        from tieflax.study.tasks import tasks_section  # noqa: PLC0415

        lines += ["", "## Benchmark tasks", ""]
        for size, per_task in summary["tasks"].items():
            text = tasks_section(per_task, _table)
            if text:
                lines += [f"### Size {size}: {tuple(sizes[int(size)])}", "", text, ""]
    lines += ["", "## Plots", "", "![loss vs total](loss_vs_total.png)", "",
              "![loss vs non-embedding](loss_vs_non_embedding.png)", "",
              "## Caveats", "",
              f"- {len(summary['sweep']['seeds'])} seeds per point: intervals over so few seeds under-cover.",
              "- The learning rate is tuned at one size and reused at the others.",
              "- On a CPU the sizes are small; `tie_scaling.py:pod` extends the curve to a 1B-parameter model.", ""]
    path = storage.join(out_dir, "sweep_report.md")
    storage.write_text(path, "\n".join(lines))
    return path
