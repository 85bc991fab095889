"""Generation: a static key/value cache, one prefill, then a ``lax.while_loop`` of one-token steps.

    gen = Generator(model_config, mesh=None)              # or the run's mesh
    out = gen.generate(params, prompts, max_new_tokens=64, stop_ids=(eos,), temperature=0.0, seed=0)
    out.tokens [B, N] int32 (after a row stops: ``pad_id``), out.lengths [B] (new tokens, the stop included)

Prompts are a list of token lists of any lengths: they are left-padded to the longest (rounded up to a
bucket, so a few shapes serve many batches), each row keeping its own positions 0..len-1, so a row's
tokens do not depend on the other rows or on the batch size. Each row stops at its first stop token (or
after N tokens); the loop ends when every row has stopped.

``generate_recompute`` is the same loop without a cache (every step runs the whole fixed-length sequence
through the training forward pass): the reference the cache is tested against, and the benchmark baseline.

Temperature 0 is greedy (argmax); T > 0 samples from softmax(logits / T) with a PRNG key per step, derived
from ``seed`` only (not from the batch), so a batch's samples are reproducible.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tieflax import sharding as shd
from tieflax.errors import ConfigError
from tieflax.model.config import ModelConfig
from tieflax.model.kv_cache import init_cache
from tieflax.model.layer_stacking import is_stacked, unstack_layers
from tieflax.model.transformer import TransformerLM

Array = jax.Array


class EvalError(ConfigError):
    """Bad input to evaluation or generation (a prompt too long, a batch the mesh cannot split...);
    the message names it and the fix. A ``ConfigError``, so the console prints it as one line."""


@dataclasses.dataclass
class Generated:
    tokens: np.ndarray    # [B, N] int32, pad_id after a row's stop token
    lengths: np.ndarray   # [B] new tokens per row, the stop token included


def bucket(n: int, minimum: int = 16) -> int:
    """n rounded up to a power of two (at least ``minimum``): the padded lengths, few compiled shapes."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """-> (tokens [B, length] int32, valid [B, length] bool), each prompt right-aligned."""
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    valid = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if p:
            tokens[i, length - len(p):] = p
            valid[i, length - len(p):] = True
    return tokens, valid


def positions_of(valid: Array) -> Array:
    """valid [B, T] -> positions [B, T]: 0.. over each row's valid tokens (pads get 0)."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)


def _pick(logits: Array, key: Array, temperature: float) -> Array:
    """logits [B, V_pad] fp32 -> next tokens [B] int32 (padded rows are -inf, never picked)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _is_stop(tokens: Array, stop_ids: tuple[int, ...]) -> Array:
    """tokens [B] -> [B] bool: whether each is one of ``stop_ids`` (a lookup in a [max id + 1] mask, so
    that hundreds of stop ids cost one gather)."""
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    mask = np.zeros(max(stop_ids) + 1, bool)
    mask[list(stop_ids)] = True
    inside = tokens < mask.shape[0]
    return inside & jnp.asarray(mask)[jnp.where(inside, tokens, 0)]


class Generator:
    """Cached and uncached generation for one model config on one mesh (or none).

    The jitted loops are built once per (prompt length, new tokens, temperature, stops) and reused.
    ``params`` may be scanned or per-layer; scanned ones are unstacked once (decode runs layer by layer).
    """

    def __init__(self, config: ModelConfig, mesh: Optional[Mesh] = None, *, max_len: Optional[int] = None,
                 pad_id: int = 0, cache_dtype: Optional[str] = None):
        # Decoding needs neither rematerialisation nor scanned layers; neither changes the parameters.
        self.config = config.replace(scan_layers=False, remat="none", offload_layer_inputs=False)
        self.source_config = config
        self.mesh = mesh
        self.model = TransformerLM(self.config, mesh=mesh)
        self.max_len = max_len or config.max_seq_len
        self.pad_id = pad_id
        self.cache_dtype = jnp.dtype(cache_dtype or config.dtype)
        self._compiled: dict = {}

    # ------------------------------------------------------------------------------------------------
    def layer_params(self, params: dict) -> dict:
        """Per-layer params (unstacks a scanned tree), as decode needs them."""
        params = nn.unbox(params)
        return unstack_layers(params, self.source_config) if is_stacked(params) else params

    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
        """Validates the batch; -> the padded prompt length."""
        if not prompts:
            raise EvalError("generate: no prompts given; pass at least one")
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise EvalError("generate: an empty prompt; every prompt needs at least one token (a BOS token)")
        if longest + max_new_tokens > self.max_len:
            raise EvalError(f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the model's "
                            f"context of {self.max_len} tokens; shorten the prompt or ask for fewer new tokens")
        if self.mesh is not None:
            shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            if len(prompts) % shards:
                raise EvalError(f"a batch of {len(prompts)} sequences does not divide over the mesh's "
                                f"{shards} data x fsdp shards; use a batch size that is a multiple of {shards}")
        length = bucket(longest)
        return length if length + max_new_tokens <= self.max_len else longest

    def generate(self, params: dict, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 stop_ids: Sequence[int] = (), temperature: float = 0.0, seed: int = 0,
                 cached: bool = True) -> Generated:
        """Continues every prompt by up to ``max_new_tokens`` tokens (see the module docstring)."""
        length = self.check(prompts, max_new_tokens)
        tokens, valid = left_pad(prompts, length, self.pad_id)
        stop_ids = tuple(sorted({int(s) for s in stop_ids}))
        key = (length, len(prompts), max_new_tokens, float(temperature), stop_ids, cached)
        if key not in self._compiled:
            loop = _cached_loop if cached else _recompute_loop
            fn = functools.partial(loop, self.model, self.config, max_new_tokens=max_new_tokens,
                                   stop_ids=stop_ids, temperature=float(temperature),
                                   pad_id=self.pad_id, cache_dtype=self.cache_dtype)
            # Replicated results: with several processes each one can read them (tieflax.eval.harness).
            replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
            self._compiled[key] = jax.jit(fn, out_shardings=replicated)
        with self._context():
            tokens, valid = self._place(tokens), self._place(valid)
            rng = jax.random.key(seed)
            if self.mesh is not None:
                rng = jax.device_put(rng, NamedSharding(self.mesh, P()))
            out, lengths = self._compiled[key](self.layer_params(params), tokens, valid, rng)
        return Generated(np.asarray(jax.device_get(out)), np.asarray(jax.device_get(lengths)))

    def _place(self, x: np.ndarray):
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, P(shd.BATCH_AXES)))

    def _context(self):
        import contextlib  # noqa: PLC0415

        stack = contextlib.ExitStack()
        stack.enter_context(nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES))
        if self.mesh is not None:
            stack.enter_context(jax.set_mesh(self.mesh))
        return stack


# ---------------------------------------------------------------------------------------------- loops
def _cached_loop(model: TransformerLM, config: ModelConfig, params: dict, tokens: Array, valid: Array,
                 rng: Array, *, max_new_tokens: int, stop_ids: tuple[int, ...], temperature: float,
                 pad_id: int, cache_dtype) -> tuple[Array, Array]:
    """Prefill [B, P], then one token per step. -> (new tokens [B, N], lengths [B])."""
    b, length = tokens.shape
    cache = init_cache(config, batch=b, slots=length + max_new_tokens, dtype=cache_dtype)
    positions = positions_of(valid)
    variables = {"params": params}
    logits, cache = model.apply(variables, tokens, positions, valid, cache, method="decode")
    first = _pick(logits[:, -1].astype(jnp.float32), jax.random.fold_in(rng, 0), temperature)
    next_position = positions[:, -1] + 1

    def step(tok, position, cache, i):
        logits, cache = model.apply(variables, tok[:, None], position[:, None], jnp.ones((b, 1), bool), cache,
                                    method="decode")
        return _pick(logits[:, 0].astype(jnp.float32), jax.random.fold_in(rng, i + 1), temperature), cache

    return _loop(step, first, next_position, cache, b, max_new_tokens, stop_ids, pad_id)


def _recompute_loop(model: TransformerLM, config: ModelConfig, params: dict, tokens: Array, valid: Array,
                    rng: Array, *, max_new_tokens: int, stop_ids: tuple[int, ...], temperature: float,
                    pad_id: int, cache_dtype) -> tuple[Array, Array]:
    """The same loop with no cache: each step runs the whole [B, P + N] sequence (the training forward,
    pads in their own segment) and reads the logits at the last written position."""
    del cache_dtype
    b, length = tokens.shape
    total = length + max_new_tokens
    seq = jnp.concatenate([tokens, jnp.full((b, max_new_tokens), pad_id, jnp.int32)], axis=1)
    seg = jnp.concatenate([valid, jnp.ones((b, max_new_tokens), bool)], axis=1).astype(jnp.int32)
    # Right of the prompt, positions continue from each row's last one (the appended slots' tokens are
    # filled in as they are generated; causal attention keeps the unfilled ones from mattering).
    positions = jnp.concatenate([positions_of(valid), positions_of(valid)[:, -1:] + 1 +
                                 jnp.arange(max_new_tokens, dtype=jnp.int32)[None]], axis=1)
    variables = {"params": params}

    def forward(seq, at):
        # The whole sequence through the body; the head only at the position read (as a cache-less
        # generator would do: the [B, P + N, V] logits of every position are not needed).
        hidden = model.apply(variables, seq, positions, seg, method="hidden_states")
        hidden = jax.lax.dynamic_slice_in_dim(hidden, at, 1, axis=1)               # [B, 1, d]
        return model.apply(variables, hidden, method=_head_logits)[:, 0].astype(jnp.float32)

    first = _pick(forward(seq, length - 1), jax.random.fold_in(rng, 0), temperature)

    def step(tok, position, seq, i):
        seq = jax.lax.dynamic_update_slice(seq, tok[:, None], (0, length + i))
        return _pick(forward(seq, length + i), jax.random.fold_in(rng, i + 1), temperature), seq

    del total
    return _loop(step, first, positions[:, length], seq, b, max_new_tokens, stop_ids, pad_id)


def _head_logits(model: TransformerLM, hidden: Array) -> Array:
    """hidden [B, t, d] -> logits [B, t, V_pad] as ``TransformerLM.__call__`` makes them (pads -inf)."""
    c = model.config
    logits = model.lm_head(hidden, model.head_bias_or_none())
    return jnp.where(jnp.arange(c.padded_vocab) < c.vocab_size, logits, -jnp.inf)


def _loop(step, first: Array, position: Array, state, b: int, n: int, stop_ids: tuple[int, ...],
          pad_id: int) -> tuple[Array, Array]:
    """The decode loop shared by both paths: record a token per row, stop rows at their stop token,
    end when all rows stopped or n tokens are out. ``step(tok, position, state, i) -> (next, state)``."""
    out = jnp.full((b, n), pad_id, jnp.int32)
    done = jnp.zeros((b,), bool)
    lengths = jnp.zeros((b,), jnp.int32)

    def cond(carry):
        i, _, _, _, _, done, _ = carry
        return (i < n) & ~jnp.all(done)

    def body(carry):
        i, tok, position, state, out, done, lengths = carry
        out = out.at[:, i].set(jnp.where(done, pad_id, tok))
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | _is_stop(tok, stop_ids)
        # The step after the last is not needed; skipping it would cost a cond around the whole model.
        tok, state = step(tok, position, state, i)
        return i + 1, tok, position + 1, state, out, done, lengths

    carry = (jnp.zeros((), jnp.int32), first, position, state, out, done, lengths)
    _, _, _, _, out, _, lengths = jax.lax.while_loop(cond, body, carry)
    return out, lengths
