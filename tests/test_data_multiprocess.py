"""Two real JAX processes (CPU, gloo): each loads its own share, and to_global_batch assembles the batch.

Each process builds the loader with its own ``jax.process_index()``, turns its local rows into global
arrays on a 2x2 (data x fsdp) mesh over both processes' devices, gathers the result back to the host,
and checks it equals the global batch a single process would have produced. Two processes of two
CPU devices each start in parallel in a few seconds.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    from tieflax.hardware import distributed
    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), cpu=True)
    import jax
    from jax.experimental import multihost_utils
    from tieflax.data import PreparedDataset, make_loader, to_global_batch
    from tieflax.sharding import make_mesh

    rng = np.random.default_rng(0)
    parts = []
    for _ in range(40):
        parts += [[0], rng.integers(1, 500, rng.integers(1, 21))]
    train = np.concatenate(parts + [[0]]).astype(np.uint16)
    prepared = PreparedDataset(train, train, np.bincount(train, minlength=500), 500, 0, None, Path("."), {})
    mesh = make_mesh(data=2, fsdp=2)
    mine = make_loader(prepared, "train", seq_len=8, global_batch_size=8, seed=3)
    whole = make_loader(prepared, "train", seq_len=8, global_batch_size=8, seed=3,
                        process_index=0, process_count=1)
    ok = True
    for _ in range(3):
        local = next(mine)
        assert local["inputs"].shape == (4, 8), local["inputs"].shape
        glob = to_global_batch(local, mesh)
        want = next(whole)
        for k, v in glob.items():
            assert v.shape == (8, 8)
            got = multihost_utils.process_allgather(v, tiled=True)
            ok &= bool(np.array_equal(got, want[k]))
    print(json.dumps({"process": jax.process_index(), "ok": ok}))
""")


def test_two_processes_assemble_the_same_global_batch_as_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from train_support import suite_xla_flags  # noqa: PLC0415

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=suite_xla_flags(2))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["process"] for r in results) == [0, 1]
    assert all(r["ok"] for r in results), results
