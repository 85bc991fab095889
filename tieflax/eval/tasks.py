"""Running lm-eval tasks on a run: task lookup with one-line errors, ``simple_evaluate``, and lm-eval's
own output files (``EvaluationTracker``), as ``tieflax evaluate`` does.

    results = evaluate_workdir("runs/x", tasks=["arc_easy"], limit=100, output="runs/x/lm_eval")
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from tieflax.eval.decode import EvalError


def task_manager(tasks: Sequence[str], include_path: Optional[str]):
    """lm-eval's ``TaskManager``, after checking that every task name exists (one line if not).

    Tasks all found under ``include_path`` skip indexing lm-eval's own ~15k task files (some 10 s).
    """
    import os  # noqa: PLC0415

    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    if include_path is not None:
        if not os.path.isdir(include_path):
            raise EvalError(f"--include-path {include_path!r} is not a folder; point it at a folder of task YAMLs")
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


def evaluate_workdir(workdir: str, *, tasks: Sequence[str], include_path: Optional[str] = None,
                     num_fewshot: Optional[int] = None, limit: Optional[float] = None, batch_size: int = 8,
                     token_budget: int = 4096, log_samples: bool = False, output: Optional[str] = None,
                     step: Optional[int] = None, seed: int = 0, show: bool = False) -> dict:
    """lm-eval's results dict for ``tasks`` on ``workdir``'s checkpoint (``samples`` kept if asked)."""
    tasks = [t.strip() for t in tasks if t.strip()]
    if not tasks:
        raise EvalError("--tasks is empty; name at least one lm-eval task, e.g. --tasks arc_easy")
    from tieflax.eval.harness import TieflaxLM  # noqa: PLC0415

    # The run first: a workdir without a checkpoint fails before lm-eval indexes its tasks.
    lm = TieflaxLM.from_workdir(workdir, step=step, batch_size=batch_size, token_budget=token_budget, seed=seed)
    manager = task_manager(tasks, include_path)
    return run_tasks(lm, tasks, manager, model_args={"pretrained": workdir}, num_fewshot=num_fewshot,
                     limit=limit, log_samples=log_samples, output=output, show=show)


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
    tracker = EvaluationTracker(output_path=output) if output else None
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), batch_size=batch_size,
                                      num_fewshot=num_fewshot, limit=limit, log_samples=log_samples,
                                      evaluation_tracker=tracker, task_manager=manager)
    if tracker is not None:
        samples = results.pop("samples") if log_samples else None
        tracker.save_results_aggregated(results=results, samples=samples)
        if log_samples:
            for name in results["configs"]:
                tracker.save_results_samples(task_name=name, samples=samples[name])
        if samples is not None:
            results["samples"] = samples
    if show:
        print(make_table(results))
    return results
