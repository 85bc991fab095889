"""Running lm-eval tasks on a run: task lookup with one-line errors, ``simple_evaluate``, and lm-eval's
own output files (``EvaluationTracker``), as ``tieflax evaluate`` does.

lm-eval writes its files with ``pathlib`` (a ``gs://`` output would become a local folder ``gs:``) and
logs a failed write instead of raising, so its tracker writes into a local temporary folder and the files
are then copied whole through ``tieflax.storage`` to the output (local, gs:// or s3://).

    tasks, output, _ = checked_request(["arc_easy"], limit=100, output="runs/x/lm_eval")
    results = evaluate_tasks(Run.read("runs/x", command="evaluate"), tasks, limit=100, output=output)

During training (``config.train.eval_tasks``), ``TrainingTasks`` scores the tasks on the live parameters
(no checkpoint is read): one ``TieflaxLM`` on the training mesh for the whole run, its parameters swapped
in at each scoring, so each task's shapes compile once. Its scalars go to the metrics and trackers; the
results and per-sample records are kept in ``<workdir>/lm_eval/step_<n>/`` (``write_scores``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from typing import Any, Optional, Sequence

from tieflax import storage
from tieflax.eval.decode import EvalError
from tieflax.run.destinations import check_output_folder
from tieflax.run.layout import LM_EVAL_DIR, LM_EVAL_STEP_DIR, RunDir, WorkdirError


def check_task_files(include_path: str, tasks: Optional[Sequence[str]] = None) -> None:
    """``--include-path`` is a local folder whose task YAMLs all parse (lm-eval skips one that does not,
    silently, and then calls its task unknown): else one line naming the file, the line and the error.
    Then the local data files of ``tasks`` (every task of the folder when None, or when one of ``tasks`` is
    no task file's ``task``: a group) are checked (``tieflax.eval.task_data``)."""
    import yaml  # noqa: PLC0415
    from lm_eval.tasks._yaml_loader import load_yaml  # noqa: PLC0415

    if storage.is_remote(include_path):
        raise EvalError(f"--include-path {include_path!r}: lm-eval reads task YAMLs from a local folder only; "
                        "copy them to a local folder")
    if not storage.is_dir(include_path):
        raise EvalError(f"--include-path {include_path!r} is not a folder; point it at a folder of task YAMLs")
    parsed = []
    for path in storage.walk_files(include_path):
        if not path.endswith(".yaml") or {"__pycache__", ".ipynb_checkpoints"} & set(path.split(os.sep)):
            continue
        try:
            parsed.append((path, load_yaml(path, resolve_func=False, recursive=True)))
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = " ".join(x for x in (e.context, e.problem) if x)
            raise EvalError(f"task file {path}{where}: not valid YAML ({what}): fix the file") from None
        except yaml.YAMLError as e:
            raise EvalError(f"task file {path}: not valid YAML ({e}): fix the file") from None
        except (OSError, ValueError) as e:   # a missing or circular `include:`
            if "Expected YAML dict" in str(e):
                continue   # not a task file (lm-eval skips it too)
            raise EvalError(f"task file {path}: {e}: fix its include") from None
    _check_data(parsed, tasks)


def _check_data(parsed: list, tasks: Optional[Sequence[str]]) -> None:
    """The data of the task files ``parsed`` (``[(path, config)]``) that ``tasks`` name."""
    from tieflax.eval.task_data import check_task_data  # noqa: PLC0415

    named = {c.get("task") for _, c in parsed if isinstance(c, dict) and isinstance(c.get("task"), str)}
    every = tasks is None or not set(tasks) <= named
    for path, config in parsed:
        if every or (isinstance(config, dict) and config.get("task") in set(tasks)):
            check_task_data(path, config)


def check_options(*, limit=None, batch_size=None, token_budget=None, num_fewshot=None, step=None) -> None:
    """The numbers ``tieflax evaluate`` passes on, before any work: one line naming the flag if not."""
    import math  # noqa: PLC0415

    if limit is not None:
        if not (math.isfinite(limit) and limit > 0):
            raise EvalError(f"--limit {limit:g}: give the items per task (a whole number >= 1) or a fraction of "
                            "them (0 < f < 1)")
        if limit >= 1 and limit != int(limit):
            raise EvalError(f"--limit {limit:g}: above 1 it counts items, a whole number (below 1 it is a fraction)")
    for flag, value, least in (("--batch-size", batch_size, 1), ("--token-budget", token_budget, 1),
                               ("--num-fewshot", num_fewshot, 0), ("--step", step, 0)):
        if value is not None and value < least:
            raise EvalError(f"{flag} {value}: use {least} or more")


def task_manager(tasks: Sequence[str], include_path: Optional[str]):
    """lm-eval's ``TaskManager``, after checking that every task name exists (one line if not).

    Tasks all found under ``include_path`` skip indexing lm-eval's own ~15k task files (some 10 s).
    """
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    if include_path is not None:
        check_task_files(include_path, tasks)
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in set(local.all_tasks) for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in set(manager.all_tasks)]
    if unknown:
        where = f" or in {include_path}" if include_path else " (add --include-path DIR for your own YAMLs)"
        raise EvalError(f"unknown lm-eval task {unknown[0]!r}: not in lm-eval's registry{where}; list the "
                        "known ones with `lm-eval ls tasks`")
    return manager


def checked_request(tasks: Sequence[str], *, include_path: Optional[str] = None, num_fewshot: Optional[int] = None,
                    limit: Optional[float] = None, batch_size: int = 8, token_budget: int = 4096,
                    output: Optional[str] = None, step: Optional[int] = None) -> tuple[list[str], Optional[str],
                                                                                        Optional[str]]:
    """``(tasks, output, unreachable)``: the task names, the output folder resolved and the Hugging Face
    host that could not be reached (None: reachable, or offline by choice), checked on process 0 before any
    run is read; a refusal (an option, a task file, the output) stops every process together."""
    tasks = [t.strip() for t in tasks if t.strip()]
    if not tasks:
        raise EvalError("--tasks is empty; name at least one lm-eval task, e.g. --tasks arc_easy")
    unreachable = offline_when_unreachable()   # before lm-eval imports huggingface_hub and datasets
    import jax  # noqa: PLC0415

    from tieflax.hardware import distributed  # noqa: PLC0415

    error = None
    try:
        if jax.process_index() == 0:   # lm-eval runs here; the other processes follow its batches
            check_options(limit=limit, batch_size=batch_size, token_budget=token_budget, num_fewshot=num_fewshot,
                          step=step)
            if include_path is not None:
                check_task_files(include_path, tasks)
            output = check_output_folder(output)   # a bad path or bucket fails before the checkpoint loads
    except (EvalError, WorkdirError) as e:
        error = str(e)
    error = distributed.first_failure(error, "evaluate-options")   # every process stops, or none
    if error is not None:
        raise EvalError(error)
    return tasks, output, unreachable


def evaluate_tasks(run, tasks: Sequence[str], *, include_path: Optional[str] = None,
                   num_fewshot: Optional[int] = None, limit: Optional[float] = None, batch_size: int = 8,
                   token_budget: int = 4096, log_samples: bool = False, output: Optional[str] = None,
                   step: Optional[int] = None, seed: int = 0, show: bool = False,
                   unreachable: Optional[str] = None) -> dict:
    """lm-eval's results dict for ``tasks`` on the checkpoint of ``run``, a run opened for reading
    (``Run.read``; ``samples`` kept if asked), with the request as ``checked_request`` returned it."""
    import jax  # noqa: PLC0415

    from tieflax.eval.harness import TieflaxLM  # noqa: PLC0415

    # The run first: a workdir without a checkpoint fails before lm-eval indexes its tasks.
    lm = TieflaxLM.from_run(run, step=step, batch_size=batch_size, token_budget=token_budget, seed=seed)
    if jax.process_index() != 0:
        lm.follow()
        return {}
    with lm.leading():
        manager = task_manager(tasks, include_path)
        try:
            return run_tasks(lm, tasks, manager, model_args={"pretrained": run.path}, num_fewshot=num_fewshot,
                             limit=limit, log_samples=log_samples, output=output, show=show)
        except ConnectionError as e:
            if unreachable is None:
                raise
            raise EvalError(f"{e}: the Hugging Face hub ({unreachable}) cannot be reached and the task's data is "
                            "not in the local cache: connect to the network (or run it once online to cache it), "
                            "or use a local task (--include-path)") from None


def offline_when_unreachable(timeout_s: float = 5.0) -> Optional[str]:
    """When the Hugging Face hub cannot be reached and no offline switch is set, sets HF_HUB_OFFLINE and
    HF_DATASETS_OFFLINE for this process, so that lm-eval's tasks load from the local cache at once and a
    task not there fails in one line, instead of after five retries (23 s) printed twice each as
    huggingface_hub warnings. Call it before huggingface_hub and datasets are imported: they read the
    switches once. -> the host that could not be reached, or None."""
    import socket  # noqa: PLC0415

    if any(os.environ.get(v, "") not in ("", "0", "false", "False") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://", 1)[-1].split("/", 1)[0]
    host, _, port = endpoint.partition(":")
    try:
        socket.create_connection((host, int(port or 443)), timeout=timeout_s).close()
        return None
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        return host


def run_tasks(model, tasks: Sequence[str], manager, *, model_args: Optional[dict] = None, batch_size=None,
              num_fewshot=None, limit=None, log_samples=False, output: Optional[str] = None,
              show: bool = False) -> dict:
    """``simple_evaluate`` of ``model`` (a name and ``model_args``, or an lm-eval ``LM``), then, with
    ``output``, lm-eval's results and samples files under it, as ``lm_eval --output_path`` writes them."""
    import lm_eval  # noqa: PLC0415
    from lm_eval.loggers import EvaluationTracker  # noqa: PLC0415
    from lm_eval.utils import make_table  # noqa: PLC0415

    import tieflax.eval.harness  # noqa: F401, PLC0415 (registers the "tieflax" lm-eval model)

    logging.getLogger("lm-eval").setLevel(logging.WARNING)   # the table is the output, not lm-eval's logs
    output = check_output_folder(output)
    with tempfile.TemporaryDirectory(prefix="tieflax-lm-eval-") as local:
        tracker = EvaluationTracker(output_path=local) if output else None
        import jinja2  # noqa: PLC0415

        try:
            with _git_quietly(), torch_report_once():
                results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                                  batch_size=batch_size, num_fewshot=num_fewshot, limit=limit,
                                                  log_samples=log_samples, evaluation_tracker=tracker,
                                                  task_manager=manager)
        except jinja2.TemplateError as e:
            raise EvalError(template_failure(e, manager)) from None
        if tracker is not None:
            samples = results.pop("samples") if log_samples else None
            tracker.save_results_aggregated(results=results, samples=samples)
            if log_samples:
                for name in results["configs"]:
                    tracker.save_results_samples(task_name=name, samples=samples[name])
            if samples is not None:
                results["samples"] = samples
            copy_outputs(local, output)
    if show:
        print(make_table(results))
    return results


def git_commit_quietly() -> Optional[str]:
    """lm-eval's ``get_git_commit_hash`` (the results' ``git_hash``: the commit of the folder the command
    runs in) without its noise: lm-eval runs ``git describe`` with git's stderr on ours, so every evaluation
    outside a git checkout printed ``fatal: not a git repository``. Same answer, git's stderr kept."""
    import subprocess  # noqa: PLC0415

    from lm_eval.loggers.utils import get_commit_from_path  # noqa: PLC0415

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, stdin=subprocess.DEVNULL,
                              timeout=30, check=False)
        if done.returncode == 0:
            return done.stdout.decode().strip()
    except (OSError, subprocess.SubprocessError):   # no git on this machine, or it hangs
        pass
    return get_commit_from_path(os.getcwd())   # lm-eval's own fallback: read .git/HEAD


@contextlib.contextmanager
def _git_quietly():
    """``simple_evaluate`` with :func:`git_commit_quietly` in place of lm-eval's git call."""
    import lm_eval.evaluator as evaluator  # noqa: PLC0415

    saved = getattr(evaluator, "get_git_commit_hash", None)
    if saved is None:   # another lm-eval: nothing to replace
        yield
        return
    evaluator.get_git_commit_hash = git_commit_quietly
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = saved


_TORCH_REPORT: list[str] = []   # torch's environment report, once collected in this process


@contextlib.contextmanager
def torch_report_once():
    """``simple_evaluate`` with torch's environment report (the results' ``pretty_env_info``:
    ``torch.utils.collect_env``, which runs ``pip list`` in a new interpreter and some ten shell commands,
    about 0.5 CPU-s of child processes) collected once per process: lm-eval collects it at every
    evaluation, and a run with ``train.eval_tasks`` evaluates every ``eval_tasks_every`` steps, each time
    forking the training process. The same text in every evaluation's results."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("torch") is None:   # lm-eval reports none, and torch is not imported here
        yield
        return
    from torch.utils import collect_env  # noqa: PLC0415

    collect = collect_env.get_pretty_env_info

    def once() -> str:
        if not _TORCH_REPORT:
            _TORCH_REPORT.append(collect())
        return _TORCH_REPORT[0]

    collect_env.get_pretty_env_info = once
    try:
        yield
    finally:
        collect_env.get_pretty_env_info = collect


def template_failure(e: Exception, manager) -> str:
    """One line for a task template that does not render: the task, its YAML file and line, the error and
    the document's fields (lm-eval raises jinja's error from deep in its request building)."""
    import re  # noqa: PLC0415

    template = doc = task = None
    tb = e.__traceback__
    while tb is not None:   # the innermost frames know the template and the task rendering it
        names = tb.tb_frame.f_locals
        if isinstance(names.get("template"), str):
            template, doc = names["template"], names.get("doc")
        config = getattr(names.get("self"), "config", None)
        if isinstance(getattr(config, "task", None), str):
            task = config.task
        tb = tb.tb_next
    entry = manager.task_index.get(task) if task and manager is not None else None
    path = str(entry.yaml_path) if entry is not None and entry.yaml_path else None
    line = None
    if path and template:
        undefined = re.findall(r"'(\w+)' is undefined|has no attribute '(\w+)'", str(e))
        needles = [template.strip().splitlines()[0]] if template.strip() else []
        needles += [n for pair in undefined for n in pair if n]
        lines = storage.read_text(path).splitlines()   # a local task file (--include-path or lm-eval's own)
        line = next((i + 1 for needle in needles for i, text in enumerate(lines) if needle in text), None)
    where = ", ".join(x for x in (f"task {task}" if task else None, path, f"line {line}" if line else None) if x)
    fields = f" (the documents' fields: {', '.join(map(str, doc))})" if isinstance(doc, dict) else ""
    shown = f" {template!r}" if template else ""
    return f"{where or 'a task'}: the template{shown} does not render: {getattr(e, 'message', None) or e}{fields}"


def copy_outputs(local: str, output: str) -> list[str]:
    """Every file lm-eval wrote under ``local`` -> the same place under ``output``; -> the paths written."""
    files = storage.walk_files(local)
    if not any(os.path.basename(f).startswith("results_") for f in files):
        raise EvalError(f"lm-eval wrote no results file for --output {output} (it logs a failed write and "
                        "goes on); rerun with the lm-eval logger at INFO to see why")
    written = []
    for f in files:
        written.append(storage.join(output, *os.path.relpath(f, local).split(os.sep)))
        storage.write_bytes(written[-1], storage.read_bytes(f))
    return written


def write_scores(results: dict, out_dir: str) -> list[str]:
    """lm-eval's ``results`` (with ``samples``) as ``out_dir/results.json`` and one
    ``samples_<task>.jsonl`` per leaf task, through the path layer; -> the paths written."""
    written = []
    for leaf, samples in (results.get("samples") or {}).items():
        text = "".join(json.dumps(s, default=str, ensure_ascii=False) + "\n" for s in samples)
        written.append(storage.join(out_dir, f"samples_{leaf}.jsonl"))
        storage.write_text(written[-1], text)
    written.append(storage.join(out_dir, "results.json"))
    storage.write_text(written[-1], json.dumps({k: results[k] for k in ("results", "group_subtasks", "n-shot",
                                                                         "versions") if k in results},
                                               default=str, indent=1))
    return written


def scalars(results: dict) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` of every task and group in lm-eval's ``results`` (lm-eval's
    ``"acc,none"`` becomes ``acc``, a filter other than ``none`` is appended: ``exact_match_strict-match``);
    values that are not finite numbers (an ``N/A`` stderr) are left out."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            if math.isfinite(float(value)):
                out[f"{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"] = float(value)
    return out


@contextlib.contextmanager
def _no_progress_bars():
    """lm-eval's request-building bar and the datasets library's bars off (training prints its own lines:
    carriage-return bars would garble a log file)."""
    import datasets  # noqa: PLC0415
    import lm_eval.api.task as lm_task  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    saved = getattr(lm_task, "tqdm", None)
    if saved is not None:
        lm_task.tqdm = lambda *a, **k: tqdm(*a, **{**k, "disable": True})
    try:
        yield
    finally:
        if saved is not None:
            lm_task.tqdm = saved
        if was_enabled:
            datasets.enable_progress_bars()


class TrainingTasks:
    """``config.train.eval_tasks`` scored on the parameters a run trains (module docstring).

    Built before the first step: lm-eval missing or an unknown task fails then, in one line, not after
    hours of training. ``score(params, step)`` -> the scalars; process 0 also writes the run's copy.
    """

    def __init__(self, config, model_config, tokenizer, mesh, run_dir: RunDir, *, write: bool = True):
        """``run_dir``: the training run's ``RunDir`` (``Run.open``'s), where ``score`` writes lm-eval's files
        (``write``: process 0)."""
        import jax  # noqa: PLC0415

        from tieflax.hardware import distributed  # noqa: PLC0415

        t = config.train
        self.tasks = [str(x).strip() for x in t.eval_tasks]
        self.lead = jax.process_index() == 0   # lm-eval runs here; the others follow (tieflax.eval.requests)
        if tokenizer is None:
            raise EvalError("config.train.eval_tasks needs the run's tokenizer, and this run trains on "
                            "pre-tokenised data without one: set data.tokenizer.path, or score checkpoints "
                            "with `tieflax evaluate` where the tokenizer is")
        try:
            import lm_eval  # noqa: F401, PLC0415
        except ImportError:
            raise EvalError("config.train.eval_tasks needs lm-evaluation-harness: pip install -e '.[eval]' (or set "
                            "config.train.eval_tasks=())") from None
        from tieflax.data.tokenizer import bos_id_of, eos_id_of  # noqa: PLC0415
        from tieflax.eval.harness import TieflaxLM  # noqa: PLC0415

        self.manager, error = None, None
        if self.lead:
            try:
                self.manager = task_manager(self.tasks, t.eval_tasks_include_path or None)
            except EvalError as e:
                error = str(e)
        error = distributed.first_failure(error, "eval-tasks")   # an unknown task stops every process
        if error is not None:
            raise EvalError(error)
        self.limit = float(t.eval_tasks_limit) or None
        self.num_fewshot = None if t.eval_tasks_num_fewshot < 0 else int(t.eval_tasks_num_fewshot)
        self.run_dir, self.write = run_dir, write
        max_length = int(t.seq_len)
        if model_config.position == "learned":
            max_length = min(max_length, model_config.max_seq_len)
        eos = eos_id_of(tokenizer, config.data.tokenizer.eos_token)
        self.lm = TieflaxLM(model_config, None, tokenizer, eos_id=eos,
                            prefix_id=bos_id_of(tokenizer, config.data.tokenizer.bos_token),
                            max_length=max_length, batch_size=int(t.eval_tasks_batch_size) or None,
                            token_budget=int(t.eval_tasks_token_budget), mesh=mesh, progress=False)

    def score(self, params: Any, step: int) -> dict[str, float]:
        self.lm.params = params
        self.lm.seed = 0   # as `tieflax evaluate` starts: the same generations for the same parameters
        try:
            if not self.lead:
                self.lm.follow()
                return {}
            with _no_progress_bars(), self.lm.leading():
                results = run_tasks(self.lm, self.tasks, self.manager, num_fewshot=self.num_fewshot,
                                    limit=self.limit, log_samples=True)
        finally:
            self.lm.params = None   # the training step donates these buffers
        if self.write:
            write_scores(results, self.run_dir.file(LM_EVAL_DIR, LM_EVAL_STEP_DIR.format(step=int(step))))
        return scalars(results)
