"""Run metrics: immutable JSON-lines segments and TensorBoard events in the workdir, a progress bar.

Only process 0 writes; the others get a writer whose methods do nothing, so the training loop never
branches on the process index. A row is ``{"step": int, "split": "train"|"val"|..., <name>: float, ...}``.

Object stores have no append, so the log is a folder of segments, each written whole, once::

    metrics/<session>-<seq>.jsonl     rows of one log period; <session> is the writer's start time in ns,
                                      so names sort in the order they were written

``read_metrics`` reads them back as one stream (later rows win for a repeated step: a resumed run repeats
the steps since its last checkpoint). A run written before segments (one ``metrics.jsonl``) still reads.

Every row also goes to the run's trackers (``tieflax.run.trackers``: TensorBoard, Weights & Biases) as
``<split>/<name>`` scalars; each tracker is flushed with the segment. Watch a run with
``tensorboard --logdir WORKDIR``.
"""

from __future__ import annotations

import json
import math
import time
from typing import Mapping, Optional, Sequence

from tieflax import storage
from tieflax.errors import UserError
from tieflax.run.layout import LEGACY_METRICS_FILE, METRICS_DIR, RunDir


class MetricsFileError(UserError, ValueError):
    """A metrics segment holds a line that is not JSON; the message names the file, the line and the fix."""


class MetricWriter:
    """Buffers rows and writes them as one new segment per ``flush`` (each log period), plus the trackers.

    ``where``: the run (``Run.dir``), its segments in ``metrics/``. ``enabled=False (every process but 0) makes
    every method a no-op. ``path`` is the segment folder.
    ``trackers``: opened trackers (``tieflax.run.trackers.open_trackers``); None = TensorBoard alone when
    ``tensorboard`` (the writer closes them).
    """

    def __init__(self, where: RunDir, *, enabled: bool = True, tensorboard: bool = True,
                 trackers: Optional[Sequence] = None):
        self.enabled = enabled
        self.where = where
        self.path = where.file(METRICS_DIR)
        self._session = f"{time.time_ns():020d}"
        self._seq = 0
        self._rows: list[str] = []
        self.trackers: list = []
        if not enabled:
            return
        if trackers is None and tensorboard:
            from tieflax.run.trackers import TensorBoard  # noqa: PLC0415

            trackers = [TensorBoard(where)]
        self.trackers = list(trackers or ())

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        """One row of scalars (kept until ``flush``); the trackers get them as ``<split>/<name>``."""
        if not self.enabled:
            return
        row = {"step": int(step), "split": split}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        self._rows.append(json.dumps(row, allow_nan=False))
        scalars = {f"{split}/{k}": v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        for tracker in self.trackers:
            tracker.log(int(step), scalars)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.enabled:
            for tracker in self.trackers:
                tracker.text(tag, text, step)

    def flush(self) -> None:
        """Writes the rows since the last flush as one new segment, and brings the trackers up to date."""
        if not self.enabled:
            return
        if self._rows:
            name = f"{self._session}-{self._seq:06d}.jsonl"
            storage.write_text(storage.join(self.path, name), "\n".join(self._rows) + "\n")
            self._rows, self._seq = [], self._seq + 1
        for tracker in self.trackers:
            tracker.flush()

    def close(self) -> None:
        """Flushes what is left and closes every tracker; a failed final write is raised after closing."""
        first = None
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 (every tracker is still closed; the first failure raised)
            first = e
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                first = first or e
        if first is not None:
            raise first


def _jsonable(v):
    v = float(v) if not isinstance(v, (int, str, bool)) else v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; "nan"/"inf" keep the row parseable by strict readers
    return v


def metric_files(workdir_or_path: str) -> list[str]:
    """The files holding a run's rows, in the order they were written (legacy ``metrics.jsonl`` first).

    ``workdir_or_path``: a workdir, its ``metrics/`` folder, or one ``.jsonl`` file."""
    path = str(workdir_or_path).rstrip("/") or "/"
    if path.endswith(".jsonl"):
        return [path]
    if storage.name(path) == METRICS_DIR:
        path = storage.parent(path)
    files = [storage.join(path, LEGACY_METRICS_FILE)] if storage.is_file(
        storage.join(path, LEGACY_METRICS_FILE)) else []
    folder = storage.join(path, METRICS_DIR)
    return files + [storage.join(folder, n) for n in storage.listdir(folder) if n.endswith(".jsonl")]


def read_metrics(workdir_or_path: str, split: str | None = None) -> list[dict]:
    """Rows of a run (optionally one split), later rows winning for a repeated step, sorted by step.

    Raises FileNotFoundError when the run has logged nothing yet."""
    files = metric_files(workdir_or_path)
    if not files:
        raise FileNotFoundError(2, "no metrics logged yet (no metrics/ segments)", str(workdir_or_path))
    rows: dict[tuple[str, int], dict] = {}
    for path in files:
        lines = storage.read_text(path).split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if number == len(lines) and number > 1 and storage.name(path) == LEGACY_METRICS_FILE:
                    continue  # the last row of an old-format run killed while appending it
                raise MetricsFileError(f"{path} line {number} is not valid JSON ({e.msg}): delete that line "
                                       "(the other rows are kept)") from None
            if split is None or row.get("split") == split:
                rows[(row.get("split"), row["step"])] = row
    return sorted(rows.values(), key=lambda r: (r["step"], r.get("split", "")))
