"""The model's configuration: one frozen dataclass that covers GPT-2, Llama/Mistral, Gemma, Gemma 2 and Qwen2.

Every field is an explicit switch. ``family`` is a label that validation checks and reports use; it never
changes behaviour behind the user's back, so a config file states every knob its family needs. The
tie switch is ``tie_embeddings`` and nothing else reads it except the LM head and parameter accounting.

One section of the experiment config (loaded by ``tieflax.config``; the data's section is
``tieflax.data.config``). Configs are written as ``ml_collections.ConfigDict`` (see ``configs/models/``);
``ModelConfig.from_dict`` turns ``config.model`` into this hashable dataclass, validating every field with
an error that names it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from tieflax.config_rules import Range, check_section
from tieflax.errors import ConfigError

FAMILIES = ("gpt2", "llama", "mistral", "gemma", "gemma2", "qwen2")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "geglu")
POSITIONS = ("learned", "rope")
DTYPES = ("float32", "bfloat16", "float16")
HEAD_INITS = ("normal", "copy_embed")
ATTENTIONS = ("auto", "xla", "splash", "cudnn")  # tieflax.ops.attention.IMPLEMENTATIONS
# Rematerialisation policies, by the names pod training code uses (see ``tieflax.model.remat``).
REMAT_POLICIES = ("none", "full", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only transformer LM.

    Zero means "off" or "derive" for the optional numeric fields (documented per field), which keeps every
    field a plain number that command-line overrides (``--config.model.X=...``) can set.
    """

    family: str = "llama"
    vocab_size: int = 32000               # published V (tokens that exist)
    vocab_pad_multiple: int = 128         # V_pad rounds V up to this (x vocab shards in training)
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 0                   # 0 -> n_heads (multi-head); < n_heads -> GQA/MQA
    head_dim: int = 0                     # 0 -> d_model // n_heads (Gemma sets it explicitly)
    d_ff: int = 2048
    max_seq_len: int = 2048               # learned positions table size; RoPE ignores it

    # Body.
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False        # Gemma: scale by (1 + w), w initialised at 0
    sandwich_norms: bool = False          # Gemma 2: extra norms after attention and after the MLP
    mlp: str = "swiglu"
    mlp_bias: bool = False
    qkv_bias: bool = False                # Qwen2, GPT-2
    attn_out_bias: bool = False           # GPT-2
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0      # 0 -> none; > 0 -> llama3-style frequency scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    attn_softcap: float = 0.0             # Gemma 2 attention-logit soft-cap; 0 -> off
    query_pre_attn_scalar: float = 0.0    # Gemma 2 query scale 1/sqrt(this); 0 -> head_dim
    sliding_window: int = 0               # 0 -> full causal attention
    sliding_window_every: int = 1         # local attention on layers i % every == 0 (Gemma 2: 2)
    init_std: float = 0.02                # body kernels

    # The tie switch, and the study switches that apply identically whether tied or not.
    tie_embeddings: bool = False
    scale_input_embedding: bool = False   # x sqrt(d_model) after the lookup (Gemma)
    logit_scale: float = 1.0              # multiplies the logits
    logit_scale_rsqrt_d: bool = False     # also x 1/sqrt(d_model) (T5 / lm1b tied heads)
    final_logit_softcap: float = 0.0      # Gemma 2 cap * tanh(logits / cap); 0 -> off
    head_bias: bool = False               # a [V_pad] logit bias, its own parameter either way
    embed_init_std: float = 0.02
    head_init_std: float = 0.0            # untied head's std; 0 -> embed_init_std
    head_init: str = "normal"             # untied head: 'normal' or 'copy_embed' (starts equal)
    head_rng_stream: str = "params"       # PRNG stream the untied head draws from
    embed_dim: int = 0                    # >0: V x embed_dim embeddings, projected to/from d_model (Chung et al.)
    logits_fp32: bool = True              # compute logits (and the loss) in float32

    # Numerics and memory.
    dtype: str = "float32"                # activations / compute
    param_dtype: str = "float32"
    attention: str = "auto"               # kernel: 'xla' (einsum), 'splash' (TPU), 'cudnn' (GPU), 'auto'
    remat: str = "none"                   # what the backward pass recomputes: REMAT_POLICIES (True = 'full')
    scan_layers: bool = False             # nn.scan over the blocks: stacked params, one compiled layer
    offload_layer_inputs: bool = False    # keep each block's saved input in host memory (needs remat)
    mlp_chunk: int = 0                    # >0: the MLP runs over this many tokens per device at a time

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Builds and validates from ``config.model`` (a ConfigDict or dict); unknown keys are errors."""
        values = dict(values.to_dict() if hasattr(values, "to_dict") else values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"config.model has unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def __post_init__(self):
        # Configs and checkpoints written when remat was a switch say True/False: the same as full/none.
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", remat_name(self.remat))
        _validate(self)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # Derived quantities ---------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """V_pad: V rounded up to ``vocab_pad_multiple``. Rows >= V are never used or counted."""
        m = self.vocab_pad_multiple
        return int(math.ceil(self.vocab_size / m) * m)

    @property
    def effective_logit_scale(self) -> float:
        return self.logit_scale * (self.d_model ** -0.5 if self.logit_scale_rsqrt_d else 1.0)

    @property
    def effective_head_init_std(self) -> float:
        return self.head_init_std or self.embed_init_std

    def is_local_attention_layer(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer % self.sliding_window_every == 0

    @property
    def layers_per_scan_step(self) -> int:
        """Layers in one scanned step: the local/global attention period (Gemma 2: a pair), else 1."""
        return self.sliding_window_every if self.sliding_window else 1


def remat_name(value: Any) -> Any:
    """The policy name of a ``remat`` value: True -> 'full', False -> 'none', names unchanged."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value


# The fields' rules as tables, checked by ``tieflax.config_rules.check_section`` as every section's are
# (``config.train``, ``config.data``); what a table cannot say, the fields that must fit together, is
# ``_fits_together`` below.
_POSITIVE = "a positive size or count"
RANGES = {
    **{name: Range(1, why=_POSITIVE) for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff",
                                                  "max_seq_len", "vocab_pad_multiple", "rope_original_max_len",
                                                  "sliding_window_every")},
    "n_kv_heads": Range(0, why="0 means n_heads"),
    "head_dim": Range(0, why="0 means d_model // n_heads"),
    "sliding_window": Range(0, why="0 means full causal attention"),
    "embed_dim": Range(0, why="0 means embeddings of width d_model"),
    "mlp_chunk": Range(0, why="tokens per device the MLP takes at a time; 0 means the whole sequence at once"),
    **{name: Range(0.0, why="0 means off") for name in ("attn_softcap", "final_logit_softcap",
                                                        "query_pre_attn_scalar", "rope_scaling_factor",
                                                        "head_init_std")},
    "norm_eps": Range(0.0, lo_ok=False, why="the norm's epsilon"),
    "logit_scale": Range(0.0, lo_ok=False, why="multiplies the logits"),
    "embed_init_std": Range(0.0, lo_ok=False, why="the embedding's initial standard deviation"),
}
CHOICES = {
    "family": FAMILIES, "norm": NORMS, "mlp": MLPS, "position": POSITIONS, "head_init": HEAD_INITS,
    "dtype": DTYPES, "param_dtype": DTYPES, "attention": ATTENTIONS,
    "remat": REMAT_POLICIES,   # True and False read as 'full' and 'none' before this (remat_name)
    "scan_layers": (True, False), "offload_layer_inputs": (True, False),
}


def _check(ok: bool, field: str, message: str):
    if not ok:
        raise ConfigError(f"config.model.{field}: {message}")


def _validate(c: ModelConfig):
    check_section("config.model", {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}, RANGES, CHOICES)
    _fits_together(c)


def _fits_together(c: ModelConfig):
    """The rules over several fields, each refused in one line naming the field to change."""
    if not c.head_dim:
        _check(c.d_model % c.n_heads == 0, "n_heads",
               f"n_heads={c.n_heads} does not divide d_model={c.d_model}; change one, or set head_dim")
    _check(c.n_heads % c.kv_heads == 0, "n_kv_heads",
           f"n_kv_heads={c.kv_heads} must divide n_heads={c.n_heads}")
    _check(c.position == "rope" or not c.rope_scaling_factor, "rope_scaling_factor",
           "rope scaling needs position='rope'")
    _check(c.dim_per_head % 2 == 0 or c.position != "rope", "head_dim",
           f"RoPE needs an even head dimension, got {c.dim_per_head}")
    if c.attention == "cudnn":
        from tieflax.ops.cudnn_attention import unsupported_reason  # noqa: PLC0415 (imports jax)

        reason = unsupported_reason(dtype=c.dtype, head_dim=c.dim_per_head, softcap=c.attn_softcap)
        if reason:
            field, why = reason
            raise ConfigError(f"config.model.attention: 'cudnn' cannot run this model: {why} "
                              f"(config.model.{field}); use 'auto' (picks cuDNN where it can) or 'xla'")
    _check(not c.offload_layer_inputs or c.remat != "none", "offload_layer_inputs",
           "offloads what the backward pass saves of each block, so it needs rematerialisation: set "
           "config.model.remat (e.g. 'full') or drop offload_layer_inputs")
    if c.scan_layers:
        _check(c.n_layers % c.layers_per_scan_step == 0, "n_layers",
               f"{c.n_layers} layers cannot be scanned in steps of {c.layers_per_scan_step} (the local/global "
               f"attention period, sliding_window_every); use a multiple of {c.layers_per_scan_step}, or set "
               "config.model.scan_layers=False")
    if c.tie_embeddings:
        # These only describe an untied head's own matrix; silently ignoring them would hide a typo'd run.
        _check(not c.head_init_std, "head_init_std",
               "has no effect with tie_embeddings=True (the head is the embedding); set it to 0")
        _check(c.head_init == "normal", "head_init",
               "has no effect with tie_embeddings=True (the head is the embedding); use 'normal'")
