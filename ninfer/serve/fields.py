"""Typed reads of JSON request fields. Each failure is a 400 that names the field (`param`)."""
from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

from ..api import MAX_SESSION_CHARS
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
        # a JSON integer only: 4.0 or 1e308 is a number, not a count (OpenAI refuses both)
        if isinstance(value, bool) or not isinstance(value, int):
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


def session_hint(body: dict, key: str, *, param: Optional[str] = None) -> Optional[str]:
    """A context-cache session hint (OpenAI `prompt_cache_key` / `user`, Anthropic
    `metadata.user_id`): a string of at most MAX_SESSION_CHARS characters; absent, null or ""
    -> no hint."""
    param = param or key
    value = get(body, key, "str", param=param)
    if value is not None and len(value) > MAX_SESSION_CHARS:
        raise invalid(f"'{param}' may be at most {MAX_SESSION_CHARS} characters, got "
                      f"{len(value)}", param)
    return value or None


def json_object(body: Any, what: str) -> dict:
    if not isinstance(body, dict):
        raise invalid(f"{what}: the request body must be a JSON object")
    return body


def check_known(body: dict, known: Iterable[str], gateway, what: str) -> None:
    """A field this server does not implement is a 400 naming it (a client must not get different
    behaviour silently), unless the server runs with --lenient (then it is ignored)."""
    if gateway.config.lenient:
        return
    known = frozenset(known)
    for key in body:
        if key not in known:
            raise invalid(f"unknown field '{key}': {what} requests here accept "
                          f"{', '.join(sorted(known))} (start the server with --lenient to "
                          "ignore fields it does not implement)", key)


_SCHEMA_TYPES = frozenset(("string", "number", "integer", "boolean", "object", "array", "null"))
_SUB_SCHEMA = ("items", "not", "additionalProperties", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_DRAFT4_FLAGS = ("exclusiveMinimum", "exclusiveMaximum")


def check_json_schema(schema: Any, param: str, depth: int = 0) -> None:
    """The structure of a JSON schema (tool parameters, response_format): a 400 naming the first
    keyword whose value no JSON-schema validator would accept (`{"type": "wat"}`,
    `"properties": 5`, a `pattern` that is no regular expression). Unknown keywords pass."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(f"'{param}' must be a JSON schema (an object or a boolean), "
                      f"got {_short(schema)}", param)
    if depth > 64:
        raise invalid(f"'{param}' is nested too deeply", param)
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in _SCHEMA_TYPES for k in kinds):
            raise invalid(f"'{param}.type' must be one of {sorted(_SCHEMA_TYPES)} or a list of "
                          f"them, got {_short(kind)}", f"{param}.type")
    for key in _SUB_SCHEMA:
        if key in schema:
            value = schema[key]
            if key == "items" and isinstance(value, list):      # draft-7 tuple form
                for i, sub in enumerate(value):
                    check_json_schema(sub, f"{param}.items[{i}]", depth + 1)
            else:
                check_json_schema(value, f"{param}.{key}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, list) or not value:
                raise invalid(f"'{param}.{key}' must be a non-empty array of schemas", 
                              f"{param}.{key}")
            for i, sub in enumerate(value):
                check_json_schema(sub, f"{param}.{key}[{i}]", depth + 1)
    for key in _SCHEMA_MAPS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, dict):
                raise invalid(f"'{param}.{key}' must be an object of schemas, got "
                              f"{_short(value)}", f"{param}.{key}")
            for name, sub in value.items():
                check_json_schema(sub, f"{param}.{key}.{name}", depth + 1)
    required = schema.get("required")
    if required is not None and not (isinstance(required, list)
                                     and all(isinstance(r, str) for r in required)):
        raise invalid(f"'{param}.required' must be an array of property names, got "
                      f"{_short(required)}", f"{param}.required")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise invalid(f"'{param}.enum' must be an array", f"{param}.enum")
    for key in _COUNTS:
        value = schema.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise invalid(f"'{param}.{key}' must be an integer >= 0, got {_short(value)}",
                          f"{param}.{key}")
    for key in _BOUNDS:
        value = schema.get(key)
        if isinstance(value, bool) and key in _DRAFT4_FLAGS:
            continue                        # draft-4 / OpenAPI 3.0: a flag on minimum / maximum
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(_as_float(value))):
            raise invalid(f"'{param}.{key}' must be a finite number, got {_short(value)}",
                          f"{param}.{key}")
    pattern = schema.get("pattern")
    if pattern is not None:
        try:
            if not isinstance(pattern, str):
                raise TypeError("not a string")
            re.compile(pattern)
        except (re.error, TypeError, RecursionError, OverflowError) as exc:
            if not (isinstance(pattern, str) and _grammar_reads_pattern(pattern)):
                raise invalid(f"'{param}.pattern' is not a regular expression: {exc}",
                              f"{param}.pattern") from None


def _grammar_reads_pattern(pattern: str) -> bool:
    """JSON Schema patterns are ECMA-262 regular expressions (\\p{L}, (?<name>...)), which Python's
    `re` does not read; the grammar engine that enforces them (llguidance) does."""
    try:
        from llguidance import LLMatcher
        grammar = LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
        return not LLMatcher.validate_grammar(grammar)
    except Exception:  # noqa: BLE001 - no engine or it refuses: not a pattern we can enforce
        return False
