"""Hugging Face ``config.json`` <-> ``ModelConfig`` for the llama, mistral, qwen2, gemma, gemma2 and gpt2 types.

Reading accepts both the ``transformers`` 4.x layout (``rope_theta``, ``rope_scaling``) and the 5.x one
(``rope_parameters``). A key absent from ``config.json`` takes the default of that model type's
``transformers`` config class (``FAMILY_DEFAULTS``), because ``save_pretrained`` may omit a key equal to
its default: GPT-2 and Gemma checkpoints are tied when ``tie_word_embeddings`` is absent, Llama, Mistral
and Qwen2 are untied.

Any option that would change the model's function and that ``TransformerLM`` does not implement is
refused with an error naming the key, rather than silently ignored. Writing goes the other way and is
checked by reading the result back: a tieflax switch with no counterpart in the target type (a head bias,
a logit scale...) is refused, naming the ``config.model`` field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from tieflax.model.config import ModelConfig
from tieflax.errors import UserError

MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gpt2")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gpt2": "GPT2LMHeadModel"}

# The defaults of transformers' config classes for the keys we read (transformers 4.46 .. 5.x agree).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0,
                  attention_bias=False, mlp_bias=False, max_position_embeddings=2048, initializer_range=0.02),
    "mistral": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0,
                    sliding_window=4096, max_position_embeddings=4096 * 32, initializer_range=0.02),
    "qwen2": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  max_position_embeddings=32768, initializer_range=0.02),
    "gemma": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                  rope_theta=10000.0, attention_bias=False, head_dim=256, max_position_embeddings=8192,
                  initializer_range=0.02),
    "gemma2": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                   rope_theta=10000.0, attention_bias=False, head_dim=256, max_position_embeddings=8192,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, initializer_range=0.02),
    "gpt2": dict(tie_word_embeddings=True, layer_norm_epsilon=1e-5, activation_function="gelu_new",
                 n_inner=None, n_positions=1024, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                 add_cross_attention=False, initializer_range=0.02),
}

# Activations computed as tieflax computes them (tanh-approximated GELU, SiLU). Gemma's legacy "gelu"
# is mapped to the tanh approximation by transformers itself.
_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")

# tieflax fields that only concern initialisation, numerics or memory: a checkpoint does not carry them.
NOT_IN_CHECKPOINTS = ("vocab_pad_multiple", "init_std", "embed_init_std", "head_init_std", "head_init",
                       "head_rng_stream", "logits_fp32", "dtype", "param_dtype", "remat",
                       "scan_layers", "offload_layer_inputs", "mlp_chunk")


class UnsupportedHFConfig(UserError, ValueError):
    """A Hugging Face config uses a model type or an option that tieflax cannot reproduce exactly."""


def _refuse(model_type: str, key: str, value: Any, why: str) -> UnsupportedHFConfig:
    return UnsupportedHFConfig(f"Hugging Face {model_type!r} config has {key}={value!r}: {why}")


# ------------------------------------------------------------------------------------------------------
# Reading
def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """A ``config.json`` dict -> ``ModelConfig``; ``overrides`` set non-checkpoint fields (e.g. param_dtype)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedHFConfig(f"Hugging Face model_type {model_type!r} is not supported; tieflax reads "
                                  f"{MODEL_TYPES}")
    cfg = {**FAMILY_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None or k == "n_inner"}}
    fields = _gpt2_fields(cfg) if model_type == "gpt2" else _rope_family_fields(model_type, cfg)
    fields.update(family=model_type, vocab_size=int(cfg["vocab_size"]),
                  tie_embeddings=bool(cfg["tie_word_embeddings"]),
                  init_std=float(cfg["initializer_range"]), embed_init_std=float(cfg["initializer_range"]))
    fixed = sorted(set(overrides) - set(NOT_IN_CHECKPOINTS))
    if fixed:
        raise UnsupportedHFConfig(f"config.model field(s) {fixed} are defined by the checkpoint's config.json and "
                                  f"cannot be overridden on import; only {NOT_IN_CHECKPOINTS} can (untie or tie "
                                  "afterwards with tieflax.model.surgery)")
    fields.update(overrides)
    return ModelConfig(**fields)


def _gpt2_fields(cfg: dict) -> dict:
    act = cfg["activation_function"]
    if act not in _TANH_GELUS:
        raise _refuse("gpt2", "activation_function", act, f"tieflax's GPT-2 MLP computes the tanh GELU {_TANH_GELUS}")
    for key, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("add_cross_attention", False)):
        if bool(cfg[key]) != supported:
            raise _refuse("gpt2", key, cfg[key], f"only {supported} is supported")
    d = int(cfg["n_embd"])
    return dict(d_model=d, n_layers=int(cfg["n_layer"]), n_heads=int(cfg["n_head"]),
                d_ff=int(cfg["n_inner"] or 4 * d), max_seq_len=int(cfg["n_positions"]), norm="layernorm",
                norm_eps=float(cfg["layer_norm_epsilon"]), mlp="gelu", mlp_bias=True, qkv_bias=True,
                attn_out_bias=True, position="learned")


def _rope_family_fields(model_type: str, cfg: dict) -> dict:
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    act_key = "hidden_activation" if model_type == "gemma2" else "hidden_act"
    act = cfg[act_key]
    gemma = model_type in ("gemma", "gemma2")
    if gemma and act not in _TANH_GELUS + ("gelu",):
        raise _refuse(model_type, act_key, act, f"Gemma MLPs in tieflax use the tanh GELU {_TANH_GELUS}")
    if not gemma and act != "silu":
        raise _refuse(model_type, act_key, act, "tieflax's gated MLP for this type is SwiGLU ('silu')")
    if cfg.get("use_bidirectional_attention"):
        raise _refuse(model_type, "use_bidirectional_attention", True, "tieflax models are causal")
    bias = bool(cfg.get("attention_bias", False))
    fields = dict(
        d_model=d, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or d // heads),
        d_ff=int(cfg["intermediate_size"]), max_seq_len=int(cfg["max_position_embeddings"]), norm="rmsnorm",
        norm_eps=float(cfg["rms_norm_eps"]), mlp="geglu" if gemma else "swiglu",
        mlp_bias=bool(cfg.get("mlp_bias", False)), qkv_bias=bias or model_type == "qwen2",
        attn_out_bias=bias, position="rope", norm_unit_offset=gemma, scale_input_embedding=gemma)
    fields.update(_rope_fields(model_type, cfg))
    fields.update(_window_fields(model_type, cfg))
    if model_type == "gemma2":
        fields.update(sandwich_norms=True, attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                      final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
                      query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]))
    return fields


def _rope_fields(model_type: str, cfg: dict) -> dict:
    params = dict(cfg.get("rope_parameters") or {})   # transformers 5.x
    legacy = dict(cfg.get("rope_scaling") or {})       # transformers 4.x
    theta = float(params.get("rope_theta", cfg["rope_theta"]))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return dict(rope_theta=theta)
    if rope_type != "llama3":
        raise _refuse(model_type, "rope_type", rope_type, "tieflax implements 'default' and 'llama3' RoPE")
    return dict(rope_theta=theta, rope_scaling_factor=float(scaling["factor"]),
                rope_low_freq_factor=float(scaling["low_freq_factor"]),
                rope_high_freq_factor=float(scaling["high_freq_factor"]),
                rope_original_max_len=int(scaling["original_max_position_embeddings"]))


def _window_fields(model_type: str, cfg: dict) -> dict:
    """Sliding-window attention as tieflax states it: a window, local on layers ``i % every == 0``."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if model_type in ("llama", "gemma"):
        return {}
    if model_type == "qwen2" and not cfg["use_sliding_window"]:
        return {}
    if model_type == "mistral":
        return dict(sliding_window=int(window or 0))
    types = cfg.get("layer_types")
    if types is None:
        if model_type == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        else:  # qwen2 with use_sliding_window: layers from max_window_layers on are local
            types = ["sliding_attention" if i >= int(cfg["max_window_layers"]) else "full_attention"
                     for i in range(n)]
    local = [t == "sliding_attention" for t in types]
    if not any(local) or not window:
        return {}
    for every in range(1, n + 1):
        if local == [i % every == 0 for i in range(n)]:
            return dict(sliding_window=int(window), sliding_window_every=every)
    raise _refuse(model_type, "layer_types", types, "tieflax makes layers with i % every == 0 local; this "
                  "pattern of local/global layers is not one of those")


# ------------------------------------------------------------------------------------------------------
# Writing
def config_to_hf(c: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """``ModelConfig`` -> a ``config.json`` dict that ``transformers`` (4.46+ and 5.x) reads.

    Raises ``UnsupportedHFConfig`` naming every ``config.model`` field the target type cannot express.
    """
    if c.family not in MODEL_TYPES:
        raise UnsupportedHFConfig(f"config.model.family={c.family!r} has no Hugging Face model type")
    out: dict[str, Any] = dict(model_type=c.family, architectures=[ARCHITECTURES[c.family]],
                               vocab_size=c.vocab_size, tie_word_embeddings=c.tie_embeddings,
                               initializer_range=c.init_std, dtype=dtype, torch_dtype=dtype)
    out.update(_gpt2_to_hf(c) if c.family == "gpt2" else _rope_family_to_hf(c))
    _check_round_trip(c, out)
    return out


def _gpt2_to_hf(c: ModelConfig) -> dict:
    return dict(n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff,
                n_positions=c.max_seq_len, n_ctx=c.max_seq_len, layer_norm_epsilon=c.norm_eps,
                activation_function="gelu_new", scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                reorder_and_upcast_attn=False, add_cross_attention=False)


def _rope_family_to_hf(c: ModelConfig) -> dict:
    out = dict(hidden_size=c.d_model, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
               num_key_value_heads=c.kv_heads, head_dim=c.dim_per_head, intermediate_size=c.d_ff,
               max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta)
    gemma = c.family in ("gemma", "gemma2")
    out["hidden_activation" if c.family == "gemma2" else "hidden_act"] = "gelu_pytorch_tanh" if gemma else "silu"
    rope = dict(rope_type="default", rope_theta=c.rope_theta)
    if c.rope_scaling_factor:
        rope.update(rope_type="llama3", factor=c.rope_scaling_factor, low_freq_factor=c.rope_low_freq_factor,
                    high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_max_len)
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_parameters"] = rope
    if c.family in ("llama", "gemma", "gemma2"):
        out["attention_bias"] = c.qkv_bias
    if c.family == "llama":
        out["mlp_bias"] = c.mlp_bias
    layer_types = ["sliding_attention" if c.is_local_attention_layer(i) else "full_attention"
                   for i in range(c.n_layers)]
    if c.family == "mistral":
        out["sliding_window"] = c.sliding_window or None
    if c.family == "qwen2":
        out.update(use_sliding_window=bool(c.sliding_window), sliding_window=c.sliding_window or None,
                   max_window_layers=0 if c.sliding_window else c.n_layers, layer_types=layer_types)
    if c.family == "gemma2":
        out.update(sliding_window=c.sliding_window or None, layer_types=layer_types,
                   attn_logit_softcapping=c.attn_softcap or None,
                   final_logit_softcapping=c.final_logit_softcap or None,
                   query_pre_attn_scalar=_int_if_whole(c.query_pre_attn_scalar or c.dim_per_head))
    return out


def _int_if_whole(x: float):
    # transformers 5 validates config types strictly: query_pre_attn_scalar must be an int there.
    return int(x) if float(x).is_integer() else float(x)


def checkpoint_fields(c: ModelConfig) -> dict:
    """The fields of ``c`` that a checkpoint defines, normalised (derived values filled in, unused ones
    dropped): two configs with equal ``checkpoint_fields`` compute the same function."""
    values = dataclasses.asdict(c)
    for name in NOT_IN_CHECKPOINTS:
        values.pop(name)
    if not c.sliding_window:
        values["sliding_window_every"] = 1
    if c.position != "rope":  # RoPE fields mean nothing with learned positions
        for name in ("rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_max_len"):
            values.pop(name)
    elif not c.rope_scaling_factor:
        for name in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"):
            values.pop(name)
    if c.family == "gemma2" and not c.query_pre_attn_scalar:
        values["query_pre_attn_scalar"] = float(c.dim_per_head)
    if c.family not in ("gemma2",) and c.query_pre_attn_scalar == c.dim_per_head:
        values["query_pre_attn_scalar"] = 0.0
    values["n_kv_heads"], values["head_dim"] = c.kv_heads, c.dim_per_head
    return values


def _check_round_trip(c: ModelConfig, hf: dict) -> None:
    try:
        back = config_from_hf(hf)
    except UnsupportedHFConfig as e:
        raise UnsupportedHFConfig(f"config.model cannot be written as a Hugging Face {c.family!r} config: {e}") from None
    want, got = checkpoint_fields(c), checkpoint_fields(back)
    bad = sorted(k for k in want if want[k] != got[k])
    if bad:
        detail = ", ".join(f"{k}={want[k]!r} (a {c.family!r} checkpoint implies {got[k]!r})" for k in bad)
        raise UnsupportedHFConfig(f"config.model has switch(es) a Hugging Face {c.family!r} model cannot express: "
                                  f"{detail}. Set them as the family implies, or keep the checkpoint in tieflax.")
