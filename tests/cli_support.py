"""Helpers shared by the tests of what a command tells its user (a helper module, not a test file): the
experiment configs the error tests run (``COMPARE``, ``SCALING``, ``TINY``), ``one_line`` (a command run
in-process ends in one line of stderr and a given exit code) and ``WITHOUT`` (the console in a fresh
interpreter with some packages absent).

Used by tests/test_user_errors.py, test_bad_input_round_five.py and test_bad_paths_and_settings.py (the
configs, ``one_line``), test_run_identity.py and test_record_values.py (``one_line``), test_extras_missing.py
and test_prepare_ray.py (``WITHOUT``)."""

from __future__ import annotations

import os

from train_support import REPO
from tieflax.cli import main

COMPARE = os.path.join(REPO, "configs", "experiments", "tie_vs_untie.py")
SCALING = os.path.join(REPO, "configs", "experiments", "tie_scaling.py")
TINY = os.path.join(REPO, "configs", "experiments", "tiny.py")


def one_line(capsys, argv, code=1) -> str:
    """Runs ``tieflax argv`` in this process (what was captured before is dropped); asserts it returns
    ``code`` and writes one line to stderr, starting ``tieflax <command>: ``; -> that line."""
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tieflax {argv[0]}: "), err
    return err


# `python -c WITHOUT <hidden,...> tieflax args...`: the console with those top-level packages absent.
WITHOUT = """
import importlib.abc, sys
hidden = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
from tieflax.cli import main
sys.argv = ["tieflax", *sys.argv[2:]]
sys.exit(main())
"""
