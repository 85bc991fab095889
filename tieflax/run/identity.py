"""The run's identity: which config fields make a run the run it is, and what a resume must match.

A run is one thing across every resume. Its identity is the set of config fields that change results
(model, data and tokenizer, optimizer and schedule, batch, sequence length, seed, loss settings:
``result_fields``) together with what the data turned out to be (the token store's or the token
cache's content key and the tokenizer: ``data_record``). Every command that continues a run compares
both with the run's record before it writes anything (``check_resume``); a difference is refused in
one line naming each field, its saved and new value, and the fix. Memory and placement (remat,
chunking, offload, attention kernel, mesh, process count) and cadence (log, checkpoint, eval
intervals) are free. A change made on purpose (``--allow-change``) becomes the record's next entry
(``record``).

The record's files and their digest chain are ``tieflax.run.record``'s; the config read back from them,
``tieflax.run.saved_config``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
from typing import Sequence

import jax
import ml_collections

from tieflax import storage
from tieflax.errors import UserError
from tieflax.run.layout import CHECKPOINT_DIR, CONFIG_HISTORY_DIR, DATA_RECORD_FILE, RunDir, WorkdirError
from tieflax.run.record import (ALLOW_CHANGE_FLAG, RUN_ID_KEY, NotARun, RecordBroken, in_force, read_data_record,
                                read_record, shown)
# Re-exported for the commands and studies outside the run room that read a run's config (and its history) from
# here: ``tieflax.run.saved_config`` and ``tieflax.run.record`` are where they live.
from tieflax.run.record import history_lines  # noqa: F401
from tieflax.run.saved_config import best_effort_config, config_in_force, load_workdir_config, save_config  # noqa: F401

# Fields that do not change a run's results: logging and checkpoint cadence, where files live, how the
# data is read, memory/kernel switches that recompute the same function. The mesh and the process count
# are not result fields at all (``SECTIONS``).
FREE = {
    "train": ("analyze_every", "checkpoint_every", "keep_checkpoints", "log_every", "eval_every", "loss_impl",
              "loss_token_block", "loss_vocab_block",
              # what watches the run: the console, trackers, the profiler window, tasks scored on the way
              "console", "trackers", "wandb_project", "wandb_entity", "wandb_name", "wandb_group", "wandb_tags",
              "profile_steps", "eval_tasks", "eval_tasks_every", "eval_tasks_include_path", "eval_tasks_limit",
              "eval_tasks_num_fewshot", "eval_tasks_batch_size", "eval_tasks_token_budget"),
    "data": ("cache_dir", "prefetch_buffer_size", "read_threads", "tokenizer.path"),
    "model": ("remat", "mlp_chunk", "offload_layer_inputs", "attention"),
}
SECTIONS = ("model", "train", "data", "seed")

log = logging.getLogger(__name__)


class RunChanged(UserError, ValueError):
    """A command would continue a run with other result fields or other data than it trained with; the
    message names every field (saved and new value) and the fixes."""


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def result_fields(config) -> dict:
    """``{'section.field': value}`` of the fields that change a run's results (JSON-normalised)."""
    tree = json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") else config
    flat = _flat({k: tree[k] for k in SECTIONS if k in tree})
    drop = {f"{section}.{name}" for section, names in FREE.items() for name in names}
    return {k: v for k, v in flat.items() if k not in drop}


def changed_fields(saved, now) -> dict[str, tuple]:
    """``{field: (saved, now)}`` for every result field that differs (a field absent on one side counts
    when the other side sets it)."""
    a, b = result_fields(saved), result_fields(now)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def data_record(info: dict, tokenizer_json: str | None) -> dict:
    """What a run trains on: the data's source and content key (a token store's manifest digest, or the
    token cache's key over the corpus and its settings) and the tokenizer's digest."""
    digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16] if tokenizer_json else None
    return {"source": info.get("source"), "store": info.get("store"), "key": info.get("key"),
            "tokenizer": digest}


def _allowed(field: str, allow: Sequence[str]) -> bool:
    return any(field == a or field.startswith(a.rstrip(".") + ".") for a in allow)




@dataclasses.dataclass(frozen=True)
class Resume:
    """What ``check_resume`` found: ``fresh`` (no record yet), or the fields that change (saved, new)
    with the consent given, to be recorded by ``record`` once the start step is known. ``restart``: the
    record was broken (the one line that says how) and ``--allow-change`` starts a new entry from the
    last checkpoint. ``refused``: result fields refused, held back for ``check_data`` to name together
    with a change of data (``check_resume(..., data_next=True)``)."""
    fresh: bool
    changed: dict
    before_first_step: bool = False
    allow_change: tuple = ()
    restart: str | None = None
    refused: str | None = None


def check_allow_change(config: ml_collections.ConfigDict, allow_change: Sequence[str]) -> None:
    """Refuses an ``--allow-change`` name that is no field or section of the config, in one line naming
    it and the sections (a typo would otherwise consent to nothing and go unnoticed)."""
    tree = json.loads(config.to_json_best_effort())
    fields = _flat({k: tree[k] for k in SECTIONS if k in tree})
    for name in allow_change:
        known = name in SECTIONS or any(f == name or f.startswith(name.rstrip(".") + ".") for f in fields)
        if not known:
            raise RunChanged(f"{ALLOW_CHANGE_FLAG} {name!r} is not a field of the config: name a field such as "
                             f"train.learning_rate, or a section ({', '.join(SECTIONS)})")


def check_resume(where: RunDir, config: ml_collections.ConfigDict, *, allow_change: Sequence[str] = (),
                 command: str = "train", data_next: bool = False) -> Resume:
    """Compares ``config`` with the record of the run ``where`` before anything is written.

    Returns ``Resume(fresh=True)`` for a new run. A run that has trained (checkpoints or metrics) may go
    on only with the same result fields, unless each changed field is named in ``allow_change`` (a
    field, e.g. ``train.num_steps``, or a section prefix, e.g. ``data``). Imported or converted
    parameters that have not trained yet keep their model; their other settings may be set freely (the
    difference is recorded). Raises RunChanged naming every refused field, RecordBroken when a file of
    the record is missing, damaged or edited (unless ``allow_change`` names a field: then the config
    becomes a new entry from the last checkpoint, ``Resume.restart``). ``data_next``: the caller calls
    ``check_data`` next, which then names refused fields and changed data in one line."""
    check_allow_change(config, allow_change)
    found = read_record(where)  # the record read once; everything below checks this snapshot
    try:
        saved = config_in_force(found)
    except NotARun:
        return Resume(fresh=True, changed={})
    except RecordBroken as e:
        if not allow_change:
            raise
        best = best_effort_config(found)
        diff = changed_fields(best, config) if best is not None else {}
        return Resume(fresh=False, changed=diff, allow_change=tuple(allow_change), restart=str(e))
    diff = changed_fields(saved, config)
    if not diff:
        return Resume(fresh=False, changed={}, allow_change=tuple(allow_change))
    trained = found.trained
    refused = {k: v for k, v in diff.items() if not _allowed(k, allow_change) and (trained or k.startswith("model."))}
    if refused:
        if trained:
            fix = (f"rerun without these settings to resume it as it is (`tieflax {command} --workdir {where.path}` "
                   "alone reads its config), train them in a new --workdir, or pass "
                   f"{ALLOW_CHANGE_FLAG} {','.join(refused)} to change them on purpose from the last "
                   f"checkpoint on (recorded in {CONFIG_HISTORY_DIR}/)")
        else:
            fix = ("its parameters are of that model: change the model with `tieflax convert` (--untie, --tie, "
                   "--scan-layers) into a new --out, or train this model in a new --workdir")
        line = f"{where.path} was trained with other settings (saved -> now: {shown(refused)}): {fix}"
        # A change of data settings is named above; other settings wait for check_data's look at the data,
        # so that one refusal names every difference.
        if data_next and trained and not any(k.startswith("data.") for k in refused):
            return Resume(fresh=False, changed=diff, allow_change=tuple(allow_change), refused=line)
        raise RunChanged(line)
    return Resume(fresh=False, changed=diff, before_first_step=not trained, allow_change=tuple(allow_change))


def check_data(where: RunDir, data: dict, resume: Resume) -> None:
    """Refuses a run whose data changed under it (the same config, other content: a token store rebuilt
    at the same path, corpus files edited, another tokenizer), unless ``data`` or a ``data.*`` field is
    allowed to change in ``resume`` (a new data setting is expected to bring new data); a refusal also
    names the settings ``check_resume`` held back. An allowed change of data joins ``resume.changed``
    as ``data (key)`` etc., so that it is said and recorded like any other change."""
    saved = None if resume.fresh or resume.restart else read_data_record(where)
    consent = any(a.rstrip(".") == "data" or a.startswith("data.") for a in resume.allow_change)
    diff = {} if saved is None or resume.before_first_step else {
        f"data ({k})": (saved.get(k), data.get(k)) for k in ("source", "store", "key", "tokenizer")
        if saved.get(k) != data.get(k)}
    if diff and not consent:
        line = (f"{where.path} was trained on other data (saved -> now: {shown(diff)}): "
                "point data.* at the data it trained on, train in a new --workdir, or pass "
                f"{ALLOW_CHANGE_FLAG} data to go on with this data (recorded in {CONFIG_HISTORY_DIR}/)")
        raise RunChanged(f"{resume.refused}; and {line}" if resume.refused else line)
    if resume.refused:
        raise RunChanged(resume.refused)
    resume.changed.update(diff)  # on purpose: said and recorded with the fields


def check_reached(where: RunDir, config: ml_collections.ConfigDict, resume: Resume, step: int) -> None:
    """Refuses a new entry (a change on purpose, a restart) from ``step`` whose ``train.num_steps`` is
    below that step, which the run already reached: nothing would train, and the record would say the run
    ends at a step its checkpoints are past. Called on every process (all stop together), before
    ``record`` writes anything."""
    n = config.train.num_steps
    if (resume.changed or resume.restart is not None) and not resume.before_first_step and n < step:
        raise RunChanged(f"train.num_steps {n} is below step {step}, which {where.path} already reached "
                         f"({CHECKPOINT_DIR}/{step}): nothing would train, and its record would say it ends at "
                         f"step {n}: pass --config.train.num_steps={step} or more, or train {n} steps in a new "
                         "--workdir")


def record(where: RunDir, config: ml_collections.ConfigDict, data: dict, resume: Resume, step: int) -> None:
    """Process 0 writes the run's record: a fresh run claims ``config.json`` and ``data.json``
    (create-only: two runs cannot claim one prefix); an allowed change becomes the next numbered
    history entry, naming the digests of the entry before it; a restart (``Resume.restart``) an entry
    that names none. Nothing is ever overwritten."""
    if jax.process_index() != 0:
        return
    if resume.fresh:
        save_config(where, config, claim=True)
    data_path = where.file(DATA_RECORD_FILE)
    if resume.restart is None and not storage.is_file(data_path):  # a fresh run, or one from before data records
        with_id = {**data, RUN_ID_KEY: secrets.token_hex(8)}  # the run's id: its checkpoints name it
        storage.create_new(data_path, json.dumps(with_id, indent=1, sort_keys=True).encode())
    if resume.restart is None:
        saved_data = read_data_record(where)
        if saved_data is not None and saved_data != data:  # a new tokenizer or data setting: on purpose
            for k in ("source", "store", "key", "tokenizer"):
                if saved_data.get(k) != data.get(k):
                    resume.changed.setdefault(f"data ({k})", (saved_data.get(k), data.get(k)))
    if not resume.changed and resume.restart is None:
        return
    found = read_record(where)
    taken = [int(name.split("/")[-1].removesuffix(".json")) for name in found.files if name.startswith(CONFIG_HISTORY_DIR)]
    n = max([*taken, found.claimed_entry or 0]) + 1  # never a number a checkpoint or a damaged file holds
    entry = {"number": n, "step": int(step), "changed": {k: list(v) for k, v in resume.changed.items()},
             "reason": "set before the first step" if resume.before_first_step else ALLOW_CHANGE_FLAG,
             "data": data, "config": json.loads(config.to_json_best_effort())}
    if resume.restart is not None:
        entry["restarted"] = resume.restart  # the chain starts again here: nothing before it is named
        entry["previous"] = {}
        log.warning("the run's record was broken (%s); %s starts it again as %s/%d.json from step %d",
                    resume.restart, ALLOW_CHANGE_FLAG, CONFIG_HISTORY_DIR, n, step)
    else:
        entry["previous"] = in_force(where)["files"]
    text = json.dumps(entry, indent=1, sort_keys=True).encode()
    if not storage.create_new(where.file(CONFIG_HISTORY_DIR, f"{n}.json"), text):
        raise WorkdirError(f"{where.file(CONFIG_HISTORY_DIR, f'{n}.json')} was written by another "
                           "command at the same time: only one command may continue a run")


