"""Parse one Qwen3.5 XML tool call and type its parameters by the tool's JSON schema.

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE            (the template writes one newline on each side of the value)
    </parameter>
    </function>
    </tool_call>

Lenient where a peer model commonly slips and nothing is lost: a missing `</parameter>` (the value
runs to the next `<parameter=` or `</function>`), a stray `</parameter>` between parameters, a
missing `</function>`. Strict where accepting would drop text: anything else outside a value, a
repeated parameter name, a missing or empty function name -> not a call (the caller keeps the text).

Fallback: a body that is a JSON object `{"name": NAME, "arguments": {...}}` (the Qwen3 / Hermes
format a model fine-tuned on it may still write inside `<tool_call>`; `arguments` may also be a
JSON-encoded string, or be spelled `parameters`) is a call too; its arguments are kept as written.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

FUNCTION_OPEN = "<function="
_PARAM_OPEN = re.compile(r"<parameter=([^>\n<]*)>")
_PARAM_CLOSE = "</parameter>"
_FUNCTION_CLOSE = "</function>"
_INTEGER = re.compile(r"[+-]?\d+")
_INTEGER_TEXT = re.compile(r"([+-]?\d+)(?:\.0*)?")


def parse_tool_call(body: str, schemas: Mapping[str, Mapping[str, Any]]
                    ) -> Optional[Tuple[str, Dict[str, Any]]]:
    """`body` is the text between `<tool_call>` and `</tool_call>`. Returns (name, typed arguments)
    or None when the body is not a well-formed call."""
    text = body.strip()
    if text.startswith("{"):
        return _parse_json_call(text)
    if not text.startswith(FUNCTION_OPEN):
        return None
    end = text.find(">")
    if end < 0:
        return None
    name = text[len(FUNCTION_OPEN):end].strip()
    if not name or "\n" in name or "<" in name:
        return None
    rest = text[end + 1:].rstrip()
    if rest.endswith(_FUNCTION_CLOSE):
        rest = rest[:-len(_FUNCTION_CLOSE)]
    raw = _parse_parameters(rest)
    if raw is None:
        return None
    props = _properties(schemas.get(name))
    return name, {key: convert_value(value, props.get(key)) for key, value in raw.items()}


def _parse_json_call(text: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The Qwen3 JSON form; None unless it is exactly a name and an arguments object."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not set(obj) <= {"name", "arguments", "parameters"} \
            or ("arguments" in obj and "parameters" in obj):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip() or any(c in name for c in "<>\n"):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                   # arguments JSON-encoded, as OpenAI sends them
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    return (name.strip(), args) if isinstance(args, dict) else None


def _parse_parameters(text: str) -> Optional[Dict[str, str]]:
    params: Dict[str, str] = {}
    pos = 0
    while True:
        match = _PARAM_OPEN.search(text, pos)
        gap = text[pos:match.start() if match else len(text)]
        if gap.replace(_PARAM_CLOSE, "").strip():
            return None                         # text outside any value: not ours to drop
        if match is None:
            return params
        key = match.group(1).strip()
        if not key or key in params:
            return None
        start = match.end()
        close = text.find(_PARAM_CLOSE, start)
        following = _PARAM_OPEN.search(text, start)
        if close >= 0 and (following is None or close < following.start()):
            value, pos = text[start:close], close + len(_PARAM_CLOSE)
        else:                                   # no close tag: the value runs to the next opening
            stop = following.start() if following else len(text)
            value, pos = text[start:stop], stop
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        params[key] = value


def tool_schemas(tools: Optional[Sequence[Mapping[str, Any]]]) -> Dict[str, Mapping[str, Any]]:
    """name -> parameters schema, from OpenAI-style tools (`{"type": "function", "function": ...}`)
    or bare function objects. The first definition of a name wins."""
    out: Dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            out.setdefault(fn["name"], fn.get("parameters") or {})
    return out


def _properties(schema) -> Mapping[str, Any]:
    if isinstance(schema, Mapping) and isinstance(schema.get("properties"), Mapping):
        return schema["properties"]
    return {}


def _schema_types(schema) -> list:
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, (list, tuple)):
        return [k for k in kind if isinstance(k, str)]
    types: list = []
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, (list, tuple)) else ():   # a malformed schema types nothing
            types.extend(t for t in _schema_types(sub) if t not in types)
    return types


def convert_value(value: str, schema) -> Any:
    """Type one raw parameter value. A string schema (or none) keeps the text as written; other
    types are parsed and fall back to the raw string when the text does not parse as that type."""
    types = _schema_types(schema)
    if not types or types == ["string"]:
        return value
    stripped = value.strip()
    for kind in types:
        if kind == "null" and stripped in ("null", "None"):
            return None
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind == "integer":
            number = _parse_integer(stripped)
            if number is not None:
                return number
        if kind == "number":
            number = _parse_number(stripped)
            if number is not None:
                return number
        if kind in ("object", "array"):
            parsed = _parse_container(stripped)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return value


def _parse_integer(text: str) -> Optional[int]:
    """An integer, also written with a zero fraction ("7.0"); None if it is not one or has more
    digits than int() converts (exact: never through float)."""
    match = _INTEGER_TEXT.fullmatch(text)
    if match is None:
        return None
    try:
        return int(match.group(1))
    except ValueError:
        return None


def _parse_number(text: str):
    if _INTEGER.fullmatch(text):
        return _parse_integer(text)
    try:
        number = float(text)
    except ValueError:
        return None
    return number if number == number and number not in (float("inf"), float("-inf")) else None


def _parse_container(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):        # JSONDecodeError, or an int past int()'s limit
        pass
    try:                                        # a Python literal ({'a': True}) from a sloppy peer
        parsed = ast.literal_eval(text)
        json.dumps(parsed)                      # sets, tuples-as-keys, bytes: not JSON, refuse
        return parsed
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return None
