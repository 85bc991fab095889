"""The run's config as its record holds it: ``config.json`` written once, and the config in force read
back (the newest ``config_history/`` entry's, else config.json's), completed with today's defaults for
fields added since. The record's files and their digest chain are ``tieflax.run.record``'s."""

from __future__ import annotations

import json

import jax
import ml_collections

from tieflax import storage
from tieflax.config import default_config
from tieflax.run.layout import CONFIG_FILE, RunDir, WorkdirError
from tieflax.run.record import Snapshot, broken, entry_name, read_record, verified


def save_config(where: RunDir | str, config: ml_collections.ConfigDict, *, claim: bool = False) -> str:
    """Writes the run's ``config.json`` whole (process 0 only) and returns its path.

    ``claim=True`` (a run starting in a fresh workdir): written only if no config.json exists yet (a
    create-only precondition), so two runs cannot both claim one prefix; the loser gets WorkdirError.
    An existing config.json (a resume, checked against this config before) is replaced whole.
    """
    path = RunDir.named(where).file(CONFIG_FILE)
    if jax.process_index() == 0:
        text = config.to_json_best_effort(indent=2, sort_keys=True).encode("utf-8")
        if not claim or storage.is_file(path):
            storage.write_bytes(path, text)
        elif not storage.create_new(path, text):
            raise WorkdirError(f"{path} was created by another run while this one started: each run needs "
                               "its own --workdir")
    return path


def load_workdir_config(where: RunDir | str) -> ml_collections.ConfigDict:
    """The config in force in the run ``where`` (the newest history entry's, else config.json's), completed
    with today's defaults for fields added since, once the record holds (``verify_record``). Raises
    NotARun (a FileNotFoundError and a UserError) when the folder holds no run, RecordBroken naming the
    file when the record is broken."""
    return config_in_force(read_record(RunDir.named(where)))


def config_in_force(found: Snapshot) -> ml_collections.ConfigDict:
    """``load_workdir_config`` of a snapshot (``read_record``): pure, nothing is read."""
    entries = verified(found)
    if entries:
        saved = entries[-1].get("config")
        if not isinstance(saved, dict):
            raise broken(found.where, entry_name(entries[-1].get("number", len(entries))), "holds no config")
        return _completed(saved)
    return _completed(json.loads(found.files[CONFIG_FILE]))


def best_effort_config(found: Snapshot) -> ml_collections.ConfigDict | None:
    """The newest config that still reads in a broken record, for naming what a restart changes."""
    for n in sorted(found.entries, reverse=True):
        if isinstance(found.entries[n].get("config"), dict):
            return _completed(found.entries[n]["config"])
    if CONFIG_FILE in found.files and CONFIG_FILE not in found.damaged:
        return _completed(json.loads(found.files[CONFIG_FILE]))
    return None


def _completed(saved: dict) -> ml_collections.ConfigDict:
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
