"""The one error type the package raises for failures of the user's input or environment.

Every error class that means "the input, a file or the environment is not as needed; the message names it
and the fix" derives from :class:`UserError` (ConfigError, DataError, CheckpointError, WorkdirError,
StorageError, PlanError, ...). The console (``tieflax.cli``) prints such an error as one line; any other
exception is a bug of tieflax and keeps its traceback. This module imports nothing, so any module,
however light, can use it.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure of the input or the environment, not of tieflax: ``str(e)`` names what and the fix."""


class ConfigError(UserError, ValueError):
    """A config value cannot be used: the message names the field (``config.<section>.<field>``) and the
    fix. The one error of every section's checks (model, train, data, mesh, seed, compare, sweep, tasks),
    each beside that section's defaults. A ValueError too, so callers that caught ValueError still do."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived while a command ran: raised where the program was, so every ``with``
    block on the way out (the workdir lock, partial folders) is left and cleaned up as on any error.
    A BaseException, like KeyboardInterrupt, so that ``except Exception`` handlers do not swallow it.

    ``message``: what the stop kept and lost, when the raiser knows (the trainer's second Ctrl-C); else
    the console says it in the words of the command (``ON_INTERRUPT`` of its module)."""

    def __init__(self, signum: int, message: str | None = None):
        import signal  # noqa: PLC0415

        self.signum = signum
        self.code = 128 + signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT
        self.signal_name = signal.Signals(signum).name
        self.explained = message is not None
        super().__init__(message or f"stopped by {self.signal_name}")
