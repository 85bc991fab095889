"""SIGTERM and SIGINT at random moments of ``tieflax convert --to-hf --overwrite`` over an existing export.

Builds a tiny Hugging Face llama, imports it (tied), unties it and trains the copy a few steps, and keeps
two reference exports: OLD (the tied import, one ``model.safetensors``) and NEW (the trained untied run,
sharded into ~10 files by a tiny ``--max-shard-gb``: the case where a mix is possible). For each signal,
``--moments`` runs of ``tieflax convert --to-hf --workdir NEW_RUN --out X --overwrite`` over a copy of OLD
each get the signal once: half at a uniform moment of the whole command (start-up included), half at a
uniform moment of its writing phase (from the lock it takes in X to its exit, measured by a first run).
After each, X must hold exactly OLD's files or NEW's (byte for byte; no lock, no partial folder beside
it), and ``transformers.AutoModelForCausalLM.from_pretrained(X)`` must give OLD's or NEW's embedding.

    python tools/export_signals.py                 # 20 moments per signal: 3.2 minutes on 2 cores
    python tools/export_signals.py --moments 4     # quicker
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["--config.data.source=tokens", "--config.data.tokens.vocab_size=100", "--config.data.tokens.eos_id=0",
         "--config.train.seq_len=16", "--config.train.global_batch_size=8", "--config.train.num_steps=4",
         "--config.train.warmup_steps=1", "--config.train.eval_every=1000", "--config.train.eval_batches=1",
         "--config.train.checkpoint_every=1000", "--config.train.loss_token_block=64",
         "--config.train.loss_vocab_block=128"]
SHARD_GB = "0.000004"   # ~4 KiB: every tensor its own shard file


def env() -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu")
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return e


def tieflax(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "tieflax.cli", *argv], check=True, env=env(), cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def files(folder: str) -> dict:
    """{name: sha256} of the files directly in ``folder`` (an export has no subfolders)."""
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(folder))} if os.path.isdir(folder) else {}


def build(root: str) -> dict:
    import numpy as np
    import torch
    import transformers

    hf = os.path.join(root, "hf")
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[0], (rng.integers(0, 99) + np.arange(40)) % 99 + 1]) for _ in range(200)]
    corpus = os.path.join(root, "corpus.npy")
    np.save(corpus, np.concatenate(docs + [[0]]).astype(np.uint16))
    d = {k: os.path.join(root, k) for k in ("imported", "untied", "old", "new")}
    tieflax("convert", "--from-hf", hf, "--workdir", d["imported"])
    tieflax("convert", "--untie", "--workdir", d["imported"], "--out", d["untied"],
            f"--config.data.tokens.train_path={corpus}", *TRAIN)
    tieflax("train", "--workdir", d["untied"])
    tieflax("convert", "--to-hf", "--workdir", d["imported"], "--out", d["old"])
    tieflax("convert", "--to-hf", "--workdir", d["untied"], "--out", d["new"], "--max-shard-gb", SHARD_GB)
    return d


def export_once(d: dict, out: str, signum: int | None, delay: float | None, after_lock: bool) -> dict:
    """One export over a fresh copy of OLD; the signal ``delay`` s after the start (or after the lock
    appears in ``out`` when ``after_lock``). -> what it did and what ``out`` holds."""
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(d["old"], out)
    cmd = [sys.executable, "-m", "tieflax.cli", "convert", "--to-hf", "--workdir", d["untied"], "--out", out,
           "--overwrite", "--max-shard-gb", SHARD_GB]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock_at = None
    if signum is not None:
        if after_lock:
            while not os.path.exists(os.path.join(out, "tieflax.lock")) and proc.poll() is None:
                time.sleep(0.0005)
            lock_at = time.perf_counter() - t0
            time.sleep(delay)
        else:
            time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signum)
    else:
        while not os.path.exists(os.path.join(out, "tieflax.lock")) and proc.poll() is None:
            time.sleep(0.0005)
        lock_at = time.perf_counter() - t0
    _, err = proc.communicate(timeout=120)
    return {"code": proc.returncode, "wall": time.perf_counter() - t0, "lock_at": lock_at,
            "stderr": err.strip().splitlines()[-1:] if err.strip() else []}


def judge(d: dict, out: str, refs: dict) -> str:
    """'old' or 'new' when ``out`` holds exactly that export and transformers loads it; raises otherwise."""
    import torch
    import transformers

    parent = os.path.dirname(out)
    beside = [n for n in os.listdir(parent) if n.startswith("." + os.path.basename(out) + ".")]
    assert not beside, f"left beside {out}: {beside}"
    held = files(out)
    which = [k for k in ("old", "new") if held == refs[k]["files"]]
    assert which, f"{out} is neither export: {sorted(held)}"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    emb = model.get_input_embeddings().weight.detach()
    assert torch.equal(emb, refs[which[0]]["embedding"]), f"{out}: files of {which[0]}, another embedding"
    assert bool(model.config.tie_word_embeddings) == (which[0] == "old")
    return which[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moments", type=int, default=20, help="signals per kind (SIGTERM, SIGINT)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tieflax-export-signals-") as root:
        t = time.perf_counter()
        d = build(root)
        print(f"built the runs and reference exports in {time.perf_counter() - t:.1f} s", flush=True)
        refs = {}
        for k in ("old", "new"):
            m = transformers.AutoModelForCausalLM.from_pretrained(d[k])
            refs[k] = {"files": files(d[k]), "embedding": m.get_input_embeddings().weight.detach()}
        out = os.path.join(root, "x", "export")
        os.makedirs(os.path.dirname(out))
        calib = export_once(d, out, None, None, False)
        assert calib["code"] == 0 and judge(d, out, refs) == "new", calib
        total, write = calib["wall"], calib["wall"] - calib["lock_at"]
        print(f"uninterrupted export: {total:.2f} s, of which {write:.3f} s from its lock in --out to its exit",
              flush=True)
        rows = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            for i in range(args.moments):
                after_lock = i % 2 == 1
                delay = rng.uniform(0, write if after_lock else total)
                r = export_once(d, out, signum, delay, after_lock)
                r.update(signal=signal.Signals(signum).name, delay=round(delay, 4), after_lock=after_lock,
                         result=judge(d, out, refs))
                rows.append(r)
                print(json.dumps({k: r[k] for k in ("signal", "after_lock", "delay", "code", "result", "stderr")}),
                      flush=True)
        summary = {}
        for r in rows:
            key = f"{r['signal']} {'writing' if r['after_lock'] else 'whole run'}"
            s = summary.setdefault(key, {"moments": 0, "old": 0, "new": 0, "exit codes": {}})
            s["moments"] += 1
            s[r["result"]] += 1
            s["exit codes"][str(r["code"])] = s["exit codes"].get(str(r["code"]), 0) + 1
        print(json.dumps({"uninterrupted_s": round(total, 2), "writing_s": round(write, 3), "summary": summary,
                          "bad": 0}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
