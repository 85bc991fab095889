"""``tieflax params``: exact parameter counts of one config, or the table over every published model."""

from __future__ import annotations

import argparse
import glob
import json
import os

HELP = "exact parameter counts of a model config, or the table over all published models"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--config", help="a config file, e.g. configs/models/llama3_8b.py (default: the table)")
    what.add_argument("--table", action="store_true", help="every config in --models-dir (the default)")
    parser.add_argument("--models-dir", default=None,
                        help="folder of model configs for the table (default: configs/models of this checkout)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")


def default_models_dir() -> str:
    for candidate in ("configs/models",
                      os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models")):
        if os.path.isdir(candidate):
            return os.path.normpath(candidate)
    raise FileNotFoundError("no configs/models folder here or beside the tieflax package; "
                            "pass --models-dir or run from a tieflax checkout")


def run(args: argparse.Namespace) -> int:
    from tieflax.model.params import format_table, param_report  # noqa: PLC0415
    from tieflax.config import load_config, model_config  # noqa: PLC0415

    if args.config:
        paths = [args.config]
    else:
        models_dir = args.models_dir or default_models_dir()
        if not os.path.isdir(models_dir):
            raise FileNotFoundError(f"--models-dir {models_dir} is not a folder: pass a folder of model "
                                    "configs such as configs/models")
        paths = sorted(glob.glob(os.path.join(models_dir, "*.py")))
        if not paths:
            raise FileNotFoundError(f"--models-dir {models_dir} holds no model config (*.py): pass a folder "
                                    "of model configs such as configs/models")
    reports = []
    for path in paths:
        name = os.path.splitext(os.path.basename(path.partition(":")[0]))[0]
        reports.append(param_report(model_config(load_config(path, args.overrides)), name=name))
    if args.json:
        payload = [r.as_dict() for r in reports]
        print(json.dumps(payload[0] if args.config else payload, indent=2, allow_nan=False))  # integers only
    else:
        print(format_table(reports))
    return 0
