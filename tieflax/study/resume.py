"""Resuming a study (``tieflax compare``, ``tieflax sweep``): a run found in the workdir is reused only if it
was trained with the config the study would train it with now.

A finished run is reused as it is and an unfinished one continues from its checkpoint, so a rerun with
``--config.train.num_steps=50`` over 4-step runs would report 4-step results under a 50-step config. The
trainer saves the config it trained with (``<run>/config.json``); ``tieflax.run.identity.changed_fields``
compares the fields that change results (those ``tieflax train`` holds every resume to), and
``check_run_matches`` refuses, naming them, or (``retrain``) removes the run so it trains again.
"""

from __future__ import annotations

from tieflax import storage
from tieflax.errors import UserError
from tieflax.run.identity import changed_fields, load_workdir_config, result_fields
from tieflax.run.layout import CONFIG_FILE

__all__ = ["StudyMismatch", "check_run_matches", "result_fields"]


class StudyMismatch(UserError):
    """A run in the study's workdir was trained with a different config; the message names the fields."""


def check_run_matches(run_dir: str, config, *, retrain: bool, saved_fields: dict | None = None,
                      flag: str = "--retrain-changed") -> bool:
    """Refuses (StudyMismatch) a run in ``run_dir`` trained with other result fields than ``config``;
    with ``retrain`` removes it instead and returns True (the caller trains it afresh). False when there
    is nothing to check (no run yet) or it matches. ``saved_fields``: the run's own record of its
    :func:`result_fields` (the sweep keeps it in its result file); else ``run_dir/config.json``."""
    if saved_fields is not None:
        now = result_fields(config)
        diff = {k: (saved_fields.get(k), now.get(k)) for k in sorted(set(saved_fields) | set(now))
                if saved_fields.get(k) != now.get(k)}
    elif storage.is_file(storage.join(run_dir, CONFIG_FILE)):
        diff = changed_fields(load_workdir_config(run_dir), config)
    else:
        return False
    if not diff:
        return False
    if retrain:
        storage.rmtree(run_dir)  # a run this study created, removed because the user asked for it
        return True
    shown = ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in list(diff.items())[:6])
    more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
    raise StudyMismatch(f"{run_dir} was trained with a different config (saved -> now: {shown}{more}): rerun "
                        f"with the config it was trained with, use a new --workdir, or pass {flag} to "
                        "train the changed runs again")
