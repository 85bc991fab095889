"""The largest temporaries of a compiled XLA program, named by the JAX operation that made them.

``tieflax plan`` compiles with ``xla_dump_to`` set. XLA then writes, per program, the optimized HLO
(``*after_optimizations.txt``: every instruction with the ``op_name`` JAX gave it, e.g.
``jit(step)/transpose(jvp(TransformerLM.loss))/.../block_3/attn/...``) and its buffer assignment
(``*after_optimizations-buffer-assignment.txt``: allocations, and the values each one holds with their
per-device size, offset and shape). The TPU compiler writes both even when it fails for lack of memory,
which is when they matter most: its error says only how much was needed.

Temporaries live in the allocations marked ``preallocated-temp`` in memory space 0 (HBM; TPU's other
colours are on-chip memories). Values that share a place (offset and size) in that allocation, such as
a buffer that a loop updates in place and the loop's result, occupy it once and count once, named after
the operation that wrote most of them. Places of one shape filled by one operation (per layer:
``block_*``) are grouped, so "3.00 GiB f32[48,4,2048,2048] x 8, block_*/attn/..." reads as eight such
buffers; the per-device sizes include the TPU's tile padding.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections import Counter

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One kind of temporary: ``count`` values of ``bytes`` each (per device), ``shape`` without layout."""
    bytes: int
    shape: str
    op: str
    count: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def largest_temporaries(dump_dir: str, top: int = 5) -> list[Buffer]:
    """The ``top`` largest kinds of temporaries of the biggest program dumped in ``dump_dir``.

    Returns [] when the folder holds no buffer assignment (a compiler that dumps none).
    """
    assignments = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
    best, best_values = None, []
    for path in assignments:
        values = _temp_values(path)
        if sum(v[1] for v in _places(values)) > sum(v[1] for v in _places(best_values)) or best is None:
            best, best_values = path, values
    if not best_values:
        return []
    hlo = best.replace("-buffer-assignment.txt", ".txt")
    ops = _OpNames(hlo) if os.path.isfile(hlo) else None
    groups: Counter = Counter()
    for names, size, shape in _places(best_values):
        named = Counter(short_op_name(ops.of(name)) if ops else "" for name in names)
        op = max(named, key=lambda o: (bool(o), named[o]))   # the most frequent name; a name over none
        groups[(size, _strip_layout(shape), op)] += 1
    ranked = sorted(groups.items(), key=lambda kv: (-kv[0][0], -kv[1], kv[0][1]))
    return [Buffer(size, shape, op, count) for (size, shape, op), count in ranked[:top]]


def _places(values: list[tuple[str, int, int, str]]) -> list[tuple[list[str], int, str]]:
    """Values grouped by their place in the allocation: ([value names], bytes, shape of the first)."""
    places: dict[tuple[int, int], list] = {}
    for name, size, offset, shape in values:
        places.setdefault((offset, size), [[], size, shape])[0].append(name)
    return [tuple(p) for p in places.values()]


def _temp_values(path: str) -> list[tuple[str, int, int, str]]:
    """(value name, bytes, offset, shape) of every value in an HBM ``preallocated-temp`` allocation."""
    values, in_temp = [], False
    with open(path, errors="replace") as f:
        for line in f:
            m = _ALLOCATION.match(line)
            if m:
                header = m.group(3)
                in_temp = "preallocated-temp" in header and not re.search(r"\bcolor [1-9]", header)
                continue
            if in_temp:
                v = _VALUE.match(line)
                if v and not v.group(4).startswith("("):  # tuples are tables of pointers, not data
                    values.append((v.group(1), int(v.group(2)), int(v.group(3)), v.group(4)))
    return values


def _strip_layout(shape: str) -> str:
    """``f32[48,2048]{1,0:T(8,128)}`` -> ``f32[48,2048]``."""
    return re.sub(r"\{[^{}]*\}$", "", shape)


def short_op_name(op: str) -> str:
    """Drops the ``jit(step)/`` prefix and Flax ``Module.method`` scopes; layer indices become ``*``."""
    parts = op.split("/")
    if parts and parts[0].startswith("jit("):
        parts = parts[1:]
    parts = [p for p in parts if not re.fullmatch(r"[A-Z]\w*\.\w+", p)]
    text = re.sub(r"(block|layers)_\d+", r"\1_*", "/".join(parts))
    return text if len(text) <= 110 else "..." + text[-107:]


class _OpNames:
    """Instruction name -> JAX op_name, following fusions to the root that produced a tuple element."""

    def __init__(self, path: str):
        self.op: dict[str, str] = {}
        self.calls: dict[str, str] = {}
        self.root: dict[str, tuple[str, list[str]]] = {}   # computation -> (root name, tuple operands)
        computation = None
        with open(path, errors="replace") as f:
            for line in f:
                if not line.startswith(" "):
                    m = _COMPUTATION.match(line)
                    computation = m.group(1) if m else computation
                    continue
                m = _INSTRUCTION.match(line)
                if not m:
                    continue
                is_root, name, rest = m.groups()
                op = _OP_NAME.search(rest)
                if op:
                    self.op[name] = op.group(1)
                calls = _CALLS.search(rest)
                if calls:
                    self.calls[name] = calls.group(1)
                if is_root and computation:
                    operands = []
                    t = re.search(r"\btuple\((.*)\)", rest)
                    if t:
                        cleaned = re.sub(r"/\*[^*]*\*/", "", t.group(1))
                        operands = [o.strip().lstrip("%") for o in cleaned.split(",") if o.strip()]
                    self.root[computation] = (name, operands)

    def of(self, value: str, depth: int = 0) -> str:
        """op_name of a buffer-assignment value such as ``fusion.12{1}`` ('' when none is recorded)."""
        name, _, index = value.partition("{")
        index = int(index.rstrip("}").split(",")[0]) if index.rstrip("}").split(",")[0].isdigit() else None
        if depth < 6 and name in self.calls and self.calls[name] in self.root:
            root, operands = self.root[self.calls[name]]
            inner = operands[index] if index is not None and index < len(operands) else root
            found = self.of(inner, depth + 1)
            if found:
                return found
        return self.op.get(name, "")
