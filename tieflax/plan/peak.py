"""What is live at the compiled step's peak, grouped by where it comes from (``tieflax plan --explain``).

XLA dumps, beside the buffer assignment that ``tieflax.plan.buffers`` reads, the live range of every
value of the program (``*after_optimizations-live-range.txt``: ``name{index}:start-end`` in the order of
the schedule, nested loops' bodies included). Several values can be one buffer: a loop's operand, its
body's parameter and its result, or a ``dynamic_update_slice`` done in place. Here each value is looked
up in the buffer assignment, and at each point of the schedule a place (allocation, offset, size) counts
once if any of its values is live; the peak is the point with the most bytes of temporaries live. (The
dump's own "Live ranges at N (peak)" counts values, not places, arguments included: a loop's operand
and result twice, and not always at the temporaries' peak, so it is not used.)

Places in the ``preallocated-temp`` allocation are the step's temporaries; the others are its
arguments (parameters, optimizer state, batch) and constants. Temporaries are sorted by origin, from the
JAX op name of the instruction that wrote them (``tieflax.plan.buffers._OpNames``) and the instruction:

* ``copy``: a ``copy`` instruction (XLA's own, e.g. a loop operand that could not share its buffer);
* ``gathered weights and reduced gradients (FSDP)``: a collective's result (``all-reduce``, ...), or
  the buffer an ``all-reduce`` gathers a weight into (TPU: ``constant_dynamic-update-slice``);
* attention kernels' own residuals and scratch (splash, cuDNN) count as a layer's working set;
* ``loss``: the fused cross-entropy (``/platform/`` or ``cross_entropy`` in the op name);
* ``saved for the backward (layer stack)``: written by the forward's layer loop into a [layers, ...]
  buffer (``dynamic_update_slice`` under ``jvp``, not ``transpose``): what autodiff keeps per layer;
* ``weight gradients (layer stack)``: the same, written by the backward's layer loop (``transpose``);
* ``working set of a layer or chunk``: anything else made inside a loop body (``/while/body/``), and
  what a layer's attention makes once for every layer (``/attn/`` outside the loop: the document mask);
* ``optimizer update and metrics``: made outside autodiff (no ``jvp`` in the op name);
* ``other``: the rest (the embedding and the head outside the layer loop, for one).

The ``temporaries`` figure of ``memory_analysis()`` is the size of the temp allocation: the live bytes at
the peak plus what the heap simulator could not pack (and, with TPU's libtpu before 0.0.52, more: see
``benchmarks/scan_temp_accounting.py``). The report gives both, so the gap between them is named too.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

from tieflax.plan.buffers import _OpNames, _strip_layout, short_op_name

_RANGE = re.compile(r"^\s+(\S+?)(\{[\d,]*\})?:(\d+)-(\d+)\s*$")
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")

ORIGINS = ("saved for the backward (layer stack)", "weight gradients (layer stack)",
           "working set of a layer or chunk", "gathered weights and reduced gradients (FSDP)", "loss",
           "optimizer update and metrics", "copy", "other")


@dataclasses.dataclass(frozen=True)
class Place:
    """One buffer live at the peak: ``bytes`` per device, ``shape`` (no layout), the op that wrote it."""
    bytes: int
    shape: str
    op: str
    origin: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PeakAccounting:
    """The temporaries live at the step's peak, by origin, and the arguments live there, per device."""
    places: list            # Place, temporaries only, biggest first
    arguments: int          # bytes of non-temporary places live at the peak (parameters, state, batch)
    temp_allocation: int    # bytes of the temp allocation(s): what memory_analysis() calls temporaries

    @property
    def live_temporaries(self) -> int:
        return sum(p.bytes for p in self.places)

    def by_origin(self) -> list[tuple[str, int, list[Place]]]:
        """(origin, bytes, its places biggest first), in ``ORIGINS`` order, empty origins left out."""
        groups = [(o, [p for p in self.places if p.origin == o]) for o in ORIGINS]
        return [(o, sum(p.bytes for p in ps), ps) for o, ps in groups if ps]

    def as_dict(self) -> dict:
        return dict(live_temporaries=self.live_temporaries, arguments=self.arguments,
                    temp_allocation=self.temp_allocation,
                    by_origin={o: b for o, b, _ in self.by_origin()},
                    places=[p.as_dict() for p in self.places])


def peak_accounting(dump_dir: str) -> PeakAccounting | None:
    """The accounting of the largest program dumped in ``dump_dir`` (the train step), or None when the
    compiler wrote no live ranges there."""
    ranges = glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt"))
    best = max(ranges, key=os.path.getsize, default=None)
    if best is None:
        return None
    base = best[: -len("-live-range.txt")]
    assignment, hlo = base + "-buffer-assignment.txt", base + ".txt"
    if not os.path.isfile(assignment):
        return None
    where, temp_size = _value_places(assignment)
    ops = _OpNames(hlo) if os.path.isfile(hlo) else None
    live = live_at_peak(live_ranges(best), where)
    seen: dict[tuple, list[str]] = {}
    arguments = 0
    for key, names in live.items():
        if where[names[0]][1]:
            seen[key] = names
        else:
            arguments += key[2]
    writers: dict[tuple, list[str]] = {}   # every value the buffer assignment put in a place
    for name, (key, _, _) in where.items():
        writers.setdefault(key, []).append(name)
    places = []
    for key, names in seen.items():
        shape = where[names[0]][2]
        # Named by what wrote the place: the values live at the peak are often a loop's result or its
        # body's parameter, which carry no op name of their own.
        candidates = [ops.of(n) if ops else "" for n in names + writers.get(key, [])]
        op = max(candidates, key=_informative, default="")
        places.append(Place(key[2], shape, short_op_name(op), classify(names + writers.get(key, []), op)))
    places.sort(key=lambda p: (-p.bytes, p.origin, p.shape))
    return PeakAccounting(places, arguments, temp_size)


def live_ranges(path: str) -> list[tuple[str, int, int]]:
    """(value name, first, last point of the schedule) of every value of a ``-live-range.txt`` dump."""
    ranges = []
    with open(path, errors="replace") as f:
        for line in f:
            m = _RANGE.match(line)
            if m:
                index = m.group(2) or "{}"
                ranges.append((m.group(1) + ("" if index == "{}" else index), int(m.group(3)), int(m.group(4))))
    return ranges


def live_at_peak(ranges: list[tuple[str, int, int]], where: dict) -> dict[tuple, list[str]]:
    """{place: [its values live there]} at the point of the schedule where the most bytes of temporaries
    are live, a place counted once however many of its values are live. Values the buffer assignment
    does not place (tuples, constants folded away) are left out."""
    temp = {key for key, is_temp, _ in where.values() if is_temp}
    events: list[tuple[int, int, tuple]] = []
    for name, start, end in ranges:
        if name in where:
            events += [(start, 1, where[name][0]), (end + 1, -1, where[name][0])]
    events.sort(key=lambda e: (e[0], e[1]))   # at one point, what ends goes before what starts
    count: dict[tuple, int] = {}
    live = best = 0
    best_point = None
    for point, step, key in events:
        before = count.get(key, 0)
        count[key] = before + step
        if key in temp and before == 0 and step == 1:
            live += key[2]
        elif key in temp and before == 1 and step == -1:
            live -= key[2]
        if live > best:
            best, best_point = live, point
    if best_point is None:
        return {}
    places: dict[tuple, list[str]] = {}
    for name, start, end in ranges:
        if name in where and start <= best_point <= end:
            places.setdefault(where[name][0], []).append(name)
    return places


def _value_places(path: str) -> tuple[dict[str, tuple[tuple, bool, str]], int]:
    """{value name: ((allocation, offset, size), in the temp allocation, shape)}, and the temp bytes."""
    where, temp_size, allocation, is_temp = {}, 0, None, False
    with open(path, errors="replace") as f:
        for line in f:
            m = _ALLOCATION.match(line)
            if m:
                allocation = int(m.group(1))
                is_temp = "preallocated-temp" in m.group(3) and not re.search(r"\bcolor [1-9]", m.group(3))
                temp_size += int(m.group(2)) if is_temp else 0
                continue
            v = _VALUE.match(line)
            if v and allocation is not None and not v.group(4).startswith("("):
                name = v.group(1).removesuffix("{}")
                where.setdefault(name, ((allocation, int(v.group(3)), int(v.group(2))), is_temp,
                                        _strip_layout(v.group(4))))
    return where, temp_size


def _informative(op: str) -> tuple:
    """Orders op names for naming a place: a layer loop's ``dynamic_update_slice`` (the stack's writer)
    first, then any name inside a loop, then any name at all."""
    return ("/while/body/" in op and "dynamic_update_slice" in op, "/while/body/" in op, bool(op))


def classify(names: list[str], op: str) -> str:
    """The origin (one of ``ORIGINS``) of a place holding the values ``names``, written by ``op``."""
    if any(re.match(r"copy(\.\d+)?(\{|$)", n) or n.startswith("copy-start") for n in names):
        return "copy"
    if any(re.match(r"(all-reduce|all-gather|reduce-scatter|constant_dynamic-update-slice)", n)
           for n in names):
        return "gathered weights and reduced gradients (FSDP)"
    if any(re.search(r"splash|fmha|dot_product_attention|flash", n) for n in names):
        return "working set of a layer or chunk"
    if "/platform/" in op or "cross_entropy" in op:
        return "loss"
    in_loop = "/while/body/" in op
    if in_loop and "dynamic_update_slice" in op and "jvp(" in op:
        return ("weight gradients (layer stack)" if "transpose(" in op
                else "saved for the backward (layer stack)")
    if in_loop or "/attn/" in op:   # the attention's mask, made once for all the layers, counts here too
        return "working set of a layer or chunk"
    if op and "jvp(" not in op:
        return "optimizer update and metrics"
    return "other"


def format_accounting(a: PeakAccounting, gib, top: int = 4) -> list[str]:
    """Lines of ``tieflax plan --explain``'s table: per origin its bytes and largest places."""
    lines = [f"  at the peak of the train step (XLA's live ranges, per device): {gib(a.live_temporaries)} of "
             f"temporaries live beside {gib(a.arguments)} of arguments; the temp allocation is "
             f"{gib(a.temp_allocation)} ({gib(a.temp_allocation - a.live_temporaries)} more: not packed, "
             f"or live elsewhere)"]
    for origin, size, places in a.by_origin():
        lines.append(f"    {gib(size):>10}  {origin} ({len(places)} buffers)")
        shown: dict[tuple, int] = {}
        for p in places:
            shown[(p.bytes, p.shape, p.op)] = shown.get((p.bytes, p.shape, p.op), 0) + 1
        for (size1, shape, op), count in list(shown.items())[:top]:
            lines.append(f"      {gib(size1):>10} {shape} x{count}  {op}")
    return lines
