"""The package's floors: every import, function-level ones included, points down.

A room is a sub-package (``run/``) or a top-level module (``config``). Rooms on one floor never import each
other ("around"), a room never imports a room on a higher floor ("up"), and no modules import each other
in a loop. Read from the source (``ast``), nothing is imported, so a lazy import inside a function that
would run up is caught as surely as one at the top of a file.

The floors and why each room sits where it does: docs/design.md, "The import floors". When a room moves,
FLOORS below moves with it in the same commit.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tieflax"

# Bottom to top (docs/design.md, "The import floors"): errors, storage/ (its lease included), ops at the bottom; data and model
# above them; hardware/ (chips, peaks, model FLOPs, MFU; the platform probe; multi-process start-up and
# its bounded waits) above model, below run/ and train, whose console reports MFU; run/ above storage; train/ above run; plan/ (compiles train's steps), study above train/;
# commands on top. eval/ (the lm-eval backend) sits between run/ and train: training scores lm-eval tasks
# on its live parameters (config.train.eval_tasks), and eval/ never needed train.
FLOORS = [
    {"errors"},
    {"storage/", "strict_json", "sharding", "config_rules"},
    {"ops/"},
    {"data/", "model/"},
    {"train_config", "analysis/", "hardware/"},
    {"config"},
    {"run/"},
    {"eval/"},
    {"train/", "interop/"},
    {"plan/"},
    {"study/"},
    {"commands/"},
    {"cli"},
]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "tieflax"
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def _existing(name: str) -> str | None:
    """The longest prefix of a dotted name that is a module of the package."""
    parts = name.split(".")
    while parts:
        p = PACKAGE.parent.joinpath(*parts)
        if p.with_suffix(".py").is_file() or (p / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def package_imports() -> dict[str, set[str]]:
    """``{module: {modules of the package it imports anywhere in its body}}``."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                    base = ".".join(pkg + ([base] if base else []))
                # `from pkg import mod` names the module; `from pkg import name` the package itself
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [n for n in subs if _existing(n) == n] or [base]
                if len(names) < len(subs):
                    names.append(base)
            for name in names:
                target = _existing(name) if name.startswith("tieflax") else None
                if target and target != module and target != "tieflax":
                    found.add(target)
        out[module] = found
    return out


def _floor(room: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"room {room!r} has no floor: add it to FLOORS in {__file__}")


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in package_imports()} - {"tieflax"}
    for room in sorted(rooms):
        _floor(room)
    declared = set().union(*FLOORS)
    assert not declared - rooms, f"FLOORS names rooms that no longer exist: {sorted(declared - rooms)}"


def test_every_import_points_down():
    wrong = []
    for module, targets in package_imports().items():
        here = _room(module)
        if here == "tieflax":
            continue
        for target in sorted(targets):
            there = _room(target)
            if there == here:
                continue
            if _floor(there) > _floor(here):
                wrong.append(f"{module} -> {target} (up: floor {_floor(here)} -> {_floor(there)})")
            elif _floor(there) == _floor(here):
                wrong.append(f"{module} -> {target} (around: both on floor {_floor(here)})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(wrong)


def test_no_modules_import_each_other_in_a_loop():
    graph = package_imports()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import loops:\n" + "\n".join(cycles)


def _private_names_imported(path: pathlib.Path):
    """``(imported module, name)`` for each ``from tieflax... import _name`` in the file at ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("tieflax"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.module, alias.name


def test_no_private_name_is_imported_from_another_room():
    """A name with a leading underscore is its room's own: another room that needs it gets it made public
    (a room's modules may share their private helpers)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for source, name in _private_names_imported(path):
            if _room(source) != _room(module):
                wrong.append(f"{module}: from {source} import {name}")
    assert not wrong, "private names imported across rooms:\n" + "\n".join(wrong)
