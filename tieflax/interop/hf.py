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

import json
import os
from typing import Any, Iterator, Mapping, Optional

import numpy as np

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


def read_hf_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder, as a dict."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        _refuse_pickles_only(path)  # the more useful message when only pickled weights are there
        raise FileNotFoundError(f"{path!r} has no {CONFIG_FILE}; pass a Hugging Face checkpoint folder "
                                "(config.json + model.safetensors)")
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DamagedCheckpoint(f"{config_path} is not valid JSON (line {e.lineno}: {e.msg}): download or copy the "
                         "checkpoint again") from None


def _refuse_pickles_only(path: str) -> None:
    if os.path.isfile(os.path.join(path, WEIGHTS_FILE)) or os.path.isfile(os.path.join(path, INDEX_FILE)):
        return
    pickles = [name for name in _PICKLE_FILES if os.path.exists(os.path.join(path, name))]
    if pickles:
        raise UnsafeCheckpoint(
            f"{path!r} holds pickled weights ({', '.join(pickles)}), which tieflax refuses to load because "
            "unpickling can run arbitrary code. Convert them once, in an environment you trust, with "
            "transformers: AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, "
            "safe_serialization=True), then import `out`.")


def _open_safetensors(file: str):
    """``safe_open`` naming the file when it is truncated or not a safetensors file at all."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise DamagedCheckpoint(f"{file} is not a readable safetensors file ({e}): it is damaged or incomplete; "
                         "download or copy it again") from None


class SafetensorsFolder(Mapping):
    """A read-only, lazy ``{name: numpy array}`` over a checkpoint's safetensors files: a tensor is read
    (memory-mapped) only when indexed, so importing a large checkpoint never holds all of it twice."""

    def __init__(self, files: dict[str, str]):
        self._files = files  # tensor name -> file path

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
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            with _open_safetensors(shard) as f:
                held = set(f.keys())
            missing = sorted(n for n, s in files.items() if s == shard and n not in held)
            if missing:
                raise ValueError(f"{INDEX_FILE} in {path!r} lists tensors that {os.path.basename(shard)} does "
                                 f"not hold: {missing[:8]}")
        return SafetensorsFolder(files)
    if os.path.isfile(single):
        with _open_safetensors(single) as f:
            return SafetensorsFolder({name: single for name in f.keys()})
    _refuse_pickles_only(path)
    raise FileNotFoundError(f"{path!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def load_hf_checkpoint(path: str, *, param_dtype: str = "float32",
                       **config_overrides: Any) -> tuple[ModelConfig, dict]:
    """Folder -> (``ModelConfig``, unboxed params). ``config_overrides`` set tieflax-only fields (e.g.
    ``vocab_pad_multiple``, ``dtype``); checkpoint-defined fields come from ``config.json``."""
    path = os.path.expanduser(path)
    config = config_from_hf(read_hf_config(path), param_dtype=param_dtype, **config_overrides)
    return config, params_from_state(read_safetensors(path), config)


def save_hf_checkpoint(path: str, config: ModelConfig, params: Mapping, *, dtype: Optional[str] = None,
                       max_shard_bytes: int = 5 * 2**30, extra_config: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Writes ``config.json`` and safetensors that ``AutoModelForCausalLM.from_pretrained(path)`` reads.

    ``dtype`` ('float32', 'bfloat16', 'float16') defaults to the params' own. Above ``max_shard_bytes``
    the weights are sharded with an index, as transformers does. ``extra_config`` adds keys to
    ``config.json`` (token ids, for instance). Returns the files written.
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    path = os.path.expanduser(path)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, None: None}.get(dtype, dtype)
    state = state_from_params(params, config, dtype=np_dtype)
    dtype_name = dtype or str(next(iter(state.values())).dtype)
    hf_config = {**config_to_hf(config, dtype=dtype_name), **dict(extra_config or {})}
    os.makedirs(path, exist_ok=True)
    written = [os.path.join(path, CONFIG_FILE)]
    with open(written[0], "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    shards = _shard(state, max_shard_bytes)
    metadata = {"format": "pt"}  # transformers checks this key when it loads safetensors
    if len(shards) == 1:
        written.append(os.path.join(path, WEIGHTS_FILE))
        save_file(shards[0], written[-1], metadata=metadata)
        return written
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata=metadata)
        weight_map.update({key: name for key in shard})
        written.append(os.path.join(path, name))
    total = sum(x.nbytes for x in state.values())
    written.append(os.path.join(path, INDEX_FILE))
    with open(written[-1], "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return written


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
           "UnsafeCheckpoint", "SIDE_FILES"]
