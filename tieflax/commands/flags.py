"""Argument types that check a command-line value while the command line is parsed, before any work.

A bad value is argparse's usual error (``tieflax analyze: error: argument --buckets: ...``, exit 2), never a
traceback from deep inside the work it would have started.
"""

from __future__ import annotations

import argparse
import math

from tieflax.errors import UserError


def integer(low: int, meaning: str = ""):
    """An ``int`` type for argparse that refuses values below ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}{meaning}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def positive_number(text: str) -> float:
    """A finite ``float`` > 0 (a size, a limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def non_negative_number(text: str) -> float:
    """A finite ``float`` >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def location(text: str) -> str:
    """A folder or URL, passed on as typed: the layer it enters resolves it, once (a run's folder
    ``RunDir.at``, a destination ``tieflax.run.destinations``, a token store ``data_location``), and refuses a
    malformed URL (``gs:/b``, ``http://``...) there in the command's one line (``tieflax train: gs:/b looks
    like ...``), not in argparse's usage. An empty one is refused here (it would mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a folder, gs://bucket/prefix or s3://bucket/prefix")
    return text


class OverridesNotRead(UserError, ValueError):
    """``--config.*`` given to a command (or a mode of one) that does not read a config."""


def refuse_overrides(args: argparse.Namespace, command: str, reads: str) -> None:
    """Refuses ``--config.*`` overrides a command does not read, instead of ignoring them silently."""
    if getattr(args, "overrides", None):
        raise OverridesNotRead(f"{' '.join(args.overrides)}: {command} does not read --config.* overrides "
                               f"({reads}); drop them")
