"""vLLM's structured-output fields of the OpenAI endpoints -> StructuredOutput.

    "structured_outputs": {"regex": "..."} | {"choice": [...]} | {"grammar": "..."}
                          | {"json": {schema}} | {"json_object": true}
    "guided_regex", "guided_choice", "guided_grammar", "guided_json"   (vLLM's older names)

One constraint per request: two of them (also with a `response_format` json mode) are a 400
naming the second. A `grammar` is Lark (llguidance's dialect, rule `start`) or GBNF (rule `root`),
as vLLM's guidance backend reads it. Each pattern or grammar is compiled here (without the
vocabulary), so a bad one is a 400 before the request is queued. vLLM's tuning options
(`disable_fallback`, `whitespace_pattern`, ...) and `structural_tag` are refused as unknown
fields (`serve --lenient` ignores them).
"""
from __future__ import annotations

import json
from typing import Optional

from ..api import StructuredOutput
from ..errors import RequestError
from . import fields as F
from .errors import invalid

# top-level request fields (both OpenAI endpoints)
GUIDED_FIELDS = ("structured_outputs", "guided_regex", "guided_choice", "guided_grammar",
                 "guided_json")
# structured_outputs key -> its older top-level name
_KEYS = {"json": "guided_json", "json_object": None, "regex": "guided_regex",
         "choice": "guided_choice", "grammar": "guided_grammar"}


def guided_output(body: dict, gateway, response_format: Optional[StructuredOutput]):
    """The StructuredOutput the vLLM fields ask for, or `response_format`'s (None: neither)."""
    given = []          # (param, key, value)
    outputs = F.get(body, "structured_outputs", "dict")
    if outputs is not None:
        unknown = [k for k in outputs if k not in _KEYS]
        if unknown and not gateway.config.lenient:
            raise invalid(f"unknown field 'structured_outputs.{unknown[0]}': structured_outputs "
                          f"here accepts {', '.join(_KEYS)} (one of them; start the server with "
                          "--lenient to ignore fields it does not implement)",
                          f"structured_outputs.{unknown[0]}")
        for key in _KEYS:
            value = outputs.get(key)
            if value is not None and not (key == "json_object" and value is False):
                given.append((f"structured_outputs.{key}", key, value))
    for key, old in _KEYS.items():
        if old is not None and body.get(old) is not None:
            given.append((old, key, body[old]))
    if not given:
        return response_format
    if response_format is not None:
        raise invalid(f"'response_format' ({response_format.kind}) and '{given[0][0]}' cannot be "
                      "combined: give one output constraint", given[0][0])
    if len(given) > 1:
        raise invalid(f"'{given[0][0]}' and '{given[1][0]}' cannot be combined: give one output "
                      "constraint", given[1][0])
    param, key, value = given[0]
    return _spec(param, key, value)


def _spec(param: str, key: str, value) -> StructuredOutput:
    if key == "json_object":
        if value is not True:
            raise invalid(f"'{param}' must be true or false, got {value!r}", param)
        spec = StructuredOutput("json_object")
    elif key == "json":
        if isinstance(value, str):          # vLLM takes the schema as an object or JSON text
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(f"'{param}' is a string that is not JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise invalid(f"'{param}' must be a JSON schema object, got "
                          f"{type(value).__name__}", param)
        F.check_json_schema(value, param)
        spec = StructuredOutput("json_schema", value)
    elif key == "choice":
        if not isinstance(value, list):
            raise invalid(f"'{param}' must be an array of strings, got {type(value).__name__}",
                          param)
        spec = StructuredOutput("choice", choices=value)
    else:
        if not isinstance(value, str):
            raise invalid(f"'{param}' must be a string, got {type(value).__name__}", param)
        spec = StructuredOutput(key, pattern=value) if key == "regex" \
            else StructuredOutput(key, grammar=value)
    try:
        return spec.validate()
    except RequestError as exc:
        raise invalid(f"'{param}': {exc}", param) from None
