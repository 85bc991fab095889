"""What training prints while it runs: a line per log interval, a line per event, or a progress bar.

``config.train.console`` picks (process 0 prints; the others print nothing):

- ``'lines'``: one plain line per log interval on stdout, no carriage returns, so a log file on a pod
  reads line by line, and one line per checkpoint saved::

      tieflax: step 40/250 | loss 5.4321 | lr 1.00e-02 | 0.0412 s/step | 49,710 tokens/s/device |
               0.032 TFLOP/s/device | MFU 41.2% | memory 12.1 of 79.1 GiB          (one line in the log)

  MFU where the chip's peak is known (``tieflax.hardware.targets``; none for a CPU), memory where the backend
  reports it (``device.memory_stats()`` on TPU and GPU: the most any local device holds). The first
  interval after a start includes compilation: it shows its wall time instead of a throughput.
- ``'bar'``: a tqdm progress bar on stderr with the loss, as before these lines existed.
- ``'auto'`` (default): ``'lines'`` when stdout is not a terminal; in a terminal (or a notebook) the bar,
  with the lines printed above it.
- ``'quiet'``: neither (the command's final line is all).

Events (resuming, a preemption, a checkpoint set aside, the W&B run, a profile written, tasks scored)
get one line in every mode; checkpoint saves wherever interval lines are printed.
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional, Sequence

MODES = ("auto", "lines", "bar", "quiet")
GIB = float(1 << 30)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _is_notebook(stream) -> bool:
    """A Jupyter/Colab cell's output (ipykernel's stream): tqdm.auto draws a widget there, no ``\r``."""
    return type(stream).__module__.startswith("ipykernel")


def resolve(mode: str, stream=None) -> tuple[bool, bool]:
    """``(lines, bar)`` for a ``config.train.console`` mode, ``'auto'`` decided by whether ``stream``
    (stdout) is a terminal (or a notebook's output)."""
    if mode == "auto":
        stream = stream if stream is not None else sys.stdout
        return True, _is_terminal(stream) or _is_notebook(stream)
    return mode == "lines", mode == "bar"


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on process 0 (``enabled``); elsewhere a bar that prints nothing."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, unit="step")


def for_study(mode: str) -> str:
    """The mode of a run trained inside a study (``tieflax compare`` / ``sweep``), which prints its own
    progress line per run: ``'auto'`` becomes the bar alone in a terminal (stderr) and ``'quiet'``
    elsewhere; a mode set on purpose is kept."""
    if mode != "auto":
        return mode
    return "bar" if _is_terminal(sys.stderr) else "quiet"


def device_memory(devices: Sequence) -> dict[str, float]:
    """``{'memory_gib', 'memory_peak_gib', 'memory_limit_gib'}``: the most any of ``devices`` (this
    process's) holds now and at its peak, and its limit; {} where the backend reports nothing (a CPU)."""
    stats = []
    for d in devices:
        try:
            s = d.memory_stats()
        except Exception:  # noqa: BLE001 (a backend without the call, or one that raises for it)
            s = None
        if s and "bytes_in_use" in s:
            stats.append(s)
    if not stats:
        return {}
    out = {"memory_gib": max(s["bytes_in_use"] for s in stats) / GIB}
    if all("peak_bytes_in_use" in s for s in stats):
        out["memory_peak_gib"] = max(s["peak_bytes_in_use"] for s in stats) / GIB
    if all(s.get("bytes_limit") for s in stats):
        out["memory_limit_gib"] = min(s["bytes_limit"] for s in stats) / GIB
    return out


def interval_line(step: int, total: int, summary: Mapping[str, float],
                  first_seconds: Optional[float] = None, steps: int = 0) -> str:
    """The line of one log interval (module docstring). ``first_seconds``: the wall time of an interval
    that included compilation (``steps`` steps), shown instead of the throughput."""
    parts = [f"step {step}/{total}", f"loss {summary['loss']:.4f}"]
    if "learning_rate" in summary:
        parts.append(f"lr {summary['learning_rate']:.2e}")
    if "step_time" in summary:
        parts.append(f"{summary['step_time']:.4g} s/step")
        parts.append(f"{summary['tokens_per_second_per_device']:,.0f} tokens/s/device")
        if "tflops_per_device" in summary:
            parts.append(f"{summary['tflops_per_device']:.3g} TFLOP/s/device")
        if "mfu" in summary:
            parts.append(f"MFU {100 * summary['mfu']:.1f}%")
    elif first_seconds is not None:
        parts.append(f"{steps} steps in {first_seconds:.1f} s (with compilation)")
    if "memory_gib" in summary:
        limit = f" of {summary['memory_limit_gib']:.1f}" if "memory_limit_gib" in summary else ""
        parts.append(f"memory {summary['memory_gib']:.2f}{limit} GiB")
    return "tieflax: " + " | ".join(parts)


class Console:
    """Process 0's console during training (``enabled``); elsewhere every method does nothing."""

    def __init__(self, mode: str, total: int, initial: int, *, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.total = total
        self.lines, bar = resolve(mode, stream) if enabled else (False, False)
        self._bar = None
        if bar:
            self._bar = progress_bar(total, initial, enabled=True)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def event(self, text: str) -> None:
        """One line in every mode: resume, preemption, a checkpoint set aside, a tracker, a profile."""
        if self.enabled:
            self._print(f"tieflax: {text}")

    def progress(self, text: str) -> None:
        """One line where interval lines are printed (checkpoint saves)."""
        if self.enabled and self.lines:
            self._print(f"tieflax: {text}")

    def interval(self, step: int, summary: Mapping[str, float], *, first_seconds: Optional[float] = None,
                 steps: int = 0) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{summary['loss']:.3f}")
        if self.lines:
            self._print(interval_line(step, self.total, summary, first_seconds, steps))

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
