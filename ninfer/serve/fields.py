"""Typed reads of JSON request fields. Each failure is a 400 that names the field (`param`)."""
from __future__ import annotations

import math
from typing import Any, Optional

from .errors import invalid

_MISSING = object()


def get(body: dict, key: str, kind: str, *, param: Optional[str] = None, default: Any = None,
        required: bool = False, lo=None, hi=None, lo_open: bool = False) -> Any:
    """Read body[key] as `kind` ("int", "number", "bool", "str", "list", "dict"); absent or null ->
    `default` (or a 400 when `required`). `lo`/`hi` bound numbers inclusively (`lo_open`: lo < x)."""
    param = param or key
    value = body.get(key, _MISSING) if isinstance(body, dict) else _MISSING
    if value is _MISSING or value is None:
        if required:
            raise invalid(f"'{param}' is required", param)
        return default
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise invalid(f"'{param}' must be an integer, got {_short(value)}", param)
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(_as_float(value)):
            raise invalid(f"'{param}' must be a finite number, got {_short(value)}", param)
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise invalid(f"'{param}' must be a boolean, got {value!r}", param)
    elif kind == "str":
        if not isinstance(value, str):
            raise invalid(f"'{param}' must be a string, got {type(value).__name__}", param)
    elif kind == "list":
        if not isinstance(value, list):
            raise invalid(f"'{param}' must be an array, got {type(value).__name__}", param)
    elif kind == "dict":
        if not isinstance(value, dict):
            raise invalid(f"'{param}' must be an object, got {type(value).__name__}", param)
    else:  # pragma: no cover - programming error
        raise ValueError(kind)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise invalid(f"'{param}' must be {'>' if lo_open else '>='} {lo}, got {_short(value)}",
                      param)
    if hi is not None and value > hi:
        raise invalid(f"'{param}' must be <= {hi}, got {_short(value)}", param)
    return value


def _as_float(value) -> float:
    """A JSON integer past float range (json.loads keeps it exact) reads as infinite."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def stop_strings(value: Any, param: str) -> tuple:
    """`stop` / `stop_sequences`: a string or a list of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise invalid(f"'{param}' must be a non-empty string or an array of them", param)
    if len(value) > 16:
        raise invalid(f"'{param}' may hold at most 16 sequences, got {len(value)}", param)
    return tuple(value)


def json_object(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise invalid(f"{what}: the request body must be a JSON object")
    return body
