"""Compiled memory of one attention layer, forward + backward, per attention kernel, for a TPU or GPU chip.

    # one v5e chip (needs libtpu; compile only, from any machine)
    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/attention.py --target v5e
    # one H100 (needs jax[cuda12]; compile only, no GPU needed)
    JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=-1 python benchmarks/attention.py --target h100

The layer is ``tieflax.model.layers.Attention`` of a model config (default llama3_2_1b: 32 query heads,
8 key/value heads, head_dim 64): q/k/v projections, RoPE, the kernel and the output projection, in
bfloat16 with float32 parameters, on one sequence of ``--seq-len`` tokens, causal with segment ids
(packed documents) as an input. The step is ``jax.grad`` of the summed output with respect to the parameters
and the input, compiled with ``jax.jit(...).lower(...).compile()`` for one abstract chip of the
target; ``memory_analysis().temp_size_in_bytes`` is XLA's own figure for the chip (nothing runs).
Prints a Markdown table and one JSON line.

``--train-step v5e:2x4`` instead compiles the whole ``tieflax.train`` step of the config for that TPU
topology (fsdp over all its chips, one sequence per chip, remat, bf16 compute) per attention kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tieflax import sharding as shd
from tieflax.config import load_config
from tieflax.model.config import ModelConfig
from tieflax.model.layers import Attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v4": "v4:2x2x1", "v6e": "v6e:2x2"}


def one_chip(target: str):
    """One abstract device of ``target`` (a TPU generation or a GPU name)."""
    from jax.experimental import topologies

    if target in TPU_TOPOLOGIES:
        return topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[target], platform="tpu").devices[0]
    from tieflax.hardware.targets import gpu_target_config

    return topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(target),
                                        topology="1x1x1").devices[0]


def measure(mc: ModelConfig, impl: str, seq_len: int, device) -> dict:
    c = mc.replace(attention=impl, dtype="bfloat16", param_dtype="float32")
    mesh = shd.make_mesh(1, 1, 1, devices=[device])
    layer = Attention(c, layer=0, mesh=mesh)
    shape = (1, seq_len)
    x = jax.ShapeDtypeStruct((*shape, c.d_model), jnp.bfloat16)
    ints = jax.ShapeDtypeStruct(shape, jnp.int32)
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype),
                                               jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32)))

    def step(params, x, positions, segment_ids):
        def loss(params, x):
            return layer.apply(params, x, positions, segment_ids).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(params, x)

    on_chip = NamedSharding(mesh, P())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip), (params, x, ints, ints))
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    return {"attention": impl, "seq_len": seq_len, "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes), "compile_s": round(seconds, 1)}


def measure_train_step(config_path: str, impl: str, seq_len: int, topology: str) -> dict:
    """Temporaries of the real train step on ``topology`` (fsdp = chips, one sequence per chip)."""
    import flax.linen as nn
    from jax.experimental import topologies

    from tieflax.train import BATCH_KEYS, build, make_train_step

    chips = list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    mesh = shd.make_mesh(1, len(chips), 1, devices=chips)
    config = load_config(config_path, [f"model.attention='{impl}'", "model.remat=True", "model.dtype='bfloat16'",
                                       f"train.seq_len={seq_len}", f"train.global_batch_size={len(chips)}",
                                       "mesh.data=1", f"mesh.fsdp={len(chips)}"])
    with nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)  # outside the mesh context: building evaluates a PRNG key on the host
        step = make_train_step(config, s)
    batch = {k: jax.ShapeDtypeStruct((len(chips), seq_len), jnp.int32, sharding=shd.batch_sharding(mesh))
             for k in BATCH_KEYS}
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        t0 = time.perf_counter()
        try:
            compiled = step.lower(s.abstract_state, batch).compile()
        except jax.errors.JaxRuntimeError as e:
            # XLA:TPU refuses a program that does not fit HBM, stating the temporaries it needed.
            needed = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
            if not needed:
                raise
            return {"attention": impl, "seq_len": seq_len, "temp_bytes": int(float(needed.group(1)) * 1e9),
                    "argument_bytes": None, "compile_s": round(time.perf_counter() - t0, 1), "fits": False}
        seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    return {"attention": impl, "seq_len": seq_len, "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes), "compile_s": round(seconds, 1), "fits": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e", choices=sorted(TPU_TOPOLOGIES) + ["a100", "a100_40gb", "h100"])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "models", "llama3_2_1b.py"))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--impls", default="", help="comma-separated; default: xla and the target's kernel")
    parser.add_argument("--train-step", default="", metavar="TOPOLOGY",
                        help="compile the whole train step for this TPU topology (e.g. v5e:2x4) instead")
    args = parser.parse_args()
    mc = ModelConfig.from_dict(load_config(args.config, []).model)
    kernel = "splash" if args.target in TPU_TOPOLOGIES or args.train_step else "cudnn"
    impls = args.impls.split(",") if args.impls else ["xla", kernel, "auto"]
    if args.train_step:
        rows = [measure_train_step(args.config, impl, args.seq_len, args.train_step) for impl in impls]
        print(f"train step of {os.path.basename(args.config)}, T={args.seq_len}, one sequence per chip, "
              f"fsdp over {args.train_step}, remat, bf16; per chip\n")
        target, kind = args.train_step, "TPU"
    else:
        device = one_chip(args.target)
        rows = [measure(mc, impl, args.seq_len, device) for impl in impls]
        print(f"one attention layer, forward + backward, T={args.seq_len}, heads {mc.n_heads}/{mc.kv_heads}, "
              f"head_dim {mc.dim_per_head}, bf16, one {args.target} ({device.device_kind})\n")
        target, kind = args.target, device.device_kind
    print("| attention | temporaries GiB | arguments GiB | compile s |")
    print("|---|---:|---:|---:|")
    for r in rows:
        args_gib = "" if r["argument_bytes"] is None else f"{r['argument_bytes'] / 2**30:.3f}"
        fits = "" if "fits" not in r else (" (fits)" if r["fits"] else " (does not fit: XLA refused)")
        print(f"| {r['attention']} | {r['temp_bytes'] / 2**30:.3f}{fits} | {args_gib} | {r['compile_s']} |")
    print(json.dumps({"target": target, "device_kind": kind, "rows": rows}))


if __name__ == "__main__":
    from tieflax.hardware.process import prepare_process

    prepare_process()  # as the tieflax console starts: JAX kept off libtpu where no TPU is attached
    main()
