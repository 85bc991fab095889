"""Trackers: where a run's logged scalars go besides ``metrics/``: TensorBoard and Weights & Biases.

``config.train.trackers`` names them (default ``("tensorboard",)``); ``open_trackers`` opens them on
process 0 (every other process gets none), and ``tieflax.run.metrics.MetricWriter`` hands each one the
same calls: ``log(step, {"<split>/<name>": value})`` for every row, ``text(tag, text)``, ``flush()`` at
every log period and ``close()`` at the end.

TensorBoard (``tensorboardX``, no TensorFlow): event files in ``<workdir>/tensorboard/``; on a bucket they
are written to a local folder and copied whole at every flush, so a TensorBoard pointed at the bucket
follows the run while it trains (``tensorboard --logdir WORKDIR``, the ``tensorboard`` extra).

Weights & Biases (``wandb``, the ``wandb`` extra): one W&B run per tieflax run. Its name, group, tags,
project and entity come from ``config.train.wandb_*`` (the name defaults to the workdir's name) and the
whole config is the W&B run's config. Its id is kept in ``<workdir>/wandb_run.json``, created by the first
start: every resume (SIGTERM, kill -9, another machine) passes it back with ``resume="allow"`` and
continues the same W&B run. Scalars are logged against the run's own step (the ``step`` key, every other
key plotted over it) rather than W&B's internal one, which must only grow: a run resumed from a
checkpoint logs again the steps it repeats. W&B's local files go to ``<workdir>/wandb/`` (on a bucket: a
local folder, copied whole when the command ends); ``WANDB_MODE=offline`` trains without network and
``wandb sync <workdir>/wandb/offline-run-*`` uploads later. W&B's file is written every
``FLUSH_SECONDS`` (wandb's default, 15 s, would lose that much of a run killed with -9). wandb's own
console output is switched off: tieflax prints one line naming the W&B run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from typing import Callable, Mapping, Optional, Sequence

from tieflax import storage
from tieflax.errors import UserError
from tieflax.run.layout import TENSORBOARD_DIR, WANDB_DIR, WANDB_RUN_FILE, RunDir

NAMES = ("tensorboard", "wandb")
FLUSH_SECONDS = 1.0   # W&B writes its local run file at least this often
EXTRAS = {"tensorboard": "tensorboardX", "wandb": "wandb"}


class TrackerError(UserError, RuntimeError):
    """A tracker cannot start (not installed, refused by its service); the message says what to do."""


def _finite(scalars: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in scalars.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def _new_run_id() -> str:
    """Eight random characters of [a-z0-9], as W&B's own run ids."""
    import secrets  # noqa: PLC0415

    return "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))


def _copy_tree(local: str, remote: str) -> None:
    for path in storage.walk_files(local):
        rel = os.path.relpath(path, local)
        storage.upload_file(path, storage.join(remote, *rel.split(os.sep)))


# What tensorboardX imports only for what tieflax never asks of it: torch (to accept torch tensors), boto3
# and google-cloud-storage (to write s3:// and gs:// itself; tieflax hands it a local folder and copies).
_NOT_NEEDED_BY_TENSORBOARDX = ("torch", "boto3", "google.cloud.storage")


def _summary_writer_class():
    """``tensorboardX.SummaryWriter``, imported without the packages it would import for nothing.

    tensorboardX imports torch, boto3 and google-cloud-storage whenever they are installed (about 1.9 s of
    CPU in every training process where they are). Those not yet imported are hidden for the length of this
    import (``sys.modules[name] = None`` makes importing them raise ImportError, which tensorboardX
    catches) and made importable again right after.
    """
    hidden = [] if "tensorboardX" in sys.modules else [m for m in _NOT_NEEDED_BY_TENSORBOARDX
                                                          if m not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional at import time)
    finally:
        for name in hidden:
            del sys.modules[name]
    return SummaryWriter


class TensorBoard:
    """tensorboardX event files in ``<workdir>/tensorboard/`` (on a bucket: copied whole at each flush)."""

    def __init__(self, where: RunDir):
        """``where``: the run (``Run.dir``)."""
        SummaryWriter = _summary_writer_class()
        self.folder = where.file(TENSORBOARD_DIR)
        self._local = None
        tb_dir = self.folder
        if storage.is_remote(tb_dir):  # written here, copied whole to the bucket at each flush
            self._local = tempfile.TemporaryDirectory(prefix="tieflax-tb-")
            tb_dir = self._local.name
        self._tb = SummaryWriter(tb_dir)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for k, v in _finite(scalars).items():
            self._tb.add_scalar(k, v, int(step))

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self._tb.add_text(tag, text, step)

    def flush(self) -> None:
        self._tb.flush()
        if self._local is not None:
            _copy_tree(self._local.name, self.folder)

    def _writer_died(self) -> bool:
        """True when a tensorboardX writer thread died (an OSError such as a full disk kills it): closing
        would then put its shutdown signal into a full queue that nothing empties, and wait forever."""
        writers = getattr(self._tb, "all_writers", None) or {}
        for file_writer in writers.values():
            worker = getattr(getattr(file_writer, "event_writer", None), "_worker", None)
            if worker is not None and not worker.is_alive():
                return True
        return False

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if not self._writer_died():  # else its events are lost anyway; the OS error is reported elsewhere
                self._tb.close()
            if self._local is not None:
                self._local.cleanup()
                self._local = None


class WandB:
    """One W&B run per tieflax run (module docstring); ``say`` gets the line that names it."""

    def __init__(self, where: RunDir, config, *, say: Callable[[str], None] = lambda line: None):
        try:
            import wandb  # noqa: PLC0415
        except ImportError:
            raise TrackerError("config.train.trackers names 'wandb' but the wandb package is not installed: "
                               "pip install -e '.[wandb]' (or drop 'wandb' from config.train.trackers)") from None
        self.where = where  # the run (``Run.dir``)
        t = config.train
        record_path = where.file(WANDB_RUN_FILE)
        saved = json.loads(storage.read_text(record_path)) if storage.is_file(record_path) else None
        run_id = saved["id"] if saved else _new_run_id()
        self._local = None
        root = where.path
        if storage.is_remote(root):  # W&B writes its files here; copied whole to <workdir>/wandb/ on close
            self._local = tempfile.TemporaryDirectory(prefix="tieflax-wandb-")
            root = self._local.name
        name = t.wandb_name or storage.name(where.path)
        settings = dict(silent=True, console="off", save_code=False)
        if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
            # wandb 0.31 writes its local run file every 15 s: a run killed with -9 lost up to 15 s of
            # rows that precede its last checkpoint (the resume logs the steps after it again)
            settings["x_transaction_log_flush_interval"] = FLUSH_SECONDS
        try:
            self.run = wandb.init(
                project=t.wandb_project or None, entity=t.wandb_entity or None, name=name,
                group=t.wandb_group or None, tags=list(t.wandb_tags) or None, id=run_id, resume="allow",
                dir=root, config=json.loads(config.to_json_best_effort()), settings=wandb.Settings(**settings))
        except Exception as e:  # noqa: BLE001 (wandb raises its own errors and plain ones: one line for all)
            if self._local is not None:
                self._local.cleanup()
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TrackerError(f"Weights & Biases did not start ({first}): log in with `wandb login`, or set "
                               "WANDB_MODE=offline to log locally (sync later with `wandb sync`)") from None
        if saved is None:
            storage.create_new(record_path, json.dumps(dict(
                id=run_id, project=t.wandb_project, entity=t.wandb_entity, name=name, group=t.wandb_group),
                indent=1).encode())
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._step: Optional[int] = None
        self._row: dict[str, float] = {}
        shown = self.run.url if self.run.settings.mode == "online" and self.run.url else where.file(WANDB_DIR)
        say(f"W&B run {name} (id {run_id}, {'continued' if saved else 'new'}, {self.run.settings.mode}): {shown}")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._step is not None and int(step) != self._step:
            self._commit()
        self._step = int(step)
        self._row.update(_finite(scalars))

    def _commit(self) -> None:
        if self._step is not None and self._row:
            self.run.log({"step": self._step, **self._row})
        self._step, self._row = None, {}

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """The config is the W&B run's config already; other texts are not sent."""

    def flush(self) -> None:
        self._commit()

    def close(self) -> None:
        try:
            self._commit()
            self.run.finish()
        finally:
            if self._local is not None:
                try:
                    _copy_tree(os.path.join(self._local.name, WANDB_DIR), self.where.file(WANDB_DIR))
                finally:
                    self._local.cleanup()
                    self._local = None


def check_installed(names: Sequence[str]) -> None:
    """Refuses, before any work, a tracker whose package is missing (one line, with the extra to install)."""
    import importlib.util  # noqa: PLC0415

    for name in names:
        if importlib.util.find_spec(EXTRAS[name]) is None:
            raise TrackerError(f"config.train.trackers names {name!r} but the {EXTRAS[name]} package is not "
                               f"installed: pip install -e '.[{name}]' (or drop {name!r} from config.train.trackers)")


def open_trackers(names: Sequence[str], where: RunDir, config, *, enabled: bool = True,
                  say: Callable[[str], None] = lambda line: None) -> list:
    """The trackers ``names`` (``config.train.trackers``), opened on the process that logs (``enabled``)."""
    if not enabled:
        return []
    check_installed(names)
    out = []
    try:
        for name in names:
            out.append(TensorBoard(where) if name == "tensorboard" else WandB(where, config, say=say))
    except BaseException:
        for tracker in out:
            tracker.close()
        raise
    return out
