"""Hostile and slow clients against the real server (gunicorn master, the uvicorn-loop worker,
the real EngineCore on the demo artifact), over real sockets. Each test reproduces one failure of
issue 17 as it was seen on the gthread worker: slow headers and bodies that starved the thread pool,
500 on a 5000-digit integer, chunked bodies read as empty, HTML 431, 405 on HEAD, a drain that hung
instead of answering 503, an orphaned worker that kept the port, non-streamed requests that ran on
after their client left.

Run as a script, this module is the server (ScriptedEngine, short transport limits)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from test_serve_support import ServerProcess

HERE = os.path.abspath(__file__)
LIMITS = dict(header_timeout_s=1.5, body_timeout_s=1.5, idle_timeout_s=2.0, max_connections=48,
              max_header_bytes=8192, max_body_bytes=64 << 10, drain_grace_s=2.0)
POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages",
               "/v1/messages/count_tokens")
CANCELLED = 'ninfer_generations_finished_total{reason="cancelled"}'


@pytest.fixture(scope="module")
def demo_artifact():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


class _OnPort(ServerProcess):
    """ServerProcess on a port chosen by the test (a restart on the port a dead server held)."""

    def __init__(self, argv, port):
        import tempfile
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self._log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(argv + ["--port", str(port)], stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True)
        self._wait_ready(90.0)


def start(demo_artifact, port=None, *extra) -> ServerProcess:
    argv = [sys.executable, HERE, "--artifact", demo_artifact, *extra]
    return _OnPort(argv, port) if port else ServerProcess(argv)


@pytest.fixture(scope="module")
def server(demo_artifact):
    srv = start(demo_artifact)
    yield srv
    assert srv.stop() == 0, srv.output()


def chat(content="hi", **kw):
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "chat_template_kwargs": {"enable_thinking": False}, **kw}


def raw(port, data: bytes, *, timeout=10.0) -> bytes:
    """Send `data` on a fresh connection; everything the server answers before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def split(response: bytes):
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def wait_metric(srv, name, want, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if m.get(name, 0.0) == want or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_idle(srv):
    m = wait_metric(srv, "ninfer_engine_outstanding", 0.0)
    assert m["ninfer_engine_outstanding"] == 0, srv.output()
    # every KV page not held by a context-cache checkpoint is free
    assert m["ninfer_engine_kv_pages_used"] == m["ninfer_engine_prefix_cache_kv_pages"]
    assert m["ninfer_engine_state_slots_used"] == 0 and m["ninfer_generations_in_flight"] == 0


# ---- slow clients ---------------------------------------------------------------------------------

def test_slow_header_clients_cost_a_socket_and_time_out(server):
    # connections dribbling a request line used to hold every gthread thread (the issue: 90)
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(30)]
    stop = threading.Event()

    def dribble():
        for i in range(20):
            for sock in slow:
                try:
                    sock.send(b"GET /health HTTP/1.1\r\n"[i:i + 1])
                except OSError:
                    pass
            if stop.wait(0.2):
                return
    t = threading.Thread(target=dribble)
    t.start()
    try:
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(), timeout=30)
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 20
        # the header deadline (1.5 s) ends each slow connection with a JSON 408
        slow[0].settimeout(10)
        answer = b""
        while chunk := slow[0].recv(65536):
            answer += chunk
        status, headers, body = split(answer)
        assert status == 408 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "request_timeout"
    finally:
        stop.set()
        t.join()
        for sock in slow:
            sock.close()


def test_partial_body_times_out_with_408(server):
    t0 = time.monotonic()
    answer = raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                              b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"a\"")
    status, headers, body = split(answer)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 8
    assert headers["connection"] == "close"


def test_idle_keep_alive_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.2)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert sock.recv(65536) == b""          # closed by the server after the idle timeout
        assert time.monotonic() - t0 < 8


def test_connections_beyond_the_cap_get_503_json(server):
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(60)]
    try:
        time.sleep(0.3)
        r = httpx.get(server.url + "/v1/models", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        r = httpx.post(server.url + "/v1/messages", json=chat(), timeout=5)
        assert r.status_code == 503 and r.json()["type"] == "error"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


# ---- every bad input is a 4xx in JSON ---------------------------------------------------------------

@pytest.mark.parametrize("path", POST_ROUTES)
def test_5000_digit_integer_is_400_on_every_post_route(server, path):
    body = b'{"model": "m", "ignored": ' + b"7" * 5000 + b', "max_tokens": 4}'
    r = httpx.post(server.url + path, content=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "out of range" in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("number", [b"1e400", b"NaN", b"-Infinity"])
def test_non_finite_numbers_are_400(server, number):
    body = b'{"model": "m", "messages": [], "temperature": ' + number + b"}"
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=10)
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


def test_chunked_request_body_is_read(server):
    payload = json.dumps(chat()).encode()

    def pieces():
        for i in range(0, len(payload), 7):
            yield payload[i:i + 7]
    r = httpx.post(server.url + "/v1/chat/completions", content=pieces(), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_chunked_body_over_the_limit_is_413(server):
    big = b'{"x": "' + b"a" * (LIMITS["max_body_bytes"] + 10) + b'"}'
    r = httpx.post(server.url + "/v1/messages", content=iter([big[:1000], big[1000:]]), timeout=10)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(server.url + "/v1/chat/completions", content=big, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_huge_headers_get_431_json(server):
    r = httpx.get(server.url + "/health", headers={"x-big": "a" * 20000}, timeout=10)
    assert r.status_code == 431 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    r = httpx.post(server.url + "/v1/messages", headers={"x-big": "a" * 20000}, json={}, timeout=10)
    assert r.status_code == 431 and r.json()["type"] == "error"      # Anthropic's shape there


def test_garbage_http_is_400_json(server):
    status, headers, body = split(raw(server.port, b"BLAH\x00 / HTTP/9\r\n\r\n"))
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http"


def test_head_on_get_routes(server):
    for path in ("/health", "/v1/models", "/metrics"):
        r = httpx.head(server.url + path, timeout=5)
        assert r.status_code == 200 and r.content == b"", path
    assert httpx.head(server.url + "/v1/chat/completions", timeout=5).status_code == 405


# ---- disconnects ----------------------------------------------------------------------------------

def test_non_streamed_request_is_cancelled_when_its_client_leaves(server):
    before = server.metrics().get(CANCELLED, 0.0)
    body = json.dumps(chat("[[script:long]]", max_tokens=800)).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        m = wait_metric(server, "ninfer_resident_requests", 1.0)
        assert m["ninfer_resident_requests"] == 1
    m = wait_metric(server, CANCELLED, before + 1)
    assert m[CANCELLED] == before + 1, server.output()
    assert_idle(server)


# ---- lifecycle ------------------------------------------------------------------------------------

def test_drain_answers_503_at_once_then_exits(demo_artifact):
    srv = start(demo_artifact, None, "--drain-grace", "1.5")
    try:
        got = []

        def stream():
            body = chat("[[script:long]]", max_tokens=800, stream=True)
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                              timeout=30) as resp:
                got.extend(resp.iter_lines())
        t = threading.Thread(target=stream)
        t.start()
        wait_metric(srv, "ninfer_resident_requests", 1.0)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        r = httpx.get(srv.url + "/health", timeout=3)
        assert r.status_code == 503 and r.json()["status"] == "draining"
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat(), timeout=3)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_draining"
        assert time.monotonic() - t0 < 2
        t.join(30)
        # the stream outlived the grace and was cancelled; then the worker and master exit 0
        assert any('"finish_reason":"cancelled"' in line for line in got), got[-3:]
        assert srv.proc.wait(20) == 0
    finally:
        srv.stop()


def _children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_worker_exits_with_its_master_and_a_restart_binds(demo_artifact):
    srv = start(demo_artifact)
    [worker] = _children(srv.proc.pid)

    def stream():                   # in flight when the master dies (gthread waited for it)
        body = chat("[[script:long]]", max_tokens=1500, stream=True)
        try:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                              timeout=60) as resp:
                for _ in resp.iter_lines():
                    pass
        except httpx.HTTPError:
            pass
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    wait_metric(srv, "ninfer_resident_requests", 1.0)
    srv.proc.kill()                 # SIGKILL: the master cannot tell its worker anything
    srv.proc.wait(5)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        try:
            with socket.socket() as probe:      # what gunicorn does on start
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("127.0.0.1", srv.port))
            break
        except OSError:
            time.sleep(0.02)
    released = time.monotonic() - t0
    assert released < 2, f"port still held {released:.1f} s after the master died"
    again = start(demo_artifact, port=srv.port)
    try:
        assert httpx.get(again.url + "/health", timeout=5).json()["status"] == "ok"
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{worker}") or _is_zombie(worker)
    finally:
        assert again.stop() == 0


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def main(argv=None) -> int:
    import argparse

    from test_serve_support import ScriptedEngine

    from ninfer.serve.config import ServeConfig
    from ninfer.serve.launcher import serve

    p = argparse.ArgumentParser()
    p.add_argument("--artifact", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--drain-grace", type=float, default=LIMITS["drain_grace_s"])
    args = p.parse_args(argv)

    def factory():
        return ScriptedEngine(args.artifact, max_concurrency=4, max_queue=4, max_context=2048)
    config = ServeConfig(**{**LIMITS, "drain_grace_s": args.drain_grace})
    serve(factory, config, host="127.0.0.1", port=args.port, threads=12,
          log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def test_transport_flags_reach_the_serve_config():
    from ninfer.cli import build_parser
    from ninfer.serve.config import ServeConfig, transport_overrides
    args = build_parser().parse_args(["serve", "--header-timeout", "2.5", "--body-timeout", "7",
                                      "--idle-timeout", "1", "--max-connections", "64",
                                      "--max-header-kb", "8"])
    got = transport_overrides(args)
    assert got == {"header_timeout_s": 2.5, "body_timeout_s": 7.0, "idle_timeout_s": 1.0,
                   "max_connections": 64, "max_header_bytes": 8192}
    ServeConfig(**got).validate()
    assert transport_overrides(build_parser().parse_args(["serve"])) == {}


@pytest.mark.parametrize("value", ["nan", "inf", "0.5"])
def test_bad_max_header_kb_is_a_one_line_error(value, capsys):
    # nan / inf reached int() in transport_overrides: a traceback instead of the CLI's error line
    from ninfer.cli import main
    assert main(["serve", "/nonexistent", "--max-header-kb", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer: error: ") and "max_header_bytes" in err and "Traceback" not in err
