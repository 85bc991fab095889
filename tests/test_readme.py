"""The README's promises that a test can hold: CI runs exactly its test command."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def test_ci_runs_exactly_the_readme_test_command():
    readme_commands = re.findall(r"```bash\n(.*?)\n```", _read("README.md"), flags=re.S)
    ci_command = _read(".ci/run").strip().splitlines()[-1]
    assert ci_command in [c.strip() for c in readme_commands], (
        "the last line of .ci/run must be one of the README's bash commands, verbatim")
