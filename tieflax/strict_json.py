"""Plain-JSON conversion shared by the study (``summary.json``) and the report that reads it back."""

from __future__ import annotations

import json
from typing import Any


def to_jsonable(x: Any) -> Any:
    """Tuples -> lists and NumPy/JAX scalars and arrays -> Python numbers and lists, recursively."""
    if isinstance(x, dict):
        return {k: to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return x.tolist()
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        return x.item()
    return x


# Strict JSON: NaN and infinities are not JSON (Python writes `NaN`, which other parsers refuse). They are
# written as the strings "NaN", "Infinity" and "-Infinity" and read back as floats by `loads`.
_NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def finite_or_named(x: Any) -> Any:
    """``to_jsonable(x)`` with every non-finite float replaced by its name ("NaN", "Infinity", ...)."""
    x = to_jsonable(x)
    if isinstance(x, dict):
        return {k: finite_or_named(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_or_named(v) for v in x]
    if isinstance(x, float) and x != x:
        return "NaN"
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def dumps(x: Any, **kwargs) -> str:
    """Strict JSON text of ``x`` (``allow_nan=False`` holds: non-finite floats become their names)."""
    return json.dumps(finite_or_named(x), allow_nan=False, **kwargs)


def _named_back(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _named_back(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_named_back(v) for v in x]
    if isinstance(x, str) and x in _NON_FINITE:
        return _NON_FINITE[x]
    return x


def loads(text: str) -> Any:
    """Reads what ``dumps`` wrote (and older files holding a bare NaN), non-finite floats restored."""
    return _named_back(json.loads(text))
