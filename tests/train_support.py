"""Helpers shared by the training tests (a helper module, not a test file): a micro config on a small offline corpus."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tieflax.config import default_config, default_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def micro_config(data_dir: str, *, tied: bool = True, num_steps: int = 20):
    """A 1-layer, d=32 model on 40 stdlib files with a 512-token BPE: seconds per run on a CPU."""
    c = default_config()
    c.model = default_model_config(family="llama", vocab_size=512, d_model=32, n_layers=1, n_heads=2,
                                   d_ff=64, max_seq_len=32, tie_embeddings=tied)
    c.data.source = "python_stdlib"
    c.data.python_stdlib.max_files = 40
    c.data.tokenizer.vocab_size = 512
    c.data.val_fraction = 0.2
    c.data.cache_dir = os.path.join(data_dir, "data_cache")
    c.data.tokenizer.path = os.path.join(data_dir, "tokenizer.json")
    c.data.read_threads = 0  # deterministic and light on a 2-core machine
    t = c.train
    t.seq_len, t.global_batch_size, t.num_steps = 32, 16, num_steps
    t.learning_rate, t.warmup_steps = 1e-2, 5
    t.log_every, t.checkpoint_every, t.eval_every, t.eval_batches = 5, 5, 10_000, 2
    t.loss_token_block, t.loss_vocab_block = 128, 256
    return c


def prepare_shared_data(data_dir: str) -> None:
    """Trains the tokenizer and tokenises the corpus once; later runs reuse both."""
    from tieflax.data import prepare_dataset

    c = micro_config(data_dir)
    c.data.tokenizer.path = ""
    prepare_dataset(c.data, data_dir, vocab_size=c.model.vocab_size)
    assert os.path.isfile(os.path.join(data_dir, "tokenizer.json"))


def config_overrides(config) -> list[str]:
    """The config as ``--config.a.b=v`` arguments (for subprocess runs of `tieflax train`)."""
    out = []

    def walk(node, prefix):
        for k, v in node.items():
            if hasattr(v, "items"):
                walk(v, f"{prefix}{k}.")
            elif v is not None:
                out.append(f"--config.{prefix}{k}={v!r}" if isinstance(v, str)
                           else f"--config.{prefix}{k}={v}")
    walk(config, "")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def suite_xla_flags(devices: int | None, xla_emitters: bool = False) -> str:
    """The suite's ``XLA_FLAGS`` (tests/conftest.py: its compiler settings) for a subprocess with ``devices``
    CPU devices; None: without a device count, for a launcher that sets its own. ``xla_emitters``: with
    XLA's own CPU emitters, not the suite's older ones."""
    dropped = ("--xla_force_host_platform_device_count=",) + (("--xla_cpu_use_fusion_emitters=",) if xla_emitters else ())
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(dropped)]
    return " ".join(([f"--xla_force_host_platform_device_count={devices}"] if devices is not None else []) + flags)


def subprocess_env(devices: int, **extra: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = suite_xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # JAX_COMPILATION_CACHE_DIR comes from tests/conftest.py: runs of one config share their compiled
    # programs, which roughly halves the time of the second and later runs.
    env.update(extra)
    return env


def start_train(workdir: str, config, *, devices: int = 8, log_path: str | None = None,
                **env: str) -> subprocess.Popen:
    """``python -m tieflax.cli train --workdir ... <config as overrides>`` in the background."""
    cmd = [sys.executable, "-m", "tieflax.cli", "train", "--config",
           os.path.join(REPO, "configs", "experiments", "tiny.py"), "--workdir", workdir,
           *config_overrides(config)]
    out = open(log_path or os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"), "w")
    return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(devices, **env), stdout=out,
                            stderr=subprocess.STDOUT)


def full_disk_at(monkeypatch, *patterns: str) -> None:
    """A full disk under the paths matching ``patterns`` (fnmatch): what tieflax.storage writes there
    (whole files, create-only files) and what ``np.save`` writes there go to /dev/full, so the write fails
    with the kernel's own ENOSPC ("No space left on device", no file name), as on a full disk. Files
    elsewhere are written as usual. Skips where there is no /dev/full."""
    import fnmatch
    import tempfile

    import numpy as np
    import pytest

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    full_fds: set[int] = set()
    real_mkstemp, real_open, real_fdopen, real_save = tempfile.mkstemp, os.open, os.fdopen, np.save

    def hit(path) -> bool:
        return any(fnmatch.fnmatch(str(path), p) for p in patterns)

    def full_fd() -> int:
        fd = real_open("/dev/full", os.O_WRONLY)
        full_fds.add(fd)
        return fd

    def mkstemp(suffix=None, prefix=None, dir=None, text=False):  # storage.write_bytes: ".<name>." in dir
        if dir is not None and prefix and hit(os.path.join(dir, prefix[1:-1])):
            return full_fd(), os.path.join(dir, f"{prefix}full{suffix or ''}")
        return real_mkstemp(suffix, prefix, dir, text)

    def open_(path, flags, mode=0o777, *, dir_fd=None):  # storage.create_new: O_CREAT | O_EXCL
        if flags & os.O_CREAT and hit(path):
            return full_fd()
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fdopen(fd, *args, **kwargs):  # unbuffered: the write itself fails, before anything else runs
        if fd in full_fds:
            full_fds.discard(fd)
            return open(fd, "wb", buffering=0)
        return real_fdopen(fd, *args, **kwargs)

    def save(file, arr, *args, **kwargs):  # the data cache's np.save(path, array)
        if isinstance(file, (str, os.PathLike)) and hit(file):
            with open("/dev/full", "wb", buffering=0) as f:
                return real_save(f, arr, *args, **kwargs)
        return real_save(file, arr, *args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fdopen", fdopen)
    monkeypatch.setattr(np, "save", save)


def torch_one_thread():
    """A context in which torch's CPU ops run on one thread (its previous count restored after). On the
    suite's loaded 2-core machine torch's intra-op workers spin while they wait for the CPU: the tuned-lens
    reference of tests/test_literature.py (250 steps of a 2-layer lens) took 15.7 CPU-s on torch's 2
    threads and 0.4 s on one (one run each, 2026-12-07). What runs is the same; sums over a few hundred
    numbers may round in another order."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def one():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return one()


def _placeholder_png() -> bytes:
    """A 1 x 1 grey PNG: what `plots_not_rendered` leaves where a plot would be."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b""))


def plots_not_rendered(monkeypatch) -> None:
    """For a test that reads no plot of the report it makes: every figure is still built from the numbers
    (tieflax.analysis.plots), but not laid out and rendered to PNG (``_save``: tight_layout and savefig,
    most of a compare report's time). A PNG already at the path is left as it is; where there is none, a
    1 x 1 placeholder is written (the report's HTML embeds every PNG it names)."""
    from tieflax import storage
    from tieflax.analysis import plots

    def save(fig, path: str) -> str:
        if not storage.exists(path):
            storage.write_bytes(path, _placeholder_png())
        return path

    monkeypatch.setattr(plots, "_save", save)
