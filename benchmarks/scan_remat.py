"""Compile time and per-chip memory of the real train step for a TPU topology: scanned vs unrolled
layers, and every remat policy. Compile-only (no TPU needed: libtpu compiles from a CPU process).

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/scan_remat.py \\
        --config configs/models/gemma_2b.py --topology v5e:4x4 --seq-len 8192 \\
        --variants scan-full,scan-minimal,unrolled-full

Each variant is ``tieflax.train.build`` + ``make_train_step`` with bf16 compute and fp32 parameters,
one sequence of ``--seq-len`` tokens per chip, all chips on the ``fsdp`` axis. Variants are
``<scan|unrolled>-<remat policy>``. Reported per variant: compile seconds (lower + compile) on this
machine, wall and process CPU (the CPU figure is the steadier one on a shared machine), and XLA:TPU's
``memory_analysis()`` per chip: arguments (params + optimizer state), temporaries, their sum against the
chip's HBM. A program that does not fit is refused by the compiler; its temporaries are then the figure
the refusal states (and compile time is the time to that refusal).
Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import topologies

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tieflax import sharding as shd
from tieflax.config import load_config
from tieflax.train import BATCH_KEYS, build, make_train_step

HBM_GIB = {"v5e": 16, "v5p": 95, "v4": 32, "v6e": 32}  # per chip, GiB


def measure(config_path: str, topology: str, seq_len: int, scan: bool, remat: str, extra: list[str]) -> dict:
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    n = len(devices)
    config = load_config(config_path, [f"model.scan_layers={scan}", f"model.remat='{remat}'",
                                       "model.dtype='bfloat16'", "model.param_dtype='float32'",
                                       f"train.seq_len={seq_len}", f"train.global_batch_size={n}",
                                       "mesh.data=1", f"mesh.fsdp={n}", "mesh.tensor=1", *extra])
    mesh = shd.mesh_from_config(config.mesh, devices=devices)
    with nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        step = make_train_step(config, s)
        batch = {k: jax.ShapeDtypeStruct((n, seq_len), np.int32, sharding=shd.batch_sharding(mesh))
                 for k in BATCH_KEYS}
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            with jax.set_mesh(mesh):   # as in training: the model's sharding constraints take effect
                m = step.lower(s.abstract_state, batch).compile().memory_analysis()
            args_b, temp_b, fits = int(m.argument_size_in_bytes), int(m.temp_size_in_bytes), True
        except jax.errors.JaxRuntimeError as e:
            # XLA:TPU refuses a program that does not fit HBM; its message states the temporaries needed
            # (in GiB). Arguments are then the state's bytes per chip (everything is fsdp-sharded).
            need = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
            if not need:
                raise
            args_b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.abstract_state)) // n
            temp_b, fits = int(float(need.group(1)) * 2**30), False
        compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    return {"config": os.path.basename(config_path), "topology": topology, "chips": n, "seq_len": seq_len,
            "scan": scan, "remat": remat, "compile_s": round(compile_s, 1),
            "compile_cpu_s": round(compile_cpu_s, 1), "argument_bytes": int(args_b),
            "temp_bytes": temp_b, "fits": fits, "hbm_bytes": HBM_GIB[topology.split(":")[0]] * 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--topology", required=True, help="e.g. v5e:4x4, v5e:2x4, v5p:4x4x4")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--variants", default="scan-full,unrolled-full")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. model.tie_embeddings=False")
    args = parser.parse_args()
    rows = []
    for variant in args.variants.split(","):
        layout, _, remat = variant.partition("-")
        rows.append(measure(args.config, args.topology, args.seq_len, layout == "scan", remat, args.overrides))
        r = rows[-1]
        print(f"# {variant}: compile {r['compile_s']} s ({r['compile_cpu_s']} s CPU), "
              f"temp {r['temp_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        jax.clear_caches()
    gib = 2**30
    print(f"\n{rows[0]['config']} on {args.topology} ({rows[0]['chips']} chips, fsdp), T = {args.seq_len}, "
          f"one sequence per chip, bf16 compute, fp32 params; jax {jax.__version__}\n")
    print("| layers | remat | compile wall (s) | compile CPU (s) | arguments GiB | temporaries GiB | total GiB "
          "| of HBM | fits |")
    print("|---|---|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        total = r["argument_bytes"] + r["temp_bytes"]
        print(f"| {'scanned' if r['scan'] else 'unrolled'} | {r['remat']} | {r['compile_s']} | "
              f"{r['compile_cpu_s']} | "
              f"{r['argument_bytes'] / gib:.2f} | {r['temp_bytes'] / gib:.2f} | {total / gib:.2f} | "
              f"{100 * total / r['hbm_bytes']:.0f}% | {'yes' if r['fits'] else 'no'} |")
    print(json.dumps({"benchmark": "scan_remat", "rows": rows}))


if __name__ == "__main__":
    main()
