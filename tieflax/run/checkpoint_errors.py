"""How a checkpoint fails: the errors every checkpoint module raises, and orbax's failures in one line.

``CheckpointError`` and its kinds (another model's parameters, a data position that cannot move to this
number of processes) are told apart because their fixes differ: a damaged checkpoint is set aside, a
config or launch problem is the user's to fix. ``why`` turns orbax's and TensorStore's nested failures
into the one line a message ends with; ``quiet_abandoned_reads`` drops the noise they leave behind.
"""

from __future__ import annotations

import sys

from tieflax.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the step or folder and what to do."""



class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint of another model (a config problem, not a damaged checkpoint)."""


class ProcessCountError(CheckpointError):
    """A readable checkpoint whose data position cannot be moved to this run's number of processes (a
    launch problem, not a damaged checkpoint): the message names both counts."""



def why(e: BaseException) -> str:
    """One short line for an orbax/tensorstore failure: the innermost cause's first line (the outer ones
    say "error while reading array index ..."; the inner one says what is wrong with which file)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in reversed(chain):
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        if first:
            return f"{type(err).__name__}: {first[:200]}"
    return type(chain[0]).__name__


def quiet_abandoned_reads() -> None:
    """After a failed restore, orbax's other pending reads of that checkpoint finish on an event loop that
    is already closed: Python then prints "Event loop is closed" tracebacks and "Exception ignored in
    <coroutine _read_array_index_and_device_put>" with a full TensorStore spec, long after tieflax has
    reported the checkpoint in one line. These two kinds only are dropped; every other report stays."""
    if getattr(sys, "_tieflax_quiet_reads", False):
        return
    sys._tieflax_quiet_reads = True
    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook

    def abandoned(exc_value, obj=None) -> bool:
        if isinstance(exc_value, RuntimeError) and str(exc_value) == "Event loop is closed":
            return True
        return "orbax" in repr(obj) or "_read_array_index_and_device_put" in repr(obj)

    def unraisable(u):
        if not abandoned(u.exc_value, u.object):
            previous_unraisable(u)

    def excepthook(kind, value, tb):
        if not abandoned(value):
            previous_except(kind, value, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook
