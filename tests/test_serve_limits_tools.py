"""Issue 23 over real sockets with the official `openai` and `anthropic` SDKs (the real EngineCore
and Frontend on the demo artifact; ScriptedModel forces exact outputs, tests/test_serve_support.py):

- limits like the peers: prompt + max_tokens over the context is a 400 naming the numbers (OpenAI
  `max_tokens` / `max_completion_tokens`, /v1/completions, Anthropic `max_tokens`), streaming or
  not, before any stream starts; a missing max_tokens runs to the context; `--max-tokens-cap`;
- forced calls end cleanly: at the length limit the complete calls come back as `tool_calls` /
  `tool_use` blocks, the cut one is dropped (no raw `<tool_call>` XML anywhere) and the finish
  reason says `length` / `max_tokens`; JSON cut by the length limit says `length`;
- Qwen3-style JSON calls inside `<tool_call>` are parsed."""
from __future__ import annotations

import json
import pathlib
import sys

import anthropic
import httpx
import openai
import pytest

from test_serve_support import SAY_TOOL, SCRIPTS, WEATHER_TOOL, ServerProcess

pytestmark = pytest.mark.timeout(300)

SUPPORT = pathlib.Path(__file__).with_name("test_serve_support.py")
KEY = "test-key"
CONTEXT = 1024
CAP = 24
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def demo_artifact():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module")
def server(demo_artifact):
    srv = ServerProcess([sys.executable, SUPPORT, "--artifact", demo_artifact, "--api-key", KEY,
                         "--max-context", CONTEXT])
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def capped(demo_artifact):
    """The ASGI app (uvicorn) with --max-tokens-cap."""
    srv = ServerProcess([sys.executable, SUPPORT, "--artifact", demo_artifact, "--api-key", KEY,
                         "--max-context", CONTEXT, "--max-tokens-cap", CAP, "--asgi"])
    yield srv
    srv.stop()


def oai_for(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def claude_for(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def oai(server):
    return oai_for(server)


@pytest.fixture
def claude(server):
    return claude_for(server)


def user(text):
    return [{"role": "user", "content": text}]


def prompt_tokens(oai, **kw) -> int:
    """The prompt's token count as the server counts it (max_tokens=1: one generated token)."""
    return oai.chat.completions.create(model="m", max_tokens=1, **kw).usage.prompt_tokens


def no_markup(text):
    return "<tool_call>" not in (text or "") and "<function=" not in (text or "")


# ---- limits ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_max_tokens_over_the_context_is_a_400_naming_the_numbers(oai, field, stream):
    msgs = user("[[script:fox]]")
    n = prompt_tokens(oai, messages=msgs, extra_body=NO_THINK)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="m", messages=msgs, stream=stream, extra_body=NO_THINK,
                                    **{field: 1_000_000_000})
    err = info.value
    assert err.status_code == 400
    assert err.body["message"] == (f"{field}=1000000000 + {n} prompt tokens exceeds the context "
                                   f"of {CONTEXT} tokens (at most {CONTEXT - n} tokens fit after "
                                   "this prompt)")
    assert err.body["param"] == field and err.body["code"] == "context_length_exceeded"
    # the edge: exactly what fits is accepted (and ends at the context's end at the latest)
    ok = oai.chat.completions.create(model="m", messages=msgs, extra_body=NO_THINK,
                                     **{field: CONTEXT - n})
    assert ok.choices[0].message.content == SCRIPTS["fox"]
    with pytest.raises(openai.BadRequestError, match=f"{field}={CONTEXT - n + 1} "):
        oai.chat.completions.create(model="m", messages=msgs, extra_body=NO_THINK,
                                    **{field: CONTEXT - n + 1})


@pytest.mark.parametrize("stream", [False, True])
def test_completions_max_tokens_over_the_context_is_a_400(oai, stream):
    with pytest.raises(openai.BadRequestError) as info:
        r = oai.completions.create(model="m", prompt="[[script:fox]]", max_tokens=CONTEXT,
                                   stream=stream)
        list(r) if stream else r
    assert "max_tokens=1024 + " in info.value.body["message"]
    assert f"exceeds the context of {CONTEXT} tokens" in info.value.body["message"]
    assert info.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_max_tokens_over_the_context_is_a_400(claude, stream):
    kw = dict(model="m", max_tokens=100_000_000, messages=user("[[script:fox]]"))
    with pytest.raises(anthropic.BadRequestError) as info:
        if stream:
            with claude.messages.stream(**kw) as s:
                list(s)
        else:
            claude.messages.create(**kw)
    err = info.value
    assert err.status_code == 400 and err.body["type"] == "error"
    message = err.body["error"]["message"]
    assert message.startswith("max_tokens=100000000 + ") and \
        f"prompt tokens exceeds the context of {CONTEXT} tokens" in message


def test_a_missing_max_tokens_runs_to_the_context(server):
    """No max_tokens: as many as the context leaves (raw HTTP: the SDKs always send one for
    Anthropic, never for OpenAI unless asked)."""
    body = {"model": "m", "messages": user("[[script:long]]"), **NO_THINK}
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT


def test_max_tokens_cap(capped):
    oai, claude = oai_for(capped), claude_for(capped)
    msgs = user("[[script:long]]")
    # a missing max_tokens gets the cap, silently
    r = oai.chat.completions.create(model="m", messages=msgs, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == CAP
    r = oai.completions.create(model="m", prompt="[[script:long]]")     # OpenAI's default 16
    assert r.usage.completion_tokens == 16
    # the cap itself is fine; one more is a 400 naming the cap and the field
    r = oai.chat.completions.create(model="m", messages=msgs, max_tokens=CAP, extra_body=NO_THINK)
    assert r.usage.completion_tokens == CAP
    for field in ("max_tokens", "max_completion_tokens"):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                oai.chat.completions.create(model="m", messages=msgs, stream=stream,
                                            extra_body=NO_THINK, **{field: CAP + 1})
            assert info.value.body["message"] == (
                f"'{field}' is {CAP + 1}, over this server's cap of {CAP} tokens "
                "(serve --max-tokens-cap)")
            assert info.value.body["param"] == field
    with pytest.raises(anthropic.BadRequestError, match=f"over this server's cap of {CAP}"):
        claude.messages.create(model="m", max_tokens=CAP + 1, messages=msgs)
    msg = claude.messages.create(model="m", max_tokens=CAP, messages=msgs)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == CAP


# ---- forced calls end cleanly ----------------------------------------------------------------------

CALLS3 = user("[[script:calls3]] weather in Paris, Lyon and Rome?")
PARIS, LYON = {"city": "Paris", "days": 3}, {"city": "Lyon", "days": 1}


@pytest.fixture(scope="module")
def cut_budget(server):
    """A max_tokens that ends the output inside the third call of SCRIPTS['calls3']."""
    def count(text):
        r = httpx.post(server.url + "/tokenize", json={"prompt": text},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        return r.json()["count"]
    first_two = SCRIPTS["calls3"][:SCRIPTS["calls3"].index("<tool_call>\n<function=get_weather>"
                                                              "\n<parameter=city>\nRome")]
    return count(first_two) + 6


def test_forced_call_runs_to_the_end_and_stops(oai):
    r = oai.chat.completions.create(model="m", messages=CALLS3, tools=[WEATHER_TOOL],
                                    tool_choice="required", max_tokens=300, extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == \
        [PARIS, LYON, {"city": "Rome", "days": 2}]


@pytest.mark.parametrize("stream", [False, True])
def test_required_may_stop_after_the_newline_that_follows_a_call(oai, stream):
    """The model writes `</tool_call>\n` and then EOS: that newline used to commit a `required`
    answer to another call (the EOS was masked out and calls ran on to the length limit)."""
    kw = dict(model="m", messages=user("[[script:call_nl]] weather in Paris?"),
              tools=[WEATHER_TOOL], tool_choice="required", max_tokens=200, extra_body=NO_THINK)
    if stream:
        chunks = list(oai.chat.completions.create(**kw, stream=True))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
        assert finish == ["tool_calls"] and [tc.function.name for tc in calls] == ["get_weather"]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        r = oai.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == \
            [{"city": "Paris"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "get_weather"}}])
def test_forced_single_call_stops_after_it(oai, choice):
    """parallel_tool_calls false (or a named tool): exactly one call, then the answer ends."""
    r = oai.chat.completions.create(model="m", messages=CALLS3, tools=[WEATHER_TOOL],
                                    tool_choice=choice, parallel_tool_calls=False,
                                    max_tokens=300, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [PARIS]
    assert r.usage.completion_tokens < 40


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_parallel_tool_calls_false_returns_one_call(oai, stream):
    """parallel_tool_calls false without a forced call (auto): the model chooses to call, and
    its first complete call ends the answer (no grammar forces anything here)."""
    kw = dict(model="m", messages=CALLS3, tools=[WEATHER_TOOL], tool_choice="auto",
              parallel_tool_calls=False, max_tokens=300, extra_body=NO_THINK)
    if stream:
        chunks = list(oai.chat.completions.create(**kw, stream=True))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        args = [json.loads(tc.function.arguments) for c in chunks
                for tc in c.choices[0].delta.tool_calls or ()]
        assert finish == ["tool_calls"] and args == [PARIS]
    else:
        r = oai.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == \
            [PARIS]
        assert r.usage.completion_tokens < 40
        kw["parallel_tool_calls"] = True                # the same script, calls allowed
        assert len(oai.chat.completions.create(**kw).choices[0].message.tool_calls) == 3


def test_anthropic_auto_with_disable_parallel_tool_use_returns_one_block(claude):
    msg = claude.messages.create(
        model="m", max_tokens=300, messages=CALLS3,
        tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.input) for b in msg.content] == [("tool_use", PARIS)]


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_openai_call_cut_by_the_length_limit(oai, cut_budget, tool_choice):
    kw = dict(model="m", messages=CALLS3, tools=[WEATHER_TOOL], tool_choice=tool_choice,
              max_tokens=cut_budget, extra_body=NO_THINK)
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == cut_budget
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [PARIS, LYON]
    assert not choice.message.content and no_markup(choice.message.content)

    calls, content, finish = {}, [], []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for tc in delta.tool_calls or ():
            calls.setdefault(tc.index, "")
            calls[tc.index] += tc.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    assert finish == ["length"] and "".join(content) == ""
    assert [json.loads(a) for a in calls.values()] == [PARIS, LYON]


def test_anthropic_call_cut_by_the_length_limit(claude, cut_budget):
    kw = dict(model="m", max_tokens=cut_budget, messages=CALLS3,
              tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}],
              tool_choice={"type": "any"})
    msg = claude.messages.create(**kw)
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["tool_use", "tool_use"]
    assert [b.input for b in msg.content] == [PARIS, LYON]
    with claude.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and [b.input for b in final.content] == [PARIS, LYON]
    assert not any(e.type == "content_block_delta" and e.delta.type == "text_delta"
                   for e in events)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_any_with_a_string_parameter_is_a_tool_use_block(claude, stream):
    kw = dict(model="m", max_tokens=100, messages=user("[[script:say]] say hello"),
              tools=[{"name": "say", "input_schema": SAY_TOOL["function"]["parameters"]}],
              tool_choice={"type": "any"})
    if stream:
        with claude.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = claude.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in msg.content] == \
        [("tool_use", "say", {"text": "hello, world"})]


def test_anthropic_any_cut_inside_a_string_parameter_leaks_no_markup(claude):
    msg = claude.messages.create(
        model="m", max_tokens=8, messages=user("[[script:say]] say hello"),
        tools=[{"name": "say", "input_schema": SAY_TOOL["function"]["parameters"]}],
        tool_choice={"type": "any"})
    assert msg.stop_reason == "max_tokens"
    assert all(b.type != "tool_use" for b in msg.content)
    assert all(no_markup(getattr(b, "text", "")) and not getattr(b, "text", "")
               for b in msg.content)


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_json_call_is_a_tool_call(oai, stream):
    kw = dict(model="m", messages=user("[[script:jsoncall]] weather in Oslo?"),
              tools=[WEATHER_TOOL], max_tokens=100, extra_body=NO_THINK)
    if stream:
        calls, finish = {}, None
        for chunk in oai.chat.completions.create(**kw, stream=True):
            assert not chunk.choices[0].delta.content
            for tc in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        got = [(n, json.loads(a)) for n, a in calls.values()]
    else:
        r = oai.chat.completions.create(**kw)
        finish, msg = r.choices[0].finish_reason, r.choices[0].message
        assert not msg.content
        got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert finish == "tool_calls" and got == [("get_weather", {"city": "Oslo", "days": 2})]


# ---- JSON output cut by the length limit -----------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                      "strict": True}}


def test_json_schema_output_cut_by_the_length_limit_says_length(oai):
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        days: int

    kw = dict(model="m", messages=user("[[script:json]]"), extra_body=NO_THINK)
    whole = oai.chat.completions.create(**kw, response_format=JSON_FORMAT, max_tokens=100)
    assert whole.choices[0].finish_reason == "stop"
    assert json.loads(whole.choices[0].message.content) == {"city": "Paris", "days": 3}
    cut = oai.chat.completions.create(**kw, response_format=JSON_FORMAT, max_tokens=4)
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.choices[0].message.content)
    finish = [c.choices[0].finish_reason for c in
              oai.chat.completions.create(**kw, response_format=JSON_FORMAT, max_tokens=4,
                                          stream=True) if c.choices[0].finish_reason]
    assert finish == ["length"]
    # the SDK's parse() refuses a cut answer instead of returning half an object
    with pytest.raises(openai.LengthFinishReasonError):
        oai.chat.completions.parse(**kw, response_format=Weather, max_tokens=4)
    parsed = oai.chat.completions.parse(**kw, response_format=Weather, max_tokens=100)
    assert parsed.choices[0].message.parsed == Weather(city="Paris", days=3)
