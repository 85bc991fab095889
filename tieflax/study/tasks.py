"""Benchmark tasks in the study: each run's final checkpoint scored on lm-eval tasks, and the paired
comparison of the variants per task (``config.compare.tasks``; off when empty).

Scoring (``score_run``) goes through the tieflax lm-eval backend (``tieflax.eval``) with per-sample
logging; the run keeps

- ``<run>/lm_eval/samples_<task>.jsonl``: lm-eval's per-sample records (prompt, responses, metrics);
- ``<run>/analysis/tasks.json``: per requested task, one row per item ``[leaf task, doc_id, prompt_hash,
  value]`` (value: the task's main metric for that item), with the step and the settings scored with, so a
  resumed compare reuses it when both still hold.

Comparison (``compare_tasks``): items are joined across variants and seeds by ``(leaf task, doc_id)``;
their ``prompt_hash`` must be equal everywhere (else the runs saw different prompts and pairing them
means nothing: refused in one line). Per task, the accuracy of a variant is the mean over seeds x items
with a 95% bootstrap interval resampling both, and the difference to ``tied`` is paired item by item
and seed by seed (``stats.two_level_bootstrap`` with unit weights: seeds and items resampled together).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from tieflax import storage
from tieflax.run.layout import ANALYSIS_DIR, LM_EVAL_DIR, RunDir
from tieflax import strict_json as jsonable
from tieflax.analysis import stats as st
from tieflax.errors import ConfigError, UserError

TASKS_FILE = "tasks.json"
PREFERRED = ("acc", "exact_match")   # the main metric when a task has it; else its first metric


class TaskMismatch(UserError):
    """Runs scored on different prompts for the same item: they cannot be paired."""


def settings(cc) -> dict:
    """The scoring settings of ``config.compare`` (what a stored score must match to be reused)."""
    return dict(tasks=[str(t) for t in cc.tasks], include_path=str(cc.task_include_path or ""),
                num_fewshot=int(cc.task_num_fewshot), limit=float(cc.task_limit))


def check_settings(cc, *, lookup: bool = False) -> None:
    """Config checks (one line naming the field); with ``lookup`` also that lm-eval is installed and
    knows every task (run once before anything is trained: indexing lm-eval's registry takes seconds)."""
    if isinstance(cc.tasks, str) or not all(isinstance(t, str) and t.strip() for t in cc.tasks):
        raise ConfigError(f"config.compare.tasks = {cc.tasks!r}: give a tuple of lm-eval task names, "
                               "e.g. ('arc_easy', 'hellaswag'), or () for none")
    if cc.task_limit < 0 or cc.task_num_fewshot < -1:
        raise ConfigError(f"config.compare.task_limit = {cc.task_limit} / task_num_fewshot = "
                               f"{cc.task_num_fewshot}: limit >= 0 (0 = every item), num_fewshot >= 0 or -1 "
                               "(-1 = the task's own)")
    if not cc.tasks or not lookup:
        return
    try:
        from tieflax.eval.tasks import task_manager  # noqa: PLC0415
    except ImportError:
        raise ConfigError("config.compare.tasks needs lm-evaluation-harness: pip install -e '.[eval]'") from None
    task_manager(list(cc.tasks), cc.task_include_path or None)   # unknown task or bad folder: one line


def main_metric(samples: list[dict]) -> str:
    """The metric an item is scored by: ``acc`` or ``exact_match`` when present, else the task's first."""
    names = list(samples[0].get("metrics", []))
    for m in PREFERRED:
        if m in names:
            return m
    if not names:
        raise UserError("lm-eval logged no per-sample metric for this task; it cannot be compared per item")
    return names[0]


def _leaves(results: dict, name: str) -> list[str]:
    """The leaf tasks of ``name`` (itself unless it is a group), from lm-eval's ``group_subtasks``."""
    sub = results.get("group_subtasks", {}).get(name)
    if not sub:
        return [name]
    return [leaf for s in sub for leaf in _leaves(results, s)]


def items_of(results: dict, name: str) -> dict:
    """``{'metric', 'items': [[leaf, doc_id, prompt_hash, value]]}`` of one requested task (a group pools
    its subtasks' items). One filter per leaf: lm-eval's first (a task with several logs each doc once per
    filter)."""
    rows, metric = [], None
    for leaf in _leaves(results, name):
        samples = results["samples"].get(leaf, [])
        if not samples:
            continue
        first = samples[0].get("filter", "none")
        samples = [s for s in samples if s.get("filter", "none") == first]
        m = main_metric(samples)
        metric = metric or m
        rows += [[leaf, int(s["doc_id"]), str(s["prompt_hash"]), float(s[m])] for s in samples]
    if not rows:
        raise UserError(f"lm-eval returned no samples for task {name!r}; check the task (and task_limit)")
    return dict(metric=metric, items=sorted(rows, key=lambda r: (r[0], r[1])))


def score_run(run_dir: str, cc, *, log: Callable[[str], None] = print) -> dict:
    """Scores ``run_dir``'s latest checkpoint on ``cc.tasks`` (or reuses ``analysis/tasks.json`` when it
    holds the same step and settings); -> ``{'step', 'settings', 'tasks': {name: items_of(...)}}``.
    ``run_dir``: one run of a study, a path inside the study's canonical folder."""
    from tieflax.study.analyze import checkpoint_steps  # noqa: PLC0415

    where = RunDir.named(run_dir)
    path = where.file(ANALYSIS_DIR, TASKS_FILE)
    step, want = int(checkpoint_steps(run_dir)[-1]), settings(cc)
    if storage.is_file(path):
        saved = jsonable.loads(storage.read_text(path))
        if saved.get("step") == step and saved.get("settings") == want:
            return saved
    import datasets  # noqa: PLC0415

    from tieflax.eval.harness import TieflaxLM  # noqa: PLC0415
    from tieflax.eval.tasks import run_tasks, task_manager, write_scores  # noqa: PLC0415

    datasets.disable_progress_bars()   # compare prints its own progress, not one bar per dataset split

    lm = TieflaxLM.from_workdir(run_dir, step=step, batch_size=cc.task_batch_size or None,
                                token_budget=int(cc.task_token_budget))
    results = run_tasks(lm, want["tasks"], task_manager(want["tasks"], want["include_path"] or None),
                        model_args={"pretrained": run_dir},
                        num_fewshot=None if want["num_fewshot"] < 0 else want["num_fewshot"],
                        limit=want["limit"] or None, log_samples=True)
    write_scores(results, where.file(LM_EVAL_DIR))
    scored = dict(step=step, settings=want, tasks={t: items_of(results, t) for t in want["tasks"]})
    storage.write_text(path, jsonable.dumps(scored))
    return scored


# ------------------------------------------------------------------------------------------ comparison
def _matrix(task: str, by_run: dict, keys: list) -> dict:
    """``by_run[(variant, seed)]`` item rows -> ({(variant, seed): values [N]} over ``keys``), after checking
    every prompt hash against the first run's (TaskMismatch, one line, if one differs)."""
    ref_run, ref = None, {}
    out = {}
    for run, rows in by_run.items():
        table = {(r[0], r[1]): (r[2], r[3]) for r in rows}
        if ref_run is None:
            ref_run, ref = run, {k: table[k][0] for k in keys}
        for k in keys:
            if table[k][0] != ref[k]:
                raise TaskMismatch(
                    f"task {task!r}: item {k[0]} doc_id {k[1]} has prompt hash {table[k][0][:12]} in {run[0]} "
                    f"seed {run[1]} but {ref[k][:12]} in {ref_run[0]} seed {ref_run[1]}: the runs were scored on "
                    "different prompts and cannot be paired; score every run with the same lm-eval version and "
                    "task settings (delete the runs' analysis/tasks.json and rerun `tieflax compare`)")
        out[run] = np.array([table[k][1] for k in keys], np.float64)
    return out


def compare_tasks(runs: list[dict], n_boot: int = st.N_BOOT) -> dict:
    """Per task: accuracy per variant and the paired difference to ``tied``, 95% intervals over
    seeds x items. ``runs``: the summary's runs, each with ``tasks`` (``score_run``'s dict) or none.
    -> ``{task: {'metric', 'n_items', 'seeds', 'variants': {v: ci}, 'minus_tied': {v: ci}}}``."""
    scored = [r for r in runs if r.get("tasks")]
    if not scored:
        return {}
    variants = list(dict.fromkeys(r["variant"] for r in scored))
    # Paired: the seeds every variant has scored.
    seeds = sorted(set.intersection(*({r["seed"] for r in scored if r["variant"] == v} for v in variants)))
    out = {}
    for task in scored[0]["tasks"]["tasks"]:
        by_run = {(r["variant"], r["seed"]): r["tasks"]["tasks"][task]["items"] for r in scored
                  if r["seed"] in seeds and task in r["tasks"]["tasks"]}
        if len(by_run) < len(variants) * len(seeds) or not seeds:
            continue
        keys = sorted(set.intersection(*({(row[0], row[1]) for row in rows} for rows in by_run.values())))
        if not keys:
            continue
        values = _matrix(task, by_run, keys)
        a = {v: np.stack([values[(v, s)] for s in seeds]) for v in variants}   # [S, N] per variant
        ones, zeros = np.ones(len(keys)), np.zeros((len(seeds), len(keys)))
        entry = dict(metric=scored[0]["tasks"]["tasks"][task]["metric"], n_items=len(keys), seeds=seeds,
                     variants={v: st.two_level_bootstrap(a[v], zeros, ones, n_boot=n_boot, units=("seed", "item"))
                               for v in variants},
                     minus_tied={})
        if "tied" in a:
            for v in variants:
                if v != "tied":
                    entry["minus_tied"][v] = st.two_level_bootstrap(a[v], a["tied"], ones, n_boot=n_boot,
                                                                    units=("seed", "item"))
        out[task] = entry
    return out


def tasks_section(tasks: dict, table: Callable[[list[str], list[list[str]]], str]) -> Optional[str]:
    """The report's markdown for ``compare_tasks``'s result (None when no task was scored)."""
    if not tasks:
        return None
    def cell(ci: dict, sign: str = "") -> str:  # no interval (1 seed or 1 item): the mean and what is missing
        if st.excludes_zero(ci) is None:
            return f"{ci['mean']:{sign}.3f} ({st.missing(ci)})"
        return f"{ci['mean']:{sign}.3f} [{ci['lo']:{sign}.3f}, {ci['hi']:{sign}.3f}]"

    diff = lambda ci: cell(ci, "+")  # noqa: E731
    parts = ["Each run's final checkpoint scored through the tieflax lm-eval backend. Accuracy: the mean of "
             "the task's per-item main metric over seeds x items; the difference to `tied` is paired by item "
             "(lm-eval's doc id, prompt hash checked equal) and seed; both intervals are 95% bootstrap "
             "intervals resampling seeds and items together. The verdict says only whether the interval "
             "excludes 0."]
    for task, e in tasks.items():
        rows = []
        for v, ci in e["variants"].items():
            d = e["minus_tied"].get(v)
            verdict = st.verdict(d, f"{v} scores higher", f"{v} scores lower") if d else ""
            rows.append([v, cell(ci), diff(d) if d else "(reference)", verdict])
        parts += ["", f"**{task}** ({e['metric']}; {e['n_items']} items x {len(e['seeds'])} seed(s))", "",
                  table(["variant", f"{e['metric']} [95% CI]", "minus tied [95% CI]", "verdict"], rows)]
    return "\n".join(parts)
