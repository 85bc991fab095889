"""Helpers shared by tests (no tests here): what a command prints, as the user's terminal would show it."""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import warnings

# A line that reads as a problem to a user: absl/Python logging, glog/C++ logs (E0000 12:00:00 ...),
# Python warnings shown by default, tracebacks.
PROBLEM = re.compile(r"^(WARNING|ERROR|CRITICAL|[EWF]\d{4} |Traceback|.*(Warning|Error):)")


def capture_console(fn, *args, **kwargs):
    """Runs ``fn``; returns ``(result, text)`` where text is everything written to file descriptors 1 and
    2 (C++ libraries included), every logging record at WARNING or above, and every Python warning of a
    category shown by default, each record as ``LEVEL:logger:message``."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.levelname}:{record.name}:{record.getMessage()}")

    handler = Collect(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    sys.stdout.flush(), sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    saved_streams = sys.stdout, sys.stderr
    with tempfile.TemporaryFile("w+b") as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        # Python-level writes too: pytest replaces sys.stdout/sys.stderr with its own files.
        stream = open(out.fileno(), "w", buffering=1, closefd=False)
        try:
            for fd in (1, 2):
                os.dup2(out.fileno(), fd)
            sys.stdout = sys.stderr = stream
            result = fn(*args, **kwargs)
        finally:
            stream.flush()
            sys.stdout, sys.stderr = saved_streams
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            root.removeHandler(handler)
        out.seek(0)
        text = out.read().decode("utf-8", "replace").replace("\r", "\n")
    shown = (UserWarning, RuntimeWarning, FutureWarning)
    records += [f"WARNING:py.warnings:{w.category.__name__}: {w.message}" for w in caught
                if issubclass(w.category, shown)]
    return result, text + "\n" + "\n".join(records)


def foreign_problems(text: str, own=("tieflax",)) -> list[str]:
    """Problem lines (see ``PROBLEM``) that tieflax did not write itself."""
    return [line for line in text.splitlines()
            if PROBLEM.match(line.strip()) and not any(f":{o}" in line or line.startswith(f"{o}")
                                                     for o in own)]
