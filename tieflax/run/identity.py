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

The record proves itself with a digest chain: history entry 1 names the digests of config.json and
data.json (``previous``), entry n those of entry n-1, and every checkpoint names the files of the entry
in force when it was saved (its orbax custom metadata, ``RECORD_KEY``). So a deleted, truncated or edited
file is found on the next read (``verify_record``) and refused in one line naming it and the fixes
(restore it, or ``--allow-change`` to start a new entry from the last checkpoint), never a silent
fallback to an older entry. Runs written before the chain (no ``previous``, checkpoints that name no
entry) are accepted as before, said once; their next checkpoint starts the chain.

A file is named by the digest of its values (canonical JSON: ``digest``), not of its bytes, so a record
file written again with other indentation or key order is the same record, and a changed value is not.
data.json also holds the run's id (``RUN_ID_KEY``, random, made once with the record), which every
checkpoint names beside the entry: a checkpoint copied in from another run is named as such
(``ForeignCheckpoint``), not blamed on the record it does not match, and no fix offered trains on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import secrets
from typing import Sequence

import jax
import ml_collections

from tieflax import storage
from tieflax.config import default_config
from tieflax.errors import UserError
from tieflax.run import layout
from tieflax.run.layout import (CHECKPOINT_DIR, CONFIG_FILE, CONFIG_HISTORY_DIR, DATA_RECORD_FILE,
                                INITIAL_PARAMS_DIR, LEGACY_METRICS_FILE, METRICS_DIR, WorkdirError)

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
RECORD_KEY = "tieflax_record"  # in a checkpoint's custom metadata: the files of the entry in force
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step metadata (holds the custom metadata)
COMMIT_MARKER = "commit_success.txt"  # orbax's end-of-save marker where it cannot rename (Cloud Storage)
_TMP_NAME = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")  # a local save's folder until it is renamed
RUN_ID_KEY = "run_id"  # in data.json and in what a checkpoint names: which run the record is

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


def _shown(diff: dict[str, tuple], limit: int = 8) -> str:
    items = [f"{k} {v[0]!r} -> {v[1]!r}" for k, v in diff.items()]
    return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def has_trained(workdir: str) -> bool:
    """True once the run has trained a step: it has checkpoints or logged metrics."""
    return _read_record(layout.path(workdir)).trained


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


def check_resume(workdir: str, config: ml_collections.ConfigDict, *, allow_change: Sequence[str] = (),
                 command: str = "train", data_next: bool = False) -> Resume:
    """Compares ``config`` with the run's record in ``workdir`` before anything is written.

    Returns ``Resume(fresh=True)`` for a new run. A run that has trained (checkpoints or metrics) may go
    on only with the same result fields, unless each changed field is named in ``allow_change`` (a
    field, e.g. ``train.num_steps``, or a section prefix, e.g. ``data``). Imported or converted
    parameters that have not trained yet keep their model; their other settings may be set freely (the
    difference is recorded). Raises RunChanged naming every refused field, RecordBroken when a file of
    the record is missing, damaged or edited (unless ``allow_change`` names a field: then the config
    becomes a new entry from the last checkpoint, ``Resume.restart``). ``data_next``: the caller calls
    ``check_data`` next, which then names refused fields and changed data in one line."""
    check_allow_change(config, allow_change)
    found = _read_record(workdir)  # the record read once; everything below checks this snapshot
    try:
        saved = _config_in_force(workdir, found)
    except NotARun:
        return Resume(fresh=True, changed={})
    except RecordBroken as e:
        if not allow_change:
            raise
        best = _best_effort_config(found)
        diff = changed_fields(best, config) if best is not None else {}
        return Resume(fresh=False, changed=diff, allow_change=tuple(allow_change), restart=str(e))
    diff = changed_fields(saved, config)
    if not diff:
        return Resume(fresh=False, changed={}, allow_change=tuple(allow_change))
    trained = found.trained
    refused = {k: v for k, v in diff.items() if not _allowed(k, allow_change) and (trained or k.startswith("model."))}
    if refused:
        where = workdir
        if trained:
            fix = (f"rerun without these settings to resume it as it is (`tieflax {command} --workdir {where}` "
                   "alone reads its config), train them in a new --workdir, or pass "
                   f"{ALLOW_CHANGE_FLAG} {','.join(refused)} to change them on purpose from the last "
                   f"checkpoint on (recorded in {CONFIG_HISTORY_DIR}/)")
        else:
            fix = ("its parameters are of that model: change the model with `tieflax convert` (--untie, --tie, "
                   "--scan-layers) into a new --out, or train this model in a new --workdir")
        line = f"{where} was trained with other settings (saved -> now: {_shown(refused)}): {fix}"
        # A change of data settings is named above; other settings wait for check_data's look at the data,
        # so that one refusal names every difference.
        if data_next and trained and not any(k.startswith("data.") for k in refused):
            return Resume(fresh=False, changed=diff, allow_change=tuple(allow_change), refused=line)
        raise RunChanged(line)
    return Resume(fresh=False, changed=diff, before_first_step=not trained, allow_change=tuple(allow_change))


def check_data(workdir: str, data: dict, resume: Resume) -> None:
    """Refuses a run whose data changed under it (the same config, other content: a token store rebuilt
    at the same path, corpus files edited, another tokenizer), unless ``data`` or a ``data.*`` field is
    allowed to change in ``resume`` (a new data setting is expected to bring new data); a refusal also
    names the settings ``check_resume`` held back. An allowed change of data joins ``resume.changed``
    as ``data (key)`` etc., so that it is said and recorded like any other change."""
    saved = None if resume.fresh or resume.restart else read_data_record(workdir)
    consent = any(a.rstrip(".") == "data" or a.startswith("data.") for a in resume.allow_change)
    diff = {} if saved is None or resume.before_first_step else {
        f"data ({k})": (saved.get(k), data.get(k)) for k in ("source", "store", "key", "tokenizer")
        if saved.get(k) != data.get(k)}
    if diff and not consent:
        line = (f"{workdir} was trained on other data (saved -> now: {_shown(diff)}): "
                "point data.* at the data it trained on, train in a new --workdir, or pass "
                f"{ALLOW_CHANGE_FLAG} data to go on with this data (recorded in {CONFIG_HISTORY_DIR}/)")
        raise RunChanged(f"{resume.refused}; and {line}" if resume.refused else line)
    if resume.refused:
        raise RunChanged(resume.refused)
    resume.changed.update(diff)  # on purpose: said and recorded with the fields


def check_reached(workdir: str, config: ml_collections.ConfigDict, resume: Resume, step: int) -> None:
    """Refuses a new entry (a change on purpose, a restart) from ``step`` whose ``train.num_steps`` is
    below that step, which the run already reached: nothing would train, and the record would say the run
    ends at a step its checkpoints are past. Called on every process (all stop together), before
    ``record`` writes anything."""
    n = config.train.num_steps
    if (resume.changed or resume.restart is not None) and not resume.before_first_step and n < step:
        raise RunChanged(f"train.num_steps {n} is below step {step}, which {workdir} already reached "
                         f"({CHECKPOINT_DIR}/{step}): nothing would train, and its record would say it ends at "
                         f"step {n}: pass --config.train.num_steps={step} or more, or train {n} steps in a new "
                         "--workdir")


def record(workdir: str, config: ml_collections.ConfigDict, data: dict, resume: Resume, step: int) -> None:
    """Process 0 writes the run's record: a fresh run claims ``config.json`` and ``data.json``
    (create-only: two runs cannot claim one prefix); an allowed change becomes the next numbered
    history entry, naming the digests of the entry before it; a restart (``Resume.restart``) an entry
    that names none. Nothing is ever overwritten."""
    if jax.process_index() != 0:
        return
    if resume.fresh:
        save_config(workdir, config, claim=True)
    data_path = storage.join(workdir, DATA_RECORD_FILE)
    if resume.restart is None and not storage.is_file(data_path):  # a fresh run, or one from before data records
        with_id = {**data, RUN_ID_KEY: secrets.token_hex(8)}  # the run's id: its checkpoints name it
        storage.create_new(data_path, json.dumps(with_id, indent=1, sort_keys=True).encode())
    if resume.restart is None:
        saved_data = read_data_record(workdir)
        if saved_data is not None and saved_data != data:  # a new tokenizer or data setting: on purpose
            for k in ("source", "store", "key", "tokenizer"):
                if saved_data.get(k) != data.get(k):
                    resume.changed.setdefault(f"data ({k})", (saved_data.get(k), data.get(k)))
    if not resume.changed and resume.restart is None:
        return
    found = _read_record(workdir)
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
        entry["previous"] = in_force(workdir)["files"]
    text = json.dumps(entry, indent=1, sort_keys=True).encode()
    if not storage.create_new(storage.join(workdir, CONFIG_HISTORY_DIR, f"{n}.json"), text):
        raise WorkdirError(f"{storage.join(workdir, CONFIG_HISTORY_DIR, f'{n}.json')} was written by another "
                           "command at the same time: only one command may continue a run")


# ------------------------------------------------------------------------------------- the digest chain

class RecordBroken(WorkdirError):
    """A file of the run's record is missing, damaged or edited after a later file or a checkpoint named
    its digest; the message names the file and the fixes."""


class ForeignCheckpoint(WorkdirError):
    """The newest checkpoint names another run's record (another run id): it was copied in from another
    run. Not a RecordBroken: ``--allow-change`` must not go on from it. The message names it and the fix."""


def digest(raw: bytes) -> str:
    """The digest the chain names a file by: sha256 (hex) of its values as canonical JSON (keys sorted,
    fixed separators), so that the same values written with other indentation or key order are the same
    record; a file that holds no JSON object, by its bytes (it then matches nothing)."""
    value, why = _parse(raw)
    if why:
        return _byte_digest(raw)
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _byte_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _matches(raw: bytes, want: str) -> bool:
    """Whether a file is the one a later file or a checkpoint names. Records written before the digests
    were over values name each file by the sha256 of its bytes, so either digest is accepted: such a
    record reads as it did (a file of it written again with other formatting reads as edited there, since
    its values were never digested); from the next entry or checkpoint on, the values are named."""
    return want in (digest(raw), _byte_digest(raw))


def _entry_name(n: int) -> str:
    return f"{CONFIG_HISTORY_DIR}/{n}.json"


def _fix() -> str:
    return (f"restore it from a backup, or rerun with --config FILE and {ALLOW_CHANGE_FLAG} FIELD to go on from "
            f"the last checkpoint with that config, recorded as a new entry in {CONFIG_HISTORY_DIR}/")


@dataclasses.dataclass
class _Found:
    """One snapshot of the run's record, read in one place (``_read_record``) and checked as it stands:
    the files' bytes by name relative to the run, entries by number, the newest checkpoint's step and what
    it names (None: no checkpoint, or one saved before the chain), and what training left behind."""
    files: dict
    entries: dict
    damaged: dict  # name -> why, for files that do not parse
    claimed_step: int | None = None
    claim: dict | None = None
    older_claims: dict = dataclasses.field(default_factory=dict)  # step -> what each older checkpoint names
    paths: dict = dataclasses.field(default_factory=dict)  # name -> where it was read (or looked for)
    trained: bool = False  # checkpoints/ or metrics exist: the run has trained a step (``has_trained``)
    left_steps: bool = False  # a checkpoint step, a metrics segment or file, or initial parameters

    @property
    def claimed_entry(self) -> int | None:
        return self.claim.get("entry") if isinstance(self.claim, dict) else None


def _parse(raw: bytes) -> tuple[dict | None, str | None]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    except UnicodeDecodeError:
        return None, "not text"
    return (value, None) if isinstance(value, dict) else (None, "holds no JSON object")


def _read_record(workdir: str) -> _Found:
    """The record of ``workdir`` (resolved) read once: every listing and file a check needs, the files
    of the record together (``storage.read_many``: one wait on gs://, not one per object); then parsed.
    Nothing after this reads the run again: the checks work on the snapshot."""
    found = _Found(files={}, entries={}, damaged={})
    found.paths = {name: storage.join(workdir, name) for name in (CONFIG_FILE, DATA_RECORD_FILE)}
    # config.json and data.json first (all a fresh run has to read), then the listings and the entries
    found.files = {name: raw for name, raw in zip(found.paths, storage.read_many(list(found.paths.values())))
                   if raw is not None}
    history, checkpoints, segments = [storage.listdir(storage.join(workdir, d))
                                      for d in (CONFIG_HISTORY_DIR, CHECKPOINT_DIR, METRICS_DIR)]
    entries = {f"{CONFIG_HISTORY_DIR}/{n}.json": storage.join(workdir, CONFIG_HISTORY_DIR, f"{n}.json") for n in sorted(
        int(x.removesuffix(".json")) for x in history if x.endswith(".json") and x.removesuffix(".json").isdigit())}
    found.paths.update(entries)
    found.files.update({name: raw for name, raw in zip(entries, storage.read_many(list(entries.values())))
                        if raw is not None})
    steps = sorted((int(n.rstrip("/")) for n in checkpoints if n.rstrip("/").isdigit()), reverse=True)
    # What each checkpoint names (read together): the newest finished one whose orbax metadata reads is the
    # one checked (its claim None: saved before the chain); the older ones tell a foreign checkpoint from an
    # edited file. A save that never finished (killed mid-write) names nothing: it is no pre-chain run.
    finished = _finished(workdir, steps)
    metas = storage.read_many([storage.join(workdir, CHECKPOINT_DIR, str(s), CHECKPOINT_METADATA_FILE) for s in steps
                               if s in finished])
    for step, raw in zip([s for s in steps if s in finished], metas):
        try:
            meta = json.loads(raw) if raw is not None else None
        except ValueError:  # not JSON, or not text: an unreadable step, as orbax finds it
            meta = None
        if not isinstance(meta, dict):
            continue
        claim = (meta.get("custom_metadata") or {}).get(RECORD_KEY)
        if found.claimed_step is None:
            found.claimed_step, found.claim = step, claim
        else:
            found.older_claims[step] = claim
    legacy_metrics = storage.is_file(storage.join(workdir, LEGACY_METRICS_FILE))
    # An empty local checkpoints/ or metrics/ folder counts as trained, as it always has; remotely a
    # prefix exists once it holds an object, which its listing says.
    found.trained = bool(checkpoints or segments or legacy_metrics) or (not storage.is_remote(workdir) and any(
        storage.exists(storage.join(workdir, d)) for d in (CHECKPOINT_DIR, METRICS_DIR)))
    # An empty checkpoints/ folder, made before a first run failed, is not a trained run.
    found.left_steps = bool(steps or segments or legacy_metrics) or (
        CONFIG_FILE not in found.files and storage.exists(storage.join(workdir, INITIAL_PARAMS_DIR)))
    for name, raw in found.files.items():
        value, why = _parse(raw)
        if why:
            found.damaged[name] = why
        elif name.startswith(CONFIG_HISTORY_DIR):
            found.entries[int(name.split("/")[1].removesuffix(".json"))] = value
    return found


def _finished(workdir: str, steps: list[int]) -> set[int]:
    """The numbered checkpoints whose save finished. Locally orbax writes into a temporary folder and
    renames it, so a numbered folder is finished; on a bucket it writes into ``checkpoints/<step>/`` itself
    and marks the end with ``commit_success.txt`` (read together, one wait)."""
    if not storage.is_remote(workdir) or not steps:
        return set(steps)
    marks = storage.read_many([storage.join(workdir, CHECKPOINT_DIR, str(s), COMMIT_MARKER) for s in steps])
    return {s for s, mark in zip(steps, marks) if mark is not None}


def unfinished_steps(workdir: str) -> list[int]:
    """Steps (oldest first) whose checkpoint was begun and never finished: a bucket's numbered folder with
    no commit marker, or a local temporary folder (``<step>.orbax-checkpoint-tmp...``) a killed save left."""
    names = [n.rstrip("/") for n in storage.listdir(storage.join(workdir, CHECKPOINT_DIR))]
    numbered = [int(n) for n in names if n.isdigit()]
    begun = {int(m.group(1)) for m in map(_TMP_NAME.match, names) if m}
    return sorted(begun | (set(numbered) - _finished(workdir, numbered)))


def _broken(workdir: str, name: str, what: str) -> RecordBroken:
    return RecordBroken(f"{storage.join(workdir, name)} {what}: {_fix()}")


def _check_named(workdir: str, found: _Found, named: dict, by: str) -> None:
    for name, want in sorted(named.items()):
        raw = found.files.get(name)
        if raw is None:
            raise _broken(workdir, name, f"is missing ({by} names it in the run's record)")
        if not _matches(raw, want):
            why = found.damaged.get(name)
            what = f"is {why}" if why else "was edited"
            raise _broken(workdir, name, f"{what} (its digest differs from the one {by} names)")


_LEGACY_SAID: set = set()


def verify_record(workdir: str) -> list[dict]:
    """Checks the run's record against its digest chain and returns the history entries in force (oldest
    first, from the newest restart on). Raises NotARun when the folder holds no run, RecordBroken naming
    the file when one is missing, damaged or edited (config.json missing from a run that has trained
    included: that is not a fresh run). Links written before the chain are accepted, said once."""
    workdir = layout.path(workdir)  # as the run layer names it (check_resume takes the Run's resolved path)
    return _verified(workdir, _read_record(workdir))


def _verified(workdir: str, found: _Found) -> list[dict]:
    """``verify_record`` of a snapshot (``_read_record``): pure, nothing is read."""
    _check_belongs(workdir, found)  # first: a fix for a broken record must not go on from another run's
    numbers = sorted(set(found.entries) | {int(n.split("/")[1].removesuffix(".json")) for n in found.damaged
                                           if n.startswith(CONFIG_HISTORY_DIR)})
    restarts = [n for n in numbers if n in found.entries and "restarted" in found.entries[n]]
    first = restarts[-1] if restarts else 1
    if not restarts:
        if CONFIG_FILE not in found.files:
            if found.left_steps:
                raise _broken(workdir, CONFIG_FILE, "is missing, yet the run has trained (checkpoints or "
                              "metrics): it is not a fresh run")
            if not numbers:
                path = found.paths[CONFIG_FILE]
                raise NotARun(2, f"{path} does not exist: {workdir} is not a tieflax run (train into it with "
                                 "--config first, or save_initial_params there)", path)
        for name in (CONFIG_FILE, DATA_RECORD_FILE):
            if name in found.damaged:
                raise _broken(workdir, name, f"is {found.damaged[name]}")
    for n in range(first, (numbers[-1] if numbers else 0) + 1):
        name = _entry_name(n)
        if name in found.damaged:
            raise _broken(workdir, name, f"is {found.damaged[name]}")
        if n not in found.entries:
            raise _broken(workdir, name, f"is missing ({CONFIG_HISTORY_DIR}/ holds {numbers[-1]}.json after it)")
    legacy = []
    for n in range(first, (numbers[-1] if numbers else 0) + 1):
        previous = found.entries[n].get("previous")
        if previous is None:
            legacy.append(_entry_name(n))
        else:
            _check_named(workdir, found, previous, _entry_name(n))
    if found.claimed_step is not None:
        by = f"{CHECKPOINT_DIR}/{found.claimed_step}"
        if found.claim is None:
            legacy.append(by)
        elif (found.claimed_entry or 0) >= (restarts[-1] if restarts else 0):
            try:
                _check_named(workdir, found, found.claim.get("files", {}), by)
            except RecordBroken:
                _check_not_foreign(workdir, found, by)
                raise
            if found.claimed_entry and found.claimed_entry not in found.entries:
                raise _broken(workdir, _entry_name(found.claimed_entry), f"is missing ({by} names it)")
    if legacy and workdir not in _LEGACY_SAID:
        _LEGACY_SAID.add(workdir)
        log.warning("%s was written before the run's record carried digests (%s): its record is trusted as it "
                    "is; checkpoints saved from now on name it", workdir, ", ".join(legacy))
    return [found.entries[n] for n in range(first, (numbers[-1] if numbers else 0) + 1)]


def _run_id(found: _Found) -> str | None:
    """The run's id in data.json; None for runs made before ids (or with data.json lost)."""
    value = _parse(found.files[DATA_RECORD_FILE])[0] if DATA_RECORD_FILE in found.files else None
    return value.get(RUN_ID_KEY) if isinstance(value, dict) else None


def _check_belongs(workdir: str, found: _Found) -> None:
    """Raises ForeignCheckpoint when the newest checkpoint names another run's id: the record's files
    then differ from what it names because it is not this run's, not because they were edited. A
    checkpoint or a run from before ids is left to the digests."""
    theirs = found.claim.get(RUN_ID_KEY) if isinstance(found.claim, dict) else None
    ours = _run_id(found)
    if theirs is not None and ours is not None and theirs != ours:
        raise _foreign(workdir, f"{CHECKPOINT_DIR}/{found.claimed_step}", f"it was saved by run {theirs}, this "
                       f"run is {ours}")


def _check_not_foreign(workdir: str, found: _Found, by: str) -> None:
    """For a checkpoint or a run from before ids whose named files differ: raises ForeignCheckpoint when
    an older checkpoint names the same entry by the files as they are. A run's checkpoints that name one
    entry name the same digests (entries are create-only), so the record holds and the newest one was
    saved against another run's; when no older one vouches, an edited file stays the likelier cause."""
    entry = found.claimed_entry or 0
    for step, claim in sorted(found.older_claims.items(), reverse=True):
        named = claim.get("files") if isinstance(claim, dict) else None
        if named and (claim.get("entry") or 0) == entry and all(
                name in found.files and _matches(found.files[name], want) for name, want in named.items()):
            raise _foreign(workdir, by, f"it names other files than {CHECKPOINT_DIR}/{step}, which match the record")


def _foreign(workdir: str, by: str, why: str) -> ForeignCheckpoint:
    return ForeignCheckpoint(f"{storage.join(workdir, by)} does not belong to this run's record ({why}): it was "
                             f"copied in from another run; remove it (move it out of {CHECKPOINT_DIR}/) or restore "
                             f"this run's own {by}, then rerun")


def in_force(workdir: str) -> dict:
    """What a checkpoint names (``RECORD_KEY`` in its custom metadata): ``{'entry': n, 'files': {name:
    digest}, 'run_id': id}`` of the entry in force (n = 0: config.json and data.json) and the run (no id
    for a run made before ids)."""
    found = _read_record(layout.path(workdir))
    ours = _run_id(found)
    named = {RUN_ID_KEY: ours} if ours is not None else {}
    if found.entries:
        n = max(found.entries)
        return {"entry": n, "files": {_entry_name(n): digest(found.files[_entry_name(n)])}, **named}
    return {"entry": 0, "files": {name: digest(found.files[name]) for name in (CONFIG_FILE, DATA_RECORD_FILE)
                                  if name in found.files}, **named}


def _best_effort_config(found: _Found) -> ml_collections.ConfigDict | None:
    """The newest config that still reads in a broken record, for naming what a restart changes."""
    for n in sorted(found.entries, reverse=True):
        if isinstance(found.entries[n].get("config"), dict):
            return _completed(found.entries[n]["config"])
    if CONFIG_FILE in found.files and CONFIG_FILE not in found.damaged:
        return _completed(json.loads(found.files[CONFIG_FILE]))
    return None


def history(workdir: str) -> list[dict]:
    """The run's config-history entries in force, oldest first (``[]`` when its config never changed);
    RecordBroken when the record does not hold (``verify_record``)."""
    try:
        return verify_record(workdir)
    except NotARun:
        return []


def _changed_text(entry: dict) -> str:
    text = _shown({k: tuple(v) for k, v in entry.get("changed", {}).items()})
    return text or "no result field (the same settings)"


def history_lines(workdir: str) -> list[str]:
    """One sentence per config change, for ``tieflax analyze`` and the study's report."""
    return [(f"config record restarted at step {e['step']} ({e['restarted']}): " if "restarted" in e else
             f"config changed at step {e['step']} ({e['reason']}): ") + _changed_text(e)
            for e in history(workdir)]


def read_data_record(workdir: str) -> dict | None:
    """The data record in force: the newest history entry's, else ``data.json``'s; None for runs written
    before data records."""
    workdir = layout.path(workdir)
    found = _read_record(workdir)
    try:
        entries = _verified(workdir, found)
    except NotARun:
        entries = []
    if entries:
        return entries[-1]["data"]
    raw = found.files.get(DATA_RECORD_FILE)
    if raw is None:
        return None
    saved = json.loads(raw)
    saved.pop(RUN_ID_KEY, None)  # which run, not what it trained on
    return saved


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
    with today's defaults for fields added since, once the record holds (``verify_record``). Raises
    NotARun (a FileNotFoundError and a UserError) when the folder holds no run, RecordBroken naming the
    file when the record is broken."""
    workdir = layout.path(workdir)  # as the run layer names it (check_resume takes the Run's resolved path)
    return _config_in_force(workdir, _read_record(workdir))


def _config_in_force(workdir: str, found: _Found) -> ml_collections.ConfigDict:
    """``load_workdir_config`` of a snapshot (``_read_record``): pure, nothing is read."""
    entries = _verified(workdir, found)
    if entries:
        saved = entries[-1].get("config")
        if not isinstance(saved, dict):
            raise _broken(workdir, _entry_name(entries[-1].get("number", len(entries))), "holds no config")
        return _completed(saved)
    return _completed(json.loads(found.files[CONFIG_FILE]))


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
