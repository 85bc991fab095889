"""Token store throughput: prepare tokens/s with 1 and 2 workers; loader tokens/s per process.

Prepare is also given per worker CPU-second, which says whether a shortfall in the 2-worker speed-up is
the tokenizer's or the machine's cores. The loader runs in one and in two processes, from a local store,
from a gs:// store on the Cloud Storage emulator and from the memmap .bin path, on the same tokens.

    python benchmarks/token_store.py                       # KJV, trained 8192-token BPE, tiny's shapes
    python benchmarks/token_store.py --corpus python_stdlib --seq-len 2048 --batches 200

Prepare is timed with a given tokenizer (trained once beforehand), so the figure is tokenising and
writing, not BPE training; ``tokenise`` is the worker phase, ``total`` adds the finalize (arrays and
manifest). The loader figure is ``make_loader`` (shuffled rows, packing, grain threads) tokens per
wall-second per process, median of repeats after a warm-up; with 2 processes both run at once, each taking
its half of every global batch, and the table gives each one's rate. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # object_store: the emulator the tests use


def data_config(corpus: str, tokenizer: str = ""):
    from tieflax.data import default_data_config

    c = default_data_config()
    c.source = corpus
    c.python_stdlib.include_tests = True
    c.tokenizer.path = tokenizer
    return c


def time_prepare(corpus: str, tokenizer: str, out: str, workers: int, shard_mb: float) -> dict:
    from tieflax.data.store_build import build_store

    stats: dict = {}
    t0 = time.perf_counter()
    manifest = build_store(data_config(corpus, tokenizer), out, workers=workers,
                           shard_bytes=int(shard_mb * (1 << 20)), stats=stats)
    total = time.perf_counter() - t0
    return {"workers": workers, "tokens": stats["tokens"], "tokenise_s": stats["tokenise_s"], "total_s": total,
            "tokenise_tps": stats["tokens"] / stats["tokenise_s"], "total_tps": stats["tokens"] / total,
            "worker_cpu_s": stats["worker_cpu_s"], "main_cpu_s": stats["main_cpu_s"],
            "tokens_per_worker_cpu_s": stats["tokens"] / stats["worker_cpu_s"],
            "digest": manifest["digest"]}


def loader_rate(kind: str, path: str, vocab: int, eos: int, seq_len: int, batch: int, batches: int,
                repeats: int, process_index: int, process_count: int, env: dict, queue) -> None:
    os.environ.update(env)
    from tieflax.data import make_loader, prepare_dataset

    c = data_config("kjv")
    c.source = "tokens"
    if kind == "memmap":
        c.tokens.update(train_path=path + "/train.bin", val_path=path + "/val.bin", vocab_size=vocab, eos_id=eos)
    else:
        c.tokens.path = path
    with tempfile.TemporaryDirectory() as w:
        prepared = prepare_dataset(c, w, vocab_size=vocab)
        rates = []
        for r in range(repeats):
            it = make_loader(prepared, "train", seq_len=seq_len, global_batch_size=batch, seed=r,
                             process_index=process_index, process_count=process_count)
            for _ in range(10):
                next(it)
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            rates.append(batches * (batch // process_count) * seq_len / (time.perf_counter() - t0))
    queue.put(statistics.median(rates))


def time_loader(kind, path, vocab, eos, args, processes: int, env: dict) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=loader_rate, args=(kind, path, vocab, eos, args.seq_len, args.batch, args.batches,
                                                   args.repeats, p, processes, env, queue))
             for p in range(processes)]
    for p in procs:
        p.start()
    rates = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return rates


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="kjv", choices=("kjv", "python_stdlib"))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    ap.add_argument("--batches", type=int, default=500, help="loader batches per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=float, default=0.5, help="text per input shard")
    ap.add_argument("--no-emulator", action="store_true")
    ap.add_argument("--prepare-only", action="store_true", help="skip the read measurements")
    args = ap.parse_args()

    from tieflax import storage
    from tieflax.data.sources import load_documents
    from tieflax.data.store import open_store
    from tieflax.data.token_files import write_token_file
    from tieflax.data.tokenizer import train_bpe

    tmp = tempfile.mkdtemp(prefix="tieflax-store-bench-")
    tokenizer = os.path.join(tmp, "tokenizer.json")
    docs = load_documents(data_config("kjv"))
    train_bpe((d.text for d in docs), vocab_size=8192, eos_token="<|endoftext|>").save(tokenizer)

    prep = [time_prepare(args.corpus, tokenizer, os.path.join(tmp, f"store{w}"), w, args.shard_mb) for w in (1, 2)]
    assert prep[0]["digest"] == prep[1]["digest"], "1 and 2 workers must build the same store"
    local = os.path.join(tmp, "store1")
    m = open_store(local).manifest
    store = open_store(local)
    for split in ("train", "val"):
        write_token_file(os.path.join(tmp, f"{split}.bin"), store.tokens(split)[:], vocab_size=m["vocab_size"])

    kinds = {} if args.prepare_only else {"memmap .bin": ("memmap", tmp, {}), "local store": ("store", local, {})}
    server = None
    if not args.no_emulator and not args.prepare_only:
        from object_store import GcsServer

        server = GcsServer()
        os.environ.update(server.env)
        remote = server.new_bucket() + "/store"
        from tieflax.data.store_build import build_store

        build_store(data_config(args.corpus, tokenizer), remote, workers=2,
                    shard_bytes=int(args.shard_mb * (1 << 20)))
        kinds["gs:// store (emulator)"] = ("store", remote, dict(server.env))
    read = {}
    try:
        for name, (kind, path, env) in kinds.items():
            read[name] = {p: time_loader(kind, path, m["vocab_size"], m["eos_id"], args, p, env) for p in (1, 2)}
    finally:
        if server is not None:
            server.stop()
        storage.rmtree(tmp)

    print(f"token store: {args.corpus}, {m['splits']['train']['tokens']:,} train tokens, vocabulary "
          f"{m['vocab_size']}, loader batch {args.batch} x seq {args.seq_len}, {os.cpu_count()} CPUs")
    for p in prep:
        print(f"  prepare, {p['workers']} worker(s): tokenise {p['tokenise_tps'] / 1e6:.2f}M tokens/s "
              f"({p['tokenise_s']:.1f} s), total {p['total_tps'] / 1e6:.2f}M tokens/s ({p['total_s']:.1f} s); "
              f"per worker CPU-second {p['tokens_per_worker_cpu_s'] / 1e6:.2f}M tokens, workers' CPU "
              f"{p['worker_cpu_s']:.1f} s, main process CPU {p['main_cpu_s']:.1f} s")
    print(f"  prepare speed-up, 2 workers / 1: {prep[1]['tokenise_tps'] / prep[0]['tokenise_tps']:.2f}x (tokenise), "
          f"{prep[1]['total_tps'] / prep[0]['total_tps']:.2f}x (total)")
    base = read["memmap .bin"][1][0] if read else 1.0
    for name, r in read.items():
        print(f"  read, {name:<24} 1 process {r[1][0] / 1e6:6.2f}M tokens/s ({r[1][0] / base:.2f}x memmap); "
              f"2 processes {', '.join(f'{x / 1e6:.2f}M' for x in r[2])} tokens/s each")
    print(json.dumps({"benchmark": "token_store", "corpus": args.corpus, "seq_len": args.seq_len,
                      "batch": args.batch, "prepare": [{k: (round(v, 3) if isinstance(v, float) else v)
                                                        for k, v in p.items() if k != "digest"} for p in prep],
                      "read_tokens_per_s": {name: {str(p): [round(x) for x in v] for p, v in r.items()}
                                            for name, r in read.items()}}))


if __name__ == "__main__":
    from tieflax.hardware.process import prepare_process

    prepare_process()  # as the tieflax console starts: JAX kept off libtpu where no TPU is attached
    main()
