"""Every documented bad input gets its documented status and a JSON error body in the route's
shape (OpenAI's {"error": {...}} or Anthropic's {"type": "error", "error": {...}}); one test each.
In process over FakeEngine, on both the WSGI and the ASGI app."""
from __future__ import annotations

import pytest
from falcon import testing

from ninfer import SamplingParams
from ninfer.serve import create_app, create_asgi_app
from test_serve_support import FakeEngine

CHAT, COMP, MSGS = "/v1/chat/completions", "/v1/completions", "/v1/messages"
EMB = "/v1/embeddings"
U = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": "m", "messages": U, **kw}


def msgs(**kw):
    return {"model": "m", "max_tokens": 16, "messages": U, **kw}


# (id, path, JSON body or raw bytes, status, param (OpenAI) or None, message fragment)
CASES = [
    ("invalid-json", CHAT, b"{not json", 400, None, "not valid JSON"),
    ("empty-body", CHAT, b"", 400, None, "empty"),
    ("body-not-object", CHAT, [1, 2], 400, None, "JSON object"),
    ("messages-missing", CHAT, {"model": "m"}, 400, "messages", "required"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages", "at least one"),
    ("bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", "wizard"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]), 400,
     "messages[0].content[0].image_url.url", "data: URL"),
    ("video-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "video_url", "video_url": {"url": 5}}]}]), 400,
     "messages[0].content[1].video_url.url", "string"),
    ("content-not-string", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "string"),
    ("temperature-type", CHAT, chat(temperature="hot"), 400, "temperature", "number"),
    ("temperature-range", CHAT, chat(temperature=3), 400, "temperature", "<= 2"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", "> 0"),
    ("top-k-negative", CHAT, chat(top_k=-5), 400, "top_k", ">= 0"),
    ("min-p-range", CHAT, chat(min_p=1.5), 400, "min_p", "<= 1"),
    ("penalty-range", CHAT, chat(presence_penalty=9), 400, "presence_penalty", "<= 2"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", ">= 1"),
    ("max-completion-tokens-type", CHAT, chat(max_completion_tokens="many"), 400,
     "max_completion_tokens", "integer"),
    ("n-over-cap", CHAT, chat(n=17), 400, "n", "<= 16"),
    ("n-zero", CHAT, chat(n=0), 400, "n", ">= 1"),
    ("seed-negative", CHAT, chat(seed=-1), 400, "seed", ">= 0"),
    ("stop-empty", CHAT, chat(stop=[""]), 400, "stop", "non-empty"),
    ("stream-type", CHAT, chat(stream="yes"), 400, "stream", "boolean"),
    ("top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    ("top-logprobs-range", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs",
     "<= 20"),
    ("tools-malformed", CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0]", "function"),
    ("tool-choice-unknown", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "g"}}), 400,
     "tool_choice", "'g'"),
    ("tool-choice-bad", CHAT, chat(tool_choice="sometimes"), 400, "tool_choice", "auto"),
    ("tool-call-arguments", CHAT, chat(messages=U + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ("response-format", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema", "required"),
    ("response-format-type", CHAT, chat(response_format={"type": "xml"}), 400,
     "response_format.type", "'json_schema'"),
    ("tool-choice-required-no-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice",
     "needs 'tools'"),
    ("enable-thinking-type", CHAT, chat(chat_template_kwargs={"enable_thinking": "no"}), 400,
     "chat_template_kwargs.enable_thinking", "boolean"),
    ("prompt-too-long", CHAT, chat(messages=[{"role": "user", "content": "x" * 2000}]), 400,
     None, "the context holds 1024"),
    ("completion-prompt-missing", COMP, {"model": "m"}, 400, "prompt", "string"),
    ("completion-prompt-bad-ids", COMP, {"prompt": [1, -2]}, 400, "prompt", "token ids"),
    ("completion-prompt-bool-id", COMP, {"prompt": [1, True]}, 400, "prompt", "token ids"),
    ("completion-prompt-float-id", COMP, {"prompt": [1, 2.0]}, 400, "prompt", "token ids"),
    ("completion-echo-type", COMP, {"prompt": "a", "echo": "yes"}, 400, "echo", "boolean"),
    ("completion-best-of", COMP, {"prompt": "a", "best_of": 3}, 400, "best_of",
     "not supported"),
    ("completion-n-over-cap", COMP, {"prompt": "a", "n": 100}, 400, "n", "<= 16"),
    # FakeEngine cannot score: echo's prompt logprobs are a 400 naming why, never a 5xx
    ("completion-echo-logprobs-unsupported", COMP, {"prompt": "ab", "echo": True, "logprobs": 1},
     400, None, "does not score"),
    ("embeddings-input-missing", EMB, {"model": "m"}, 400, "input", "non-empty"),
    ("embeddings-input-empty-string", EMB, {"input": ["a", ""]}, 400, "input[1]", "empty"),
    ("embeddings-input-mixed", EMB, {"input": ["a", 5]}, 400, "input[1]", "token ids"),
    ("embeddings-bad-token", EMB, {"input": [[1, -2]]}, 400, "input[0]", "token ids"),
    ("embeddings-format", EMB, {"input": "a", "encoding_format": "int8"}, 400,
     "encoding_format", "'base64'"),
    ("embeddings-dimensions", EMB, {"input": "a", "dimensions": 0}, 400, "dimensions", ">= 1"),
    ("embeddings-unknown-field", EMB, {"input": "a", "pooling": "mean"}, 400, "pooling",
     "unknown"),
    ("embeddings-unsupported", EMB, {"input": "a"}, 400, None, "does not embed"),
    ("messages-max-tokens-missing", MSGS, {"model": "m", "messages": U}, 400, None,
     "'max_tokens' is required"),
    ("messages-role-system", MSGS, msgs(messages=[{"role": "system", "content": "x"}]), 400,
     None, "'user' or 'assistant'"),
    ("messages-temperature", MSGS, msgs(temperature=1.5), 400, None, "<= 1.0"),
    ("messages-thinking-type", MSGS, msgs(thinking={"type": "maybe"}), 400, None,
     "thinking.type"),
    ("messages-image", MSGS, msgs(messages=[{"role": "user", "content": [
        {"type": "image", "source": {}}]}]), 400, None, "base64"),
    ("messages-prefill", MSGS, msgs(messages=U + [{"role": "assistant", "content": "ok"}]), 400,
     None, "prefill"),
    ("messages-tool-no-schema", MSGS, msgs(tools=[{"name": "f"}]), 400, None,
     "'tools.0.input_schema' is required"),
    ("messages-server-tool", MSGS, msgs(tools=[{"type": "web_search_20250305", "name": "w"}]),
     400, None, "custom tools only"),
    ("count-tokens-no-messages", MSGS + "/count_tokens", {"model": "m"}, 400, None,
     "'messages' is required"),
    # valid JSON escapes, but no Unicode text: neither tokenizer nor UTF-8 writer can take them
    ("lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     None, "surrogate"),
    # a JSON integer past float range (json.loads keeps it exact) in a number field
    ("temperature-huge-int", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"temperature": 1' + b"0" * 400 + b"}", 400, "temperature", "finite number"),
    ("messages-top-p-huge-int", MSGS, b'{"max_tokens": 4, "messages": [{"role": "user", '
     b'"content": "hi"}], "top_p": -1' + b"0" * 400 + b"}", 400, None, "finite number"),
    ("nested-too-deep", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "x": '
     + b"[" * 1900 + b"]" * 1900 + b"}", 400, None, "nested"),    # < max_body_bytes
    ("lone-low-surrogate-messages", MSGS,
     b'{"max_tokens": 4, "messages": [{"role": "user", "content": "\\uDC00"}]}', 400, None,
     "surrogate"),
]


@pytest.fixture(params=["wsgi", "asgi"])
def client(request):
    factory = create_app if request.param == "wsgi" else create_asgi_app
    return testing.TestClient(factory(FakeEngine(), max_body_bytes=4096, api_key=None))


def post(client, path, body, **kw):
    if isinstance(body, bytes):
        return client.simulate_post(path, body=body, **kw)
    return client.simulate_post(path, json=body, **kw)


def check_shape(r, path, status, fragment=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers.get("x-request-id")
    if path.startswith(MSGS):
        assert r.json["type"] == "error" and set(r.json["error"]) == {"type", "message"}
        message = r.json["error"]["message"]
    else:
        assert set(r.json["error"]) == {"message", "type", "param", "code"}
        message = r.json["error"]["message"]
    if fragment:
        assert fragment in message, message
    return r.json


@pytest.mark.parametrize("path, body, status, param, fragment",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(client, path, body, status, param, fragment):
    r = post(client, path, body)
    body = check_shape(r, path, status, fragment)
    if path.startswith(MSGS):
        assert body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"
        if param is not None:
            assert body["error"]["param"] == param


def test_prompt_too_long_names_the_numbers(client):
    r = post(client, CHAT, chat(messages=[{"role": "user", "content": "x" * 2000}]))
    msg = check_shape(r, CHAT, 400)["error"]["message"]
    assert str(len("<user>" + "x" * 2000 + "\n<assistant>")) in msg and "1024" in msg


@pytest.mark.parametrize("flavour", ["wsgi", "asgi"])
@pytest.mark.parametrize("path", [CHAT, MSGS, "/v1/models", "/metrics"])
def test_auth_required_everywhere_but_health(flavour, path):
    factory = create_app if flavour == "wsgi" else create_asgi_app
    c = testing.TestClient(factory(FakeEngine(), api_key="sekret"))
    method = c.simulate_get if path in ("/v1/models", "/metrics") else c.simulate_post
    body = msgs() if path == MSGS else chat()
    r = method(path, json=body)
    err = check_shape(r, path, 401, "API key")
    assert r.headers["www-authenticate"] == "Bearer"
    if path == MSGS:
        assert err["error"]["type"] == "authentication_error"
    else:
        assert err["error"]["code"] == "invalid_api_key"
    assert method(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert method(path, json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert method(path, json=body, headers={"x-api-key": "sekret"}).status_code == 200
    assert c.simulate_get("/health").status_code == 200


def test_body_too_large_413(client):
    r = post(client, CHAT, chat(messages=[{"role": "user", "content": "x" * 5000}]))
    check_shape(r, CHAT, 413, "exceeds the limit of 4096 bytes")
    r = post(client, MSGS, msgs(messages=[{"role": "user", "content": "x" * 5000}]))
    assert check_shape(r, MSGS, 413)["error"]["type"] == "request_too_large"


def test_unknown_route_404_and_method_405(client):
    check_shape(client.simulate_get("/v1/nothing"), "/v1/nothing", 404, "no route")
    check_shape(client.simulate_get(CHAT), CHAT, 405, "not allowed")
    check_shape(client.simulate_get("/v1/models/other"), "/v1/models/other", 404, "not found")


def test_queue_full_429():
    engine = FakeEngine(slow_delay=0.2, max_concurrency=1, max_queue=0)
    c = testing.TestClient(create_app(engine))
    held = engine.submit([{"role": "user", "content": "slow"}], SamplingParams())
    r = post(c, CHAT, chat())
    err = check_shape(r, CHAT, 429)
    assert err["error"]["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
    r = post(c, MSGS, msgs())
    assert check_shape(r, MSGS, 429)["error"]["type"] == "rate_limit_error"
    held.cancel()
    held.close()


def test_engine_failed_503(client):
    engine = client.app.gateway._engine
    engine.health = "failed"
    r = client.simulate_get("/health")
    assert r.status_code == 503 and r.json == {"status": "failed"}
    err = check_shape(post(client, CHAT, chat()), CHAT, 503, "failed")
    assert err["error"]["code"] == "engine_failed"
    assert check_shape(post(client, MSGS, msgs()), MSGS, 503)["error"]["type"] == \
        "overloaded_error"


def test_engine_failure_during_submit_503(client):
    from ninfer.errors import EngineFailedError
    engine = client.app.gateway._engine

    def boom(*a, **k):
        raise EngineFailedError("worker died")

    engine.submit = boom
    err = check_shape(post(client, CHAT, chat()), CHAT, 503, "worker died")
    assert err["error"]["code"] == "engine_failed"


def test_escaped_surrogate_pair_is_text(client):
    """A pair of surrogate escapes is one character (only a lone one is a 400)."""
    body = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\u00e9"}]}'
    r = post(client, CHAT, body)
    assert r.status_code == 200, r.text
    assert r.json["choices"][0]["message"]["content"] == "echo: \U0001F600 \u00e9"


@pytest.mark.parametrize("field, value", [
    ("keepalive_s", float("nan")), ("keepalive_s", 0.0), ("keepalive_s", float("inf")),
    ("drain_grace_s", float("nan")), ("drain_grace_s", float("inf")), ("drain_grace_s", -1.0),
    ("temperature", float("nan")), ("top_p", 0.0), ("max_body_bytes", 0),
])
def test_serve_config_rejects_bad_values(field, value):
    from ninfer.errors import RequestError
    from ninfer.serve import ServeConfig
    with pytest.raises(RequestError, match=field):
        ServeConfig(**{field: value}).validate()
