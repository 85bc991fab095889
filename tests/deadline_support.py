"""Helpers shared by the tests of the storage deadline (a helper module, not a test file): the deadline the
commands run under (``DEADLINE``) and the cap on waiting for their progress (``PROGRESS_CAP_S``), their
variables against a test server (``deadline_env``, ``train_env``), the small training run they stop and resume
(``TRAIN``, ``STEPS`` steps), the steps it has committed to the bucket (``committed_steps``) and the run that
never stopped, which both tests compare with (``reference_argv``).

Used by tests/test_storage_deadline.py and tests/test_storage_deadline_two_processes.py."""

from __future__ import annotations

import os

from tieflax import storage

# The storage deadline the commands of those tests run under. It must exceed the slowest honest answer, or
# a test measures the machine's load instead of a frozen bucket: the emulator is a Python process beside the
# training ones, and on a loaded 2-core machine (two CPU-bound processes beside a suite) a call it did answer
# once took longer than the 6 s this was, so a run stopped before its first checkpoint. Every bound of those
# tests is derived from it.
DEADLINE = 15
# A cap on waiting for progress (a run reaching its first checkpoint, a prepare its third shard), not a
# measure: the wait ends with that progress or with the process; the cap only ends a hang.
PROGRESS_CAP_S = 1200


def deadline_env(server, **extra) -> dict:
    """The commands' variables: this server, this deadline. Compiled as the suite compiles (without XLA's
    backend optimisations, tests/conftest.py): with TRAIN's 512-token vocabulary a step is cheap, and the
    optimised compile cost more than it saved (one 120-step run, cold cache then warm: 15.6 and 7.0 CPU-s
    optimised, 10.4 and 7.7 not; with tiny.py's 8,192 tokens the optimisations had paid)."""
    return {**os.environ, **server.env, storage.DEADLINE_ENV: str(DEADLINE), "JAX_PLATFORMS": "cpu", **extra}


# A 512-token BPE (the one tests/test_eval_harness.py's runs train on the same corpus, in the suite's data
# cache): with tiny.py's 8,192 a step of this model cost ten times as much (the head and the loss over the
# vocabulary), and what is tested is where a run stops and how it resumes, not what it learns. 80 steps: a
# stop comes at the first log step after the bucket goes quiet (its metrics write waits the deadline), so
# well before the end of a run frozen after its first checkpoint (step 20), even where the freeze comes a
# second late (a step takes some 7 ms on 2 devices), and a resume from step 20, 40 or 60 still crosses a
# checkpoint. (120 steps on the test process's 8 devices cost a third more CPU in the single-process runs.)
TRAIN = ["--config", "configs/experiments/tiny.py", "--config.model.d_model=32", "--config.model.n_layers=1",
         "--config.model.n_heads=2", "--config.model.d_ff=64", "--config.model.max_seq_len=32",
         "--config.model.vocab_size=512", "--config.data.tokenizer.vocab_size=512",
         "--config.train.seq_len=32", "--config.train.global_batch_size=8", "--config.train.num_steps=80",
         "--config.train.log_every=10", "--config.train.checkpoint_every=20", "--config.train.eval_every=1000"]


STEPS = int(next(a for a in TRAIN if a.startswith("--config.train.num_steps=")).split("=")[1])


def committed_steps(server, bucket: str) -> list[int]:
    """Steps committed in ``bucket``'s run: orbax's step-level ``checkpoints/<n>/commit_success.txt`` (the
    ``state`` item has a commit marker of its own, written before the step's)."""
    return sorted(int(o.split("/")[2]) for o in server.objects(bucket, "run/checkpoints/")
                  if o.count("/") == 3 and o.endswith("/commit_success.txt"))


def reference_argv(workdir: str) -> list[str]:
    """``tieflax train``'s arguments for the run that never stopped: in a local folder, saving only its last
    step (where a run keeps its files and how often it saves change neither its losses nor its compiled
    programs, and the emulator, a Python process counted in the suite's time, serves no third run's writes).
    Both tests run it as one process x 2 devices (``train_env``) with this same command, so the second to run
    it finds every program in the suite's compilation cache."""
    return ["--workdir", workdir, *TRAIN, f"--config.train.checkpoint_every={STEPS}"]


def train_env(server, devices: int = 2, **extra) -> dict:
    """``deadline_env`` for a training command on ``devices`` CPU devices per process, under a checkpoint
    deadline of twice the storage deadline."""
    from train_support import suite_xla_flags  # noqa: PLC0415

    return deadline_env(server, TIEFLAX_CHECKPOINT_DEADLINE_S=str(2 * DEADLINE), XLA_FLAGS=suite_xla_flags(devices),
                        **extra)
