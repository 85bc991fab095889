"""The run's record: the config it trains with, read back by every resume and every reader.

``config.json`` is created once, when the run starts (create-only, so two runs cannot claim one prefix),
and read back by ``tieflax eval``, ``evaluate``, ``analyze`` and every resume.
"""

from __future__ import annotations

import json

import jax
import ml_collections

from tieflax import storage
from tieflax.config import default_config
from tieflax.run import layout
from tieflax.run.layout import CONFIG_FILE, WorkdirError


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
    """The config saved in ``workdir``, completed with today's defaults for fields added since."""
    path = layout.path(workdir, CONFIG_FILE)
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: {workdir!r} is not a tieflax workdir (train into it "
                                "first, or save_initial_params there).") from None
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
