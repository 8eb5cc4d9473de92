"""serve.fields.check_json_schema accepts the valid schemas real clients send as tool parameters /
response formats (a 400 there breaks an ordinary request) and still refuses broken ones."""
from __future__ import annotations

import pytest

from ninfer.serve import fields as F
from ninfer.serve.errors import ApiError

# schemas as clients write them: draft-4 / OpenAPI 3.0 boolean exclusive bounds, ECMA-262
# patterns (JSON Schema's regex dialect) that Python's `re` does not read but the grammar engine
# (llguidance) does, pydantic's $defs / $ref / anyOf-null
VALID = [
    {"type": "object", "properties": {"n": {"type": "number", "minimum": 0,
                                            "exclusiveMinimum": True}}},
    {"type": "integer", "maximum": 10, "exclusiveMaximum": False},
    {"type": "string", "pattern": r"^\p{L}+$"},
    {"type": "string", "pattern": r"^(?<year>\d{4})-(?<month>\d{2})$"},
    {"type": "string", "pattern": r"^\d{3}-\d{4}$"},
    {"$defs": {"Item": {"title": "Item", "type": "object",
                        "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                             "default": None}}}},
     "type": "object", "properties": {"items": {"type": "array",
                                                "items": {"$ref": "#/$defs/Item"}}},
     "required": ["items"], "additionalProperties": False},
]

INVALID = [
    ({"type": "string", "pattern": "([a-"}, "p.pattern"),
    ({"type": "string", "pattern": 5}, "p.pattern"),
    ({"type": "number", "exclusiveMinimum": "yes"}, "p.exclusiveMinimum"),
    ({"type": "number", "minimum": True}, "p.minimum"),
]


@pytest.mark.parametrize("schema", VALID)
def test_valid_client_schemas_pass(schema):
    F.check_json_schema(schema, "p")


@pytest.mark.parametrize("schema, param", INVALID)
def test_broken_schemas_are_400_naming_the_keyword(schema, param):
    with pytest.raises(ApiError) as info:
        F.check_json_schema(schema, "p")
    assert info.value.status == 400
    assert info.value.param == param
