"""Model FLOPs of a training step, counted analytically from the model's shapes.

The convention, stated once (it is the one MaxText, Megatron-LM and NeMo use, so figures compare):

- A matmul of ``n`` token vectors with a weight of ``a x b`` costs ``2 n a b`` FLOPs forward (one multiply
  and one add per weight per token) and twice that backward (the input's gradient and the weight's), so a
  training step costs **3x the forward**: ``6 N`` per token for the ``N`` weights that multiply tokens.
- Those weights are the attention projections (q, k, v, out), the MLP (2 matrices for GELU, 3 for the
  gated SwiGLU/GeGLU) and the output head ``V x d`` (published ``V``: padded rows are not model work).
  The input lookup is a gather, not a matmul: a tied model's head is counted once, as the head, and an
  untied model's input table not at all, so **tied and untied models cost the same FLOPs**. Biases,
  norms, activations, RoPE, softmax and the optimizer update are not counted (they are O(N) per step or
  O(d) per token, under 1% here).
- Attention's own matmuls (``Q K^T`` and ``P V``) cost ``4 H h`` FLOPs per visible (query, key) pair
  forward (``H`` query heads of width ``h``), x3 for training. A causal sequence of ``T`` tokens has
  ``T^2 / 2`` visible pairs (half the square; the diagonal's extra ``T / 2`` is not counted), a sliding
  window ``w < T`` has ``T w - w^2 / 2``. Per layer and sequence that is ``6 H h T^2`` training FLOPs
  for full causal attention, i.e. ``6 L H h T`` per token over ``L`` layers, which for ``H h = d`` is the
  ``6 L T d`` of the Chinchilla/PaLM-style "12 L T d" with the causal half taken off. Packed documents
  (segment ids) are counted as full sequences.
- Recomputation (remat) is not model work: these are *model* FLOPs, the numerator of MFU. What the
  compiled program actually executes is larger; ``tieflax plan`` shows that factor where XLA reports it.

``maxtext_tflops_per_device`` re-derives MaxText's ``calculate_tflops_training_per_device`` (its
``maxtext_utils.py``) for the dense models here, term by term, so the two counts can be set side by side.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from tieflax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Forward FLOPs of one step by term (all sequences of the step), and the training total (x3).

    ``weights``: per term of the matmuls with learned weights ('qkv', 'attn_out', 'mlp', 'head',
    'embed_proj'); ``attention``: ``Q K^T`` and ``P V`` over the visible pairs.
    """
    tokens: int
    weights: dict
    attention: float

    @property
    def forward(self) -> float:
        return sum(self.weights.values()) + self.attention

    @property
    def train(self) -> float:
        """Model FLOPs of one training step: forward + backward = 3 x forward."""
        return 3.0 * self.forward

    @property
    def train_weights(self) -> float:
        return 3.0 * sum(self.weights.values())

    @property
    def train_attention(self) -> float:
        return 3.0 * self.attention

    def per_device(self, devices: int) -> float:
        """Training FLOPs per device when the step's work is spread evenly over ``devices``."""
        return self.train / devices


def causal_pairs(seq_len: int, window: int = 0) -> float:
    """Visible (query, key) pairs of one causal sequence: T^2/2, or T w - w^2/2 with a window w < T."""
    t = float(seq_len)
    if window and window < seq_len:
        return t * window - window * window / 2.0
    return t * t / 2.0


def step_flops(c: ModelConfig, batch: int, seq_len: int) -> StepFlops:
    """Model FLOPs of one step over ``batch`` sequences of ``seq_len`` tokens (module docstring)."""
    n = batch * seq_len
    d, h, heads, kv = c.d_model, c.dim_per_head, c.n_heads, c.kv_heads
    layers = c.n_layers
    mlp_matrices = 2 if c.mlp == "gelu" else 3
    weights = {
        "qkv": 2.0 * n * d * (heads + 2 * kv) * h * layers,
        "attn_out": 2.0 * n * heads * h * d * layers,
        "mlp": 2.0 * n * d * c.d_ff * mlp_matrices * layers,
        "head": 2.0 * n * (c.embed_dim or d) * c.vocab_size,
    }
    if c.embed_dim:
        # Decoupled width: the input's [E, d] projection per token; the head multiplies by
        # W_E [V, E] @ P [E, d] formed once per step (tieflax.model.embedding.LMHead.weight).
        weights["embed_proj"] = 2.0 * n * c.embed_dim * d + 2.0 * c.vocab_size * c.embed_dim * d
    pairs = sum(causal_pairs(seq_len, c.sliding_window if c.is_local_attention_layer(i) else 0)
                for i in range(layers))
    attention = 4.0 * batch * pairs * heads * h
    return StepFlops(tokens=n, weights=weights, attention=attention)


def throughput(model_flops_per_step: float, seconds_per_step: float, devices: Sequence) -> dict:
    """``{'tflops_per_device': ..., 'mfu': ...}`` of a step that took ``seconds_per_step`` on ``devices``.

    ``mfu`` (model FLOPs utilisation: achieved model FLOP/s over the devices' peak) only where the
    devices' peak is known (``tieflax.hardware.targets.device_peak``); a CPU has none, so no ``mfu``.
    """
    from tieflax.hardware.targets import device_peak  # noqa: PLC0415

    if seconds_per_step <= 0 or not devices:
        return {}
    per_device = model_flops_per_step / len(devices) / seconds_per_step
    out = {"tflops_per_device": per_device / 1e12}
    peak = device_peak(devices[0].device_kind)
    if peak is not None:
        out["mfu"] = per_device / peak.flops
    return out


def step_time_lower_bound(flops_per_device: float, bytes_per_device: float, peak) -> Optional[float]:
    """Seconds one step needs at the least on one device: its model FLOPs at the peak FLOP/s, or its
    HBM traffic at the peak bandwidth, whichever is longer. None without a known peak."""
    if peak is None:
        return None
    return max(flops_per_device / peak.flops, bytes_per_device / peak.hbm_bytes_per_second)


def maxtext_tflops_per_device(c: ModelConfig, per_device_batch: int, seq_len: int,
                              vocab_size: Optional[int] = None) -> dict:
    """MaxText's count (``calculate_tflops_training_per_device``) for a dense model, in TFLOPs per device.

    MaxText counts per device with ``per_device_batch`` sequences: the FFN as ``2 B T f d`` per matrix
    (``len(mlp_activations) + 1`` matrices), q/k/v as ``2 B T d (H + 2 K) h``, the output projection as
    ``2 B T d H h``, the head ("embedding") once as ``2 B T d V`` with its config's ``vocab_size`` (the
    Gemma configs there say 256,128), attention as ``4 B T^2 H h / 2`` per layer; x3 for training. Gemma 2
    (its decoder block is a local + global pair): sliding-window layers as ``4 B T min(w, T) H h / 2``.
    Returns ``{'weights': ..., 'attention': ..., 'total': ...}``.
    """
    b, t, d, h = per_device_batch, seq_len, c.d_model, c.dim_per_head
    ffn = 2.0 * b * t * c.d_ff * d * (2 if c.mlp == "gelu" else 3)
    qkv = 2.0 * b * t * d * (c.n_heads + 2 * c.kv_heads) * h
    proj = 2.0 * b * t * d * c.n_heads * h
    head = 2.0 * b * t * d * (vocab_size or c.vocab_size)
    attention = 0.0
    for i in range(c.n_layers):
        span = min(c.sliding_window, t) if c.is_local_attention_layer(i) else t
        attention += 4.0 * b * t * span * c.n_heads * h / 2.0
    weights = ((ffn + qkv + proj) * c.n_layers + head) * 3 / 1e12
    attention = attention * 3 / 1e12
    return {"weights": weights, "attention": attention, "total": weights + attention}
