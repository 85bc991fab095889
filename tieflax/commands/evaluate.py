"""``tieflax evaluate --workdir RUN --tasks T1,T2``: lm-evaluation-harness tasks on a run's checkpoint.

The run's latest checkpoint (or ``--step N``) is scored on its mesh through ``tieflax.eval.harness``
(loglikelihood, rolling loglikelihood and generation with a KV cache). Prints lm-eval's results table;
``--output DIR`` writes lm-eval's own results file (and with ``--log-samples`` its per-task samples
files), exactly as ``lm_eval --output_path DIR --log_samples`` would; DIR may be local, gs:// or s3://
(written through ``tieflax.storage``). Tasks come from lm-eval's registry
or from YAML files under ``--include-path DIR`` (offline: set HF_DATASETS_OFFLINE=1 and use local data).
Under several processes (``launch/local_multiprocess.sh 2 4 tieflax evaluate ...``, a pod) process 0 runs
lm-eval and the others compute their share of each batch: the results equal one process's.
"""

from __future__ import annotations

import argparse

from tieflax.commands.flags import integer, location, refuse_overrides

HELP = "lm-evaluation-harness tasks (MMLU, HellaSwag, local YAMLs) on a run's checkpoint"
FULL_DISK_FIX = "free space on that disk, or choose another --output"
ON_INTERRUPT = ("no scores are kept (--output gets lm-eval's files only once every task has run): rerun the "
                "same command")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=location, required=True, help="a run folder written by `tieflax train`")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    parser.add_argument("--include-path", default=None, help="a folder of extra task YAML files")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    parser.add_argument("--limit", type=float, default=None, help="items per task (a fraction if < 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per generation batch")
    parser.add_argument("--token-budget", type=int, default=4096,
                        help="tokens per loglikelihood batch (rows = budget / padded length)")
    parser.add_argument("--log-samples", action="store_true", help="keep per-sample records (with --output)")
    parser.add_argument("--output", default=None,
                        help="folder (local, gs:// or s3://) for lm-eval's results (and samples) files")
    parser.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the latest)")
    parser.add_argument("--seed", type=integer(0), default=0, help="seed of sampled generations")


def run(args: argparse.Namespace) -> int:
    from tieflax.hardware import distributed  # noqa: PLC0415

    refuse_overrides(args, "evaluate", "it scores the run with the run's own config")

    # Several processes (launch/: TIEFLAX_COORDINATOR ...): lm-eval runs on process 0, which alone prints
    # and writes; the others compute their share of its batches on the run's mesh (tieflax.eval.harness).
    distributed.initialize()
    from tieflax.eval.decode import EvalError  # noqa: PLC0415
    from tieflax.eval.tasks import checked_request, evaluate_tasks  # noqa: PLC0415
    from tieflax.run.run import Run  # noqa: PLC0415

    if args.log_samples and not args.output:
        raise EvalError("--log-samples keeps lm-eval's per-sample records in --output: add --output DIR")
    # The request first (options, task files, the output folder), then the run: a bad option is refused
    # before any checkpoint or record is read.
    options = dict(include_path=args.include_path, num_fewshot=args.num_fewshot, limit=args.limit,
                   batch_size=args.batch_size, token_budget=args.token_budget, step=args.step)
    tasks, output, unreachable = checked_request(args.tasks.split(","), output=args.output, **options)
    run = Run.read(args.workdir, command="evaluate")
    evaluate_tasks(run, tasks, log_samples=args.log_samples, output=output, seed=args.seed, show=True,
                   unreachable=unreachable, **options)
    return 0
