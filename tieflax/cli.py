"""The ``tieflax`` console: one subcommand per module in ``tieflax/commands/``.

Each command module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Command modules keep heavy imports (orbax, grain, torch) inside ``run`` so that building the parser, and
light commands such as ``tieflax params``, stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> module; order is the order of `tieflax --help`.
COMMANDS = {
    "params": "tieflax.commands.params",
    "train": "tieflax.commands.train",
    "eval": "tieflax.commands.eval",
    "compare": "tieflax.commands.compare",
    "analyze": "tieflax.commands.analyze",
    "convert": "tieflax.commands.convert",
    "plan": "tieflax.commands.plan",
}

HELP = {
    "params": "exact parameter counts of a model config, or the table over all published models",
    "train": "train a model (resumes from the workdir's latest checkpoint)",
    "eval": "validation loss and perplexity of a workdir's latest checkpoint",
    "compare": "the tied-vs-untied study: train the variants and write a report with plots",
    "analyze": "embedding diagnostics of a checkpoint",
    "convert": "Hugging Face import/export, and tie/untie surgery on checkpoints",
    "plan": "per-device memory of the train step on a TPU pod or GPU server, compiled from this machine",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tieflax", description="Tied vs untied embeddings in JAX/Flax LMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue  # a command whose module is not installed in this build
        command_parser = sub.add_parser(name, help=HELP[name], description=HELP[name])
        command_parser.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv``; ``--config.a.b=value`` arguments anywhere become ``args.overrides``."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    overrides = [a for a in unknown if a.startswith("--config.")]
    rest = [a for a in unknown if not a.startswith("--config.")]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = list(getattr(args, "overrides", None) or []) + overrides
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
