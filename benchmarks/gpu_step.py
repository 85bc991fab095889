"""Llama-3.2-1B train step on one GPU: tieflax (tied, untied) beside Hugging Face (+ Liger), same shapes.

    python benchmarks/gpu_step.py                      # on a GPU: a Markdown table + one JSON line
    python benchmarks/gpu_step.py --profile DIR        # also traces a few steps (tieflax tied, HF + Liger)
    python benchmarks/gpu_step.py --budget-s 280       # starts no variant late, so the table always prints
    SMOKE=1 python benchmarks/gpu_step.py              # a tiny model on the CPU, in seconds

Each variant runs in its own process (``--variant NAME`` runs one and prints its JSON line), so peak
memory is that variant's alone and JAX and PyTorch never share the GPU's memory:

- ``tieflax-tied`` / ``tieflax-untied``: the real ``tieflax.train`` step (AdamW, clipping, the tied
  gradient split) of ``configs/models/llama3_2_1b.py`` with its defaults but remat 'none' (bf16 compute,
  fp32 parameters and Adam, scanned layers, ``loss_impl`` as configured) and, with remat 'none', the MLP
  unchunked (``mlp_chunk=0``: a chunk is rematerialised), batch 8 x 2048 tokens, each row one sequence
  (``data.document_masking=False``: the HF peers mask no documents either);
- ``tieflax-tied-xla-flags``: ``tieflax-tied`` with ``TIEFLAX_GPU_XLA_FLAGS=recommended`` (NVIDIA's XLA flags
  for LLM training, ``tieflax/hardware/gpu_flags.py``; added on a GPU only, so under ``SMOKE=1`` on a CPU it
  runs the defaults); the other variants run with the choice ``off``. Its row's ``xla_flags`` is the
  ``XLA_FLAGS`` its process ran with;
- ``hf``: ``transformers.LlamaForCausalLM`` with the same shapes, fp32 parameters under bf16 autocast,
  SDPA attention, fused AdamW (the config's rate, betas, weight decay), gradient clipping, no activation
  checkpointing (what a PyTorch user runs);
- ``hf-liger``: the same after ``liger_kernel.transformers.apply_liger_kernel_to_llama()`` (fused
  linear cross-entropy, RMSNorm, SwiGLU, RoPE kernels), when liger-kernel imports and a GPU is there.

Per variant: median step time of ``--steps`` steps after ``--warmup`` steps, tokens/s, MFU (model FLOPs as
tieflax.hardware.flops counts them, over the peak tieflax.hardware.targets knows for the device; none where
unknown, e.g. a CPU), and peak memory: ``device.memory_stats()['peak_bytes_in_use']`` for JAX,
``torch.cuda.max_memory_allocated()`` for PyTorch. A peer that cannot run prints one line saying why.

``--profile DIR`` then traces ``--profile-steps`` steps of tieflax tied (``jax.profiler``, the
TensorBoard layout ``DIR/tieflax-tied/plugins/profile/<time>/<host>.xplane.pb``, and the compiled
step's HLO ``DIR/tieflax-tied.hlo.txt``) and of HF + Liger (HF
without Liger) (``torch.profiler``, ``DIR/hf-liger.trace.json``); ``tools/profile_table.py`` reads both.

``SMOKE=1``: a 2-layer, d=64 model of the same family, batch 2 x 64, 2 timed steps, on the CPU
(``JAX_PLATFORMS=cpu``; torch on its CPU; Liger skipped: its kernels are Triton's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# XLA_FLAGS as the user started this process: each variant's process starts from this and chooses its own
# flags (``prepare_process`` in ``main`` adds the GPU flags where TIEFLAX_GPU_XLA_FLAGS asks).
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS")

# ``tieflax.hardware`` (JAX not imported) here; the FLOP count and the peaks, which import
# JAX and Flax (1.1 CPU-s), in ``result``: the parent process that starts the variants, a --budget-s that
# starts none and --help need neither.
from tieflax.hardware.gpu_flags import ENV as GPU_FLAGS_ENV  # noqa: E402 (after the path: this checkout's tieflax)

CONFIG = os.path.join(ROOT, "configs", "models", "llama3_2_1b.py")
# The flags variant second: with --budget-s, a variant late in the list is the one left out.
VARIANTS = ("tieflax-tied", "tieflax-tied-xla-flags", "tieflax-untied", "hf", "hf-liger")
SMOKE = os.environ.get("SMOKE", "") not in ("", "0")
# The smoke model: the same family and code paths, small enough for a CPU in seconds.
SMOKE_MODEL = {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128,
               "mlp_chunk": 0}


def load(tied: bool, batch: int, seq_len: int, remat: str = "none"):
    """The Llama-3.2-1B config as benchmarked: its defaults, remat 'none' (and then no MLP chunking), one
    process, ``batch x seq_len``, rows that are one sequence each (no document masking), as the Hugging
    Face peers run: cuDNN attention then takes its causal flag alone, with no [B, 1, T, T] mask."""
    from tieflax.config import load_config

    overrides = [f"model.tie_embeddings={tied}", f"model.remat='{remat}'", f"train.global_batch_size={batch}",
                 f"train.seq_len={seq_len}", "mesh.fsdp=-1", "data.document_masking=False"]
    if remat == "none":
        # The config's mlp_chunk=1024 rematerialises each chunk: its backward recomputes the MLP's up and
        # gate matmuls (two thirds of the MLP, about 17.6 of the step's 128.1 TFLOP). 'none' is the run with
        # no activation checkpointing, as the HF peers run.
        overrides.append("model.mlp_chunk=0")
    if SMOKE:
        overrides += [f"model.{k}={v}" for k, v in SMOKE_MODEL.items()]
    return load_config(CONFIG, overrides)


def result(name: str, step_times: list[float], tokens: int, peak_bytes, extra: dict, device_kind: str,
           model) -> dict:
    """One row: median step, tokens/s, model TFLOP/s and MFU (tieflax's count and peaks)."""
    from tieflax.hardware.flops import step_flops  # noqa: PLC0415 (the module's comment says why)
    from tieflax.hardware.targets import device_peak  # noqa: PLC0415

    median = statistics.median(step_times)
    flops = step_flops(model, extra["batch"], extra["seq_len"]).train
    peak = device_peak(device_kind)
    return {"variant": name, "device": device_kind, "step_s": median, "steps_s": step_times,
            "tokens_per_s": tokens / median, "model_tflops": flops / median / 1e12,
            "mfu": flops / median / peak.flops if peak else None,
            "peak_flops": peak.flops if peak else None, "peak_bytes": peak_bytes, **extra}


# ---------------------------------------------------------------------------------------------- tieflax


def tieflax_step(variant: str, args) -> dict:
    """Compiles and times the real step; ``args.profile`` traces ``args.profile_steps`` more (tieflax-tied
    only). The GPU XLA flags were merged, or not, by ``prepare_process`` as the variant's process started."""
    import flax.linen as nn
    import jax
    import numpy as np

    from tieflax import sharding as shd
    from tieflax.config import model_config
    from tieflax.train import BATCH_KEYS, build, make_train_step, setup_mesh

    tied = variant != "tieflax-untied"
    config = load(tied, args.batch, args.seq_len, args.remat)
    t = config.train
    mesh = setup_mesh(config)
    with jax.set_mesh(mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = build(config, mesh)
        step = make_train_step(config, s)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, config.model.vocab_size, size=(t.global_batch_size, t.seq_len + 1), dtype=np.int32)
        shape = (t.global_batch_size, t.seq_len)
        host = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.ones(shape, np.int32),
                "positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), shape)}
        batch = {k: jax.device_put(host[k], shd.batch_sharding(mesh)) for k in BATCH_KEYS}
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
        t0 = time.perf_counter()
        compiled = step.lower(s.abstract_state, abstract).compile()
        compile_s = time.perf_counter() - t0
        memory = compiled.memory_analysis()
        state = s.init_state(jax.random.key(0))
        times = []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        if args.profile and variant == "tieflax-tied":
            folder = os.path.join(args.profile, "tieflax-tied")
            os.makedirs(args.profile, exist_ok=True)
            with open(os.path.join(args.profile, "tieflax-tied.hlo.txt"), "w") as f:
                f.write(compiled.as_text())  # op_name paths for tools/profile_table.py --hlo
            with jax.profiler.trace(folder):
                for n in range(args.profile_steps):
                    with jax.profiler.StepTraceAnnotation("train", step_num=n):
                        state, metrics = compiled(state, batch)
                        jax.block_until_ready(metrics)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    extra = {"batch": t.global_batch_size, "seq_len": t.seq_len, "compile_s": compile_s,
             "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
             "loss": float(metrics["loss"]), "jax": jax.__version__, "loss_impl": t.loss_impl,
             "remat": config.model.remat, "gpu_xla_flags": os.environ.get(GPU_FLAGS_ENV, "off"),
             "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return result(variant, times, t.global_batch_size * t.seq_len,
                  stats.get("peak_bytes_in_use"), extra, device.device_kind, model_config(config))


# ------------------------------------------------------------------------------------ Hugging Face (+ Liger)


def hf_config(model, attn: str = "sdpa"):
    """A ``transformers.LlamaConfig`` with tieflax's model shapes (``model``: tieflax's ModelConfig)."""
    from transformers import LlamaConfig

    rope = None
    if model.rope_scaling_factor:
        rope = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                "low_freq_factor": model.rope_low_freq_factor, "high_freq_factor": model.rope_high_freq_factor,
                "original_max_position_embeddings": model.rope_original_max_len}
    return LlamaConfig(vocab_size=model.vocab_size, hidden_size=model.d_model, intermediate_size=model.d_ff,
                       num_hidden_layers=model.n_layers, num_attention_heads=model.n_heads,
                       num_key_value_heads=model.kv_heads, max_position_embeddings=model.max_seq_len,
                       rms_norm_eps=model.norm_eps, rope_theta=model.rope_theta, rope_scaling=rope,
                       tie_word_embeddings=model.tie_embeddings, attn_implementation=attn)


def hf_step(liger: bool, args) -> dict:
    """Times HF Llama's step: fp32 params, bf16 autocast, SDPA, fused AdamW, clipping (torch on GPU)."""
    import torch

    from tieflax.config import model_config

    cuda = torch.cuda.is_available()
    if liger:
        if not cuda:
            raise RuntimeError("Liger's kernels are Triton's and need a GPU")
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()  # patches the Llama classes: build the model after this
    from transformers import LlamaForCausalLM

    config = load(True, args.batch, args.seq_len)
    model_cfg, t = model_config(config), config.train
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(model_cfg)).to(device=device, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, betas=(t.adam_b1, t.adam_b2),
                                  weight_decay=t.weight_decay, fused=cuda)
    ids = torch.randint(0, model_cfg.vocab_size, (t.global_batch_size, t.seq_len), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss  # HF shifts the labels: T - 1 targets a row
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def synced_step():
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        return loss

    times = []
    for i in range(args.warmup + args.steps):
        if cuda and i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = synced_step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    if args.profile and (liger or not args.liger_available):
        profile_torch(synced_step, os.path.join(args.profile, "hf-liger.trace.json"), args.profile_steps, cuda)
    kind = torch.cuda.get_device_name() if cuda else "cpu"
    extra = {"batch": t.global_batch_size, "seq_len": t.seq_len, "loss": float(loss), "torch": torch.__version__,
             "liger": liger}
    return result("hf-liger" if liger else "hf", times, t.global_batch_size * t.seq_len, peak, extra, kind,
                  model_cfg)


def profile_torch(step, path: str, steps: int, cuda: bool) -> None:
    """``steps`` steps under ``torch.profiler`` (CPU and CUDA activity), written as a Chrome trace."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("train_step"):
                step()
    prof.export_chrome_trace(path)


# ------------------------------------------------------------------------------------------------ driver


def missing_peer(variant: str) -> str | None:
    """Why a peer cannot run here (one line), or None."""
    import importlib.util

    if variant.startswith("hf"):
        for module in ("torch", "transformers"):
            if importlib.util.find_spec(module) is None:
                return f"{variant}: skipped, {module} is not installed (pip install torch transformers)"
    if variant == "hf-liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "hf-liger: skipped, liger-kernel is not installed (pip install liger-kernel)"
        if SMOKE:
            return "hf-liger: skipped under SMOKE=1 (Liger's kernels are Triton's and need a GPU)"
    return None


def run_one(variant: str, args) -> dict:
    if variant.startswith("tieflax"):
        return tieflax_step(variant, args)
    return hf_step(variant == "hf-liger", args)


def variant_env(variant: str, liger: bool) -> dict:
    """A variant's process environment: the user's XLA_FLAGS, and the GPU XLA flags for the flags variant."""
    env = dict(os.environ, GPU_STEP_LIGER="1" if liger else "0")
    env[GPU_FLAGS_ENV] = "recommended" if variant == "tieflax-tied-xla-flags" else "off"
    env.pop("XLA_FLAGS", None)
    if USER_XLA_FLAGS is not None:
        env["XLA_FLAGS"] = USER_XLA_FLAGS
    return env


def run_all(args) -> list[dict]:
    """Each variant in a child process; a failing one is reported with its last line and the rest go on.
    With ``args.budget_s``, no variant starts with under 30 s of it left and a running one is stopped when
    it is spent, so the table of those that ran still prints."""
    rows, start = [], time.monotonic()
    liger = missing_peer("hf-liger") is None
    for variant in args.variants.split(","):
        why = missing_peer(variant)
        left = args.budget_s - (time.monotonic() - start) if args.budget_s else None
        if left is not None and left < 30:
            why = f"{variant}: not started, {left:.0f} s of the {args.budget_s:.0f} s budget left"
        if why:
            print(f"# {why}", file=sys.stderr, flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
               "--profile-steps", str(args.profile_steps), "--remat", args.remat]
        cmd += ["--profile", args.profile] if args.profile else []
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=variant_env(variant, liger), timeout=left)
        except subprocess.TimeoutExpired:
            print(f"# {variant}: stopped, the {args.budget_s:.0f} s budget was spent", file=sys.stderr, flush=True)
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"# {variant}: failed (exit {done.returncode}): {last}", file=sys.stderr, flush=True)
            continue
        rows.append(json.loads(lines[-1]))
        print(f"# {variant}: {rows[-1]['step_s'] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    gib = 2.0 ** 30
    out = ["| variant | ms/step | tokens/s | model TFLOP/s | MFU | peak memory GiB | compiled temp + args GiB |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "(no peak known)"
        peak = f"{r['peak_bytes'] / gib:.1f}" if r["peak_bytes"] is not None else "n/a"
        compiled = (f"{r['temp_bytes'] / gib:.1f} + {r['argument_bytes'] / gib:.1f}" if "temp_bytes" in r else "")
        out.append(f"| {r['variant']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['model_tflops']:.1f} | {mfu} | {peak} | {compiled} |")
    return "\n".join(out)


def flags_verdict(rows: list[dict]) -> str | None:
    """One line: tieflax tied with the recommended GPU XLA flags against without, when both ran."""
    by = {r["variant"]: r for r in rows}
    base, flagged = by.get("tieflax-tied"), by.get("tieflax-tied-xla-flags")
    if not base or not flagged:
        return None
    if flagged["xla_flags"] == base["xla_flags"]:
        return "GPU XLA flags: not added (no GPU here, or the jaxlib was not checked), so both tied rows ran the same"
    change = flagged["step_s"] / base["step_s"] - 1
    return (f"GPU XLA flags (TIEFLAX_GPU_XLA_FLAGS=recommended): {base['step_s'] * 1e3:.1f} -> "
            f"{flagged['step_s'] * 1e3:.1f} ms/step ({change:+.1%}), loss {base['loss']:.4f} -> {flagged['loss']:.4f}")


def parse(argv=None):
    smoke = {"steps": 2, "warmup": 1, "batch": 2, "seq_len": 64, "profile_steps": 1}
    full = {"steps": 5, "warmup": 2, "batch": 8, "seq_len": 2048, "profile_steps": 3}
    d = smoke if SMOKE else full
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--variant", choices=VARIANTS, help="run this one in this process, print its JSON line")
    ap.add_argument("--steps", type=int, default=d["steps"], help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=d["warmup"], help="untimed steps first (compile, autotune)")
    ap.add_argument("--batch", type=int, default=d["batch"], help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens per sequence")
    ap.add_argument("--remat", default="none", help="tieflax's remat policy (HF runs without checkpointing)")
    ap.add_argument("--profile", metavar="DIR", help="also trace a few steps of tieflax tied and HF + Liger here")
    ap.add_argument("--profile-steps", type=int, default=d["profile_steps"], help="steps traced")
    ap.add_argument("--budget-s", type=float, help="seconds for all variants: none starts with under 30 s "
                    "left, a running one is stopped when they are spent (the table of the rest still prints)")
    args = ap.parse_args(argv)
    for name in ("variants",) if not args.variant else ():
        unknown = set(getattr(args, name).split(",")) - set(VARIANTS)
        if unknown:
            ap.error(f"--variants: unknown {sorted(unknown)}; use some of {', '.join(VARIANTS)}")
    if args.profile:
        args.profile = os.path.abspath(args.profile)
    args.liger_available = os.environ.get("GPU_STEP_LIGER", "0") == "1"
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if SMOKE:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.variant:
        # As the tieflax console starts: the collector's thresholds (tieflax/cli.py says why: on the CPU the
        # default ones cost a tenth of a small variant's time, the same for every variant), JAX off libtpu
        # without a TPU, the GPU XLA flags this variant chose.
        import gc

        from tieflax.cli import COLLECTOR_THRESHOLDS
        from tieflax.hardware.process import prepare_process

        gc.set_threshold(*COLLECTOR_THRESHOLDS)
        prepare_process()
        print(json.dumps(run_one(args.variant, args)))
        return
    rows = run_all(args)
    where = rows[0]["device"] if rows else "no variant ran"
    print(f"\n{where}, batch {args.batch} x {args.seq_len} tokens, median of {args.steps} steps after "
          f"{args.warmup} warm-up{' (SMOKE: tiny model)' if SMOKE else ''}\n")
    print(table(rows))
    verdict = flags_verdict(rows)
    if verdict:
        print(f"\n{verdict}")
    print(json.dumps({"benchmark": "gpu_step", "smoke": SMOKE, "batch": args.batch, "seq_len": args.seq_len,
                      "steps": args.steps, "rows": rows}))
    if not any(r["variant"].startswith("tieflax") for r in rows):
        sys.exit("gpu_step: no tieflax variant ran (see the lines above)")


if __name__ == "__main__":
    main()
