"""The WSGI app in process over the real EngineCore (ScriptedEngine on the demo artifact): the
Engine's own rejections map to HTTP statuses, and a client that goes away mid-stream frees its
request, checked through Engine.stats()."""
from __future__ import annotations

import json
import time

import pytest
from falcon import testing

from ninfer.serve import create_app
from test_serve_support import ScriptedEngine

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine():
    from ninfer.demo import ensure_demo_artifact
    e = ScriptedEngine(ensure_demo_artifact(), max_concurrency=1, max_queue=0, max_context=512)
    yield e
    e.close()


def open_stream(app, text, max_tokens=400):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": True, "chat_template_kwargs": {"enable_thinking": False}}
    env = testing.create_environ(method="POST", path=CHAT, body=json.dumps(body),
                                 headers={"content-type": "application/json"})
    status = []
    it = app(env, lambda s, h: status.append(s))
    return status, it


def wait_idle(engine, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["outstanding"] == 0 and stats["residents"] == 0:
            return stats
        time.sleep(0.02)
    return engine.stats()


def test_disconnect_mid_stream_frees_engine_resources(engine):
    app = create_app(engine)
    status, it = open_stream(app, "[[script:long]]")
    chunks = iter(it)
    got = [next(chunks) for _ in range(5)]
    assert status == ["200 OK"] and all(c.startswith(b"data: ") for c in got)
    stats = engine.stats()
    assert stats["outstanding"] == 1 and stats["residents"] == 1 and stats["kv_pages_used"] > 0
    it.close()                      # what the WSGI server does when the socket breaks
    stats = wait_idle(engine)
    assert stats["outstanding"] == 0 and stats["residents"] == 0
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0
    assert stats["tokens_generated"] < 400 and app.gateway.num_in_flight() == 0


def test_queue_full_is_429_and_prompt_too_long_is_400(engine):
    app = create_app(engine)
    c = testing.TestClient(app)
    status, it = open_stream(app, "[[script:long]]")
    next(iter(it))                  # resident: max_concurrency 1, max_queue 0
    r = c.simulate_post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json["error"]["type"] == "rate_limit_error" and r.json["error"]["code"] == "overloaded"
    r = c.simulate_post("/v1/messages", json={"max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.json["error"]["type"] == "rate_limit_error"
    it.close()
    wait_idle(engine)
    r = c.simulate_post(CHAT, json={"messages": [{"role": "user", "content": "word " * 600}]})
    assert r.status_code == 400 and r.json["error"]["code"] == "context_length_exceeded"
    assert "max_context=512" in r.json["error"]["message"]
    assert c.simulate_post(CHAT, json={"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2}).status_code == 200


def test_engines_declare_what_the_gateway_reads(engine):
    """The Gateway reads api.ServedEngine's members directly (no hasattr probes): the Engine and
    both test engines declare every one of them, and the count-tokens and vocabulary members give
    what a request would be charged."""
    from ninfer import Engine
    from ninfer.api import ServedEngine
    from ninfer.demo import ensure_demo_artifact
    from test_serve_support import FakeEngine

    with Engine(ensure_demo_artifact(), max_context=512, warmup=False) as real:
        assert isinstance(real, ServedEngine)
        messages = [{"role": "user", "content": "hello"}]
        n = len(real.frontend.prepare(messages, enable_thinking=False).token_ids)
        assert real.count_prompt_tokens(messages, enable_thinking=False) == n
        assert real.vocab_size == real.frontend.vocab_size
    assert isinstance(engine, ServedEngine) and isinstance(FakeEngine(), ServedEngine)
    assert not callable(engine) and not callable(FakeEngine())    # callables are factories
