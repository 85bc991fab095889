"""A config section's rules as data, checked by one function (``check_section``).

Each section of the experiment config states its rules as two tables beside its defaults:

    RANGES   {field: Range(lo, hi, lo_ok, hi_ok, why)}   a number in [lo, hi] ('(' or ')' where an end is
                                                          not allowed itself); an integer field when lo is
    CHOICES  {field: (value, ...)}                        one of these values (and of its type)

``train_config`` (``config.train``), ``data.config`` (``config.data``, whose fields may be dotted:
``tokenizer.vocab_size``), ``model.config`` (``config.model``) and ``config`` (the root's ``seed``) keep
theirs; ``check_section`` refuses the first value out of its rule in one line naming
``config.<section>.<field>``, the rule, why it has one and the override that fixes it. What a table cannot
say (a tuple of names, fields that must fit together) is a short function beside the tables that raises
the same ConfigError.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from tieflax.errors import ConfigError

INF = float("inf")


class Range(NamedTuple):
    """A number in ``[lo, hi]``; ``lo_ok``/``hi_ok`` False leave that end out; ``why``: what the field is,
    said in the refusal. An integer field when ``lo`` is an int."""
    lo: float
    hi: float = INF
    lo_ok: bool = True
    hi_ok: bool = True
    why: str = ""

    @property
    def integer(self) -> bool:
        return isinstance(self.lo, int)


def _value(c: Any, field: str) -> tuple[bool, Any]:
    """``(present, value)`` of a field, dotted through subsections (``tokenizer.vocab_size``)."""
    node = c
    for name in field.split("."):
        if name not in node:
            return False, None
        node = node[name]
    return True, node


def check_section(section: str, c: Any, ranges: Mapping[str, Range] | None = None,
                  choices: Mapping[str, tuple] | None = None, *, error: type[ConfigError] = ConfigError) -> None:
    """Refuses the first field of ``c`` (the section ``section``, e.g. ``'config.train'``) out of its
    range or choices, with ``error``; a field the section lacks is not checked."""
    for field, rule in (ranges or {}).items():
        present, value = _value(c, field)
        if not present:
            continue
        name = f"{section}.{field}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (rule.integer and not isinstance(value, int)):
            kind = "an integer" if rule.integer else "a number"
            raise error(f"{name} = {value!r} must be {kind} ({rule.why}).")
        below = value < rule.lo or (value == rule.lo and not rule.lo_ok)
        above = value > rule.hi or (value == rule.hi and not rule.hi_ok)
        if below or above or value != value:  # value != value: NaN
            left, right = ("[" if rule.lo_ok else "("), ("]" if rule.hi_ok else ")")
            hi_text = "inf" if rule.hi == INF else rule.hi
            raise error(f"{name} = {value!r} is out of range {left}{rule.lo}, {hi_text}{right} ({rule.why}); "
                        f"set --{name} to a value in that range.")
    for field, allowed in (choices or {}).items():
        present, value = _value(c, field)
        # Of the same type too: 1 == True, but a switch given 1 is a mistake to name, not True.
        if present and not any(value == a and type(value) is type(a) for a in allowed):
            raise error(f"{section}.{field} = {value!r} is not one of {allowed}.")
