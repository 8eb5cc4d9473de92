"""OpenAI `n` > 1 in process over FakeEngine (tests/test_serve_support.py): the choices as separate
requests with per-choice seeds, their merged stream (chunks name their `index`, one usage chunk,
one [DONE]), usage counting the prompt once, a failed choice failing the response, and a client
that leaves cancelling every choice. The real Engine's shared prefill, the official SDK and echo
are tested over sockets in tests/test_openai_more_http.py."""
from __future__ import annotations

import json
import time

import pytest
from falcon import testing

from ninfer.serve import create_app, create_asgi_app
from test_serve_support import FakeEngine

CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def chat_body(text="hi", **kw):
    return {"model": "m", "messages": [{"role": "user", "content": text}],
            "chat_template_kwargs": {"enable_thinking": False}, **kw}


def sse_data(text: str) -> list:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture(params=["wsgi", "asgi"])
def client(request, engine):
    factory = create_app if request.param == "wsgi" else create_asgi_app
    return testing.TestClient(factory(engine))


def test_n_choices_are_requests_seeded_per_choice(client, engine):
    r = client.simulate_post(CHAT, json=chat_body("abc", n=3, seed=40, temperature=1.0))
    assert r.status_code == 200, r.text
    choices = r.json["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["message"]["content"] == "echo: abc" for c in choices)
    # three submits of the same prompt, choice i seeded 40 + i (vLLM's convention); only the
    # first asks the Engine to keep its prompt for the others
    assert [p.seed for _, p, _, _ in engine.submitted] == [40, 41, 42]
    assert [m == engine.submitted[0][0] for m, _, _, _ in engine.submitted] == [True] * 3
    assert engine.shared == [True, False, False]
    usage = r.json["usage"]
    n_prompt = len(engine.tokenize(engine.apply_chat_template(
        [{"role": "user", "content": "abc"}], enable_thinking=False)))
    assert usage["prompt_tokens"] == n_prompt                      # counted once
    per_choice = len("echo: abc") + 1                              # + the EOS
    assert usage["completion_tokens"] == 3 * per_choice            # every choice's
    assert usage["total_tokens"] == n_prompt + 3 * per_choice


def test_n_without_seed_draws_one_per_choice(client, engine):
    r = client.simulate_post(CHAT, json=chat_body("abc", n=2))
    assert r.status_code == 200
    assert [p.seed for _, p, _, _ in engine.submitted] == [None, None]


def test_n_completions_with_logprobs(client, engine):
    r = client.simulate_post(COMP, json={"model": "m", "prompt": "hey", "n": 2, "logprobs": 1,
                                         "max_tokens": 4})
    assert r.status_code == 200, r.text
    choices = r.json["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        assert c["text"] == "echo"
        assert c["logprobs"]["tokens"] == list("echo") and c["finish_reason"] == "length"
    assert r.json["usage"]["completion_tokens"] == 8
    assert r.json["usage"]["prompt_tokens"] == 3


def test_n_stream_merges_choices(engine):
    wsgi = testing.TestClient(create_app(engine))
    r = wsgi.simulate_post(CHAT, json=chat_body("abc", n=3, stream=True,
                                                stream_options={"include_usage": True}))
    data = sse_data(r.text)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    usage_chunks = [c for c in chunks if c["usage"] is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0]["choices"] == []
    assert usage_chunks[0]["usage"]["completion_tokens"] == 3 * (len("echo: abc") + 1)
    text = {0: "", 1: "", 2: ""}
    finishes = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            assert choice["index"] not in finishes
            finishes[choice["index"]] = choice["finish_reason"]
    assert text == {i: "echo: abc" for i in range(3)}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}


def test_n_completion_stream_names_choice_index(engine):
    wsgi = testing.TestClient(create_app(engine))
    r = wsgi.simulate_post(COMP, json={"model": "m", "prompt": "hey", "n": 2, "stream": True,
                                       "max_tokens": 3})
    data = sse_data(r.text)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    text = {0: "", 1: ""}
    for d in data[:-1]:
        (choice,) = json.loads(d)["choices"]
        text[choice["index"]] += choice["text"]
    assert text == {0: "ech", 1: "ech"}


def test_a_failed_choice_fails_the_response(client):
    r = client.simulate_post(CHAT, json=chat_body("fail", n=2))
    assert r.status_code == 500 and "injected failure" in r.json["error"]["message"]


def test_a_failed_choice_ends_the_stream_once(engine):
    wsgi = testing.TestClient(create_app(engine))
    r = wsgi.simulate_post(CHAT, json=chat_body("fail", n=2, stream=True))
    data = sse_data(r.text)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert "injected failure" in data[-2]


def test_n_disconnect_cancels_every_choice(engine):
    """A WSGI server closes the response iterable when the client's socket breaks: every
    choice's request is cancelled and released."""
    app = create_app(engine)
    env = testing.create_environ(method="POST", path=CHAT,
                                 body=json.dumps(chat_body("slow", n=3, stream=True)),
                                 headers={"content-type": "application/json"})
    body = app(env, lambda status, headers: None)
    first = [next(iter(body)) for _ in range(6)]
    assert all(chunk.startswith(b"data: ") for chunk in first)
    assert engine.stats()["residents"] == 3 and app.gateway.num_in_flight() == 3
    body.close()
    idle = {"queue_depth": 0, "residents": 0, "paused": 0, "open_handles": 0}
    deadline = time.monotonic() + 5
    while engine.stats() != idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats() == idle
    assert app.gateway.num_in_flight() == 0


def test_a_refused_choice_releases_the_ones_started():
    """max_concurrency + max_queue = 3 outstanding: a 4th choice is refused (429), and the
    three already submitted are cancelled and released, not left running."""
    small = FakeEngine(max_concurrency=1, max_queue=2)
    app = create_app(small)
    r = testing.TestClient(app).simulate_post(CHAT, json=chat_body("slow", n=4))
    assert r.status_code == 429 and len(small.submitted) == 3
    deadline = time.monotonic() + 5
    while small.stats()["open_handles"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert small.stats()["open_handles"] == 0 and app.gateway.num_in_flight() == 0
