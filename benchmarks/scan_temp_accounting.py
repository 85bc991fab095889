"""What a TPU compiler reports as temporaries for a scanned FSDP step, beside its own buffer assignment.

    python benchmarks/scan_temp_accounting.py                          # the installed libtpu
    python benchmarks/scan_temp_accounting.py --libtpu /path/to/libtpu.so   # another one (TPU_LIBRARY_PATH)

A two-matmul MLP block (d 4096, d_ff 14336: Llama-3-8B's MLP) scanned over ``--layers`` with remat, fp32
weights sharded over all chips of ``--topology`` (FSDP) and cast to bf16 in the block, one sequence of
``--seq-len`` bf16 tokens per chip; the step is the weights' gradient. Compiled for the TPU from this CPU
machine, it prints per layer count: ``temp_size_in_bytes`` (what ``tieflax plan`` and MaxText report),
the size of the buffer assignment's HBM ``preallocated-temp`` allocation (every temporary of the program,
placed), the compiler's peak, and the stack of saved layer inputs (``layers x seq_len x d`` bf16).
Each count runs in its own process (a libtpu chosen by ``TPU_LIBRARY_PATH`` is loaded at start-up).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

MIB = 1 << 20


def measure(topology: str, layers: int, seq_len: int, d: int, f: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    n = len(devices)
    mesh = Mesh(np.array(devices), ("fsdp",))
    w_sh = {"up": NamedSharding(mesh, P(None, "fsdp", None)), "down": NamedSharding(mesh, P(None, None, "fsdp"))}

    def block(x, w):
        h = jax.nn.silu(jnp.einsum("btd,df->btf", x, w["up"].astype(jnp.bfloat16)))
        return x + jnp.einsum("btf,fd->btd", h, w["down"].astype(jnp.bfloat16)), None

    def loss(params, x):
        y, _ = jax.lax.scan(jax.checkpoint(block, prevent_cse=False), x, params)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    params = {"up": jax.ShapeDtypeStruct((layers, d, f), jnp.float32, sharding=w_sh["up"]),
              "down": jax.ShapeDtypeStruct((layers, f, d), jnp.float32, sharding=w_sh["down"])}
    x = jax.ShapeDtypeStruct((n, seq_len, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    with tempfile.TemporaryDirectory() as dump:
        compiled = jax.jit(jax.grad(loss), out_shardings=w_sh).lower(params, x).compile({"xla_dump_to": dump})
        preallocated = None
        for path in glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt")):
            with open(path) as fh:
                for line in fh:
                    m = re.match(r"allocation \d+: size (\d+),(?: page \d+,)? preallocated-temp:", line)
                    if m:
                        preallocated = int(m.group(1))
    m = compiled.memory_analysis()
    return dict(layers=layers, temp=m.temp_size_in_bytes, preallocated_temp=preallocated,
                peak=getattr(m, "peak_memory_in_bytes", None), arguments=m.argument_size_in_bytes,
                stack=layers * seq_len * d * 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5p:2x2x2")
    ap.add_argument("--layers", default="2,8", help="comma-separated layer counts")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--libtpu", default=None, help="compile with this libtpu.so (TPU_LIBRARY_PATH)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)   # child process: one count
    args = ap.parse_args()
    if args.one is not None:
        print("JSON " + json.dumps(measure(args.topology, args.one, args.seq_len, 4096, 14336)))
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if args.libtpu:
        env.update(TPU_LIBRARY_PATH=args.libtpu, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    rows = []
    for layers in (int(v) for v in args.layers.split(",")):
        out = subprocess.run([sys.executable, __file__, "--topology", args.topology, "--seq-len", str(args.seq_len),
                              "--one", str(layers)], env=env, capture_output=True, text=True)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("JSON ")]
        if not line:
            raise RuntimeError(out.stderr[-3000:])
        rows.append(json.loads(line[0][5:]))
    print(f"{args.topology}, T = {args.seq_len}, MiB per chip (libtpu: {args.libtpu or 'installed'})\n")
    print("| layers | temp_size | preallocated-temp | temp_size - preallocated | layer-input stack | peak |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        pre = r["preallocated_temp"]
        print(f"| {r['layers']} | {r['temp'] / MIB:.1f} | {pre / MIB:.1f} | {(r['temp'] - pre) / MIB:.1f} | "
              f"{r['stack'] / MIB:.1f} | {(r['peak'] or 0) / MIB:.1f} |")
    print("JSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
