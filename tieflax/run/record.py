"""The run's record as files: read once, verified against its digest chain, named by checkpoints.

The record, in the run directory (``tieflax.run.layout``)::

    config.json              the config the run started with: created once, never rewritten
    data.json                what it trained on (source, content key, tokenizer digest) and the run's id
    config_history/<n>.json  n = 1, 2, ...: a change made on purpose (``--allow-change FIELD``) or set
                             before the first step of imported parameters: the step it applies from,
                             the fields (saved, new), the whole new config and data record; create-only

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

What the record means (which fields a resume must match) is ``tieflax.run.identity``'s; the config it
holds, read back, ``tieflax.run.saved_config``'s. Everything here reads the run through one snapshot
(``read_record``), so a check never sees two states of the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re

from tieflax import storage
from tieflax.errors import UserError
from tieflax.run.layout import (CHECKPOINT_DIR, CONFIG_FILE, CONFIG_HISTORY_DIR, DATA_RECORD_FILE,
                                INITIAL_PARAMS_DIR, LEGACY_METRICS_FILE, METRICS_DIR, RunDir, WorkdirError)

ALLOW_CHANGE_FLAG = "--allow-change"
RECORD_KEY = "tieflax_record"  # in a checkpoint's custom metadata: the files of the entry in force
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step metadata (holds the custom metadata)
COMMIT_MARKER = "commit_success.txt"  # orbax's end-of-save marker where it cannot rename (Cloud Storage)
_TMP_NAME = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")  # a local save's folder until it is renamed
RUN_ID_KEY = "run_id"  # in data.json and in what a checkpoint names: which run the record is

log = logging.getLogger(__name__)


class NotARun(UserError, FileNotFoundError):
    """The folder holds no run; the message names it and what to do."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class RecordBroken(WorkdirError):
    """A file of the run's record is missing, damaged or edited after a later file or a checkpoint named
    its digest; the message names the file and the fixes. ``problem``: the file and what is wrong with it,
    without the fix (a command that cannot mend the record names its own: ``tieflax.run.read_only``)."""

    def __init__(self, message: str, problem: str | None = None):
        super().__init__(message)
        self.problem = problem or message


class ForeignCheckpoint(WorkdirError):
    """The newest checkpoint names another run's record (another run id): it was copied in from another
    run. Not a RecordBroken: ``--allow-change`` must not go on from it. The message names it and the fix."""



def shown(diff: dict[str, tuple], limit: int = 8) -> str:
    """``field saved -> new; ...`` of at most ``limit`` fields, for one line."""
    items = [f"{k} {v[0]!r} -> {v[1]!r}" for k, v in diff.items()]
    return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")



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


def entry_name(n: int) -> str:
    """The record's name of history entry ``n`` (relative to the run)."""
    return f"{CONFIG_HISTORY_DIR}/{n}.json"


def _fix() -> str:
    return (f"restore it from a backup, or rerun with --config FILE and {ALLOW_CHANGE_FLAG} FIELD to go on from "
            f"the last checkpoint with that config, recorded as a new entry in {CONFIG_HISTORY_DIR}/")


@dataclasses.dataclass
class Snapshot:
    """One snapshot of the run's record, read in one place (``read_record``) and checked as it stands:
    the files' bytes by name relative to the run, entries by number, the newest checkpoint's step and what
    it names (None: no checkpoint, or one saved before the chain), and what training left behind;
    ``where``: the run it was read from."""
    where: RunDir
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


def read_record(where: RunDir) -> Snapshot:
    """The record of the run ``where`` read once: every listing and file a check needs, the files
    of the record together (``storage.read_many``: one wait on gs://, not one per object); then parsed.
    Nothing after this reads the run again: the checks work on the snapshot."""
    found = Snapshot(where=where, files={}, entries={}, damaged={})
    found.paths = {name: where.file(name) for name in (CONFIG_FILE, DATA_RECORD_FILE)}
    # config.json and data.json first (all a fresh run has to read), then the listings and the entries
    found.files = {name: raw for name, raw in zip(found.paths, storage.read_many(list(found.paths.values())))
                   if raw is not None}
    history, checkpoints, segments = [storage.listdir(where.file(d))
                                      for d in (CONFIG_HISTORY_DIR, CHECKPOINT_DIR, METRICS_DIR)]
    entries = {f"{CONFIG_HISTORY_DIR}/{n}.json": where.file(CONFIG_HISTORY_DIR, f"{n}.json") for n in sorted(
        int(x.removesuffix(".json")) for x in history if x.endswith(".json") and x.removesuffix(".json").isdigit())}
    found.paths.update(entries)
    found.files.update({name: raw for name, raw in zip(entries, storage.read_many(list(entries.values())))
                        if raw is not None})
    steps = sorted((int(n.rstrip("/")) for n in checkpoints if n.rstrip("/").isdigit()), reverse=True)
    # What each checkpoint names (read together): the newest finished one whose orbax metadata reads is the
    # one checked (its claim None: saved before the chain); the older ones tell a foreign checkpoint from an
    # edited file. A save that never finished (killed mid-write) names nothing: it is no pre-chain run.
    finished = _finished(where, steps)
    metas = storage.read_many([where.file(CHECKPOINT_DIR, str(s), CHECKPOINT_METADATA_FILE) for s in steps
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
    legacy_metrics = storage.is_file(where.file(LEGACY_METRICS_FILE))
    # An empty local checkpoints/ or metrics/ folder counts as trained, as it always has; remotely a
    # prefix exists once it holds an object, which its listing says.
    found.trained = bool(checkpoints or segments or legacy_metrics) or (not where.is_remote and any(
        storage.exists(where.file(d)) for d in (CHECKPOINT_DIR, METRICS_DIR)))
    # An empty checkpoints/ folder, made before a first run failed, is not a trained run.
    found.left_steps = bool(steps or segments or legacy_metrics) or (
        CONFIG_FILE not in found.files and storage.exists(where.file(INITIAL_PARAMS_DIR)))
    for name, raw in found.files.items():
        value, why = _parse(raw)
        if why:
            found.damaged[name] = why
        elif name.startswith(CONFIG_HISTORY_DIR):
            found.entries[int(name.split("/")[1].removesuffix(".json"))] = value
    return found


def _finished(where: RunDir, steps: list[int]) -> set[int]:
    """The numbered checkpoints whose save finished. Locally orbax writes into a temporary folder and
    renames it, so a numbered folder is finished; on a bucket it writes into ``checkpoints/<step>/`` itself
    and marks the end with ``commit_success.txt`` (read together, one wait)."""
    if not where.is_remote or not steps:
        return set(steps)
    marks = storage.read_many([where.file(CHECKPOINT_DIR, str(s), COMMIT_MARKER) for s in steps])
    return {s for s, mark in zip(steps, marks) if mark is not None}


def unfinished_steps(where: RunDir) -> list[int]:
    """Steps (oldest first) whose checkpoint was begun and never finished: a bucket's numbered folder with
    no commit marker, or a local temporary folder (``<step>.orbax-checkpoint-tmp...``) a killed save left."""
    names = [n.rstrip("/") for n in storage.listdir(where.file(CHECKPOINT_DIR))]
    numbered = [int(n) for n in names if n.isdigit()]
    begun = {int(m.group(1)) for m in map(_TMP_NAME.match, names) if m}
    return sorted(begun | (set(numbered) - _finished(where, numbered)))

def broken(where: RunDir, name: str, what: str) -> RecordBroken:
    """RecordBroken naming the file of the record, what is wrong with it, and the training command's fix."""
    problem = f"{where.file(name)} {what}"
    return RecordBroken(f"{problem}: {_fix()}", problem)


def _check_named(found: Snapshot, named: dict, by: str) -> None:
    for name, want in sorted(named.items()):
        raw = found.files.get(name)
        if raw is None:
            raise broken(found.where, name, f"is missing ({by} names it in the run's record)")
        if not _matches(raw, want):
            why = found.damaged.get(name)
            what = f"is {why}" if why else "was edited"
            raise broken(found.where, name, f"{what} (its digest differs from the one {by} names)")


_LEGACY_SAID: set = set()



def verify_record(where: RunDir | str) -> list[dict]:
    """Checks the run's record against its digest chain and returns the history entries in force (oldest
    first, from the newest restart on). Raises NotARun when the folder holds no run, RecordBroken naming
    the file when one is missing, damaged or edited (config.json missing from a run that has trained
    included: that is not a fresh run). Links written before the chain are accepted, said once."""
    return verified(read_record(RunDir.named(where)))


def verified(found: Snapshot) -> list[dict]:
    """``verify_record`` of a snapshot (``read_record``): pure, nothing is read."""
    where = found.where
    _check_belongs(found)  # first: a fix for a broken record must not go on from another run's
    numbers = sorted(set(found.entries) | {int(n.split("/")[1].removesuffix(".json")) for n in found.damaged
                                           if n.startswith(CONFIG_HISTORY_DIR)})
    restarts = [n for n in numbers if n in found.entries and "restarted" in found.entries[n]]
    first = restarts[-1] if restarts else 1
    if not restarts:
        if CONFIG_FILE not in found.files:
            if found.left_steps:
                raise broken(found.where, CONFIG_FILE, "is missing, yet the run has trained (checkpoints or "
                              "metrics): it is not a fresh run")
            if not numbers:
                path = found.paths[CONFIG_FILE]
                raise NotARun(2, f"{path} does not exist: {where.path} is not a tieflax run (train into it with "
                                 "--config first, or save_initial_params there)", path)
        for name in (CONFIG_FILE, DATA_RECORD_FILE):
            if name in found.damaged:
                raise broken(found.where, name, f"is {found.damaged[name]}")
    for n in range(first, (numbers[-1] if numbers else 0) + 1):
        name = entry_name(n)
        if name in found.damaged:
            raise broken(found.where, name, f"is {found.damaged[name]}")
        if n not in found.entries:
            raise broken(found.where, name, f"is missing ({CONFIG_HISTORY_DIR}/ holds {numbers[-1]}.json after it)")
    legacy = []
    for n in range(first, (numbers[-1] if numbers else 0) + 1):
        previous = found.entries[n].get("previous")
        if previous is None:
            legacy.append(entry_name(n))
        else:
            _check_named(found, previous, entry_name(n))
    if found.claimed_step is not None:
        by = f"{CHECKPOINT_DIR}/{found.claimed_step}"
        if found.claim is None:
            legacy.append(by)
        elif (found.claimed_entry or 0) >= (restarts[-1] if restarts else 0):
            try:
                _check_named(found, found.claim.get("files", {}), by)
            except RecordBroken:
                _check_not_foreign(found, by)
                raise
            if found.claimed_entry and found.claimed_entry not in found.entries:
                raise broken(found.where, entry_name(found.claimed_entry), f"is missing ({by} names it)")
    if legacy and where.path not in _LEGACY_SAID:
        _LEGACY_SAID.add(where.path)
        log.warning("%s was written before the run's record carried digests (%s): its record is trusted as it "
                    "is; checkpoints saved from now on name it", where.path, ", ".join(legacy))
    return [found.entries[n] for n in range(first, (numbers[-1] if numbers else 0) + 1)]


def _run_id(found: Snapshot) -> str | None:
    """The run's id in data.json; None for runs made before ids (or with data.json lost)."""
    value = _parse(found.files[DATA_RECORD_FILE])[0] if DATA_RECORD_FILE in found.files else None
    return value.get(RUN_ID_KEY) if isinstance(value, dict) else None


def _check_belongs(found: Snapshot) -> None:
    """Raises ForeignCheckpoint when the newest checkpoint names another run's id: the record's files
    then differ from what it names because it is not this run's, not because they were edited. A
    checkpoint or a run from before ids is left to the digests."""
    theirs = found.claim.get(RUN_ID_KEY) if isinstance(found.claim, dict) else None
    ours = _run_id(found)
    if theirs is not None and ours is not None and theirs != ours:
        raise _foreign(found.where, f"{CHECKPOINT_DIR}/{found.claimed_step}", f"it was saved by run {theirs}, this "
                       f"run is {ours}")


def _check_not_foreign(found: Snapshot, by: str) -> None:
    """For a checkpoint or a run from before ids whose named files differ: raises ForeignCheckpoint when
    an older checkpoint names the same entry by the files as they are. A run's checkpoints that name one
    entry name the same digests (entries are create-only), so the record holds and the newest one was
    saved against another run's; when no older one vouches, an edited file stays the likelier cause."""
    entry = found.claimed_entry or 0
    for step, claim in sorted(found.older_claims.items(), reverse=True):
        named = claim.get("files") if isinstance(claim, dict) else None
        if named and (claim.get("entry") or 0) == entry and all(
                name in found.files and _matches(found.files[name], want) for name, want in named.items()):
            raise _foreign(found.where, by, f"it names other files than {CHECKPOINT_DIR}/{step}, which match the record")


def _foreign(where: RunDir, by: str, why: str) -> ForeignCheckpoint:
    return ForeignCheckpoint(f"{where.file(by)} does not belong to this run's record ({why}): it was "
                             f"copied in from another run; remove it (move it out of {CHECKPOINT_DIR}/) or restore "
                             f"this run's own {by}, then rerun")


def in_force(where: RunDir | str) -> dict:
    """What a checkpoint names (``RECORD_KEY`` in its custom metadata): ``{'entry': n, 'files': {name:
    digest}, 'run_id': id}`` of the entry in force (n = 0: config.json and data.json) and the run (no id
    for a run made before ids)."""
    found = read_record(RunDir.named(where))
    ours = _run_id(found)
    named = {RUN_ID_KEY: ours} if ours is not None else {}
    if found.entries:
        n = max(found.entries)
        return {"entry": n, "files": {entry_name(n): digest(found.files[entry_name(n)])}, **named}
    return {"entry": 0, "files": {name: digest(found.files[name]) for name in (CONFIG_FILE, DATA_RECORD_FILE)
                                  if name in found.files}, **named}


def has_trained(where: RunDir | str) -> bool:
    """True once the run has trained a step: it has checkpoints or logged metrics."""
    return read_record(RunDir.named(where)).trained


def history(where: RunDir | str) -> list[dict]:
    """The run's config-history entries in force, oldest first (``[]`` when its config never changed);
    RecordBroken when the record does not hold (``verify_record``)."""
    try:
        return verify_record(where)
    except NotARun:
        return []


def _changed_text(entry: dict) -> str:
    text = shown({k: tuple(v) for k, v in entry.get("changed", {}).items()})
    return text or "no result field (the same settings)"


def history_lines(where: RunDir | str) -> list[str]:
    """One sentence per config change, for ``tieflax analyze`` and the study's report."""
    return [(f"config record restarted at step {e['step']} ({e['restarted']}): " if "restarted" in e else
             f"config changed at step {e['step']} ({e['reason']}): ") + _changed_text(e)
            for e in history(where)]


def read_data_record(where: RunDir | str) -> dict | None:
    """The data record in force: the newest history entry's, else ``data.json``'s; None for runs written
    before data records."""
    return data_record_in_force(where)[1]


def data_record_in_force(where: RunDir | str) -> tuple[str, dict | None]:
    """``(name, data record)``: the record's file that names what the run trains on now (the newest
    history entry, else data.json, relative to the run) and its data record (None for runs written
    before data records)."""
    found = read_record(RunDir.named(where))
    try:
        entries = verified(found)
    except NotARun:
        entries = []
    if entries:
        return entry_name(entries[-1].get("number", len(entries))), entries[-1]["data"]
    raw = found.files.get(DATA_RECORD_FILE)
    if raw is None:
        return DATA_RECORD_FILE, None
    saved = json.loads(raw)
    saved.pop(RUN_ID_KEY, None)  # which run, not what it trained on
    return DATA_RECORD_FILE, saved
