"""Train-step time and compiled memory: tied vs untied, fused vs dense cross-entropy, two vocabularies.

    python benchmarks/train_step.py                       # tiny (V=8,192) and tiny with V=128,256
    python benchmarks/train_step.py --steps 5 --batch 4   # fewer tokens per step for slow machines

Every variant is the real ``tieflax.train`` step (AdamW, clipping, the tied gradient split), compiled
with ``jax.jit`` on this process's devices (one CPU device unless XLA_FLAGS says otherwise):

- ``fused``: ``config.train.loss_impl='fused'``, the blockwise vocabulary-parallel cross-entropy;
- ``dense``: ``loss_impl='dense'``, full fp32 logits [B, T, V] and a log-softmax (the usual baseline).

Reported per variant: median step time over ``--steps`` timed steps (after one warm-up step),
tokens/s, and ``compiled.memory_analysis().temp_size_in_bytes`` (exact, from XLA, no execution).
Ratios are against the tied + fused step of the same vocabulary, measured in the same run.
Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tieflax import sharding as shd
from tieflax.config import load_config
from tieflax.train import BATCH_KEYS, build, make_train_step, setup_mesh

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "experiments",
                    "tiny.py")


def measure(vocab: int, tied: bool, loss_impl: str, args) -> dict:
    config = load_config(TINY, [f"model.vocab_size={vocab}", f"model.tie_embeddings={tied}",
                                f"train.loss_impl='{loss_impl}'", f"train.global_batch_size={args.batch}",
                                "mesh.data=-1"]
                         + [f"train.{k}={v}" for k, v in args.blocks.items()])
    t = config.train
    mesh = setup_mesh(config)
    # As in training (tieflax.train): under the mesh and the rules, the model's sharding constraints apply.
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        step = make_train_step(config, s)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, vocab, size=(t.global_batch_size, t.seq_len + 1), dtype=np.int32)
        shape = (t.global_batch_size, t.seq_len)
        host = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.ones(shape, np.int32),
                "positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), shape)}
        batch = {k: jax.device_put(host[k], shd.batch_sharding(mesh)) for k in BATCH_KEYS}
        abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                          for k, v in batch.items()}
        t0 = time.perf_counter()
        compiled = step.lower(s.abstract_state, abstract_batch).compile()
        compile_s = time.perf_counter() - t0
        temp = compiled.memory_analysis().temp_size_in_bytes
        state = s.init_state(jax.random.key(0))
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return {"vocab": vocab, "tied": tied, "loss": loss_impl, "step_s": median,
            "tokens_per_s": t.global_batch_size * t.seq_len / median, "temp_bytes": int(temp),
            "compile_s": compile_s, "final_loss": float(metrics["loss"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default="8192,128256")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    parser.add_argument("--batch", type=int, default=16, help="sequences of 128 tokens per step")
    parser.add_argument("--token-block", type=int, default=0, help="fused-loss token block (0: default)")
    parser.add_argument("--vocab-block", type=int, default=0, help="fused-loss vocab block (0: default)")
    parser.add_argument("--variants", default="tied-fused,tied-dense,untied-fused,untied-dense")
    args = parser.parse_args()
    args.blocks = {k: v for k, v in (("loss_token_block", args.token_block),
                                     ("loss_vocab_block", args.vocab_block)) if v}
    rows = []
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for variant in args.variants.split(","):
            head, loss_impl = variant.split("-")
            tied = head == "tied"
            rows.append(measure(vocab, tied, loss_impl, args))
            print(f"# measured V={vocab} tied={tied} {loss_impl}: {rows[-1]['step_s']:.3f} s/step",
                  file=sys.stderr, flush=True)
    base = {r["vocab"]: r for r in rows if r["tied"] and r["loss"] == "fused"}
    base = {r["vocab"]: base.get(r["vocab"], r) for r in rows}
    print(f"\njax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}, "
          f"batch {args.batch} x 128 tokens, median of {args.steps} steps\n")
    print("| V | head | loss | step (s) | tokens/s | time / tied-fused | temp MiB | temp / tied-fused |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base[r["vocab"]]
        r["time_ratio"] = r["step_s"] / b["step_s"]
        r["temp_ratio"] = r["temp_bytes"] / max(b["temp_bytes"], 1)
        print(f"| {r['vocab']:,} | {'tied' if r['tied'] else 'untied'} | {r['loss']} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['time_ratio']:.2f} | {r['temp_bytes'] / 2**20:,.1f} | "
              f"{r['temp_ratio']:.2f} |")
    print(json.dumps({"benchmark": "train_step", "batch": args.batch, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    from tieflax.hardware.process import prepare_process

    prepare_process()  # as the tieflax console starts: JAX kept off libtpu where no TPU is attached
    main()
