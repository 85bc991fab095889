"""The loss on one GPU: tieflax's implementations against naive JAX, Liger Kernel and cut-cross-entropy.

    python benchmarks/gpu.py            # one GPU; at most about 6 minutes, compiles included
    python benchmarks/gpu.py --smoke    # tiny shapes on a CPU in seconds (the Mosaic GPU kernels interpreted, jax >= 0.12;
                                        # SMOKE=1 in the environment does the same)
    python benchmarks/gpu.py --budget-s 120 --reps 3    # no variant starts after 120 s; 3 timed calls each

Loss (mean over tokens) + gradients w.r.t. the hidden states and the head weight, hidden bf16, at three
heads: Llama-3-8B (N=16384, d=4096, V=128256, W bf16), Gemma-2-2B (d=2304, V=256000, W bf16) and
Llama-3.2-1B (d=2048, V=128256) with W fp32, as training holds it, and again with W bf16 for tieflax
(an fp32 head should cost at most 10% more). Per variant:

- ms: median of ``--reps`` timed calls (default 6; 3 with ``--smoke``) after one warm-up call (compile
  excluded from the time);
- TF/s: ``6 N d V`` FLOPs (the naive loss's three matmuls) over that time;
- extra MiB: memory beyond inputs and gradients. JAX: ``memory_analysis().temp_size_in_bytes`` of the
  compiled loss+grad. torch: peak allocated during loss+backward minus what was allocated before it
  and the gradients it leaves;
- error: relative L2 error of dH and dW (the larger) and of the loss against an fp32 reference (full
  fp32 logits, ``Precision.HIGHEST`` matmuls, from the same bf16 inputs).

Peers run when importable (``liger_kernel``, ``cut_cross_entropy``, on a CUDA device); otherwise a line
says so. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# The torch peers share the GPU with JAX: JAX takes memory as it needs it instead of 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from tieflax.ops.cross_entropy import cross_entropy, mosaic_gpu
from tieflax.ops.reference import naive_cross_entropy

# Past --budget-s seconds (by default this many) no further variant starts (each is reported as skipped),
# so one call fits in 6 minutes of GPU time with the last variant's compile and runs.
BUDGET_S = 300
MIB = 2**20
# name -> (N, d, V, W dtype, variants); None: every variant.
HEADS = {
    "llama3-8b": (16384, 4096, 128256, "bfloat16", None),
    "gemma2-2b": (16384, 2304, 256000, "bfloat16", None),
    "llama3.2-1b W fp32": (16384, 2048, 128256, "float32", None),
    "llama3.2-1b W bf16": (16384, 2048, 128256, "bfloat16", ("tieflax auto", "tieflax xla")),
}
SMOKE_HEADS = {
    "smoke": (64, 64, 1000, "bfloat16", None),   # d: whole 64-column blocks, as the Mosaic GPU kernels read
    "smoke W fp32": (64, 64, 1000, "float32", None),
}


# ----------------------------------------------------------------------------------------- JAX side

def _jax_variants(v: int) -> dict:
    """name -> loss(h, w, y) (mean over tokens)."""
    def ours(impl):
        return lambda h, w, y: cross_entropy(h, w, y, valid_vocab=v, impl=impl)[0].mean()

    out = {"naive JAX (fp32 logits, optax)": lambda h, w, y: naive_cross_entropy(h, w, y, valid_vocab=v).mean(),
           "tieflax xla": ours("xla"), "tieflax auto": ours("auto")}
    # On a CPU (--smoke) the Mosaic GPU kernels run under jax >= 0.12's interpreter; jax 0.10 has none.
    if jax.default_backend() == "gpu" or mosaic_gpu.interpretable()[0]:
        out["tieflax mosaic_gpu"] = ours("mosaic_gpu")
    return out


def _reference(h, w, y):
    """fp32 loss and gradients (dH, dW): full logits, HIGHEST precision matmuls."""
    def loss(h, w):
        z = jnp.dot(h, w.T, precision=jax.lax.Precision.HIGHEST)
        lse = jax.nn.logsumexp(z, axis=1)
        return jnp.mean(lse - jnp.take_along_axis(z, y[:, None], axis=1)[:, 0])
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h.astype(jnp.float32), w.astype(jnp.float32))


def _rel(got, want) -> float:
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


def _errors(loss, dh, dw, ref) -> dict:
    (rl, (rh, rw)) = ref
    return dict(loss_err=abs(float(loss) - float(rl)) / abs(float(rl)), grad_err=max(_rel(dh, rh), _rel(dw, rw)))


def _picked(compiled) -> str:
    """Which implementation a compiled tieflax call runs: the GPU kernels leave Mosaic GPU custom calls."""
    hlo = compiled.as_text()
    return "mosaic_gpu" if 'custom_call_target="mosaic_gpu_v2"' in hlo else "xla"


def run_jax(name, fn, h, w, y, ref, reps) -> dict:
    f = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    t0 = time.perf_counter()
    compiled = f.lower(h, w, y).compile()
    compile_s = time.perf_counter() - t0
    loss, (dh, dw) = jax.block_until_ready(compiled(h, w, y))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(h, w, y))
        times.append(time.perf_counter() - t0)
    row = dict(variant=name, ms=1e3 * statistics.median(times),
               extra_mib=compiled.memory_analysis().temp_size_in_bytes / MIB, compile_s=compile_s,
               **_errors(loss, dh, dw, ref))
    if name == "tieflax auto":
        row["variant"] = f"tieflax auto (ran {_picked(compiled)})"
    return row


# --------------------------------------------------------------------------------------- torch side

def _torch_peers() -> tuple[dict, list[str]]:
    """name -> loss(h, w, y) for the torch peers that import and have a CUDA device; and why others not."""
    peers, missing = {}, []
    try:
        import torch
    except ImportError as e:
        return {}, [f"torch: not importable ({e}); Liger and cut-cross-entropy skipped"]
    if not torch.cuda.is_available():
        return {}, ["torch peers (Liger, cut-cross-entropy) need a CUDA device; none here, skipped"]
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        peers["Liger FusedLinearCrossEntropy"] = lambda h, w, y: liger(w, h, y)
    except ImportError as e:
        missing.append(f"liger-kernel: not importable ({e}); row skipped")
    try:
        from cut_cross_entropy import linear_cross_entropy
        peers["cut-cross-entropy (cce)"] = lambda h, w, y: linear_cross_entropy(h, w, y, impl="cce")
        peers["cut-cross-entropy (cce_exact)"] = lambda h, w, y: linear_cross_entropy(h, w, y, impl="cce_exact")
    except ImportError as e:
        missing.append(f"cut-cross-entropy: not importable ({e}); rows skipped")
    return peers, missing


def run_torch(name, fn, h, w, y, ref, reps) -> dict:
    """One torch peer on the same inputs (shared with JAX through DLPack). An fp32 W runs under bf16
    autocast, as a bf16-compute training step would hold it."""
    import torch
    th = torch.from_dlpack(h).clone().requires_grad_()
    tw = torch.from_dlpack(w).clone().requires_grad_()
    ty = torch.from_dlpack(y).long()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=tw.dtype == torch.float32)

    def step():
        th.grad = tw.grad = None
        with autocast:
            loss = fn(th, tw, ty)
        loss.backward()
        return loss

    loss = step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    th.grad = tw.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    torch.cuda.synchronize()
    grads = th.grad.numel() * th.grad.element_size() + tw.grad.numel() * tw.grad.element_size()
    extra = (torch.cuda.max_memory_allocated() - base - grads) / MIB
    errs = _errors(float(loss), jnp.from_dlpack(th.grad.float().contiguous()),
                   jnp.from_dlpack(tw.grad.float().contiguous()), ref)
    return dict(variant=name, ms=1e3 * statistics.median(times), extra_mib=extra, compile_s=None, **errs)


# ------------------------------------------------------------------------------------------- main

def head_rows(head, n, d, v, w_dtype, only, peers, t_start, args) -> list[dict]:
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(v, d)) * d**-0.5, w_dtype)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    ref = jax.block_until_ready(_reference(h, w, y))
    rows = []
    jax_fns = _jax_variants(v)
    for name, fn in list(jax_fns.items()) + list(peers.items()):
        if only is not None and name not in only:
            continue
        if name == "tieflax mosaic_gpu" and rows and any("ran mosaic_gpu" in r["variant"] for r in rows):
            continue  # 'auto' ran it already
        if time.perf_counter() - t_start > args.budget_s:
            row = dict(variant=name, error=f"not run: the {args.budget_s:g} s budget of this call was spent")
        else:
            row = None
        try:
            row = row or (run_jax if name in jax_fns else run_torch)(name, fn, h, w, y, ref, args.reps)
        except Exception as e:  # noqa: BLE001 (a variant that fails here is reported, not faked)
            row = dict(variant=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        row.update(head=head, n=n, d=d, v=v, w=w_dtype)
        if "ms" in row:
            row["tflops"] = 6 * n * d * v / (row["ms"] * 1e-3) / 1e12
        rows.append(row)
        _print_row(row)
    return rows


def _print_row(r):
    if "error" in r:
        print(f"{r['head']:20s} {r['variant']:36s} failed: {r['error']}", flush=True)
        return
    print(f"{r['head']:20s} {r['variant']:36s} {r['ms']:9.1f} {r['tflops']:7.1f} {r['extra_mib']:10.1f} "
          f"{r['grad_err']:9.1e} {r['loss_err']:9.1e}", flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """A wrong argument: one line (not the usage block too), status 2."""
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def parse(argv=None) -> argparse.Namespace:
    ap = _Parser(description=__doc__.splitlines()[0],
                 epilog="With no arguments: the full-size heads (Llama-3-8B, Gemma-2-2B, Llama-3.2-1B) on this machine's "
                        "first device (a GPU).")
    ap.add_argument("--smoke", action="store_true", default=os.environ.get("SMOKE") == "1",
                    help="tiny shapes, on a CPU in seconds: the code paths, not the speed (also: SMOKE=1)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"no variant starts after this many seconds (reported as not run; default {BUDGET_S})")
    ap.add_argument("--reps", type=int, help="timed calls per variant, median reported (default 6; 3 with --smoke)")
    args = ap.parse_args(argv)
    if args.reps is None:
        args.reps = 3 if args.smoke else 6
    if args.reps < 1 or args.budget_s <= 0:
        ap.error("--reps and --budget-s must be positive")
    return args


def main(argv=None):
    args = parse(argv)
    heads = SMOKE_HEADS if args.smoke else HEADS
    dev = jax.devices()[0]
    peers, missing = _torch_peers()
    print(f"# {dev.device_kind} ({dev.platform}), jax {jax.__version__}; loss+grad (dH, dW), hidden bf16; "
          f"median of {args.reps}{'; SMOKE: tiny shapes, times mean nothing' if args.smoke else ''}")
    for line in missing:
        print(f"# {line}")
    print(f"{'head':20s} {'variant':36s} {'ms':>9s} {'TF/s':>7s} {'extra MiB':>10s} {'grad err':>9s} {'loss err':>9s}")
    t0 = time.perf_counter()
    rows = []
    for head, (n, d, v, w_dtype, only) in heads.items():
        rows += head_rows(head, n, d, v, w_dtype, only, peers, t0, args)
    print(json.dumps(dict(benchmark="gpu_cross_entropy", device=dev.device_kind, platform=dev.platform,
                          jax=jax.__version__, smoke=args.smoke, seconds=round(time.perf_counter() - t0, 1),
                          missing=missing, rows=rows)))


if __name__ == "__main__":
    from tieflax.hardware.process import prepare_process

    prepare_process()  # as the tieflax console starts: JAX kept off libtpu where no TPU is attached
    main()
