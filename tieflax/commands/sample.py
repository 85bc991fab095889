"""``tieflax sample --workdir RUN --prompt TEXT``: continue a prompt with a run's checkpoint (KV cache).

Greedy by default; ``--temperature T`` samples, reproducibly for a given ``--seed``. Stops at the run's
EOS token or after ``--max-new-tokens``. Prints the continuation only. Under a multi-process launcher
(``launch/``: pod hosts, SLURM tasks) the processes generate together on the run's mesh and process 0
alone prints.
"""

from __future__ import annotations

import argparse

from tieflax.commands.flags import integer, location, refuse_overrides

HELP = "generate text from a checkpoint"
ON_INTERRUPT = "nothing was written: rerun the same command"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=location, required=True, help="a run folder written by `tieflax train`")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    parser.add_argument("--seed", type=integer(0), default=0, help="seed of the sampling")
    parser.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the latest)")


def run(args: argparse.Namespace) -> int:
    refuse_overrides(args, "sample", "it generates with the run's own config")
    from tieflax.hardware import distributed  # noqa: PLC0415

    # Before any device is touched: a launcher's processes join one job (each alone would load the run on
    # its own devices and every one would print).
    distributed.initialize()
    from tieflax.eval.decode import EvalError, Generator  # noqa: PLC0415
    from tieflax.eval.loaded import load_run  # noqa: PLC0415 (no lm-eval: sample runs on the base install)
    from tieflax.run.run import Run  # noqa: PLC0415

    import math  # noqa: PLC0415

    if args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens {args.max_new_tokens}: use 1 or more")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise EvalError(f"--temperature {args.temperature}: use a finite number >= 0 (0 = greedy)")
    if args.step is not None and args.step < 0:
        raise EvalError(f"--step {args.step}: use a checkpoint step >= 0 (or leave it out for the latest)")
    # Its record verified, and its tokenizer.json the one the record names: refused in one line otherwise.
    run = load_run(Run.read(args.workdir, command="sample"), step=args.step)
    generator = Generator(run.config, mesh=run.mesh, max_len=run.max_length, pad_id=run.eos_id)
    shards = run.mesh.shape["data"] * run.mesh.shape["fsdp"]  # one row per data shard, the first printed
    prefix = run.eos_id if run.bos_id is None else run.bos_id
    prompt = run.encode(args.prompt, prefix) or [prefix]
    out = generator.generate(generator.layer_params(run.params), [prompt] * shards,
                             max_new_tokens=args.max_new_tokens, stop_ids=(run.eos_id,),
                             temperature=args.temperature, seed=args.seed)
    if distributed.is_main_process():  # the result is replicated: every process holds the same tokens
        print(run.tokenizer.decode(out.tokens[0, :out.lengths[0]].tolist(), skip_special_tokens=True))
    return 0
