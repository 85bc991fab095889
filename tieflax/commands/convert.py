"""``tieflax convert``: Hugging Face import/export, and tie/untie surgery on tieflax checkpoints.

    tieflax convert --from-hf DIR --workdir OUT           # HF folder -> a workdir `tieflax train` starts from
    tieflax convert --to-hf --workdir RUN --out DIR       # latest checkpoint -> an HF folder (transformers)
    tieflax convert --untie --workdir RUN --out NEW       # the head becomes its own copy of the embedding
    tieflax convert --tie mean --workdir RUN --out NEW    # keep input, output or their mean; reports the loss
    tieflax convert --unscan-layers --workdir RUN --out NEW   # stacked (scan_layers) -> per-layer params
    tieflax convert --scan-layers --workdir RUN --out NEW     # per-layer -> stacked

Surgery and import write ``NEW``/``OUT`` with ``save_initial_params``: training there starts from those
parameters at step 0 with a fresh optimizer. ``--config.a.b=value`` overrides set the new workdir's
training and data settings (``--config.train.learning_rate=1e-4``); model fields that the checkpoint
defines cannot be overridden (use --untie/--tie for the tie switch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from typing import Any, Sequence

HELP = "Hugging Face import/export, tie/untie surgery and scanned/per-layer layouts of checkpoints"
HF_FILES_DIR = "hf_files"      # tokenizer and generation files carried from an imported HF folder
SURGERY_REPORT = "surgery.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-hf", metavar="DIR", help="import a Hugging Face folder (config.json + safetensors)")
    mode.add_argument("--to-hf", action="store_true", help="export --workdir's latest parameters to --out")
    mode.add_argument("--untie", action="store_true", help="untie --workdir's model into --out")
    mode.add_argument("--tie", choices=("input", "output", "mean"),
                      help="tie --workdir's model into --out, keeping this matrix")
    mode.add_argument("--scan-layers", action="store_true", help="stack --workdir's layers (scan_layers) into --out")
    mode.add_argument("--unscan-layers", action="store_true", help="unstack --workdir's layers into --out")
    parser.add_argument("--workdir", required=True, help="the tieflax workdir to write (--from-hf) or read")
    parser.add_argument("--out", help="output folder: the HF folder (--to-hf) or the new workdir (surgery)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="--to-hf: tensor dtype to write (default: the parameters' own)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="--to-hf: shard above this size")


def run(args: argparse.Namespace) -> int:
    overrides = list(getattr(args, "overrides", []) or [])
    if args.from_hf:
        report = import_hf(args.from_hf, args.workdir, overrides)
    else:
        if not args.out:
            raise SystemExit("tieflax convert: --out is required with --to-hf, --untie, --tie and "
                             "--scan-layers/--unscan-layers")
        if args.to_hf:
            report = export_hf(args.workdir, args.out, dtype=args.dtype,
                               max_shard_bytes=int(args.max_shard_gb * 2**30))
        elif args.untie:
            report = untie_workdir(args.workdir, args.out, overrides)
        elif args.scan_layers or args.unscan_layers:
            report = scan_workdir(args.workdir, args.out, args.scan_layers, overrides)
        else:
            report = tie_workdir(args.workdir, args.out, args.tie, overrides)
    print(json.dumps(report, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------------
def import_hf(hf_dir: str, workdir: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """HF folder -> a workdir with ``config.json`` and ``initial_params/``; returns a report."""
    from tieflax import checkpoint as ckpt
    from tieflax.model.params import count_params, abstract_params
    from tieflax.config import default_config, default_model_config, model_config
    from tieflax.interop.hf import SIDE_FILES, read_hf_config, read_safetensors
    from tieflax.interop.hf_config import config_from_hf
    from tieflax.interop.hf_weights import params_from_state

    imported = config_from_hf(read_hf_config(hf_dir))
    config = default_config()
    config.model = default_model_config(**dataclasses.asdict(imported))
    _use_hf_tokenizer(config, hf_dir, workdir)
    _apply_overrides(config, overrides, imported, "--from-hf")
    mc = model_config(config)
    params = params_from_state(read_safetensors(hf_dir), mc)
    ckpt.save_initial_params(workdir, config, params)
    copied = _copy_files(hf_dir, os.path.join(workdir, HF_FILES_DIR), SIDE_FILES)
    return dict(action="from-hf", source=os.path.abspath(hf_dir), workdir=os.path.abspath(workdir),
                family=mc.family, tied=mc.tie_embeddings, params=count_params(abstract_params(mc), mc),
                tokenizer=config.data.tokenizer.path or None, carried_files=copied)


def export_hf(workdir: str, out: str, *, dtype: str | None = None, max_shard_bytes: int = 5 * 2**30) -> dict:
    """The workdir's latest parameters -> an HF folder; returns a report."""
    from tieflax import checkpoint as ckpt
    from tieflax.config import model_config
    from tieflax.interop.hf import SIDE_FILES, save_hf_checkpoint

    config, params, step = ckpt.load_latest_params(workdir)
    mc = model_config(config)
    written = save_hf_checkpoint(out, mc, params, dtype=dtype, max_shard_bytes=max_shard_bytes)
    carried = _copy_files(os.path.join(workdir, HF_FILES_DIR), out, SIDE_FILES)
    if not carried and os.path.isfile(os.path.join(workdir, "tokenizer.json")):
        carried = _copy_files(workdir, out, ("tokenizer.json",))
    return dict(action="to-hf", workdir=os.path.abspath(workdir), step=step, out=os.path.abspath(out),
                family=mc.family, tied=mc.tie_embeddings, files=[os.path.basename(p) for p in written] + carried)


def untie_workdir(workdir: str, out: str, overrides: Sequence[str] = ()) -> dict:
    """Latest parameters of a tied run -> a new untied workdir whose head is a copy of the embedding."""
    from tieflax.model.surgery import untie

    def change(config, params):
        config.model.tie_embeddings = False
        return untie(params), {"discarded": "nothing (the head starts as an exact copy of the embedding)"}

    return _surgery(workdir, out, "untie", change, overrides)


def tie_workdir(workdir: str, out: str, source: str, overrides: Sequence[str] = ()) -> dict:
    """Latest parameters of an untied run -> a new tied workdir keeping ``source`` (input, output, mean)."""
    from tieflax.model.surgery import tie

    def change(config, params):
        config.model.tie_embeddings = True
        # These describe an untied head's own init; a tied config must leave them at their defaults.
        config.model.head_init_std, config.model.head_init = 0.0, "normal"
        return tie(params, source)

    return _surgery(workdir, out, f"tie-{source}", change, overrides)


def scan_workdir(workdir: str, out: str, scan: bool, overrides: Sequence[str] = ()) -> dict:
    """Latest parameters -> a new workdir with the layers stacked (``scan``) or per layer; same function."""
    from tieflax.config import model_config
    from tieflax.model.layout import to_layout

    def change(config, params):
        config.model.scan_layers = scan
        return to_layout(params, model_config(config)), {"discarded": "nothing (the same values, relaid)"}

    return _surgery(workdir, out, "scan-layers" if scan else "unscan-layers", change, overrides)


def _surgery(workdir: str, out: str, action: str, change, overrides: Sequence[str]) -> dict:
    from tieflax import checkpoint as ckpt
    from tieflax.config import model_config

    if os.path.abspath(out) == os.path.abspath(workdir):
        raise SystemExit("tieflax convert: --out must be a new workdir, not --workdir itself (the run "
                         "there would resume its own checkpoints)")
    config, params, step = ckpt.load_latest_params(workdir)
    params, report = change(config, params)
    # The parameters exist already: overrides may change training and data settings, not their shapes.
    _apply_overrides(config, overrides, model_config(config), "--untie/--tie",
                     also_fixed=("vocab_pad_multiple", "scan_layers"))
    ckpt.save_initial_params(out, config, params)
    for name in ("tokenizer.json", HF_FILES_DIR):
        src = os.path.join(workdir, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(out, name), dirs_exist_ok=True)
        elif os.path.isfile(src):
            shutil.copy2(src, os.path.join(out, name))
    report = dict(action=action, workdir=os.path.abspath(workdir), step=step, out=os.path.abspath(out), **report)
    with open(os.path.join(out, SURGERY_REPORT), "w") as f:
        json.dump(report, f, indent=2)
    return report


# ------------------------------------------------------------------------------------------------------
def _use_hf_tokenizer(config, hf_dir: str, workdir: str) -> None:
    """Points the data pipeline at the checkpoint's own tokenizer (copied into the workdir), if it has one."""
    src = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(src):
        return
    os.makedirs(workdir, exist_ok=True)
    dst = os.path.abspath(os.path.join(workdir, "tokenizer.json"))
    shutil.copy2(src, dst)
    config.data.tokenizer.path = dst
    tok_config = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.isfile(tok_config):
        with open(tok_config) as f:
            eos = json.load(f).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and eos:
            config.data.tokenizer.eos_token = eos


def _apply_overrides(config, overrides: Sequence[str], before, mode: str, also_fixed: Sequence[str] = ()) -> None:
    """Applies ``--config.*`` overrides, refusing any change to a model field the parameters define."""
    from tieflax.config import apply_override, model_config
    from tieflax.interop.hf_config import NOT_IN_CHECKPOINTS

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
    found = [n for n in names if os.path.isfile(os.path.join(src_dir, n))]
    if found:
        os.makedirs(dst_dir, exist_ok=True)
    for name in found:
        shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return found


__all__ = ["import_hf", "export_hf", "untie_workdir", "tie_workdir", "scan_workdir"]
