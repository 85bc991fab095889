"""A token store deleted or replaced while a run trains on it: one line naming the store and the step, exit
1, the last checkpoint kept (it read as zeros, exit 0, or ended in a 63-line traceback)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from store_support import corpus_config
from tieflax.data.store import CHECK_SECONDS
from tieflax.data.store_build import build_store


# A cap on waiting for progress (checkpoint 50, the process's end), not a measure: on a loaded 2-core machine
# compiling and training 50 steps can take minutes; the cap only ends a hang.
PROGRESS_CAP_S = 1200
# From the run's look at the changed store to its exit: the step in flight, the close (the pending checkpoint
# written) and the exit. Beside two CPU-bound processes on a loaded 2-core machine (load average 12) the
# whole stop, look included, took 5.7 s (deleted) and 7.7 s (replaced); 30 s leaves room for a slower
# machine. (Before the change a run read a deleted store as zeros and trained on, exit 0: no bound at all.)
STOP_S = 30


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    build_store(corpus_config(), str(root / "a"), workers=1, shard_bytes=64 << 10)
    other = corpus_config()
    other.split_seed = 7  # the same corpus held out otherwise: another store, another digest
    build_store(other, str(root / "b"), workers=1, shard_bytes=64 << 10)
    return root


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_store_deleted_or_replaced_mid_run_stops_in_one_line_naming_it_and_the_step(stores, tmp_path, how):
    store = tmp_path / "store"
    shutil.copytree(stores / "a", store)
    workdir = tmp_path / "w"
    argv = [sys.executable, "-m", "tieflax.cli", "train", "--config", "configs/experiments/tiny.py", "--workdir",
            str(workdir), "--config.data.source=tokens", f"--config.data.tokens.path={store}",
            "--config.model.vocab_size=512", "--config.model.d_model=32", "--config.model.n_layers=1",
            "--config.model.n_heads=2", "--config.model.d_ff=64", "--config.model.max_seq_len=32",
            "--config.train.seq_len=32", "--config.train.global_batch_size=8", "--config.train.num_steps=20000",
            # A constant learning rate (no warmup, no decay): the compiled step does not depend on num_steps, so
            # these runs and tests/test_checkpoint_outage.py's (60 steps) of the same model share one program
            # in the suite's compilation cache (a 20,000-step schedule was one of its own); what is tested is
            # how a run meets its store changing, not what it learns.
            "--config.train.warmup_steps=0", "--config.train.min_lr_ratio=1.0",
            "--config.train.log_every=10", "--config.train.checkpoint_every=50", "--config.train.eval_every=100"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    t0 = time.monotonic()  # the wait ends with the checkpoint or the process; the cap only ends a hang
    while not (workdir / "checkpoints" / "50").is_dir() and proc.poll() is None and time.monotonic() - t0 < PROGRESS_CAP_S:
        time.sleep(0.05)
    assert proc.poll() is None and (workdir / "checkpoints" / "50").is_dir(), proc.communicate()
    if how == "deleted":
        shutil.rmtree(store)
    else:  # another store's files written over this one's, manifest included
        shutil.copytree(stores / "b", store, dirs_exist_ok=True)
    t_change = time.monotonic()
    _, err = proc.communicate(timeout=PROGRESS_CAP_S)
    took = time.monotonic() - t_change
    said = [line for line in err.splitlines() if line.startswith("tieflax train:")]
    print(f"store {how} mid-run: exit {proc.returncode} after {took:.1f} s: {said}")
    assert proc.returncode == 1 and "Traceback" not in err and len(said) == 1, err
    m = re.fullmatch(rf"tieflax train: step (\d+): token store {re.escape(str(store))} was {how} while this run "
                     r"read it \(.*\); training stopped and its last checkpoint, step (\d+), is kept: put the store "
                     r"back .*", said[0])
    assert m, said
    kept = sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())
    assert kept and kept[-1] == int(m.group(2)) <= int(m.group(1)) < 20000, (kept, said)
    # A deleted store fails the next read at once; a replaced one is seen at the reader's next look at its
    # manifest, within CHECK_SECONDS; then the step in flight, the close (the pending checkpoint) and the exit.
    assert took < CHECK_SECONDS + STOP_S, took
