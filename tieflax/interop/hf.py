"""Hugging Face checkpoints in and out: ``config.json`` + ``model.safetensors`` (or sharded, with
``model.safetensors.index.json``) for the llama, mistral, qwen2, gemma, gemma2 and gpt2 model types.

    config, params = load_hf_checkpoint("path/to/SmolLM-135M")      # tied: no lm_head.weight
    params = tieflax.model.surgery.untie(params)                   # the head becomes its own copy
    save_hf_checkpoint("out/", config.replace(tie_embeddings=False), params)

Only safetensors are read: pickled ``.bin`` / ``.pt`` weights can run arbitrary code when loaded, so
they are refused with the command that converts them. Neither torch nor transformers is needed here;
``safetensors`` reads and writes numpy arrays (bfloat16 through ml_dtypes).

Imported parameters are unboxed (plain arrays) in ``param_dtype`` (float32 by default, for training);
the vocabulary is padded to V_pad with zero rows, which export drops again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from tieflax import storage
from tieflax.interop.hf_config import config_from_hf, config_to_hf
from tieflax.interop.hf_weights import params_from_state, state_from_params
from tieflax.model.config import ModelConfig
from tieflax.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")
# Files beside the weights that a user wants to travel with them (tokenizer, generation settings).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "merges.txt", "generation_config.json")


class UnsafeCheckpoint(UserError, ValueError):
    """The folder holds pickled weights only; loading pickles can execute code."""


class DamagedCheckpoint(UserError, ValueError):
    """A file of the checkpoint cannot be parsed (truncated, zeroed); the message names it."""


class IncompleteCheckpoint(UserError, ValueError):
    """The folder is an export that is being written or was interrupted; the message names it."""


def read_hf_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder, as a dict."""
    check_complete(path)
    config_path = storage.join(path, CONFIG_FILE)
    if not storage.is_file(config_path):
        _refuse_pickles_only(path)  # the more useful message when only pickled weights are there
        raise FileNotFoundError(f"{path!r} has no {CONFIG_FILE}; pass a Hugging Face checkpoint folder "
                                "(config.json + model.safetensors)")
    try:
        return json.loads(storage.read_text(config_path))
    except json.JSONDecodeError as e:
        raise DamagedCheckpoint(f"{config_path} is not valid JSON (line {e.lineno}: {e.msg}): download or copy the "
                         "checkpoint again") from None


def _refuse_pickles_only(path: str) -> None:
    if storage.is_file(storage.join(path, WEIGHTS_FILE)) or storage.is_file(storage.join(path, INDEX_FILE)):
        return
    pickles = [name for name in _PICKLE_FILES if storage.exists(storage.join(path, name))]
    if pickles:
        raise UnsafeCheckpoint(
            f"{path!r} holds pickled weights ({', '.join(pickles)}), which tieflax refuses to load because "
            "unpickling can run arbitrary code. Convert them once, in an environment you trust, with "
            "transformers: AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, "
            "safe_serialization=True), then import `out`.")


def _open_safetensors(file: str):
    """``safe_open`` naming the file when it is truncated or not a safetensors file at all."""
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415

    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise DamagedCheckpoint(f"{file} is not a readable safetensors file ({e}): it is damaged or incomplete; "
                         "download or copy it again") from None


class SafetensorsFolder(Mapping):
    """A read-only, lazy ``{name: numpy array}`` over a checkpoint's safetensors files: a tensor is read
    (memory-mapped) only when indexed, so importing a large checkpoint never holds all of it twice."""

    def __init__(self, files: dict[str, str], keep_alive: Any = None):
        self._files = files  # tensor name -> local file path
        self._keep_alive = keep_alive  # the temporary folder holding local copies of remote files

    def __getitem__(self, name: str) -> np.ndarray:
        with _open_safetensors(self._files[name]) as f:
            try:
                return f.get_tensor(name)
            except Exception as e:  # noqa: BLE001 (a truncated file fails only when the tensor is read)
                raise DamagedCheckpoint(f"{self._files[name]}: tensor {name!r} cannot be read ({e}): the file is "
                                 "damaged or incomplete; download or copy it again") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def read_safetensors(path: str) -> SafetensorsFolder:
    """All tensors of a checkpoint folder (single file or sharded), lazily, by name."""
    check_complete(path)
    single, index = storage.join(path, WEIGHTS_FILE), storage.join(path, INDEX_FILE)
    if storage.is_file(index):
        weight_map: dict[str, str] = json.loads(storage.read_text(index))["weight_map"]
        files, keep_alive = _local_files(path, {name: shard for name, shard in weight_map.items()})
        for shard in sorted(set(files.values())):
            with _open_safetensors(shard) as f:
                held = set(f.keys())
            missing = sorted(n for n, s in files.items() if s == shard and n not in held)
            if missing:
                raise DamagedCheckpoint(f"{INDEX_FILE} in {path!r} lists tensors that {os.path.basename(shard)} does "
                                 f"not hold: {missing[:8]}")
        return SafetensorsFolder(files, keep_alive)
    if storage.is_file(single):
        files, keep_alive = _local_files(path, {"": WEIGHTS_FILE})
        with _open_safetensors(files[""]) as f:
            return SafetensorsFolder({name: files[""] for name in f.keys()}, keep_alive)
    _refuse_pickles_only(path)
    raise FileNotFoundError(f"{path!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def load_hf_checkpoint(path: str, *, param_dtype: str = "float32",
                       **config_overrides: Any) -> tuple[ModelConfig, dict]:
    """Folder -> (``ModelConfig``, unboxed params). ``config_overrides`` set tieflax-only fields (e.g.
    ``vocab_pad_multiple``, ``dtype``); checkpoint-defined fields come from ``config.json``."""
    config = config_from_hf(read_hf_config(path), param_dtype=param_dtype, **config_overrides)
    return config, params_from_state(read_safetensors(path), config)


def save_hf_checkpoint(path: str, config: ModelConfig, params: Mapping, *, dtype: Optional[str] = None,
                       max_shard_bytes: int = 5 * 2**30, extra_config: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Writes ``config.json`` and safetensors that ``AutoModelForCausalLM.from_pretrained(path)`` reads.

    ``dtype`` ('float32', 'bfloat16', 'float16') defaults to the params' own. Above ``max_shard_bytes``
    the weights are sharded with an index, as transformers does. ``extra_config`` adds keys to
    ``config.json`` (token ids, for instance). Returns the files written.
    """
    import ml_dtypes  # noqa: PLC0415
    from safetensors.numpy import save  # noqa: PLC0415

    np_dtype = {"bfloat16": ml_dtypes.bfloat16, None: None}.get(dtype, dtype)
    state = state_from_params(params, config, dtype=np_dtype)
    dtype_name = dtype or str(next(iter(state.values())).dtype)
    hf_config = {**config_to_hf(config, dtype=dtype_name), **dict(extra_config or {})}
    storage.makedirs(path)
    written = [storage.join(path, CONFIG_FILE)]
    storage.write_text(written[0], json.dumps(hf_config, indent=2, sort_keys=True, allow_nan=False))
    shards = _shard(state, max_shard_bytes)
    metadata = {"format": "pt"}  # transformers checks this key when it loads safetensors
    if len(shards) == 1:
        written.append(storage.join(path, WEIGHTS_FILE))
        storage.write_bytes(written[-1], save(shards[0], metadata=metadata))  # whole, local or remote
        return written
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        storage.write_bytes(storage.join(path, name), save(shard, metadata=metadata))
        weight_map.update({key: name for key in shard})
        written.append(storage.join(path, name))
    total = sum(x.nbytes for x in state.values())
    written.append(storage.join(path, INDEX_FILE))
    storage.write_text(written[-1], json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2, sort_keys=True))
    return written


def _local_files(path: str, names: dict[str, str]) -> tuple[dict[str, str], Any]:
    """``({key: local file}, keep_alive)`` for the files ``names`` (key -> file name) of ``path``: the
    files themselves when local; for a gs:// or s3:// folder, local copies in a temporary folder (kept
    while ``keep_alive`` lives), since safetensors reads a tensor from a memory-mapped local file."""
    if not storage.is_remote(path):
        return {k: os.path.join(path, n) for k, n in names.items()}, None
    tmp = tempfile.TemporaryDirectory(prefix="tieflax-hf-")
    local = {}
    for n in sorted(set(names.values())):
        local[n] = os.path.join(tmp.name, n)
        storage.write_bytes(local[n], storage.read_bytes(storage.join(path, n)))
    return {k: local[n] for k, n in names.items()}, tmp


_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def not_written_by_export(out: str) -> list[str]:
    """Names directly under ``out`` that an HF export does not write (an earlier export, or what an
    interrupted one left, is none of them: a new export replaces those)."""
    from tieflax.run.layout import INCOMPLETE_MARKER, LOCK_FILE  # noqa: PLC0415

    ours = {CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, *SIDE_FILES, INCOMPLETE_MARKER, LOCK_FILE}
    return [n for n in storage.listdir(out) if n not in ours and not _SHARD_FILE.fullmatch(n)]


@contextlib.contextmanager
def writing_hf_folder(out: str, command: str = "convert --to-hf") -> Iterator[str]:
    """Yields the folder to write an HF export into; ``out`` then holds the new export whole, or is
    marked incomplete. Holds ``out``'s lock for the block.

    Local: a partial folder beside ``out``, renamed over it at the end (what an earlier export left is
    replaced whole, so no stale shard survives; swapped in one step where the kernel can, see
    ``publish``). gs:// / s3://: ``out`` itself (no rename there): ``INCOMPLETE_MARKER`` is written
    first, then what an earlier or interrupted export left is deleted, and the marker is deleted last, so
    a reader (``check_complete``) never takes a mix for an export. A failure or SIGTERM removes what the
    block wrote; on a bucket where it was replacing an earlier export (already deleted: there is no
    rename to keep it until the new one is whole) the marker stays, so the prefix reads as an incomplete
    export, never as an empty one; after a kill -9, or such a stop, the next export clears the partial
    folder or the marked prefix.
    """
    from tieflax.run.destinations import fresh_partial_folder, publish  # noqa: PLC0415
    from tieflax.run.layout import INCOMPLETE_MARKER, LOCK_FILE  # noqa: PLC0415
    # workdir_lock_single, not workdir_lock: an export holds no orbax checkpoint, so s3:// is fine.
    from tieflax.run.lock import workdir_lock_single  # noqa: PLC0415

    marker = storage.join(out, INCOMPLETE_MARKER)  # ``out`` canonical: export_hf checked it

    def clear():  # everything under the prefix but this command's lock and the marker
        for p in storage.walk_files(out):
            if p not in (storage.join(out, LOCK_FILE), marker):
                storage.delete(p)

    with workdir_lock_single(out, command):
        if not storage.is_remote(out):
            partial = fresh_partial_folder(out)
            try:
                yield partial
                publish(partial, out, overwrite=True)   # the caller checked what out holds
            except BaseException:
                storage.rmtree(partial)
                raise
            return
        # An earlier export here (not only an interrupted one's marker): a stop after it was deleted must
        # not leave an empty prefix that reads as "nothing was ever here".
        replacing = any(p not in (storage.join(out, LOCK_FILE), marker) for p in storage.walk_files(out))
        # The marker first: from here until it is gone, a reader refuses the prefix (the old export is
        # being deleted, the new one written); a signal never leaves an unmarked mix.
        storage.write_text(marker, f"tieflax {command} is writing this folder; it is complete once this object "
                                   "is gone\n")
        try:
            clear()
            yield out
        except BaseException:
            try:
                clear()
                if not replacing:   # it held nothing: it holds nothing again
                    storage.delete(marker)
            except Exception:  # noqa: BLE001 (the first failure is the one to report; the marker stays)
                pass
            raise   # replacing: the prefix stays marked incomplete, readers refuse it, the rerun clears it
        storage.delete(marker)


def check_complete(path: str) -> None:
    """Refuses a folder an export or import is still writing, or left unfinished: the incomplete marker
    (on a bucket), or a local partial folder (``.<name>.partial-<pid>``)."""
    from tieflax.run.layout import INCOMPLETE_MARKER, PARTIAL_TAG  # noqa: PLC0415

    if storage.is_file(storage.join(path, INCOMPLETE_MARKER)):
        raise IncompleteCheckpoint(f"{path} is an incomplete export ({INCOMPLETE_MARKER} is there: an export into it "
                                   "is running or was interrupted): wait for it, or rerun the export")
    base = storage.name(path.rstrip("/"))
    if base.startswith(".") and re.search(re.escape(PARTIAL_TAG) + r"\d+$", base):
        raise IncompleteCheckpoint(f"{path} is the partial folder of an export or import that did not finish: "
                                   "read the finished folder, or rerun the command that writes it")


def _shard(state: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Greedy, in name order: a new shard starts when the next tensor would overflow this one."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(state):
        x = state[name]
        if shards[-1] and size + x.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    return shards


__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "read_hf_config", "read_safetensors", "SafetensorsFolder",
           "UnsafeCheckpoint", "IncompleteCheckpoint", "check_complete", "SIDE_FILES", "writing_hf_folder", "not_written_by_export"]
