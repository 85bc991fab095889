"""Running lm-eval tasks on a run: task lookup with one-line errors, ``simple_evaluate``, and lm-eval's
own output files (``EvaluationTracker``), as ``tieflax evaluate`` does.

lm-eval writes its files with ``pathlib`` (a ``gs://`` output would become a local folder ``gs:``) and
logs a failed write instead of raising, so its tracker writes into a local temporary folder and the files
are then copied whole through ``tieflax.storage`` to the output (local, gs:// or s3://).

    results = evaluate_workdir("runs/x", tasks=["arc_easy"], limit=100, output="runs/x/lm_eval")
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Optional, Sequence

from tieflax import storage
from tieflax.eval.decode import EvalError


def task_manager(tasks: Sequence[str], include_path: Optional[str]):
    """lm-eval's ``TaskManager``, after checking that every task name exists (one line if not).

    Tasks all found under ``include_path`` skip indexing lm-eval's own ~15k task files (some 10 s).
    """
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    if include_path is not None:
        if storage.is_remote(include_path):
            raise EvalError(f"--include-path {include_path!r}: lm-eval reads task YAMLs from a local folder only; "
                            "copy them to a local folder")
        if not storage.is_dir(include_path):
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

    output = output_folder(output)   # a bad path or bucket fails before the checkpoint loads
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
    output = output_folder(output)
    with tempfile.TemporaryDirectory(prefix="tieflax-lm-eval-") as local:
        tracker = EvaluationTracker(output_path=local) if output else None
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                          batch_size=batch_size, num_fewshot=num_fewshot, limit=limit,
                                          log_samples=log_samples, evaluation_tracker=tracker, task_manager=manager)
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


def output_folder(output: Optional[str]) -> Optional[str]:
    """``--output`` resolved (``gs:/b`` and other schemes refused) and, on a bucket, checked writable."""
    if output is None:
        return None
    output = storage.resolve(output)
    storage.check_writable(output)
    return output


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
