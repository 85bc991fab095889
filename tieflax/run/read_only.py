"""A run directory opened for reading: where ``evaluate``, ``sample``, ``val-loss``, ``analyze`` and
``convert`` (its source run) start (``Run.read``).

    run = Run.read(workdir, command="sample")   # resolved and checked once; the record verified
    run.config                                   # the config in force (config.json, or its newest entry)
    params, step = run.params(step)              # host NumPy: checkpoint ``step`` (default: the latest)
    tokenizer = run.tokenizer()                  # tokenizer.json as the record names it (None: it has none)

It is checked as ``Run.open`` checks a run for training, less the lease and the comparison with a new
config: the location resolved once, at ``open`` (``layout.RunDir.at``); then, once, when the config
is first asked for, an interrupted import refused (``destinations.check_no_partial_import``), the record
verified against its digest chain and the config in force read back (``tieflax.run.saved_config``). A
reader writes nothing, so it cannot mend a broken record: its refusal names the training command that
does (``fix_by_training``).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from tieflax import storage
from tieflax.run import checkpoints as ckpt
from tieflax.run import record
from tieflax.run.destinations import check_no_partial_import
from tieflax.run.layout import CONFIG_HISTORY_DIR, TOKENIZER_FILE, RunDir, WorkdirError
from tieflax.run.saved_config import load_workdir_config


class TokenizerChanged(WorkdirError):
    """The run's ``tokenizer.json`` is not the tokenizer its record names (edited or replaced after the
    run trained): the ids a reader would decode are not the ids the model learned."""


def fix_by_training(problem: str, command: str, path: str) -> str:
    """The one line a reader refuses a broken record with: what is wrong, and the training command that
    mends it (only training may write a new entry of the record)."""
    return (f"{problem}: `tieflax {command}` reads the record as it is and cannot mend it: restore the file "
            f"from a backup, or start a new entry from the last checkpoint with `tieflax train --workdir {path} "
            f"--config FILE --allow-change FIELD` (recorded in {CONFIG_HISTORY_DIR}/), then rerun")


class ReadOnlyRun:
    """One run directory opened for reading (``open``); nothing is written through it.

    ``dir``      where the run lives (``RunDir``), resolved and checked at ``open``; ``path`` its local path
                 or ``gs://`` URL
    ``config``   the config in force, read (and the record verified) once, when first asked for: a command
                 may check its other arguments (``convert``'s --out) before anything of the run is read
    ``command``  the command reading it (its refusals name it)
    """

    def __init__(self, where: RunDir, command: str):
        self.dir, self.path, self.command = where, where.path, command
        self._config: ml_collections.ConfigDict | None = None

    @classmethod
    def open(cls, workdir: str, *, command: str) -> "ReadOnlyRun":
        """``workdir`` resolved once and refused when it cannot hold a run (a file, ``s3://``)."""
        return cls(RunDir.at(workdir), command)

    @property
    def config(self) -> ml_collections.ConfigDict:
        """The config in force (the command's own: a command may apply overrides to it). The first call
        verifies the run: an interrupted import is refused, NotARun when the folder holds no run,
        RecordBroken (with the training command's fix) when its record does not hold, ForeignCheckpoint
        when its newest checkpoint is another run's."""
        self.verify()
        return self._config

    def verify(self) -> None:
        """Checks the run and reads its config in force, once (``config``)."""
        if self._config is not None:
            return
        check_no_partial_import(self.dir)
        try:
            self._config = load_workdir_config(self.dir)
        except record.RecordBroken as e:
            raise record.RecordBroken(fix_by_training(e.problem, self.command, self.path), e.problem) from None

    def file(self, *names: str) -> str:
        """``<path>/<names...>``: a name of ``tieflax.run.layout`` inside this run."""
        return self.dir.file(*names)

    def params(self, step: int | None = None) -> tuple[Any, int]:
        """``(params, step)``: checkpoint ``step``'s parameters (default: the latest) as host NumPy arrays,
        or ``initial_params/`` at step 0 before the first checkpoint; only the parameters are read."""
        self.verify()  # the record before any checkpoint
        return ckpt.read_host_params(self.dir, step)

    def tokenizer(self):
        """The run's ``tokenizers.Tokenizer``; None when the run has no ``tokenizer.json`` (it trained on
        pre-tokenised data). Refused (TokenizerChanged) when the record names another tokenizer: a
        ``tokenizer.json`` edited after training would decode the model's ids into other text, silently."""
        from tieflax.data.tokenizer import load_tokenizer, tokenizer_digest  # noqa: PLC0415 (tokenizers: here only)

        self.verify()  # the record before the tokenizer it names
        path = self.file(TOKENIZER_FILE)
        if not storage.is_file(path):
            return None
        tok = load_tokenizer(path)
        named_by, data = record.data_record_in_force(self.dir)
        want = (data or {}).get("tokenizer")  # None: a run from before data records, or not trained yet
        have = tokenizer_digest(tok)[:len(want)] if want else None
        if want and have != want:
            raise TokenizerChanged(
                f"{path} is not the tokenizer the run's record names ({named_by} names tokenizer {want}, this file "
                f"is {have}): it was edited or replaced after the run trained; put back the run's own "
                f"{TOKENIZER_FILE} (the one its data was tokenised with), or train on with this one on purpose: "
                f"`tieflax train --workdir {self.path} --allow-change data` (recorded in {CONFIG_HISTORY_DIR}/)")
        return tok
