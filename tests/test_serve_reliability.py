"""Reliability of the real servers (gunicorn with the uvicorn-loop worker, and plain uvicorn over
the ASGI app) over raw sockets and Python's http.client, on the ScriptedEngine with one lane:

- a streamed request still waiting in the Engine's queue leaves it as soon as its client closes
  the connection (it used to keep its place until the next SSE keep-alive write, 15 s later);
- a body over the limit sent by http.client (which writes the whole body before it reads) gets
  the 413 JSON, not a connection reset, with a Content-Length and chunked."""
from __future__ import annotations

import http.client
import json
import pathlib
import socket
import sys
import threading
import time

import httpx
import pytest

from test_serve_support import ServerProcess

SUPPORT = pathlib.Path(__file__).with_name("test_serve_support.py")
LIMIT = 1 << 20
QUEUED = "ninfer_queue_depth"
RESIDENT = "ninfer_resident_requests"
CANCELLED = 'ninfer_generations_finished_total{reason="cancelled"}'
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def demo_artifact():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module", params=["gunicorn", "uvicorn"])
def server(request, demo_artifact):
    argv = [sys.executable, SUPPORT, "--artifact", demo_artifact, "--max-concurrency", "1",
            "--max-context", "2048", "--max-body-bytes", str(LIMIT)]
    if request.param == "uvicorn":
        argv.append("--asgi")
    srv = ServerProcess(argv)
    yield srv
    srv.stop()


def chat(content, **kw):
    return {"model": "m", "messages": [{"role": "user", "content": content}],
            "chat_template_kwargs": {"enable_thinking": False}, **kw}


def wait_for(srv, check, timeout):
    """The metrics once `check(metrics)` holds, else the last ones seen after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if check(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_queued_stream_leaves_the_queue_when_its_client_disconnects(server):
    before = server.metrics().get(CANCELLED, 0.0)
    stop_long = threading.Event()

    def long_stream():          # holds the only lane for ~30 s unless told to stop
        body = chat("[[script:long]]", max_tokens=1500, stream=True)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=120) as resp:
            for _ in resp.iter_lines():
                if stop_long.is_set():
                    return
    holder = threading.Thread(target=long_stream)
    holder.start()
    try:
        m = wait_for(server, lambda m: m.get(RESIDENT) == 1, 30)
        assert m[RESIDENT] == 1
        body = json.dumps(chat("hello", max_tokens=20, stream=True)).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            head = sock.recv(65536)             # the stream has begun: status, headers, role
            assert head.startswith(b"HTTP/1.1 200"), head
            m = wait_for(server, lambda m: m.get(QUEUED) == 1, 10)
            assert m[QUEUED] == 1 and m[RESIDENT] == 1
        finally:
            sock.close()
        t0 = time.monotonic()
        m = wait_for(server, lambda m: m.get(QUEUED) == 0 and m.get(CANCELLED) == before + 1, 10)
        waited = time.monotonic() - t0
        assert m[QUEUED] == 0 and m[CANCELLED] == before + 1, server.output()[-3000:]
        # well before the 15 s keep-alive, and while the long request still holds the lane
        assert waited < 5, waited
        assert m[RESIDENT] == 1
    finally:
        stop_long.set()
        holder.join(60)
    m = wait_for(server, lambda m: m.get("ninfer_engine_outstanding") == 0, 30)
    assert m["ninfer_engine_outstanding"] == 0


def _post_with_http_client(port, body, **request_kw):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"content-type": "application/json"}, **request_kw)
        resp = conn.getresponse()
        return resp.status, resp.getheader("connection"), json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("size", [9 << 20, 40 << 20])
def test_http_client_gets_the_413_for_a_body_over_the_limit(server, size):
    body = b'{"x": "' + b"a" * size + b'"}'
    status, connection, reply = _post_with_http_client(server.port, body)
    assert status == 413 and reply["error"]["code"] == "request_too_large", reply
    assert connection == "close"
    # the same with chunked transfer encoding (no Content-Length: found while reading)
    chunks = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    status, _, reply = _post_with_http_client(server.port, chunks, encode_chunked=True)
    assert status == 413 and reply["error"]["code"] == "request_too_large", reply
    # and the server still answers
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("hi", max_tokens=2), timeout=30)
    assert r.status_code == 200, r.text
