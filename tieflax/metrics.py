"""Run metrics: ``metrics.jsonl`` and TensorBoard event files in the workdir, a progress bar on process 0.

Only process 0 writes; the others get a writer whose methods do nothing, so the training loop never
branches on the process index. One JSON object per line: ``{"step": int, "split": "train"|"val"|...,
<name>: float, ...}``.

Watch a run with ``tensorboard --logdir WORKDIR``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

from tieflax.errors import UserError

METRICS_FILE = "metrics.jsonl"


class MetricsFileError(UserError, ValueError):
    """``metrics.jsonl`` holds a line that is not JSON; the message names the file, the line and the fix."""


class MetricWriter:
    """Appends metrics to ``<workdir>/metrics.jsonl`` and TensorBoard (``<workdir>/tensorboard``).

    ``enabled=False`` (every process but 0) makes every method a no-op. Appending keeps the history of
    a resumed run in one file; rows after a resume repeat the steps since the last checkpoint.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS_FILE)
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        _drop_partial_last_row(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional at import time)

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        """One row of scalars; names become TensorBoard tags ``<split>/<name>``."""
        if not self.enabled:
            return
        row = {"step": int(step), "split": split}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self._tb.add_scalar(f"{split}/{k}", float(v), int(step))

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _drop_partial_last_row(path: str) -> None:
    """A run killed while writing a row leaves it without its newline; appending would glue the next row
    to it. The partial row carries nothing (its interval is retrained), so it is cut off."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        content = f.read()
        f.truncate(content.rfind(b"\n") + 1)


def _jsonable(v):
    v = float(v) if not isinstance(v, (int, str, bool)) else v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; "nan"/"inf" keep the row parseable by strict readers
    return v


def read_metrics(workdir_or_path: str, split: str | None = None) -> list[dict]:
    """Rows of a run's ``metrics.jsonl`` (optionally one split), later rows winning for a repeated step."""
    path = workdir_or_path
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    rows: dict[tuple[str, int], dict] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    if number > 1 and not line.endswith("\n"):
                        continue  # the last row of a run killed while writing it
                    raise MetricsFileError(f"{path} line {number} is not valid JSON ({e.msg}): delete that line "
                                     "(the other rows are kept)") from None
                if split is None or row.get("split") == split:
                    rows[(row.get("split"), row["step"])] = row
    return sorted(rows.values(), key=lambda r: (r["step"], r.get("split", "")))


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on process 0 (``enabled``); elsewhere a bar that prints nothing."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, unit="step")
