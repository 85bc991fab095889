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


class ConfigValueError(UserError, ValueError):
    """A config section (``compare``, ``sweep``, ...) holds a value that cannot be used; the message names
    the field and the valid choices. A ValueError too, so callers that caught ValueError still do."""
