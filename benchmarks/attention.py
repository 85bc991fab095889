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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tieflax import sharding as shd  # noqa: E402
from tieflax.config import load_config  # noqa: E402
from tieflax.model.config import ModelConfig  # noqa: E402
from tieflax.model.layers import Attention  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TARGETS = {"h100": "h100.txtpb"}
TPU_TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v4": "v4:2x2x1", "v6e": "v6e:2x2"}


def one_chip(target: str):
    """One abstract device of ``target`` (a TPU generation or a GPU name)."""
    from jax.experimental import topologies  # noqa: PLC0415

    if target in TPU_TOPOLOGIES:
        return topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[target], platform="tpu").devices[0]
    path = os.environ.get("TIEFLAX_GPU_TARGET") or os.path.join("/work/shared/gpu_targets", GPU_TARGETS[target])
    with open(path) as f:
        return topologies.get_topology_desc(platform="cuda", target_config=f.read(), topology="1x1x1").devices[0]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e", choices=sorted(TPU_TOPOLOGIES) + sorted(GPU_TARGETS))
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "models", "llama3_2_1b.py"))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--impls", default="", help="comma-separated; default: xla and the target's kernel")
    args = parser.parse_args()
    mc = ModelConfig.from_dict(load_config(args.config, []).model)
    kernel = "splash" if args.target in TPU_TOPOLOGIES else "cudnn"
    impls = args.impls.split(",") if args.impls else ["xla", kernel, "auto"]
    device = one_chip(args.target)
    rows = [measure(mc, impl, args.seq_len, device) for impl in impls]
    print(f"one attention layer, forward + backward, T={args.seq_len}, heads {mc.n_heads}/{mc.kv_heads}, "
          f"head_dim {mc.dim_per_head}, bf16, one {args.target} ({device.device_kind})\n")
    print("| attention | temporaries GiB | arguments GiB | compile s |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['attention']} | {r['temp_bytes'] / 2**30:.3f} | {r['argument_bytes'] / 2**30:.3f} "
              f"| {r['compile_s']} |")
    print(json.dumps({"target": args.target, "device_kind": device.device_kind, "rows": rows}))


if __name__ == "__main__":
    main()
