"""The Falcon apps in process, over FakeEngine (tests/test_serve_support.py): protocol mapping,
every documented error, auth, request ids, metrics, disconnect and drain. WSGI everywhere; the
ASGI app too wherever the in-process simulation can (it cannot hold an SSE stream open, so
ASGI streaming is tested against uvicorn in test_serve_http.py)."""
from __future__ import annotations

import json
import threading
import time

import pytest
from falcon import testing

from ninfer.serve import ServeConfig, create_app, create_asgi_app
from test_serve_support import FakeEngine

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"


def chat_body(text="hi", **kw):
    return {"model": "m", "messages": [{"role": "user", "content": text}], **kw}


def msg_body(text="hi", **kw):
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": text}], **kw}


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture(params=["wsgi", "asgi"])
def client(request, engine):
    factory = create_app if request.param == "wsgi" else create_asgi_app
    return testing.TestClient(factory(engine))


@pytest.fixture
def wsgi(engine):
    return testing.TestClient(create_app(engine))


def sse_data(text: str) -> list:
    """data payloads of an SSE body, in order."""
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def sse_events(text: str) -> list:
    """(event, json) pairs of an Anthropic SSE body."""
    out, name = [], None
    for line in text.split("\n"):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


# ---- OpenAI chat --------------------------------------------------------------------------------------

def test_chat_non_stream_shape_reasoning_and_usage(client):
    r = client.simulate_post(CHAT, json=chat_body("hi", max_tokens=100))
    assert r.status_code == 200
    body = r.json
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "echo: hi",
                                 "reasoning_content": "Let me think."}
    assert choice["finish_reason"] == "stop"
    # 13 reasoning + 8 content + EOS
    assert body["usage"] == {"prompt_tokens": len("<user>hi\n<assistant>"), "completion_tokens": 22,
                             "total_tokens": len("<user>hi\n<assistant>") + 22,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 13}}


def test_chat_stream_chunks_match_non_stream(wsgi):
    full = wsgi.simulate_post(CHAT, json=chat_body("stream me")).json
    r = wsgi.simulate_post(CHAT, json=chat_body("stream me", stream=True,
                                                stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or ""
                        for c in chunks if c["choices"])
    assert content == full["choices"][0]["message"]["content"]
    assert reasoning == full["choices"][0]["message"]["reasoning_content"]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_without_usage_has_no_usage_chunk(wsgi):
    r = wsgi.simulate_post(CHAT, json=chat_body(stream=True))
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)


def test_chat_parameters_reach_the_engine(client, engine):
    r = client.simulate_post(CHAT, json=chat_body(
        max_tokens=5, max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.1,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, seed=3,
        stop=["a", "b"], chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200
    prompt, params, tools, thinking = engine.submitted[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 40)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.1, 0.5, -0.5)
    assert (params.repetition_penalty, params.seed, tuple(params.stop)) == (1.1, 3, ("a", "b"))
    assert thinking is False and tools is None and params.logprobs is None
    assert r.json["choices"][0]["finish_reason"] == "length"     # 7 tokens of "echo: hi"


def test_server_sampling_defaults_fill_gaps(engine):
    c = testing.TestClient(create_app(engine, temperature=0.7, top_p=0.8, top_k=5, max_tokens=9,
                                      enable_thinking=False))
    assert c.simulate_post(CHAT, json=chat_body()).status_code == 200
    _, params, _, thinking = engine.submitted[-1]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.7, 0.8, 5, 9)
    assert thinking is False
    # no server max_tokens: the whole context (the Engine stops at max_context)
    c2 = testing.TestClient(create_app(engine))
    c2.simulate_post(CHAT, json=chat_body())
    assert engine.submitted[-1][1].max_tokens == engine.options.max_context


def test_chat_messages_map_to_template_form(client, engine):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "need a tool",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.simulate_post(CHAT, json={"model": "m", "messages": messages})
    assert r.status_code == 200
    prompt = engine.submitted[-1][0]
    assert prompt == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need a tool",
         "tool_calls": [{"type": "function", "id": "call_1",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("choice, expected", [
    (None, ["get_weather", "get_time"]), ("auto", ["get_weather", "get_time"]),
    ("required", ["get_weather", "get_time"]), ("none", None),
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])])
def test_tool_choice(wsgi, engine, choice, expected):
    body = chat_body(tools=TOOLS)
    if choice is not None:
        body["tool_choice"] = choice
    assert wsgi.simulate_post(CHAT, json=body).status_code == 200
    tools = engine.submitted[-1][2]
    assert (None if tools is None else [t["function"]["name"] for t in tools]) == expected


def test_chat_tool_call_structured(wsgi):
    body = chat_body('tool:get_weather {"city": "Paris"}', tools=TOOLS)
    msg = wsgi.simulate_post(CHAT, json=body).json["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    assert msg["message"]["content"] is None
    [call] = msg["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    stream = wsgi.simulate_post(CHAT, json={**body, "stream": True})
    chunks = [json.loads(d) for d in sse_data(stream.text)[:-1]]
    deltas = [c["choices"][0]["delta"]["tool_calls"] for c in chunks
              if "tool_calls" in c["choices"][0]["delta"]]
    assert len(deltas) == 1 and len(deltas[0]) == 1
    assert deltas[0][0]["index"] == 0 and deltas[0][0]["type"] == "function"
    assert deltas[0][0]["function"] == call["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_logprobs(wsgi):
    r = wsgi.simulate_post(CHAT, json=chat_body("ab", logprobs=True, top_logprobs=2,
                                                chat_template_kwargs={"enable_thinking": False}))
    content = r.json["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == list("echo: ab")
    assert content[0] == {"token": "e", "logprob": -0.25, "bytes": [101],
                          "top_logprobs": [{"token": "e", "logprob": -0.25, "bytes": [101]},
                                           {"token": "?", "logprob": -2.0, "bytes": [63]}]}
    s = wsgi.simulate_post(CHAT, json=chat_body("ab", logprobs=True, stream=True,
                                                chat_template_kwargs={"enable_thinking": False}))
    streamed = [e["token"] for d in sse_data(s.text)[:-1]
                for c in [json.loads(d)] if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == list("echo: ab")


# ---- OpenAI completions and models ----------------------------------------------------------------

def test_completions_text_and_token_prompts(client, engine):
    r = client.simulate_post("/v1/completions", json={"model": "m", "prompt": "abc",
                                                      "max_tokens": 4})
    assert r.status_code == 200
    assert r.json["object"] == "text_completion"
    assert r.json["choices"][0]["text"] == "echo"          # raw prompt: no reasoning channel
    assert r.json["choices"][0]["finish_reason"] == "length"
    assert engine.submitted[-1][0] == "abc" and engine.submitted[-1][3] is False
    assert client.simulate_post("/v1/completions", json={"prompt": [[5, 6, 7]]}).status_code == 200
    assert engine.submitted[-1][0] == [5, 6, 7]
    assert engine.submitted[-1][1].max_tokens == 16           # OpenAI's documented default


def test_completions_stream(wsgi):
    full = wsgi.simulate_post("/v1/completions", json={"prompt": "xy", "max_tokens": 50}).json
    r = wsgi.simulate_post("/v1/completions", json={"prompt": "xy", "max_tokens": 50,
                                                    "stream": True,
                                                    "stream_options": {"include_usage": True}})
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        full["choices"][0]["text"]
    assert chunks[-1]["usage"] == full["usage"]


def test_models(client):
    r = client.simulate_get("/v1/models")
    assert r.status_code == 200
    assert r.json["object"] == "list" and [m["id"] for m in r.json["data"]] == ["fake-model"]
    assert r.json["data"][0]["max_model_len"] == 1024
    a = client.simulate_get("/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert a.json["data"][0]["type"] == "model" and a.json["first_id"] == "fake-model"
    assert client.simulate_get("/v1/models/fake-model").json["id"] == "fake-model"


def test_model_id_override(engine):
    c = testing.TestClient(create_app(engine, ServeConfig(model_id="my-model")))
    assert c.simulate_get("/v1/models").json["data"][0]["id"] == "my-model"
    assert c.simulate_post(CHAT, json=chat_body()).json["model"] == "my-model"


@pytest.mark.parametrize("factory", [create_app, create_asgi_app])
def test_model_id_with_a_slash_is_retrievable(engine, factory):
    """Hugging Face style ids ("Qwen/Qwen3.5-9B") are common; the SDKs put them in the path."""
    c = testing.TestClient(factory(engine, ServeConfig(model_id="Qwen/Qwen3.5-9B")))
    r = c.simulate_get("/v1/models/Qwen/Qwen3.5-9B")
    assert r.status_code == 200 and r.json["id"] == "Qwen/Qwen3.5-9B", r.text
    r = c.simulate_get("/v1/models/Qwen/other")
    assert r.status_code == 404 and r.json["error"]["code"] == "model_not_found"


# ---- Anthropic ---------------------------------------------------------------------------------------

def test_messages_non_stream(client):
    r = client.simulate_post(MSGS, json=msg_body("hi", thinking={"type": "enabled", "budget_tokens": 32}))
    assert r.status_code == 200
    body = r.json
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                               {"type": "text", "text": "echo: hi"}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"]["output_tokens"] == 22


def test_messages_stop_reasons(wsgi):
    r = wsgi.simulate_post(MSGS, json=msg_body("hello world", stop_sequences=["wor"],
                                               thinking={"type": "disabled"}))
    assert r.json["content"] == [{"type": "text", "text": "echo: hello "}]
    assert (r.json["stop_reason"], r.json["stop_sequence"]) == ("stop_sequence", "wor")
    r = wsgi.simulate_post(MSGS, json=msg_body("hello", max_tokens=3,
                                               thinking={"type": "disabled"}))
    assert r.json["stop_reason"] == "max_tokens"
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    r = wsgi.simulate_post(MSGS, json=msg_body('tool:get_weather {"city": "Rome"}', tools=tools))
    assert r.json["stop_reason"] == "tool_use"
    [block] = r.json["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["input"] == {"city": "Rome"}


def test_messages_stream_event_sequence(wsgi):
    full = wsgi.simulate_post(MSGS, json=msg_body("yo", thinking={"type": "enabled", "budget_tokens": 32})).json
    r = wsgi.simulate_post(MSGS, json=msg_body("yo", stream=True, thinking={"type": "enabled", "budget_tokens": 32}))
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    # thinking block 0, then text block 1, each start -> deltas -> stop
    compact = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert compact == ["message_start", "content_block_start", "content_block_delta",
                       "content_block_stop", "content_block_start", "content_block_delta",
                       "content_block_stop", "message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"),
                                                                           (1, "text")]
    thinking = "".join(d["delta"]["thinking"] for n, d in events
                       if n == "content_block_delta" and d["delta"]["type"] == "thinking_delta")
    text = "".join(d["delta"]["text"] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert [{"type": "thinking", "thinking": thinking, "signature": ""},
            {"type": "text", "text": text}] == full["content"]
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == full["usage"]["input_tokens"]
    delta = [d for n, d in events if n == "message_delta"][0]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == full["usage"]["output_tokens"]


def test_messages_stream_tool_use(wsgi):
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    r = wsgi.simulate_post(MSGS, json=msg_body('tool:get_weather {"city": "Rome"}', tools=tools,
                                               stream=True))
    events = sse_events(r.text)
    start = [d for n, d in events if n == "content_block_start"]
    assert start[0]["content_block"]["type"] == "tool_use"
    assert start[0]["content_block"]["name"] == "get_weather"
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Rome"}
    assert [d for n, d in events if n == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


def test_messages_blocks_map_to_template_form(client, engine):
    body = {"model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "sys"}],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "tu_1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": "42"},
                    {"type": "text", "text": "thanks"}]}]}
    assert client.simulate_post(MSGS, json=body).status_code == 200
    prompt, _, tools, _ = engine.submitted[-1]
    assert prompt == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "calling", "reasoning_content": "hmm",
         "tool_calls": [{"type": "function", "id": "tu_1",
                         "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "tu_1"},
        {"role": "user", "content": "thanks"}]
    assert tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                        "parameters": {"type": "object"}}}]


def test_messages_thinking_switch(wsgi, engine):
    """Anthropic's API thinks only when asked: no `thinking` field is thinking off."""
    wsgi.simulate_post(MSGS, json=msg_body(thinking={"type": "disabled"}))
    assert engine.submitted[-1][3] is False
    wsgi.simulate_post(MSGS, json=msg_body())
    assert engine.submitted[-1][3] is False
    r = wsgi.simulate_post(MSGS, json=msg_body(thinking={"type": "enabled", "budget_tokens": 48}))
    assert r.status_code == 200
    assert engine.submitted[-1][3] is True and engine.submitted[-1][1].thinking_budget == 48
    r = wsgi.simulate_post(MSGS, json=msg_body(thinking={"type": "enabled", "budget_tokens": 64}))
    assert r.status_code == 400 and r.json["error"]["message"].startswith(
        "'thinking.budget_tokens' (64) must be less than 'max_tokens'")


def test_count_tokens(client, engine):
    body = {"model": "m", "messages": [{"role": "user", "content": "count me"}],
            "system": "s", "thinking": {"type": "disabled"}}
    r = client.simulate_post("/v1/messages/count_tokens", json=body)
    expected = engine.apply_chat_template([{"role": "system", "content": "s"},
                                           {"role": "user", "content": "count me"}],
                                          None, True, False)
    assert r.status_code == 200 and r.json == {"input_tokens": len(expected)}
    assert engine.submitted == []      # nothing generated


@pytest.mark.parametrize("choice, expected_tools", [
    (None, ["f", "g"]), ({"type": "auto"}, ["f", "g"]), ({"type": "none"}, []),
    ({"type": "tool", "name": "g"}, ["g"])])
def test_count_tokens_counts_the_prompt_the_request_would_send(client, choice, expected_tools):
    """tool_choice decides which tools the prompt holds, so it decides the count too."""
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in ("f", "g")]
    base = msg_body("count me", tools=tools, thinking={"type": "disabled"})
    if choice is not None:
        base["tool_choice"] = choice
    counted = client.simulate_post("/v1/messages/count_tokens", json=base).json["input_tokens"]
    sent = client.simulate_post(MSGS, json=base).json["usage"]["input_tokens"]
    assert counted == sent
    only = msg_body("count me", thinking={"type": "disabled"},
                    tools=[t for t in tools if t["name"] in expected_tools] or None)
    assert counted == client.simulate_post("/v1/messages/count_tokens",
                                           json=only).json["input_tokens"]


# ---- operations ------------------------------------------------------------------------------------

def test_health_and_request_id(client):
    r = client.simulate_get("/health")
    assert r.status_code == 200 and r.json["status"] == "ok"
    assert len(r.headers["x-request-id"]) == 32
    r = client.simulate_get("/health", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = client.simulate_post(CHAT, body="{", headers={"x-request-id": "err-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "err-1"
    bad = client.simulate_get("/health", headers={"x-request-id": "has space\x01"})
    assert bad.headers["x-request-id"] != "has space\x01"


def test_metrics(wsgi):
    wsgi.simulate_post(CHAT, json=chat_body())
    wsgi.simulate_post(CHAT, json=chat_body(stream=True))
    r = wsgi.simulate_get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("ninfer_queue_depth 0.0", "ninfer_resident_requests 0.0",
                 "ninfer_paused_requests 0.0", "ninfer_engine_ready 1.0",
                 "ninfer_time_to_first_token_seconds_count 2.0",
                 "ninfer_inter_token_latency_seconds_count 40.0",    # (21 shown - 1) x 2
                 "ninfer_generated_tokens_total 44.0", "ninfer_generations_in_flight 0.0",
                 'ninfer_http_requests_total{route="/v1/chat/completions",status="200"} 2.0'):
        assert name in text, name


def test_wsgi_disconnect_cancels_and_frees(engine):
    """A WSGI server closes the response iterable when the client's socket breaks."""
    app = create_app(engine)
    env = testing.create_environ(method="POST", path=CHAT,
                                 body=json.dumps(chat_body("slow", stream=True)),
                                 headers={"content-type": "application/json"})
    body = app(env, lambda status, headers: None)
    first = [next(iter(body)) for _ in range(3)]
    assert all(chunk.startswith(b"data: ") for chunk in first)
    assert engine.stats()["residents"] == 1 and app.gateway.num_in_flight() == 1
    body.close()
    idle = {"queue_depth": 0, "residents": 0, "paused": 0, "open_handles": 0}
    deadline = time.monotonic() + 5
    while engine.stats() != idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats() == idle
    assert app.gateway.num_in_flight() == 0


def test_wsgi_close_before_first_chunk_frees(engine):
    app = create_app(engine)
    env = testing.create_environ(method="POST", path=CHAT,
                                 body=json.dumps(chat_body("slow", stream=True)),
                                 headers={"content-type": "application/json"})
    app(env, lambda status, headers: None).close()
    deadline = time.monotonic() + 5
    while (engine.stats()["open_handles"] or engine.stats()["residents"]) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["open_handles"] == 0 and engine.stats()["residents"] == 0


def test_request_submitted_while_closing_is_cancelled(engine):
    """A request that passed the ready check just before close() and was submitted just after
    its cancel_all() (the race, made deterministic) is cancelled too, not left running."""
    app = create_app(engine)
    submit = engine.submit

    def submit_racing_close(*args, **kwargs):
        handle = submit(*args, **kwargs)
        app.gateway.close()
        return handle

    engine.submit = submit_racing_close
    r = testing.TestClient(app).simulate_post(CHAT, json=chat_body("slow"))
    assert r.status_code == 200, r.text
    assert r.json["choices"][0]["finish_reason"] == "cancelled"
    assert app.gateway.num_in_flight() == 0


def test_drain_refuses_new_and_cancels_in_flight(engine):
    app = create_app(engine)
    c = testing.TestClient(app)
    out = {}

    def slow():
        out["r"] = c.simulate_post(CHAT, json=chat_body("slow", stream=True))

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 5
    while app.gateway.num_in_flight() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    app.gateway.drain(0.2)
    assert c.simulate_get("/health").status_code == 503
    r = c.simulate_post(CHAT, json=chat_body())
    assert r.status_code == 503 and r.json["error"]["code"] == "engine_draining"
    t.join(10)
    chunks = [json.loads(d) for d in sse_data(out["r"].text)[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cancelled"
    assert engine.stats()["open_handles"] == 0


def test_engine_loading_then_ready():
    gate = threading.Event()
    engine = FakeEngine()

    def factory():
        gate.wait(5)
        return engine

    app = create_app(factory)
    c = testing.TestClient(app)
    r = c.simulate_get("/health")
    assert r.status_code == 503 and r.json == {"status": "loading"}
    r = c.simulate_post(CHAT, json=chat_body())
    assert r.status_code == 503 and r.json["error"]["code"] == "engine_loading"
    gate.set()
    deadline = time.monotonic() + 5
    while c.simulate_get("/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.simulate_post(CHAT, json=chat_body()).status_code == 200
    app.gateway.close()
    assert engine.closed          # a factory-built engine belongs to the app


def test_engine_load_failure_is_503():
    def factory():
        raise RuntimeError("disk on fire")

    c = testing.TestClient(create_app(factory))
    deadline = time.monotonic() + 5
    while c.simulate_get("/health").json["status"] == "loading" and time.monotonic() < deadline:
        time.sleep(0.01)
    r = c.simulate_get("/health")
    assert r.status_code == 503 and r.json == {"status": "failed"}
    r = c.simulate_post(MSGS, json=msg_body())
    assert r.status_code == 503 and "disk on fire" in r.json["error"]["message"]


def test_close_keeps_a_passed_in_engine_open(engine):
    """create_app(engine) and create_asgi_app(engine) share one Engine; closing an app cancels its
    requests but leaves the Engine to its owner."""
    wsgi_app, asgi_app = create_app(engine), create_asgi_app(engine)
    for app in (wsgi_app, asgi_app):
        assert testing.TestClient(app).simulate_post(CHAT, json=chat_body()).status_code == 200
    wsgi_app.gateway.close()
    assert not engine.closed
    assert testing.TestClient(asgi_app).simulate_post(CHAT, json=chat_body()).status_code == 200
    assert testing.TestClient(wsgi_app).simulate_post(CHAT, json=chat_body()).status_code == 503


def test_keepalive_comments_while_waiting(engine):
    engine.slow_delay = 0.15
    c = testing.TestClient(create_app(engine, keepalive_s=0.05))
    r = c.simulate_post(CHAT, json=chat_body("slow", stream=True, max_tokens=3,
                                             chat_template_kwargs={"enable_thinking": False}))
    assert ": keep-alive\n\n" in r.text
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "xxx"


@pytest.mark.parametrize("script, status", [("fail", 500), ("crash", 503)])
def test_generation_failure(engine, script, status):
    """A request that ends in "error" is a 500; an Engine that fails under it is a 503; in a
    stream either becomes an error event, after the output already sent."""
    c = testing.TestClient(create_app(engine))
    r = c.simulate_post(CHAT, json=chat_body(script))
    if script == "crash":
        assert r.status_code == 503 and "crashed" in r.json["error"]["message"]
    else:
        assert r.status_code == 500 and "injected failure" in r.json["error"]["message"]
    s = c.simulate_post(CHAT, json=chat_body(script, stream=True))
    data = sse_data(s.text)
    assert s.status_code == 200 and data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["code"] == ("engine_failed" if script == "crash" else "generation_error")
    assert "echo: " in "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                               for d in data[:-2])
    m = c.simulate_post(MSGS, json=msg_body(script, stream=True))
    events = sse_events(m.text)
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["type"] == "error"
    assert engine.stats()["open_handles"] == 0


def test_asgi_health_answers_while_every_route_thread_is_busy(engine):
    """Open streams and queued requests each hold a route thread; /health, /metrics and
    /v1/models run on their own threads so they still answer."""
    app = create_asgi_app(engine)
    release = threading.Event()
    busy = [app.executor.submit(release.wait, 10) for _ in range(app.executor._max_workers)]
    threading.Timer(5.0, release.set).start()
    try:
        t0 = time.monotonic()
        r = testing.TestClient(app).simulate_get("/health")
        elapsed = time.monotonic() - t0
    finally:
        release.set()
    assert r.status_code == 200 and elapsed < 2.0, elapsed
    assert all(f.result(timeout=5) for f in busy)
