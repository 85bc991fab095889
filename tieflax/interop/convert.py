"""Checkpoints in and out of tieflax, and the surgery between tied and untied models.

- ``import_hf``: a Hugging Face folder (config.json + safetensors) -> a workdir `tieflax train` starts from.
- ``export_hf``: a run's latest parameters -> a Hugging Face folder (transformers reads it).
- ``untie_run`` / ``tie_run``: a new workdir whose head is a copy of the embedding, or whose one
  matrix is the input, output or their mean (``tieflax.model.surgery`` does the arithmetic).
- ``scan_run``: the layers stacked (``scan_layers``) or per layer; the same function.

The run read from is a ``Run.read`` handle (``tieflax.run.read_only``): resolved once by the command, its
record verified when its config is first read, after the destination's checks.

Each writes its destination with ``save_initial_params``, whole or not at all: training there starts from
those parameters at step 0 with a fresh optimizer. ``overrides`` (``--config.a.b=value``) set the new
workdir's training and data settings; model fields the parameters define cannot be overridden.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from tieflax import storage
from tieflax import strict_json as jsonable
from tieflax.config import (apply_override, default_config, default_model_config, model_config,
                            validate_config)
from tieflax.interop.hf import (SIDE_FILES, not_written_by_export, read_hf_config, read_safetensors,
                                save_hf_checkpoint, writing_hf_folder)
from tieflax.interop.hf_config import NOT_IN_CHECKPOINTS, config_from_hf
from tieflax.interop.hf_tokenizer import export_tokenizer_side
from tieflax.interop.hf_weights import params_from_state
from tieflax.model.layer_stacking import to_layout
from tieflax.model.params import abstract_params, count_params
from tieflax.model.surgery import tie, untie
from tieflax.run import checkpoints as ckpt
from tieflax.run.destinations import check_destination as check_safe_destination
from tieflax.run.destinations import (check_empty_or_replaceable, copy_file, copy_tree, inside, real,
                                      writing_new_workdir)
from tieflax.run.layout import (HF_FILES_DIR, IMPORT_SOURCE_FILE, INCOMPLETE_MARKER, LOCK_FILE, TOKENIZER_FILE,
                                RunDir, WorkdirError, is_run)
from tieflax.run.layout import SURGERY_FILE as SURGERY_REPORT
from tieflax.run.read_only import ReadOnlyRun

# What every surgery leaves behind: the new workdir holds parameters only (``initial_params/``), so training
# there starts a new run from them; `tieflax train` says so when it starts.
RESET_BY_SURGERY = ("the step (training restarts at 0), the optimizer state (moments start from zero), the "
                    "learning-rate schedule (warmup again) and the data position (the first batch again)")


def import_hf(hf_dir: str, dest: str, overrides: Sequence[str] = (), *, overwrite: bool = False
              ) -> dict[str, Any]:
    """HF folder -> a new run folder ``dest`` (``--workdir``: a path, checked here) with ``config.json``
    and ``initial_params/``; returns a report.

    The run appears complete or not at all (written beside it, then renamed); a folder that holds
    anything is refused unless ``overwrite``."""
    # The destination's checks return it canonical: the tokenizer path recorded in its config names it so.
    workdir = check_safe_destination(dest, sources=[("--from-hf", hf_dir)], overwrite=overwrite, flag="--workdir")
    check_empty_or_replaceable(workdir, overwrite=overwrite, flag="--workdir")
    imported = config_from_hf(read_hf_config(hf_dir))
    config = default_config()
    config.model = default_model_config(**dataclasses.asdict(imported))
    tokenizer = _use_hf_tokenizer(config, hf_dir, workdir)
    _apply_overrides(config, overrides, imported, "--from-hf")
    validate_config(config)
    mc = model_config(config)
    weights = read_safetensors(hf_dir)
    with writing_new_workdir(workdir, overwrite=overwrite) as partial:
        if tokenizer:
            copy_file(tokenizer, storage.join(partial, TOKENIZER_FILE))
        params = params_from_state(weights, mc)
        ckpt.save_initial_params(partial, config, params)
        copied = _copy_files(hf_dir, storage.join(partial, HF_FILES_DIR), SIDE_FILES)
        # Where the run came from: `convert --to-hf` refuses to write over it (surgery copies the record).
        storage.write_text(storage.join(partial, IMPORT_SOURCE_FILE), json.dumps({"hf_dir": real(hf_dir)}))
    return dict(action="from-hf", source=hf_dir, workdir=workdir,
                family=mc.family, tied=mc.tie_embeddings, params=count_params(abstract_params(mc), mc),
                tokenizer=config.data.tokenizer.path or None, carried_files=copied)


def export_hf(run: ReadOnlyRun, out: str, *, dtype: str | None = None, max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False) -> dict:
    """The latest parameters of ``run`` (``Run.read``) -> an HF folder; returns a report. ``out`` (local, gs:// or s3://)
    must be new or empty; with ``overwrite`` what it holds is replaced whole (locally by a rename, on a
    bucket only an earlier export: a prefix holding other files cannot be replaced whole). Never the
    Hugging Face folder the run was imported from (``imported_from.json``), even with ``overwrite``.
    Every file goes through ``tieflax.storage``, inside ``writing_hf_folder``."""
    workdir = run.path
    out = check_export_destination(run.dir, out, overwrite=overwrite)  # before anything of the run is read
    config = run.config
    params, step = run.params()
    mc = model_config(config)
    with writing_hf_folder(out) as target:
        written = save_hf_checkpoint(target, mc, params, dtype=dtype, max_shard_bytes=max_shard_bytes)
        carried = _copy_files(storage.join(workdir, HF_FILES_DIR), target, SIDE_FILES)
        if not carried and storage.is_file(storage.join(workdir, TOKENIZER_FILE)):
            carried = _copy_files(workdir, target, (TOKENIZER_FILE,))
            carried += export_tokenizer_side(target, config)   # special tokens and ids: lm-eval, generate need them
    return dict(action="to-hf", workdir=workdir, step=step, out=out,
                family=mc.family, tied=mc.tie_embeddings, files=[storage.name(p) for p in written] + carried)


def import_source(run_dir: RunDir) -> str | None:
    """The Hugging Face folder the run ``run_dir`` was imported from (``imported_from.json``), or None."""
    record = run_dir.file(IMPORT_SOURCE_FILE)
    if not storage.is_file(record):
        return None
    try:
        return json.loads(storage.read_text(record))["hf_dir"]
    except (ValueError, KeyError, TypeError):
        raise WorkdirError(f"{record} is damaged (it names the Hugging Face folder this run was imported "
                           "from, which an export must not overwrite): restore it from the import, or delete "
                           "it if that folder no longer matters") from None


def check_export_destination(run_dir: RunDir, out: str, *, overwrite: bool) -> str:
    """Before anything is read: ``out`` is not, does not hold and does not lie inside the run ``run_dir`` or the
    Hugging Face folder the run was imported from (even with ``overwrite``); without ``overwrite`` it is
    new or empty; on a bucket it holds nothing but an earlier export (an interrupted one, behind its
    incomplete marker, is cleared without ``overwrite``). Returns ``out`` canonical, a local link resolved."""
    workdir = run_dir.path
    source = import_source(run_dir)
    if source:
        src, dest = real(source), real(out)
        what = ("is" if dest == src else "holds" if inside(src, dest) else "lies inside" if inside(dest, src)
                else None)
        if what:
            harm = "add files to" if what == "lies inside" else "replace"
            raise WorkdirError(f"--out {out} {what} the Hugging Face folder {src} that the run {workdir} comes "
                               f"from ({IMPORT_SOURCE_FILE}): an export there would {harm} the model it started "
                               "from; export to a new folder" + (" (--overwrite does not change this)"
                                                                 if overwrite else ""))
    out = check_safe_destination(out, sources=[("--workdir", workdir)], overwrite=overwrite)
    if not storage.is_remote(out) and storage.exists(out) and not storage.is_dir(out):
        raise WorkdirError(f"--out {out} is a file, not a folder: export to a new folder")
    if not overwrite and is_run(out):
        raise WorkdirError(f"--out {out} holds a tieflax run: export to a new folder (or pass --overwrite to "
                           "replace it whole, on a local disk)")
    other = not_written_by_export(out)
    if other and (storage.is_remote(out) or not overwrite):
        raise WorkdirError(f"--out {out} holds {other[0]!r}, which an export does not write: export to a new "
                           "folder" + (" or prefix (a prefix cannot be replaced whole: there is no rename)"
                                       if storage.is_remote(out) else ", or pass --overwrite to replace it whole"))
    held = [n for n in storage.listdir(out) if n != LOCK_FILE]
    if held and not overwrite and not (storage.is_remote(out) and INCOMPLETE_MARKER in held):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise WorkdirError(f"--out {out} is not empty ({shown}): pass --overwrite to replace what it holds "
                           "whole, or export to a new folder")
    # A local --out that is a link names the folder it points to: that folder is locked and replaced (the
    # partial folder beside it, on its file system), and the link then names the new export. Replacing the
    # link itself swapped the link away and left this command's lock in the old folder.
    return out if storage.is_remote(out) else real(out)


def untie_run(run: ReadOnlyRun, out: str, overrides: Sequence[str] = (), *, overwrite: bool = False) -> dict:
    """Latest parameters of a tied run -> a new untied workdir whose head is a copy of the embedding."""

    def change(config, params):
        config.model.tie_embeddings = False
        return untie(params), {"discarded": "no parameter (the head starts as an exact copy of the embedding)",
                               "reset": RESET_BY_SURGERY}

    return _surgery(run, out, "untie", change, overrides, overwrite, needs_tied=True)


def tie_run(run: ReadOnlyRun, out: str, source: str, overrides: Sequence[str] = (), *,
            overwrite: bool = False) -> dict:
    """Latest parameters of an untied run -> a new tied workdir keeping ``source`` (input, output, mean)."""

    def change(config, params):
        config.model.tie_embeddings = True
        # These describe an untied head's own init; a tied config must leave them at their defaults.
        config.model.head_init_std, config.model.head_init = 0.0, "normal"
        return tie(params, source)

    return _surgery(run, out, f"tie-{source}", change, overrides, overwrite, needs_tied=False)


def scan_run(run: ReadOnlyRun, out: str, scan: bool, overrides: Sequence[str] = (), *,
             overwrite: bool = False) -> dict:
    """Latest parameters -> a new workdir with the layers stacked (``scan``) or per layer; same function."""

    def change(config, params):
        config.model.scan_layers = scan
        return to_layout(params, model_config(config)), {
            "discarded": "no parameter (the same values, relaid)",
            "reset": RESET_BY_SURGERY}

    return _surgery(run, out, "scan-layers" if scan else "unscan-layers", change, overrides, overwrite)


def _surgery(run: ReadOnlyRun, out: str, action: str, change, overrides: Sequence[str], overwrite: bool,
             needs_tied: bool | None = None) -> dict:
    """The latest parameters of ``run`` (``Run.read``), changed by ``change(config, params) -> (params, report)``,
    written as the new workdir ``out`` (whole or not at all) with the tokenizer, the Hugging Face files and
    the surgery's report; returns the report. ``needs_tied``: the run must be tied (untie) or untied (tie),
    checked on its config before its parameters are read."""
    workdir = run.path
    # Before anything is read: --out must not be, contain or lie inside the source or another run.
    out = check_safe_destination(out, sources=[("--workdir", workdir)], overwrite=overwrite)
    check_empty_or_replaceable(out, overwrite=overwrite)
    config = run.config  # the run verified here, once
    if needs_tied is not None:
        _check_tie(run.dir, config, needs_tied)
    params, step = run.params()
    params, report = change(config, params)
    # The parameters exist already: overrides may change training and data settings, not their shapes.
    _apply_overrides(config, overrides, model_config(config), "--untie/--tie",
                     also_fixed=("vocab_pad_multiple", "scan_layers"))
    validate_config(config)
    _repoint_tokenizer(config, run.dir, out)
    report.setdefault("reset", RESET_BY_SURGERY)
    report = dict(action=action, workdir=workdir, step=step, out=out, **report)
    with writing_new_workdir(out, overwrite=overwrite) as partial:
        ckpt.save_initial_params(partial, config, params)
        for name in (TOKENIZER_FILE, HF_FILES_DIR, IMPORT_SOURCE_FILE):
            src = storage.join(workdir, name)
            if storage.is_file(src):
                storage.write_bytes(storage.join(partial, name), storage.read_bytes(src))
            elif storage.is_dir(src):
                copy_tree(src, storage.join(partial, name))
        storage.write_text(storage.join(partial, SURGERY_REPORT), jsonable.dumps(report, indent=2))
    return report


def _check_tie(run_dir: RunDir, config, needs_tied: bool) -> None:
    """One line when the run ``run_dir`` is already what the surgery would make it (``model.tie_embeddings``)."""
    tied = bool(config.model.tie_embeddings)
    if tied != needs_tied:
        state, flag, other = ("tied", "--tie", "--untie") if tied else ("untied", "--untie", "--tie input|output|mean")
        raise WorkdirError(f"--workdir {run_dir.path} is already {state} (model.tie_embeddings={tied}): {flag} has "
                           f"nothing to do; give it a run that is not {state}, or use {other}")


def _repoint_tokenizer(config, run_dir: RunDir, out: str) -> None:
    """A tokenizer path inside the source run ``run_dir`` becomes the copy in the new one, ``out``."""
    path = config.data.tokenizer.path
    if path and real(path) == real(run_dir.file(TOKENIZER_FILE)):  # the same file, however named
        config.data.tokenizer.path = storage.join(out, TOKENIZER_FILE)


# ------------------------------------------------------------------------------------------------------
def _use_hf_tokenizer(config, hf_dir: str, dest: str) -> str | None:
    """Points the data pipeline at the checkpoint's own tokenizer as it will be copied into the new run
    folder ``dest`` (canonical), if it has one; returns the file to copy (or None)."""
    src = storage.join(hf_dir, "tokenizer.json")
    if not storage.is_file(src):
        return None
    config.data.tokenizer.path = storage.join(dest, TOKENIZER_FILE)  # canonical: import_hf's destination
    tok_config = storage.join(hf_dir, "tokenizer_config.json")
    if storage.is_file(tok_config):
        eos = json.loads(storage.read_text(tok_config)).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and eos:
            config.data.tokenizer.eos_token = eos
    return src


def _apply_overrides(config, overrides: Sequence[str], before, mode: str, also_fixed: Sequence[str] = ()) -> None:
    """Applies ``--config.*`` overrides, refusing any change to a model field the parameters define."""
    for item in overrides:
        apply_override(config, item)
    now = model_config(config)
    changed = sorted(f.name for f in dataclasses.fields(now)
                     if (f.name not in NOT_IN_CHECKPOINTS or f.name in also_fixed)
                     and getattr(now, f.name) != getattr(before, f.name))
    if changed:
        raise SystemExit(f"tieflax convert {mode}: config.model field(s) {changed} are fixed by the parameters "
                         "being converted and cannot be overridden here (change the tie switch with "
                         "--untie / --tie; other fields only with a new model)")


def _copy_files(src_dir: str, dst_dir: str, names: Sequence[str]) -> list[str]:
    """The files ``names`` that ``src_dir`` holds, copied whole into ``dst_dir`` (local or remote)."""
    found = [n for n in names if storage.is_file(storage.join(src_dir, n))]
    for name in found:
        storage.write_bytes(storage.join(dst_dir, name), storage.read_bytes(storage.join(src_dir, name)))
    return found

