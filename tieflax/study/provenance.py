"""Where a study's runs came from: the command, the code's commit, the date and the compute they took.

A rerun of a finished study (or ``--report-only``) trains nothing, so it must not restate the study's
cost as its own few seconds: the provenance is written when runs train and carried over, with each run's
own measured seconds, when they are reused (``summary.json``'s ``provenance`` and ``runs[i].seconds``).
"""

from __future__ import annotations

import os
import subprocess
import time


def code_commit() -> str:
    """``git describe --always --dirty`` of the tieflax source (``-dirty``: uncommitted changes), or what
    stands in for it where the package is not a git checkout."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=20, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.decode().strip()
    except (OSError, subprocess.SubprocessError):  # no git here, or it hangs
        pass
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return f"tieflax {version('tieflax')} (not a git checkout)"
    except PackageNotFoundError:
        return "unknown (not a git checkout)"


def carried_seconds(previous: dict | None, variant: str, seed: int) -> dict | None:
    """A run's ``seconds`` (``train``, ``analysis``) as the study that trained it measured them, from the
    previous ``summary.json`` (None when it has no such run)."""
    for r in (previous or {}).get("runs", []):
        if r.get("variant") == variant and int(r.get("seed", -1)) == int(seed) and r.get("seconds"):
            return dict(r["seconds"])
    return None


def provenance(previous: dict | None, runs: list[dict], command: str, trained: int) -> dict:
    """The study's provenance after this invocation, which trained ``trained`` of ``runs``: the previous
    one unchanged when nothing trained and it had one, else this command's, with ``compute_seconds`` the
    sum of every run's (carried) training and analysis seconds."""
    kept = (previous or {}).get("provenance")
    if not trained and kept:
        return dict(kept)
    return dict(command=command, commit=code_commit(), date=time.strftime("%Y-%m-%d"),
                compute_seconds=float(sum(r["seconds"]["train"] + r["seconds"]["analysis"] for r in runs)),
                runs_trained=int(trained))
