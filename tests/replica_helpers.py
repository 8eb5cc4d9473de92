"""What the tests of the two routers in front of replicas share (test_serve_replicas.py:
`serve --data-parallel`; test_serve_ray.py: ninfer.serve.ray)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from ninfer.serve.routing import rendezvous_order

CHAT = "/v1/chat/completions"


def chat(content, system=None, **kw):
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]
    return {"model": "m", "messages": messages, **kw}


def poll(check, timeout, what, every=0.05):
    """check()'s first truthy value within `timeout` s, else fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(every)


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def keys_for_each_replica():
    """A session key that rendezvous hashing sends to replica (rank) 0, and one it sends to 1."""
    found = {}
    for i in range(100):
        key = f"conversation-{i}"
        found.setdefault(rendezvous_order("s:" + key, [0, 1])[0], key)
    return found[0], found[1]


def streamed_text(url, body, replica: str) -> str:
    """A streamed chat completion of `body` through the router at `url`: checks it came from
    `replica` as well-formed SSE (a role first, a finish reason last, [DONE]); its text."""
    with httpx.stream("POST", url + CHAT, json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-ninfer-replica"] == replica
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
