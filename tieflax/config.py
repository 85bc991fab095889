"""Experiment configuration: loading ``get_config()`` files and applying ``--config.a.b=value`` overrides.
One concern, the experiment config, in three modules named alike: this one (the whole config, its
loading and overrides), ``tieflax.data.config`` (``config.data``) and ``tieflax.model.config``
(``config.model``), each section beside the code that reads it.

A config file is Python with a ``get_config(arg=None)`` that returns an ``ml_collections.ConfigDict``
built on ``default_config()``, where every default lives. ``arg`` (``--config path.py:ARG``) lets a
file offer variants, e.g. ``runlocal`` for a laptop-sized version of a pod config.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
from typing import Any, Iterable

import ml_collections

from tieflax.config_rules import Range, check_section
from tieflax.errors import ConfigError
from tieflax.model.config import ModelConfig, remat_name
from tieflax.train_config import default_train_config, train_value, validate_train_config

# The root's own field, as a table like every section's (``tieflax.config_rules``).
RANGES = {"seed": Range(0, 2**32, True, False, "the run's PRNG seed")}
MESH_AXES = ("data", "fsdp", "tensor")


def default_model_config(**overrides: Any) -> ml_collections.ConfigDict:
    """``ModelConfig``'s defaults as a ConfigDict, with ``overrides`` applied (validated on build)."""
    values = dataclasses.asdict(ModelConfig())
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise ConfigError(f"unknown model field(s) {unknown}; known fields: {sorted(values)}")
    values.update(overrides)
    values["remat"] = remat_name(values["remat"])  # a name, so that name overrides type-check
    return ml_collections.ConfigDict(values)


def default_config() -> ml_collections.ConfigDict:
    """The root config. Sections: model, mesh, seed; data and train sections are added by their modules."""
    config = ml_collections.ConfigDict()
    config.model = default_model_config()
    # Mesh axis sizes; -1 on one axis means "all remaining devices".
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    config.seed = 0
    _add_optional_sections(config)
    return config


def _add_optional_sections(config: ml_collections.ConfigDict) -> None:
    """Adds the data and train sections from the modules that own their defaults."""
    from tieflax.data.config import default_data_config  # noqa: PLC0415 (import cycle-free, late)

    config.data = default_data_config()
    config.train = default_train_config()


def section_with_defaults(config: ml_collections.ConfigDict, name: str,
                          defaults: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``defaults`` updated with ``config.<name>`` if the config has that section; an unknown field in it
    is an error that names the field and the known ones."""
    if name in config:
        unknown = sorted(set(config[name].keys()) - set(defaults.keys()))
        if unknown:
            raise ConfigError(f"config.{name} has unknown field(s) {unknown}; known: {sorted(defaults.keys())}")
        defaults.update(config[name])
    return defaults


def validate_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """Checks every section (model, train, data, mesh, seed), naming the field; returns the validated
    ``ModelConfig``. Once per command, before anything is written: when a command loads its config
    (``load_config``), or, for ``tieflax train`` and ``train_and_evaluate``, when ``Run.open`` opens the run.
    Each section's ranges and choices are tables checked by ``tieflax.config_rules.check_section``."""
    from tieflax.data.config import validate_data_config  # noqa: PLC0415

    mc = model_config(config)
    validate_train_config(config.train)
    if train_value(config.train, "tied_input_grad_scale") != 1.0 and not mc.tie_embeddings:
        raise ConfigError(f"config.train.tied_input_grad_scale = {config.train.tied_input_grad_scale!r} has no "
                          "effect with model.tie_embeddings=False (it scales a tied matrix's lookup-path gradient); "
                          "set it to 1.0 or tie the embeddings.")
    validate_data_config(config.data)
    _validate_mesh(config.mesh)
    check_section("config", config, RANGES)
    _validate_across_sections(config, mc)
    return mc


def _validate_mesh(mesh: ml_collections.ConfigDict) -> None:
    """Each axis a positive size, or -1 (a rule no range states: 0 and -2 out, -1 in)."""
    for axis in MESH_AXES:
        size = mesh[axis] if axis in mesh else 1
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ConfigError(f"config.mesh.{axis} = {size!r} must be a positive integer, or -1 for all "
                              "remaining devices.")


def _validate_across_sections(config: ml_collections.ConfigDict, mc: ModelConfig) -> None:
    """Fields that are each in range but do not fit together: a row longer than the model is made for,
    a profiler window outside the steps the run takes."""
    t = config.train
    if t.seq_len > mc.max_seq_len:
        raise ConfigError(f"config.train.seq_len = {t.seq_len} exceeds config.model.max_seq_len = {mc.max_seq_len} "
                          "(the longest row the model is made for): lower train.seq_len or raise model.max_seq_len")
    window = train_value(t, "profile_steps")
    if window and window[1] > t.num_steps:
        raise ConfigError(f"config.train.profile_steps = {tuple(window)!r} lies outside the run's steps 1..{t.num_steps} "
                          f"(config.train.num_steps): no trace would be written there; choose steps within it, or () "
                          "for no trace")


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The validated, hashable ``ModelConfig`` of a root config."""
    return ModelConfig.from_dict(config.model)


def load_config(path: str, overrides: Iterable[str] = (), *, validate: bool = True) -> ml_collections.ConfigDict:
    """Loads ``path[:arg]`` and applies ``a.b=value`` overrides (a leading ``--config.`` is allowed).

    Values are parsed as Python literals when possible (``3``, ``1e-3``, ``False``, ``(2, 4)``) and kept
    as strings otherwise; the ConfigDict's type checks reject a value of the wrong type by field name.
    ``validate=False``: the caller validates it once later (``tieflax train``: ``Run.open``).
    """
    path, _, arg = path.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist; pass a path such as "
                                "configs/experiments/tiny.py")
    config = _run_config_file(path, arg)
    for item in overrides:
        apply_override(config, item)
    if "train" in config and "data" in config:
        if validate:
            validate_config(config)  # validate early, naming the field
    else:
        model_config(config)  # a model-only config (configs/models)
    return config


def _run_config_file(path: str, arg: str) -> ml_collections.ConfigDict:
    """Runs the config file's ``get_config([arg])``, the one guarded place a config file's Python runs:
    a syntax error, or an exception while the file runs, is one ConfigError naming the file and line."""
    spec = importlib.util.spec_from_file_location(f"tieflax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"config file {path!r} line {e.lineno}: syntax error ({e.msg}): fix the file") from None
    except Exception as e:  # noqa: BLE001 (the file's own code: a failure of the input, named by line)
        raise _failed_in(path, "", e, "while it was imported") from None
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"config file {path!r} has no get_config() function")
    if arg and not inspect.signature(module.get_config).parameters:
        raise ConfigError(f"config file {path!r} has no variants (its get_config() takes no argument): drop "
                          f"':{arg}' from --config")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except ConfigError:
        raise
    except ValueError as e:  # a config file's own refusal (an unknown ':arg'): one line naming the file
        raise ConfigError(f"config file {path!r}{':' + arg if arg else ''}: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise _failed_in(path, arg, e, "in get_config()") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path!r}: get_config() returned {type(config).__name__}, not an "
                          "ml_collections.ConfigDict (build it on tieflax.config.default_config())")
    return config


def _failed_in(path: str, arg: str, e: Exception, when: str) -> ConfigError:
    """One line: the file, the line of it that raised (the innermost frame in that file), and the error."""
    import traceback  # noqa: PLC0415

    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(path)]
    line = f" line {frames[-1].lineno}" if frames else ""
    what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return ConfigError(f"config file {path!r}{':' + arg if arg else ''}{line}: {what} ({when}): fix the file")


def apply_override(config: ml_collections.ConfigDict, item: str) -> None:
    """Applies one ``[--config.]a.b.c=value`` override in place. A refusal is one line naming the field:
    a misspelled name with the closest field (``did you mean``), a value of the wrong kind with the values
    the field takes."""
    key, sep, raw = item.removeprefix("--").removeprefix("config.").partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} must look like --config.section.field=value")
    *parents, leaf = key.split(".")
    node = config
    for depth, name in enumerate(parents):
        if name in node and not isinstance(node[name], ml_collections.ConfigDict):
            field = ".".join(["config", *parents[:depth + 1]])
            raise ConfigError(f"override {item!r}: {field} is a field, not a section: set it as --{field}=VALUE")
        if name not in node:
            raise ConfigError(f"override {item!r}: no section {name!r} in the config"
                              + _closest(name, node, ".".join(["config", *parents[:depth]])))
        node = node[name]
    if leaf not in node:
        raise ConfigError(f"override {item!r}: no field {leaf!r} in config.{'.'.join(parents)}"
                          + _closest(leaf, node, ".".join(["config", *parents])))
    value = _parse(raw)
    current = node[leaf]
    if leaf == "remat":
        # --config.model.remat=True still means 'full'; a saved config may hold the old bool; 'none' is a
        # policy's name here, not Python's None.
        with node.ignore_type():
            node[leaf] = remat_name("none" if value is None else value)
        return
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    try:
        node[leaf] = value
    except TypeError:
        # ml_collections' own words ("no is of original type <class 'bool'> and cannot be casted ...") name
        # neither the field nor what it takes.
        raise ConfigError(f"override {item!r}: config.{key} takes {_KIND_TAKES.get(type(current), type(current).__name__)}, "
                          f"not {raw!r}") from None


# What a field of each type takes, in the words of a refusal (``_parse`` reads the value as Python).
_KIND_TAKES = {bool: "True or False (any case)", int: "a whole number, e.g. 100", float: "a number, e.g. 3e-4",
               str: "text", tuple: "a tuple, e.g. (2, 4) or () for none"}


def _closest(name: str, node: ml_collections.ConfigDict, where: str) -> str:
    """``: did you mean <where>.<field>?`` for the closest field of ``node``, else the fields it has."""
    import difflib  # noqa: PLC0415

    known = sorted(node.keys())
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if match:
        return f": did you mean {where}.{match[0]}?"
    return f"; its fields: {', '.join(known)}"


def _parse(raw: str) -> Any:
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw
