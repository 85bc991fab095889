"""The Run: a run directory opened once, for writing (``Run.open``) or for reading (``Run.read``).

    with Run.open(workdir, config, allow_change=("train.num_steps",)) as run:
        run.adopt_data(prepared.info, tokenizer_json)   # the data it trains on, checked and recorded
        run.open_checkpoints()                          # run.manager, run.saves
        step, state, params = run.restore(abstract_state, loader)   # a checkpoint, initial params or fresh
        run.record(step)
        run.open_writers(step)                          # run.console, run.writer (trackers), run.profiler
        ...train...
    # closed in order on every exit path: profiler, console, metric writer, saves, then the lease

``Run.open`` validates the config (the one check of every section a training command makes: ``run.model``
is the validated ``ModelConfig``), resolves and checks the workdir once (``run.dir``, a
``tieflax.run.layout.RunDir``: what every part is handed; ``run.path`` its canonical local path or URL),
refuses an interrupted import, takes the lease (``tieflax.run.lock``) and checks the run's identity
(``tieflax.run.identity``) before anything is written. Every part it opens (identity, checkpoints, lock,
metrics, trackers, profiler) takes its ``RunDir``, never the string; the training loop's hooks take the
Run, and the compute side (``tieflax.train.session.Session``) never sees it.

    run = Run.read(workdir, command="sample")   # evaluate, sample, val-loss, analyze, convert's source

``Run.read`` opens a run the same way less the lease, for commands that write nothing into it: the
handle of ``tieflax.run.read_only`` (config in force, checkpoints' parameters, the verified tokenizer).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

import ml_collections

from tieflax import storage
from tieflax.config import validate_config
from tieflax.model.config import ModelConfig
from tieflax.run import checkpoints as ckpt
from tieflax.run import identity
from tieflax.run.console import Console
from tieflax.run.destinations import check_no_partial_import
from tieflax.run.layout import TOKENIZER_FILE, RunDir
from tieflax.run.lock import Held, hold
from tieflax.run.metrics import MetricWriter, read_metrics
from tieflax.run.profiler import ProfileWindow
from tieflax.run.read_only import ReadOnlyRun
from tieflax.run.trackers import check_installed, open_trackers


class Run:
    """One run directory held for writing. Open with ``Run.open``; attributes appear as their part opens:

    ``dir``       where the run lives, resolved and checked once (``RunDir``); ``path`` its local path or URL
    ``config``    the config it trains with, validated once; ``model`` its ``ModelConfig``
    ``resume``    what the identity check found
    ``held``      the lease (``held.check()`` raises once another process took it over)
    ``manager``, ``saves``              after ``open_checkpoints``; ``restore`` then says where training starts
    ``console``, ``writer``, ``profiler``  after ``open_writers``; ``earlier``, the train rows logged before
    """

    def __init__(self, where: RunDir, config: ml_collections.ConfigDict, model: ModelConfig, held: Held,
                 resume: identity.Resume, *, is_main: bool):
        self.dir, self.path = where, where.path
        self.config, self.model, self.held, self.resume, self.is_main = config, model, held, resume, is_main
        self.data: dict | None = None
        self.manager = self.saves = None
        self.console: Console | None = None
        self.writer: MetricWriter | None = None
        self.profiler: ProfileWindow | None = None
        self.step = 0  # the last step trained; the profiler's window closes there
        self.earlier: list[dict] = []  # the train rows logged before this session (``open_writers``)
        self._also: list[Callable[[], Any]] = []
        self._closed = False

    @classmethod
    @contextlib.contextmanager
    def open(cls, workdir: str, config: ml_collections.ConfigDict, *, allow_change: Sequence[str] = (),
             command: str = "train") -> Iterator["Run"]:
        """Opens ``workdir`` for ``command``; closes everything it opened on the way out, in order."""
        import jax  # noqa: PLC0415

        model = validate_config(config)  # the config's one check, before anything is read or written
        # Resolved once (a malformed URL is refused here); a file, or a store orbax cannot write to, too.
        where = RunDir.at(workdir)
        check_no_partial_import(where)
        is_main = jax.process_index() == 0
        with hold(where, command, enabled=is_main) as held:
            check_installed(config.train.trackers)  # a missing tracker fails before any work, on every process
            # data_next: refused settings are named together with a change of data by ``adopt_data``
            resume = identity.check_resume(where, config, allow_change=tuple(allow_change), command=command,
                                           data_next=True)
            run = cls(where, config, model, held, resume, is_main=is_main)
            try:
                yield run
            finally:
                run.close()

    @staticmethod
    def read(workdir: str, *, command: str) -> ReadOnlyRun:
        """Opens ``workdir`` for ``command``, a reader: resolved and checked once, its record verified, no
        lease taken and nothing written (``tieflax.run.read_only``)."""
        return ReadOnlyRun.open(workdir, command=command)

    # ------------------------------------------------------------------------------------ identity
    def say(self, line: str) -> None:
        """One event line on process 0 (through the console once it is open)."""
        if self.console is not None:
            self.console.event(line)
        elif self.is_main:
            print(f"tieflax: {line}", flush=True)

    def adopt_data(self, info: dict, tokenizer_json: str | None) -> None:
        """Checks the data against the run's record (``identity.check_data``) and keeps the tokenizer the
        ids come from beside the run."""
        self.data = identity.data_record(info, tokenizer_json)
        identity.check_data(self.dir, self.data, self.resume)
        tokenizer_path = self.dir.file(TOKENIZER_FILE)
        if self.is_main and tokenizer_json is not None and not storage.is_file(tokenizer_path):
            storage.write_text(tokenizer_path, tokenizer_json)

    def record(self, start: int) -> None:
        """config.json once; a change made on purpose as a numbered config-history entry from ``start``
        (refused when its num_steps is below ``start``: ``identity.check_reached``)."""
        identity.check_reached(self.dir, self.config, self.resume, start)
        identity.record(self.dir, self.config, self.data, self.resume, start)
        if self.resume.changed and not self.resume.before_first_step:
            self.say(f"changed on purpose from step {start} on ({identity.CONFIG_HISTORY_DIR}/): "
                     + "; ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in self.resume.changed.items()))

    # ------------------------------------------------------------------------------ what it owns
    def open_checkpoints(self) -> None:
        """The checkpoint manager over ``checkpoints/`` and the watch over its background saves."""
        if self.resume.refused and self.data is None:  # held back for adopt_data, which was not called
            raise identity.RunChanged(self.resume.refused)
        self.manager = ckpt.make_manager(self.dir, keep=self.config.train.keep_checkpoints)
        self.saves = ckpt.SaveWatch(self.manager)

    def restore(self, abstract_state: Any, loader) -> tuple[int, Any, Any]:
        """Where training starts, said in one line: ``(step, state, None)`` from the newest readable checkpoint
        (``loader`` put at its position); else ``(0, None, params)``, the run's initial parameters (imports,
        surgery), to start with a fresh optimizer; else ``(0, None, None)``, a fresh start."""
        start, state = ckpt.restore_newest_readable(self.manager, self.dir, abstract_state, loader, say=self.say)
        if start is not None:
            self.say(f"finished before, at step {start} ({ckpt.CHECKPOINT_DIR}/{start}): nothing to train"
                     if start >= self.config.train.num_steps   # a rerun of a finished run: nothing trains
                     else f"resuming from step {start} ({ckpt.CHECKPOINT_DIR}/{start})")
            return start, state, None
        # No checkpoint finished: one begun and never finished (killed mid-save) is said, not passed over.
        unfinished = ckpt.unfinished_steps(self.dir)
        why = (f"checkpoint {unfinished[-1]} ({ckpt.CHECKPOINT_DIR}/{unfinished[-1]}) was never finished: the run "
               "was stopped while saving it") if unfinished else ""
        if ckpt.has_initial_params(self.dir):
            params = ckpt.load_initial_params(self.dir, abstract_state["params"])
            self.say(f"starting from {ckpt.INITIAL_PARAMS_DIR}/ (imported or converted parameters) at step 0"
                     f"{f' ({why})' if why else ''}: a fresh optimizer state and schedule, and the data from its "
                     "first batch")
            return 0, None, params
        if why:
            self.say(f"starting from step 0: {why}")
        return 0, None, None

    def open_writers(self, start: int) -> None:
        """The console (its bar from ``start``), the metric writer with its trackers, the profiler; the train
        rows logged before (``earlier``) read first."""
        t = self.config.train
        self.step = start
        self.earlier = self.logged_train_rows()  # before this session writes: its last interval may span a restart
        self.console = Console(t.console, t.num_steps, start, enabled=self.is_main)
        trackers = open_trackers(t.trackers, self.dir, self.config, enabled=self.is_main, say=self.say)
        self.writer = MetricWriter(self.dir, enabled=self.is_main, trackers=trackers)
        self.profiler = ProfileWindow(t.profile_steps, self.dir, enabled=self.is_main, say=self.say)
        if self.is_main and start == 0:
            self.writer.write_text("config", "```\n" + self.config.to_json_best_effort(indent=2) + "\n```")

    def logged_train_rows(self) -> list[dict]:
        """The train rows logged before this session (a resume's last interval may span the restart):
        read once, before this session writes any."""
        try:
            return read_metrics(self.path, "train")
        except FileNotFoundError:
            return []

    def also_close(self, closer: Callable[[], Any]) -> None:
        """Something the caller opened (a signal handler) closed after the Run's own parts."""
        self._also.append(closer)

    def close(self) -> None:
        """Closes what is open, in order: the profiler's window (at ``step``), the console, the metric
        writer (its last segment, the trackers), the saves (waits for the last one and raises its error),
        then what ``also_close`` added. Every part is closed; the first failure is raised unless an
        exception is already on its way (a full disk also fails the metrics' close: the failed save is
        the error to report). Once: the parts stay readable after it (the console still prints)."""
        if self._closed:
            return
        self._closed = True
        parts = [self.profiler and (lambda: self.profiler.close(self.step)), self.console and self.console.close,
                 self.writer and self.writer.close, self.saves and self.saves.close, *self._also]
        first = None
        for close in filter(None, parts):
            try:
                close()
            except Exception as e:  # noqa: BLE001
                first = first or e
        if first is not None and sys.exc_info()[1] is None:
            raise first
