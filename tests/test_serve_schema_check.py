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


def test_anthropic_informational_service_tier_is_accepted():
    # the Anthropic SDK's `service_tier` ("auto" / "standard_only") picks a capacity tier, which
    # cannot change the output: like OpenAI's informational fields it is accepted, not a 400
    from falcon import testing

    from ninfer.serve.app import create_app
    from test_serve_support import FakeEngine
    client = testing.TestClient(create_app(FakeEngine()))
    body = {"model": "m", "max_tokens": 4, "service_tier": "auto",
            "messages": [{"role": "user", "content": "hi"}]}
    resp = client.simulate_post("/v1/messages", json=body)
    assert resp.status_code == 200, resp.text
    resp = client.simulate_post("/v1/messages", json={**body, "container": "x"})
    assert resp.status_code == 400 and "container" in resp.text      # a real behaviour change


def test_logit_bias_key_that_is_no_ascii_integer_is_400_not_500():
    # '\u00b2' (superscript two) passes str.isdigit() but not int(): it was an internal error (500)
    from falcon import testing

    from ninfer.serve.app import create_app
    from test_serve_support import FakeEngine
    client = testing.TestClient(create_app(FakeEngine()))
    resp = client.simulate_post("/v1/chat/completions", json={
        "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {"\u00b2": 1}})
    assert resp.status_code == 400, resp.text
    assert resp.json["error"]["param"] == "logit_bias.\u00b2"
