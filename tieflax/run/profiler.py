"""A profiler window: ``config.train.profile_steps = (start, stop)`` traces steps start..stop.

The trace is JAX's (``jax.profiler.start_trace``/``stop_trace``: the XLA ops of every device, the host's
Python and the runtime), with a ``train`` step marker (``StepTraceAnnotation``) per step, the layout that
TensorBoard's profile plugin and xprof read::

    <workdir>/profile/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<host>.xplane.pb   (and <host>.trace.json.gz)

Open it with ``tensorboard --logdir <workdir>/profile`` (the ``tensorboard`` extra brings the profile
plugin) or ``xprof --logdir <workdir>/profile``. Steps are counted from 1, as the console and the metrics
count them; a run resumed inside the window traces the rest of it, one resumed after it traces nothing.
The trace is written to a local folder and copied whole through ``tieflax.storage`` when it stops, so a
workdir on a bucket gets it too. Only process 0 traces (its devices and host; on a pod each host's
program is the same).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Sequence

from tieflax import storage
from tieflax.run.layout import PROFILE_DIR, RunDir


class ProfileWindow:
    """``before(n)`` ahead of step n, ``step(n)`` around it, ``after(n, out)`` once it was dispatched."""

    def __init__(self, window: Sequence[int], where: RunDir, *, enabled: bool = True,
                 say: Callable[[str], None] = lambda line: None):
        self.start, self.stop = (int(window[0]), int(window[1])) if enabled and len(window) == 2 else (0, -1)
        self.target = where.file(PROFILE_DIR)  # the run's profile/ (``Run.dir``)
        self.say = say
        self._local = None
        self._first = None

    @property
    def tracing(self) -> bool:
        return self._local is not None

    def before(self, n: int) -> None:
        if not self.tracing and self.start <= n <= self.stop:
            import jax  # noqa: PLC0415

            self._local = tempfile.TemporaryDirectory(prefix="tieflax-profile-")
            self._first = n
            jax.profiler.start_trace(self._local.name)

    def step(self, n: int):
        if not self.tracing:
            return contextlib.nullcontext()
        import jax  # noqa: PLC0415

        return jax.profiler.StepTraceAnnotation("train", step_num=n)

    def ends_at(self, n: int) -> bool:
        """True when step n is the window's last: ``after(n, out)`` then stops the trace and copies it."""
        return self.tracing and n >= self.stop

    def after(self, n: int, out: Any) -> None:
        if self.ends_at(n):
            self._finish(n, out)

    def _finish(self, n: int, out: Any) -> None:
        import jax  # noqa: PLC0415

        local, self._local = self._local, None
        try:
            jax.block_until_ready(out)   # the traced steps' device work ends inside the trace
            jax.profiler.stop_trace()
            target = self.target
            files = storage.walk_files(local.name)
            for path in files:
                rel = os.path.relpath(path, local.name)
                storage.upload_file(path, storage.join(target, *rel.split(os.sep)))
        finally:
            local.cleanup()
        traces = sorted({storage.join(target, *os.path.relpath(os.path.dirname(p), local.name).split(os.sep))
                         for p in files if p.endswith(".xplane.pb")})
        where = traces[0] if len(traces) == 1 else target
        self.say(f"profile of steps {self._first}-{n} written to {where} (open with: tensorboard --logdir "
                 f"{target}, Profile tab; or xprof --logdir {target})")

    def close(self, n: int, out: Any = None) -> None:
        """Ends a window the run stopped inside (the last step, a preemption, an error)."""
        if self.tracing:
            self._finish(n, out)
