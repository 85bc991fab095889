"""The run's record: the config it trains with, what it trained on, and every deliberate change.

A run is one thing across every resume. Its identity is the set of config fields that change results
(model, data and tokenizer, optimizer and schedule, batch, sequence length, seed, loss settings:
``result_fields``) together with what the data turned out to be (the token store's or the token
cache's content key and the tokenizer: ``data_record``). Every command that continues a run compares
both with the run's record before it writes anything (``check_resume``); a difference is refused in
one line naming each field, its saved and new value, and the fix. Memory and placement (remat,
chunking, offload, attention kernel, mesh, process count) and cadence (log, checkpoint, eval
intervals) are free.

The record, in the run directory (``tieflax.run.layout``)::

    config.json              the config the run started with: created once, never rewritten
    data.json                what it trained on (source, content key, tokenizer digest): created once
    config_history/<n>.json  n = 1, 2, ...: a change made on purpose (``--allow-change FIELD``) or set
                             before the first step of imported parameters: the step it applies from,
                             the fields (saved, new), the whole new config and data record; create-only

``load_workdir_config`` returns the config in force: the newest history entry's, else config.json's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Sequence

import jax
import ml_collections

from tieflax import storage
from tieflax.config import default_config
from tieflax.errors import UserError
from tieflax.run import layout
from tieflax.run.layout import (CHECKPOINT_DIR, CONFIG_FILE, CONFIG_HISTORY_DIR, DATA_RECORD_FILE,
                                LEGACY_METRICS_FILE, METRICS_DIR, WorkdirError)

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
ALLOW_CHANGE_FLAG = "--allow-change"


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


def _shown(diff: dict[str, tuple], limit: int = 8) -> str:
    items = [f"{k} {v[0]!r} -> {v[1]!r}" for k, v in diff.items()]
    return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def has_trained(workdir: str) -> bool:
    """True once the run has trained a step: it has checkpoints or logged metrics."""
    return any(storage.exists(layout.path(workdir, n)) for n in (CHECKPOINT_DIR, METRICS_DIR, LEGACY_METRICS_FILE))


@dataclasses.dataclass(frozen=True)
class Resume:
    """What ``check_resume`` found: ``fresh`` (no record yet), or the fields that change (saved, new)
    with the consent given, to be recorded by ``record`` once the start step is known."""
    fresh: bool
    changed: dict
    before_first_step: bool = False
    allow_change: tuple = ()


def check_resume(workdir: str, config: ml_collections.ConfigDict, *, allow_change: Sequence[str] = (),
                 command: str = "train") -> Resume:
    """Compares ``config`` with the run's record in ``workdir`` before anything is written.

    Returns ``Resume(fresh=True)`` for a new run. A run that has trained (checkpoints or metrics) may go
    on only with the same result fields, unless each changed field is named in ``allow_change`` (a
    field, e.g. ``train.num_steps``, or a section prefix, e.g. ``data``). Imported or converted
    parameters that have not trained yet keep their model; their other settings may be set freely (the
    difference is recorded). Raises RunChanged naming every refused field."""
    if not storage.is_file(layout.path(workdir, CONFIG_FILE)):
        return Resume(fresh=True, changed={})
    diff = changed_fields(load_workdir_config(workdir), config)
    if not diff:
        return Resume(fresh=False, changed={}, allow_change=tuple(allow_change))
    trained = has_trained(workdir)
    refused = {k: v for k, v in diff.items() if not _allowed(k, allow_change) and (trained or k.startswith("model."))}
    if refused:
        where = layout.path(workdir)
        if trained:
            fix = (f"rerun without these settings to resume it as it is (`tieflax {command} --workdir {where}` "
                   "alone reads its config), train them in a new --workdir, or pass "
                   f"{ALLOW_CHANGE_FLAG} {','.join(refused)} to change them on purpose from the last "
                   f"checkpoint on (recorded in {CONFIG_HISTORY_DIR}/)")
        else:
            fix = ("its parameters are of that model: change the model with `tieflax convert` (--untie, --tie, "
                   "--scan-layers) into a new --out, or train this model in a new --workdir")
        raise RunChanged(f"{where} was trained with other settings (saved -> now: {_shown(refused)}): {fix}")
    return Resume(fresh=False, changed=diff, before_first_step=not trained, allow_change=tuple(allow_change))


def check_data(workdir: str, data: dict, resume: Resume) -> None:
    """Refuses a run whose data changed under it (the same config, other content: a token store rebuilt
    at the same path, corpus files edited, another tokenizer), unless ``data`` or a ``data.*`` field is
    allowed to change in ``resume`` (a new data setting is expected to bring new data)."""
    saved = read_data_record(workdir)
    consent = any(a.rstrip(".") == "data" or a.startswith("data.") for a in resume.allow_change)
    if saved is None or resume.fresh or resume.before_first_step or consent:
        return
    diff = {f"data ({k})": (saved.get(k), data.get(k)) for k in ("source", "store", "key", "tokenizer")
            if saved.get(k) != data.get(k)}
    if diff:
        raise RunChanged(f"{layout.path(workdir)} was trained on other data (saved -> now: {_shown(diff)}): "
                         "point data.* at the data it trained on, train in a new --workdir, or pass "
                         f"{ALLOW_CHANGE_FLAG} data to go on with this data (recorded in "
                         f"{CONFIG_HISTORY_DIR}/)")


def record(workdir: str, config: ml_collections.ConfigDict, data: dict, resume: Resume, step: int) -> None:
    """Process 0 writes the run's record: a fresh run claims ``config.json`` and ``data.json``
    (create-only: two runs cannot claim one prefix); an allowed change becomes the next numbered
    history entry. Nothing is ever overwritten."""
    if jax.process_index() != 0:
        return
    if resume.fresh:
        save_config(workdir, config, claim=True)
    data_path = layout.path(workdir, DATA_RECORD_FILE)
    if not storage.is_file(data_path):
        storage.create_new(data_path, json.dumps(data, indent=1, sort_keys=True).encode())
    saved_data = read_data_record(workdir)
    data_changed = saved_data is not None and saved_data != data
    if not resume.changed and not data_changed:
        return
    entries = history(workdir)
    n = (entries[-1]["number"] if entries else 0) + 1
    entry = {"number": n, "step": int(step), "changed": {k: list(v) for k, v in resume.changed.items()},
             "reason": "set before the first step" if resume.before_first_step else ALLOW_CHANGE_FLAG,
             "data": data, "config": json.loads(config.to_json_best_effort())}
    text = json.dumps(entry, indent=1, sort_keys=True).encode()
    if not storage.create_new(layout.path(workdir, CONFIG_HISTORY_DIR, f"{n}.json"), text):
        raise WorkdirError(f"{layout.path(workdir, CONFIG_HISTORY_DIR, f'{n}.json')} was written by another "
                           "command at the same time: only one command may continue a run")


def history(workdir: str) -> list[dict]:
    """The run's config-history entries, oldest first (``[]`` when its config never changed)."""
    folder = layout.path(workdir, CONFIG_HISTORY_DIR)
    names = sorted((n for n in storage.listdir(folder) if n.removesuffix(".json").isdigit()),
                   key=lambda n: int(n.removesuffix(".json")))
    return [json.loads(storage.read_text(storage.join(folder, n))) for n in names]


def history_lines(workdir: str) -> list[str]:
    """One sentence per config change, for ``tieflax analyze`` and the study's report."""
    return [f"config changed at step {e['step']} ({e['reason']}): " + _shown({k: tuple(v) for k, v in e["changed"].items()})
            for e in history(workdir)]


def read_data_record(workdir: str) -> dict | None:
    """The data record in force: the newest history entry's, else ``data.json``'s; None for runs written
    before data records."""
    entries = history(workdir)
    if entries:
        return entries[-1]["data"]
    path = layout.path(workdir, DATA_RECORD_FILE)
    return json.loads(storage.read_text(path)) if storage.is_file(path) else None


class NotARun(UserError, FileNotFoundError):
    """The folder holds no run; the message names it and what to do."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def save_config(workdir: str, config: ml_collections.ConfigDict, *, claim: bool = False) -> str:
    """Writes ``<workdir>/config.json`` whole (process 0 only) and returns its path.

    ``claim=True`` (a run starting in a fresh workdir): written only if no config.json exists yet (a
    create-only precondition), so two runs cannot both claim one prefix; the loser gets WorkdirError.
    An existing config.json (a resume, checked against this config before) is replaced whole.
    """
    path = layout.path(workdir, CONFIG_FILE)
    if jax.process_index() == 0:
        text = config.to_json_best_effort(indent=2, sort_keys=True).encode("utf-8")
        if not claim or storage.is_file(path):
            storage.write_bytes(path, text)
        elif not storage.create_new(path, text):
            raise WorkdirError(f"{path} was created by another run while this one started: each run needs "
                               "its own --workdir")
    return path


def load_workdir_config(workdir: str) -> ml_collections.ConfigDict:
    """The config in force in ``workdir`` (the newest history entry's, else config.json's), completed
    with today's defaults for fields added since. Raises NotARun (a FileNotFoundError and a UserError)
    when the folder holds no config.json."""
    path = layout.path(workdir, CONFIG_FILE)
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        raise NotARun(2, f"{path} does not exist: {layout.path(workdir)} is not a tieflax run (train into "
                         "it with --config first, or save_initial_params there)", path) from None
    entries = history(workdir)
    if entries:
        text = json.dumps(entries[-1]["config"])
    try:
        saved = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkdirError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): restore "
                              "it from a backup or rewrite it with `tieflax train --config ... --workdir` "
                              "using the run's original config") from None
    if not isinstance(saved, dict):
        raise WorkdirError(f"{path} holds no config object: restore it from a backup")
    config = default_config()
    _merge(config, saved, "config")
    return config


def _merge(node: ml_collections.ConfigDict, values: dict, where: str) -> None:
    for key, value in values.items():
        if key in node and isinstance(node[key], ml_collections.ConfigDict) and isinstance(value, dict):
            _merge(node[key], value, f"{where}.{key}")
        else:
            if isinstance(value, list):
                value = tuple(value) if isinstance(node.get(key), tuple) else value
            with node.ignore_type():
                node[key] = value
