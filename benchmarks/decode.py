"""Decode throughput: generation with the static KV cache against recomputing the whole prefix each step.

Both loops are ``tieflax.eval.decode.Generator`` (``cached=True`` / ``cached=False``): the same prompts,
the same ``lax.while_loop``, greedy, no stop token (every row produces all N tokens). The uncached loop
runs the training forward over the whole fixed-length [B, P + N] sequence at every step, which is what a
model without a cache has to do. Times are medians of interleaved repetitions after a compile run, in one
process, and the two loops' tokens are checked equal.

    python benchmarks/decode.py                       # CPU-sized default (a Llama-style 4 x 256 model)
    python benchmarks/decode.py --d-model 1024 --layers 8 --prompt 512 --new 256 --batch 8   # accelerator
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tieflax.eval.decode import Generator
from tieflax.model import ModelConfig, TransformerLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=128, help="new tokens per row")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    c = ModelConfig(family="llama", vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 64), n_kv_heads=max(1, args.d_model // 256), d_ff=4 * args.d_model,
                    max_seq_len=args.prompt + args.new, tie_embeddings=True, dtype=args.dtype, attention="xla")
    params = nn.unbox(TransformerLM(c).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, args.vocab, args.prompt)) for _ in range(args.batch)]
    gen = Generator(c)

    def run(cached: bool):
        start = time.perf_counter()
        out = gen.generate(params, prompts, max_new_tokens=args.new, cached=cached)
        return time.perf_counter() - start, out.tokens

    first = {cached: run(cached) for cached in (True, False)}   # compiles
    assert (first[True][1] == first[False][1]).all(), "cached and recomputed tokens differ"
    times = {True: [], False: []}
    for _ in range(args.reps):
        for cached in (True, False):
            times[cached].append(run(cached)[0])
    tokens = args.batch * args.new
    rows = {name: statistics.median(times[cached]) for name, cached in (("kv_cache", True), ("recompute", False))}
    print(f"{'loop':<10} {'median s':>9} {'tokens/s':>10}   (B={args.batch}, prompt={args.prompt}, "
          f"new={args.new}, d={args.d_model}, L={args.layers}, V={args.vocab}, {args.dtype}, "
          f"{jax.devices()[0].platform})")
    for name, seconds in rows.items():
        print(f"{name:<10} {seconds:>9.3f} {tokens / seconds:>10.1f}")
    speedup = rows["recompute"] / rows["kv_cache"]
    print(f"speed-up of the cache: {speedup:.2f}x")
    print(json.dumps({"benchmark": "decode", "platform": jax.devices()[0].platform, **vars(args),
                      "kv_cache_s": rows["kv_cache"], "recompute_s": rows["recompute"],
                      "kv_cache_tokens_per_s": tokens / rows["kv_cache"],
                      "recompute_tokens_per_s": tokens / rows["recompute"], "speedup": speedup,
                      "same_tokens": True}))


if __name__ == "__main__":
    from tieflax.hardware.process import prepare_process

    prepare_process()  # as the tieflax console starts: JAX kept off libtpu where no TPU is attached
    main()
