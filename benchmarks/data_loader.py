"""Loader throughput against what a training step of ``configs/experiments/tiny.py`` consumes.

    python benchmarks/data_loader.py                  # default: tiny experiment shapes, KJV corpus
    python benchmarks/data_loader.py --batches 3000 --repeats 5

Measures, in one run on the same machine:

1. ``fresh build``: ``prepare_dataset`` of the default corpus in an empty workdir (tokenizer training,
   tokenising, counts): the "fresh machine, no network" cost.
2. ``loader``: tokens/s of ``make_loader`` alone (median of repeats, after a warm-up).
3. ``step``: tokens/s one jitted train step consumes: the tiny ``TransformerLM`` (tieflax.model),
   dense logits, ``optax.softmax_cross_entropy_with_integer_labels`` over targets >= 0, adam.
4. ``step + loader``: the same steps fed by the live loader (its threads compete with XLA for the
   cores), so the overhead the loader adds to a real loop is visible.

Wall-clock rates depend on what else runs on the machine; the per-CPU-second rates (process time of
all threads) compare the two costs more robustly on a shared machine. Prints a table and one JSON line. The loader must deliver at least 10x what the step consumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from tieflax.config import load_config, model_config
from tieflax.data import make_loader, prepare_dataset
from tieflax.model import TransformerLM

ROOT = Path(__file__).resolve().parents[1]


def time_loader(prepared, seq_len, batch, batches, repeats):
    """Median tokens per wall-second and per CPU-second (all threads; robust on a shared machine)."""
    rates, cpu_rates = [], []
    for r in range(repeats):
        it = make_loader(prepared, "train", seq_len=seq_len, global_batch_size=batch, seed=r)
        for _ in range(20):  # warm-up: thread pool start, first reads
            next(it)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(it)
        rates.append(batches * batch * seq_len / (time.perf_counter() - t0))
        cpu_rates.append(batches * batch * seq_len / (time.process_time() - c0))
    return statistics.median(rates), statistics.median(cpu_rates)


def make_step(cfg):
    model = TransformerLM(model_config(cfg))
    tx = optax.adam(cfg.train.get("learning_rate", 1e-3) if "train" in cfg else 1e-3)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"], batch["positions"],
                             batch["segment_ids"]).astype(jnp.float32)
        valid = batch["targets"] >= 0
        per_token = optax.softmax_cross_entropy_with_integer_labels(
            jnp.where(jnp.isfinite(logits), logits, -1e30), jnp.where(valid, batch["targets"], 0))
        return jnp.sum(per_token * valid) / jnp.maximum(valid.sum(), 1)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, tx, step


def time_steps(step, params, opt_state, batches_fn, n):
    """Median wall seconds per step, CPU seconds per step (all threads), final loss."""
    times, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        batch = batches_fn()
        params, opt_state, loss = step(params, opt_state, batch)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu), float(loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/experiments/tiny.py"))
    ap.add_argument("--batches", type=int, default=2000, help="loader batches per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed train steps")
    args = ap.parse_args()

    cfg = load_config(args.config)
    seq_len, batch = cfg.train.seq_len, cfg.train.global_batch_size
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        prepared = prepare_dataset(cfg.data, workdir, vocab_size=cfg.model.vocab_size)
        build_s = time.perf_counter() - t0

        loader_tps, loader_cpu_tps = time_loader(prepared, seq_len, batch, args.batches, args.repeats)

        model, tx, step = make_step(cfg)
        first = next(make_loader(prepared, "train", seq_len=seq_len, global_batch_size=batch, seed=0))
        fixed = jax.device_put(first)
        params = model.init(jax.random.key(0), fixed["inputs"])["params"]
        opt_state = tx.init(params)
        params, opt_state, _ = step(params, opt_state, fixed)  # compile
        step_s, step_cpu_s, _ = time_steps(step, params, opt_state, lambda: fixed, args.steps)
        live = make_loader(prepared, "train", seq_len=seq_len, global_batch_size=batch, seed=1)
        for _ in range(5):
            next(live)
        fed_s, _, loss = time_steps(step, params, opt_state, lambda: jax.device_put(next(live)),
                                 args.steps)

    tokens = batch * seq_len
    step_tps, fed_tps, step_cpu_tps = tokens / step_s, tokens / fed_s, tokens / step_cpu_s
    rows = [
        ("fresh build of the default dataset", f"{build_s:.1f} s"),
        ("loader alone", f"{loader_tps:,.0f} tokens/s"),
        ("train step (fixed batch)", f"{step_s * 1e3:.1f} ms = {step_tps:,.0f} tokens/s"),
        ("train step fed by the loader", f"{fed_s * 1e3:.1f} ms = {fed_tps:,.0f} tokens/s"),
        ("loader / step consumption", f"{loader_tps / step_tps:.1f}x (must be >= 10x)"),
        ("per CPU-second: loader / step", f"{loader_cpu_tps:,.0f} / {step_cpu_tps:,.0f} tokens = "
                                          f"{loader_cpu_tps / step_cpu_tps:.1f}x"),
    ]
    print(f"tiny experiment: batch {batch} x seq {seq_len}, vocab {cfg.model.vocab_size}, "
          f"{jax.device_count()} {jax.default_backend()} device(s)")
    for name, value in rows:
        print(f"  {name:<38} {value}")
    print(json.dumps({"benchmark": "data_loader", "build_s": round(build_s, 2),
                      "loader_tokens_per_s": round(loader_tps), "step_ms": round(step_s * 1e3, 2),
                      "step_tokens_per_s": round(step_tps), "fed_step_ms": round(fed_s * 1e3, 2),
                      "ratio": round(loader_tps / step_tps, 1),
                      "loader_tokens_per_cpu_s": round(loader_cpu_tps),
                      "step_tokens_per_cpu_s": round(step_cpu_tps),
                      "cpu_ratio": round(loader_cpu_tps / step_cpu_tps, 1), "final_loss": round(loss, 3)}))


if __name__ == "__main__":
    from tieflax.hardware.process import prepare_process

    prepare_process()  # as the tieflax console starts: JAX kept off libtpu where no TPU is attached
    main()
