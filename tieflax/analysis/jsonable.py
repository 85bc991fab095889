"""Plain-JSON conversion shared by the study (``summary.json``) and the report that reads it back."""

from __future__ import annotations

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
