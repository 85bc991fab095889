"""Tensor names and layouts: a Hugging Face state dict <-> a tieflax parameter tree.

Every tieflax parameter of the config (from ``jax.eval_shape`` of the model's init, so nothing is
guessed) gets exactly one Hugging Face tensor, and the conversion is a transpose and/or reshape:

* ``torch.nn.Linear`` weights are [out, in]; tieflax kernels are [in..., out...]:
  q/k/v ``[d, heads, head_dim]``, attention output ``[heads, head_dim, d]``, MLP ``[in, out]``.
* GPT-2 ``Conv1D`` weights are already [in, out]; its fused ``c_attn`` [d, 3d] splits into q, k, v.
* Embeddings are [V, d] on both sides; tieflax pads rows V..V_pad-1 with zeros (they never receive
  probability mass or gradient) and drops them on export.
* RoPE uses the rotate-half layout on both sides, so q/k weights need no permutation.

A tied checkpoint has no ``lm_head.weight``; an untied one must have it. Scanned models
(``scan_layers``) are imported into and exported from their stacked layout through ``tieflax.model.layer_stacking``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from typing import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tieflax.model.config import ModelConfig
from tieflax.model.layer_stacking import is_stacked, stack_layers, unstack_layers
from tieflax.model.params import abstract_params
from tieflax.errors import UserError

# Non-parameter buffers that some checkpoints carry; they hold nothing a model needs.
_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")


class CheckpointMismatch(UserError, ValueError):
    """The checkpoint's tensors do not match its config (missing, unexpected or wrongly shaped)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: tieflax ``path`` (shape ``shape``) <-> Hugging Face tensor ``name``."""

    path: tuple[str, ...]
    name: str
    shape: tuple[int, ...]
    kind: str         # 'embed' | 'linear' (torch [out, in]) | 'conv1d' ([in, out]) | 'flat'
    in_axes: int = 1  # leading tieflax axes that form the input dimension of a kernel


@functools.lru_cache(maxsize=64)
def parameter_shapes(c: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of every parameter of ``TransformerLM(c)`` in the per-layer layout, computed
    abstractly (cached per config). Scanned models are converted through that layout."""
    tree = nn.unbox(abstract_params(c.replace(scan_layers=False)))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def weight_entries(c: ModelConfig) -> list[Entry]:
    """The name map for ``c``; raises if a tieflax parameter has no Hugging Face counterpart."""
    name_of = _gpt2_name if c.family == "gpt2" else _llama_name
    entries = []
    for path, shape in dict(parameter_shapes(c)).items():
        name = name_of(path, c)
        if name is None:
            raise CheckpointMismatch(f"tieflax parameter {'/'.join(path)} has no Hugging Face {c.family!r} "
                                     "counterpart (was config.model.head_bias set?)")
        leaf = path[-1]
        if leaf == "embedding" and path[0] in ("embed", "lm_head"):
            kind = "embed"
        elif leaf == "kernel":
            kind = "conv1d" if c.family == "gpt2" else "linear"
        else:
            kind = "flat"
        entries.append(Entry(path, name, shape, kind, in_axes=2 if path[-2:-1] == ("out",) else 1))
    return entries


_NORMS_LLAMA = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_NORMS_GEMMA2 = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
_LLAMA_LINEARS = {"query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj",
                  "out": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_GPT2_LINEARS = {"query": "attn.c_attn", "key": "attn.c_attn", "value": "attn.c_attn", "out": "attn.c_proj",
                 "up": "mlp.c_fc", "down": "mlp.c_proj"}
_LEAF = {"scale": "weight", "kernel": "weight", "bias": "bias"}


def _llama_name(path: tuple[str, ...], c: ModelConfig) -> str | None:
    if path == ("embed", "embedding"):
        return "model.embed_tokens.weight"
    if path == ("lm_head", "embedding"):
        return "lm_head.weight"
    if path == ("final_norm", "scale"):
        return "model.norm.weight"
    if path[0].startswith("block_"):
        layer = f"model.layers.{path[0].removeprefix('block_')}."
        norms = _NORMS_GEMMA2 if c.sandwich_norms else _NORMS_LLAMA
        if len(path) == 3 and path[1] in norms:
            return layer + norms[path[1]] + ".weight"
        if len(path) == 4 and path[2] in _LLAMA_LINEARS:
            return layer + _LLAMA_LINEARS[path[2]] + "." + _LEAF[path[3]]
    return None


def _gpt2_name(path: tuple[str, ...], c: ModelConfig) -> str | None:
    del c
    top = {("embed", "embedding"): "transformer.wte.weight", ("position_embedding",): "transformer.wpe.weight",
           ("lm_head", "embedding"): "lm_head.weight", ("final_norm", "scale"): "transformer.ln_f.weight",
           ("final_norm", "bias"): "transformer.ln_f.bias"}
    if path in top:
        return top[path]
    if path[0].startswith("block_"):
        layer = f"transformer.h.{path[0].removeprefix('block_')}."
        norms = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
        if len(path) == 3 and path[1] in norms:
            return layer + norms[path[1]] + "." + _LEAF[path[2]]
        if len(path) == 4 and path[2] in _GPT2_LINEARS:
            suffix = f"#{path[2][0]}" if path[2] in ("query", "key", "value") else ""  # a third of c_attn
            return layer + _GPT2_LINEARS[path[2]] + "." + _LEAF[path[3]] + suffix
    return None


# ------------------------------------------------------------------------------------------------------
# Import
def params_from_state(state: Mapping[str, np.ndarray], c: ModelConfig) -> dict:
    """Hugging Face tensors (numpy, any float dtype) -> unboxed tieflax params in ``c.param_dtype``.

    ``state`` may be lazy (``tieflax.interop.hf.read_safetensors``): each tensor is read once, converted
    and dropped, so peak host memory is the tieflax parameters plus one tensor.
    """
    sources = _source_names(list(state.keys()), c)   # our name -> (checkpoint key, third of c_attn or None)
    entries = weight_entries(c)

    def fetch(name: str) -> np.ndarray:
        key, part = sources[name]
        value = np.asarray(state[key])
        return value if part is None else np.split(value, 3, axis=-1)[part]

    if c.tie_embeddings and "lm_head.weight" in sources:
        del sources["lm_head.weight"]
        embed_name = next(e.name for e in entries if e.path == ("embed", "embedding"))
        if embed_name in sources and not np.array_equal(state["lm_head.weight"], fetch(embed_name)):
            warnings.warn("the checkpoint is tied (tie_word_embeddings) but also holds an lm_head.weight that "
                          "differs from the embedding; like transformers, tieflax ignores lm_head.weight. Set "
                          "tie_word_embeddings=false in config.json to load it as an untied model.")
    expected = {e.name for e in entries}
    missing = sorted(expected - set(sources))
    unexpected = sorted(n for n in set(sources) - expected if not _BUFFERS.search(n))
    if missing or unexpected:
        hint = (" An untied checkpoint needs lm_head.weight; if the model is tied, set tie_word_embeddings=true."
                if "lm_head.weight" in missing else "")
        raise CheckpointMismatch(f"checkpoint tensors do not match its {c.family!r} config: missing "
                                 f"{_short(missing)}, unexpected {_short(unexpected)}.{hint}")
    dtype = jnp.dtype(c.param_dtype)
    params: dict = {}
    for e in entries:
        value = _to_tieflax(fetch(e.name), e, c)
        node = params
        for key in e.path[:-1]:
            node = node.setdefault(key, {})
        node[e.path[-1]] = jnp.asarray(value, dtype)
    return stack_layers(params, c) if c.scan_layers else params


def _source_names(keys: list[str], c: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """Our name for every checkpoint key; GPT-2's fused c_attn appears as three names (#q, #k, #v)."""
    # GPT-2 checkpoints saved from GPT2Model (as the original 'gpt2' is) have no 'transformer.' prefix.
    bare = c.family == "gpt2" and not any(k.startswith("transformer.") for k in keys)
    out: dict[str, tuple[str, int | None]] = {}
    for key in keys:
        name = "transformer." + key if bare and key != "lm_head.weight" else key
        if c.family == "gpt2" and re.search(r"\.attn\.c_attn\.(weight|bias)$", name):
            out.update({f"{name}#{p}": (key, i) for i, p in enumerate("qkv")})
        else:
            out[name] = (key, None)
    return out


def _hf_shape(e: Entry, c: ModelConfig) -> tuple[int, ...]:
    """The shape the Hugging Face tensor of ``e`` has."""
    if e.kind == "embed":
        return (c.vocab_size, e.shape[1])
    n_in, n_out = math.prod(e.shape[:e.in_axes]), math.prod(e.shape[e.in_axes:])
    if e.kind == "linear":
        return (n_out, n_in)
    if e.kind == "conv1d":
        return (n_in, n_out)
    return (math.prod(e.shape),) if e.path[-1] == "bias" else e.shape  # q/k/v biases are [heads * head_dim]


def _to_tieflax(x: np.ndarray, e: Entry, c: ModelConfig) -> np.ndarray:
    want = _hf_shape(e, c)
    if tuple(x.shape) != want:
        raise CheckpointMismatch(f"tensor {e.name} has shape {tuple(x.shape)}; the config implies {want} "
                                 f"(tieflax {'/'.join(e.path)} {e.shape})")
    if e.kind == "embed":
        return np.pad(x, ((0, e.shape[0] - c.vocab_size), (0, 0)))  # padded rows are zeros
    if e.kind == "linear":
        return x.T.reshape(e.shape)
    return x.reshape(e.shape)


# ------------------------------------------------------------------------------------------------------
# Export
def state_from_params(params: Mapping, c: ModelConfig, dtype=None) -> dict[str, np.ndarray]:
    """Unboxed tieflax params -> Hugging Face tensors (numpy, ``dtype`` or the params' own dtype)."""
    params = nn.unbox(params)
    if is_stacked(params):
        params = unstack_layers(params, c)
    state: dict[str, np.ndarray] = {}
    for e in weight_entries(c):
        node = params
        try:
            for key in e.path:
                node = node[key]
        except KeyError:
            raise CheckpointMismatch(f"params have no {'/'.join(e.path)}, which a config with tie_embeddings="
                                     f"{c.tie_embeddings} needs; do params and config match?") from None
        x = np.asarray(jax.device_get(node))
        if x.shape != e.shape:
            raise CheckpointMismatch(f"param {'/'.join(e.path)} has shape {x.shape}; the config implies {e.shape}")
        if dtype is not None:
            x = x.astype(dtype)
        if e.kind == "embed":
            x = x[:c.vocab_size]
        elif e.kind == "linear":
            x = x.reshape(math.prod(e.shape[:e.in_axes]), -1).T
        else:
            x = x.reshape(_hf_shape(e, c))
        state[e.name] = np.ascontiguousarray(x)
    if c.family == "gpt2":
        state = _join_gpt2_qkv(state)
    return state


def _join_gpt2_qkv(state: dict) -> dict:
    out = {k: v for k, v in state.items() if "#" not in k}
    for name in sorted({k.split("#")[0] for k in state if "#" in k}):
        out[name] = np.concatenate([state[f"{name}#{p}"] for p in "qkv"], axis=-1)
    return out


def _short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
