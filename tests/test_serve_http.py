"""Black-box tests of the real server: gunicorn (and uvicorn for the ASGI app) in a subprocess on a
loopback port, the real EngineCore and Frontend on the demo artifact, driven with the official
`openai` and `anthropic` SDKs. Forced output (tests/test_serve_support.py ScriptedModel) makes the
model emit exact token sequences, so tool calls and reasoning are parsed by the real Frontend,
not by luck."""
from __future__ import annotations

import json
import pathlib
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest

from test_serve_support import SCRIPTS, WEATHER_TOOL, ServerProcess

SUPPORT = pathlib.Path(__file__).with_name("test_serve_support.py")
KEY = "test-key"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def demo_artifact():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module", params=["gunicorn", "uvicorn"])
def server(request, demo_artifact):
    argv = [sys.executable, SUPPORT, "--artifact", demo_artifact, "--api-key", KEY]
    if request.param == "uvicorn":
        argv.append("--asgi")
    srv = ServerProcess(argv)
    srv.kind = request.param
    yield srv
    rc = srv.stop()
    # uvicorn re-raises the SIGTERM it handled gracefully, so its status is -15
    assert rc == (0 if request.param == "gunicorn" else -15), srv.output()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def user(text):
    return [{"role": "user", "content": text}]


def reasoning_of(obj):
    return (obj.model_extra or {}).get("reasoning_content")


# ---- OpenAI SDK --------------------------------------------------------------------------------------

def test_models_list(oai):
    assert [m.id for m in oai.models.list().data] == ["scripted-demo"]


def test_chat_reasoning_separated_stream_equals_non_stream(oai):
    kw = dict(model="any", messages=user("[[script:reason]] hello"), max_tokens=100)
    full = oai.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.content == "Hello! How can I help?"
    assert reasoning_of(msg) == "The user says hello; answer briefly."
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens_details.reasoning_tokens > 0

    content, reasoning, finish, usage = [], [], [], None
    for chunk in oai.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content.append(c.delta.content or "")
            reasoning.append(reasoning_of(c.delta) or "")
            if c.finish_reason:
                finish.append(c.finish_reason)
    assert "".join(content) == msg.content
    assert "".join(reasoning) == reasoning_of(msg)
    assert finish == ["stop"]
    assert usage.model_dump() == full.usage.model_dump()


def test_chat_random_text_stream_equals_non_stream(oai):
    kw = dict(model="any", messages=user("Write a haiku."), max_tokens=12, temperature=0,
              extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    chunks = list(oai.chat.completions.create(**kw, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_tool_call_structured(oai):
    kw = dict(model="any", messages=user("[[script:tool]] weather in Paris?"),
              tools=[WEATHER_TOOL], max_tokens=100, extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert not choice.message.content

    calls, finish = {}, None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris", "days": 3})]


def test_chat_stop_string(oai):
    r = oai.chat.completions.create(model="any", messages=user("[[script:fox]]"), stop=["lazy"],
                                    max_tokens=50, extra_body=NO_THINK)
    assert r.choices[0].message.content == "The quick brown fox jumps over the "
    assert r.choices[0].finish_reason == "stop"


def test_completions(oai):
    r = oai.completions.create(model="any", prompt="[[script:fox]]", max_tokens=50)
    assert r.choices[0].text == SCRIPTS["fox"] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in
                       oai.completions.create(model="any", prompt="[[script:fox]]",
                                              max_tokens=50, stream=True) if c.choices)
    assert streamed == SCRIPTS["fox"]


def test_n_choices_stream_on_both_servers(oai):
    """n = 2 through each server flavour: every choice runs the script; the merged stream names
    each chunk's choice and ends once, after both."""
    kw = dict(model="any", messages=user("[[script:fox]]"), n=2, extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    assert [c.message.content for c in full.choices] == [SCRIPTS["fox"]] * 2
    text = {0: "", 1: ""}
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
    assert text == {0: SCRIPTS["fox"], 1: SCRIPTS["fox"]}


def test_openai_errors(oai, server):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="any", messages=user("word " * 2000), max_tokens=4)
    assert err.value.status_code == 400 and "max_context=1024" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="any", messages=user("x"), temperature=7)
    assert err.value.body["param"] == "temperature"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- Anthropic SDK -----------------------------------------------------------------------------------

def test_messages_reasoning_stream_equals_non_stream(claude):
    kw = dict(model="any", max_tokens=100, messages=user("[[script:reason]] hello"),
              thinking={"type": "enabled", "budget_tokens": 64})    # below max_tokens, as Anthropic asks
    full = claude.messages.create(**kw)
    assert [b.type for b in full.content] == ["thinking", "text"]
    assert full.content[0].thinking == "The user says hello; answer briefly."
    assert full.content[1].text == "Hello! How can I help?"
    assert full.stop_reason == "end_turn"
    with claude.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Hello! How can I help?"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens
    assert final.stop_reason == full.stop_reason


def test_messages_tool_use(claude):
    tools = [{"name": "get_weather", "description": "forecast",
              "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    kw = dict(model="any", max_tokens=100, tools=tools, thinking={"type": "disabled"},
              messages=user("[[script:tool]] weather?"))
    full = claude.messages.create(**kw)
    assert full.stop_reason == "tool_use"
    [block] = full.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris", "days": 3}
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [("get_weather", {"city": "Paris",
                                                                           "days": 3})]


def test_messages_stop_sequence_and_count_tokens(claude):
    msgs = user("[[script:fox]]")
    r = claude.messages.create(model="any", max_tokens=50, messages=msgs,
                               stop_sequences=["lazy"], thinking={"type": "disabled"})
    assert r.content[0].text == "The quick brown fox jumps over the "
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "lazy")
    n = claude.messages.count_tokens(model="any", messages=msgs, thinking={"type": "disabled"})
    assert n.input_tokens == r.usage.input_tokens


def test_anthropic_errors(claude, server):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "m", "messages": user("hi")})
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="any", max_tokens=5, messages=user("word " * 2000))
    assert "max_context=1024" in err.value.message
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="any", max_tokens=5, messages=user("hi"))


# ---- operations --------------------------------------------------------------------------------------

def test_health_metrics_request_id(server):
    r = httpx.get(server.url + "/health", headers={"x-request-id": "probe-7"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "probe-7"
    assert httpx.get(server.url + "/metrics").status_code == 401
    m = server.metrics({"authorization": f"Bearer {KEY}"})
    for name in ("ninfer_queue_depth", "ninfer_resident_requests", "ninfer_paused_requests",
                 "ninfer_engine_outstanding", "ninfer_generated_tokens_total",
                 "ninfer_time_to_first_token_seconds_count",
                 "ninfer_inter_token_latency_seconds_count"):
        assert name in m, name


def test_client_disconnect_mid_stream_frees_the_request(server):
    auth = {"authorization": f"Bearer {KEY}"}
    cancelled = 'ninfer_generations_finished_total{reason="cancelled"}'
    before = server.metrics(auth).get(cancelled, 0.0)
    body = {"model": "m", "messages": user("[[script:long]]"), "max_tokens": 800,
            "stream": True, **NO_THINK}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/chat/completions", json=body,
                           headers=auth) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            m = server.metrics(auth)
            assert m["ninfer_engine_outstanding"] == 1 and m["ninfer_resident_requests"] == 1
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = server.metrics(auth)
        if m["ninfer_engine_outstanding"] == 0 and m.get(cancelled, 0.0) == before + 1:
            break
        time.sleep(0.1)
    assert m["ninfer_engine_outstanding"] == 0, server.output()
    assert m["ninfer_resident_requests"] == 0 and m["ninfer_generations_in_flight"] == 0
    assert m[cancelled] == before + 1
    assert m["ninfer_engine_kv_pages_used"] == 0 and m["ninfer_engine_state_slots_used"] == 0


def test_eight_concurrent_streams_each_get_their_own_tokens(oai):
    barrier = threading.Barrier(8)
    results, spans, errors = {}, {}, []

    def client(i):
        try:
            barrier.wait(30)
            parts, first = [], None
            for chunk in oai.chat.completions.create(
                    model="any", messages=user(f"[[script:client{i}]]"), max_tokens=200,
                    stream=True, extra_body=NO_THINK):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    parts.append(chunk.choices[0].delta.content)
            results[i] = "".join(parts)
            spans[i] = (first, time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {i: SCRIPTS[f"client{i}"] for i in range(8)}
    # served at once: every stream had started before any of them ended
    assert max(s[0] for s in spans.values()) < min(s[1] for s in spans.values())
