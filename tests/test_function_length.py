"""No function in tieflax/ is longer than 80 lines: a reader holds one on a screen and follows it.

Counted from the source (``ast``): the ``def`` line to the last line of its body, docstring and comments
included, decorators not. Nested functions count inside their parent and on their own.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

from tieflax import cli

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tieflax"
MAX_LINES = 80


def lengths_in(source: str, path: str) -> list[tuple[int, str]]:
    """``[(lines, 'path:Class.function'), ...]`` for every function in ``source``."""
    found = []

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((child.end_lineno - child.lineno + 1, f"{path}:{name}"))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, path), "")
    return found


def function_lengths() -> list[tuple[int, str]]:
    """Every function of the package, as ``lengths_in`` counts it."""
    return [found for file in sorted(PACKAGE.rglob("*.py"))
            for found in lengths_in(file.read_text(), str(file.relative_to(PACKAGE.parent)))]


def test_no_function_is_longer_than_80_lines():
    long = sorted(((n, where) for n, where in function_lengths() if n > MAX_LINES), reverse=True)
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(
        f"  {n:4d}  {where}" for n, where in long)


def test_the_count_sees_every_kind_of_function():
    """Methods, nested and async functions are found, each counted from ``def`` (decorators excluded) to
    its body's last line."""
    source = ("@decorator\n@another\ndef f():\n    def g():\n        return 1\n\n    return g\n\n\n"
              "class C:\n    async def m(self):\n        pass\n")
    assert sorted(lengths_in(source, "x.py")) == [(2, "x.py:C.m"), (2, "x.py:f.g"), (5, "x.py:f")]
    # A real one: the console's main, as inspect reads it (no decorators).
    assert (len(inspect.getsource(cli.main).splitlines()), "tieflax/cli.py:main") in function_lengths()
