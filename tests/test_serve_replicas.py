"""`serve --data-parallel N`: replicas behind a router (ninfer/serve/routing.py, replicas.py,
router.py, router_metrics.py).

Pure tests of the routing policy (keys, rendezvous stability, the load bound, the prompt digest),
of the replicas' command line and of the router's own answers (a stub supervisor), then black-box
tests of `python -m ninfer serve --data-parallel 2` on the built-in reference model: affinity,
spreading, SSE relayed as it is produced, errors relayed unchanged, labelled /metrics, a client
disconnect cancelling the replica's generation, a killed replica routed around and restarted, and
a SIGTERM drain. Every wait polls with a deadline."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import httpx
import pytest

from ninfer.serve import routing
from ninfer.serve.routing import ANY, LOAD_BOUND, PREFIX, SESSION, choose, rendezvous_order
from replica_helpers import CHAT, chat, keys_for_each_replica, poll, post, streamed_text

pytestmark = pytest.mark.timeout(180)


# ---- routing: keys ----------------------------------------------------------------------------

def test_session_key_of_each_protocol():
    assert routing.affinity_key(CHAT, chat("hi", prompt_cache_key="k", user="u")) == \
        (SESSION, "s:k")
    assert routing.affinity_key(CHAT, chat("hi", user="u")) == (SESSION, "s:u")
    assert routing.affinity_key(CHAT, chat("hi", prompt_cache_key="", user="u")) == \
        (SESSION, "s:u")
    assert routing.affinity_key("/v1/completions", {"prompt": "x", "prompt_cache_key": "c"}) == \
        (SESSION, "s:c")
    anthropic = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                 "metadata": {"user_id": "a"}}
    assert routing.affinity_key("/v1/messages", anthropic) == (SESSION, "s:a")
    # OpenAI's fields mean nothing on the Anthropic route: keyed by its prompt instead
    assert routing.affinity_key("/v1/messages", {**anthropic, "metadata": {},
                                                 "user": "u"})[0] == PREFIX
    # a hint of the wrong type is the replica's 400 to give; the router just does not use it
    assert routing.affinity_key(CHAT, chat("hi", prompt_cache_key=5))[0] == PREFIX
    for path in ("/v1/embeddings", "/tokenize", "/detokenize", "/v1/messages/count_tokens",
                 "/v1/models"):
        assert routing.affinity_key(path, chat("hi", prompt_cache_key="k")) is None
    assert routing.affinity_key(CHAT, ["not", "an", "object"]) is None
    assert routing.affinity_key(CHAT, {"messages": "nope"}) is None


def test_prefix_digest_keeps_a_conversation_and_its_system_prompt_together():
    system = "You are a coding agent. " * 20
    first = chat("fix the bug in parser.py", system=system)
    later = dict(first, messages=first["messages"] + [
        {"role": "assistant", "content": "done"}, {"role": "user", "content": "now test it"}])
    digest = routing.prefix_digest(CHAT, first)
    assert digest is not None and routing.prefix_digest(CHAT, later) == digest
    # sampling fields do not change where a prompt goes
    assert routing.prefix_digest(CHAT, dict(first, temperature=0.3, max_tokens=9)) == digest
    assert routing.prefix_digest(CHAT, chat("fix the bug in parser.py", system="other")) != digest
    assert routing.prefix_digest(CHAT, chat("another task", system=system)) != digest
    # the developer role stands for system, as the replica reads it
    dev = {"messages": [{"role": "developer", "content": system},
                        {"role": "user", "content": "fix the bug in parser.py"}]}
    assert routing.prefix_digest(CHAT, dev) == digest
    # so two such requests land on one replica, whatever the replicas
    for live in ([0, 1], [0, 1, 2, 3], [3, 5, 7]):
        a = choose(routing.affinity_key(CHAT, first), live, {}, slack=4)
        b = choose(routing.affinity_key(CHAT, later), live, {}, slack=4)
        assert a == b and a.rule == PREFIX
    # Anthropic: the top-level system and the first user message
    msg = {"system": system, "messages": [{"role": "user", "content": "fix it"}]}
    turn2 = dict(msg, messages=msg["messages"] + [{"role": "assistant", "content": "ok"},
                                                  {"role": "user", "content": "more"}])
    assert routing.prefix_digest("/v1/messages", msg) == \
        routing.prefix_digest("/v1/messages", turn2)
    # completions: the prompt's first PREFIX_CHARS characters (text) or ids
    head = "x" * routing.PREFIX_CHARS
    assert routing.prefix_digest("/v1/completions", {"prompt": head + "a"}) == \
        routing.prefix_digest("/v1/completions", {"prompt": [head + "b"]})
    assert routing.prefix_digest("/v1/completions", {"prompt": "a" + head}) != \
        routing.prefix_digest("/v1/completions", {"prompt": "b" + head})
    ids = list(range(routing.PREFIX_TOKEN_IDS))
    assert routing.prefix_digest("/v1/completions", {"prompt": ids + [1]}) == \
        routing.prefix_digest("/v1/completions", {"prompt": ids + [2]})
    assert routing.prefix_digest("/v1/completions", {"prompt": 5}) is None


# ---- routing: rendezvous hashing and the load bound -------------------------------------------

def test_rendezvous_moves_only_the_removed_replicas_keys():
    keys = [f"s:conversation-{i}" for i in range(2000)]
    everyone = [0, 1, 2, 3]
    before = {k: choose((SESSION, k), everyone, {}, slack=4).replica for k in keys}
    counts = [list(before.values()).count(i) for i in everyone]
    assert min(counts) > 400, counts                    # spread: about 500 each
    survivors = [0, 1, 3]
    after = {k: choose((SESSION, k), survivors, {}, slack=4).replica for k in keys}
    moved = {k for k in keys if after[k] != before[k]}
    assert moved == {k for k in keys if before[k] == 2}
    # each moved key goes to its runner-up, so replica 2's keys spread over the others
    assert all(after[k] == rendezvous_order(k, everyone)[1] for k in moved)
    assert len({after[k] for k in moved}) == 3
    # replica 2 back: exactly its keys return
    assert {k: choose((SESSION, k), everyone, {}, slack=4).replica for k in keys} == before


def test_load_bound_overrides_affinity():
    key = (SESSION, "s:busy-conversation")
    home, other = rendezvous_order(key[1], [0, 1, 2])[:2]
    third = ({0, 1, 2} - {home, other}).pop()
    live = [0, 1, 2]
    # within fewest + slack: affinity holds
    assert choose(key, live, {home: 6, other: 2, third: 3}, slack=4) == \
        routing.Choice(home, SESSION)
    # beyond it: the least-loaded replica
    assert choose(key, live, {home: 7, other: 3, third: 2}, slack=4) == \
        routing.Choice(third, LOAD_BOUND)
    # equally loaded candidates: the key's runner-up first, so overflow is stable too
    assert choose(key, live, {home: 9, other: 1, third: 1}, slack=4) == \
        routing.Choice(other, LOAD_BOUND)
    # no key: the least loaded, ties in the given order
    assert choose(None, live, {0: 2, 1: 1, 2: 1}, slack=4, any_order=[2, 0, 1]) == \
        routing.Choice(2, ANY)
    assert choose(key, [], {}, slack=4) is None


# ---- the replicas' command line ---------------------------------------------------------------

def _serve_args(argv):
    from ninfer.cli import build_parser
    return build_parser().parse_args(["serve", *argv])


def test_replica_flags_give_each_replica_the_routers_options():
    from ninfer.serve_command import _ROUTER_ONLY, replica_flags
    argv = ["model.ninfer", "--host", "0.0.0.0", "--port", "9000", "--data-parallel", "4",
            "--replica-devices", "4,5,6,7", "--api-key", "secret", "--max-concurrency", "8",
            "--max-context", "4096", "--no-prefix-cache", "--prefix-cache-host-bytes", "1G",
            "--no-thinking", "--temperature", "0.6", "--allowed-origins", "https://a.example",
            "--allowed-origins", "*", "--lenient", "--header-timeout", "2.5",
            "--max-header-kb", "32", "--drain-grace", "5", "--log-level", "warning",
            "--backend", "numpy", "--chat-template", "t.jinja"]
    args = _serve_args(argv)
    flags = replica_flags(args.serve_parser, args)
    assert "secret" not in flags and "9000" not in flags and "--data-parallel" not in flags
    again = _serve_args(flags)
    for name, value in vars(args).items():
        if name not in _ROUTER_ONLY:
            assert getattr(again, name) == value, name
    assert again.thinking is False and again.prefix_cache is False
    assert replica_flags(args.serve_parser, _serve_args([])) == []


def test_replica_devices_default_to_the_visible_gpus(monkeypatch):
    from ninfer.serve_command import _replica_devices
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _replica_devices(_serve_args([])) is None
    assert _replica_devices(_serve_args(["--data-parallel", "3"])) == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert _replica_devices(_serve_args(["--data-parallel", "2"])) == ["4", "5"]
    assert _replica_devices(_serve_args(["--data-parallel", "4"])) == ["0", "1", "2", "3"]
    assert _replica_devices(_serve_args(["--data-parallel", "2", "--replica-devices",
                                         "1, GPU-5f3e"])) == ["1", "GPU-5f3e"]


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel", "0"], "--data-parallel 0: must be >= 1"),
    (["--replica-devices", "0"], "--replica-devices needs --data-parallel N with N >= 2"),
    (["--data-parallel", "2", "--replica-devices", "0,1,2"], "must list 2 devices"),
    (["--data-parallel", "2", "--replica-devices", "0,"], "must list 2 devices"),
    (["--data-parallel", "2", "--device-id", "1"], "name the GPUs with --replica-devices"),
])
def test_bad_replica_flags_are_one_error_line(argv, message, capsys):
    from ninfer.cli import main
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# ---- the router's own answers and its failover (a stub supervisor: no processes) --------------

class _StubSupervisor:
    """The Supervisor's face to the router, over replicas in the given states."""

    def __init__(self, states):
        from ninfer.serve.replicas import Replica, ReplicaState
        self.replicas = [Replica(i, str(i), port=9000 + i, state=ReplicaState(s))
                         for i, s in enumerate(states)]
        self.unreachable = []

    def ready(self):
        return [r.index for r in self.replicas if r.state.value == "ready"]

    def url(self, i):
        return self.replicas[i].url

    def mark_unreachable(self, i, why):
        self.unreachable.append((i, why))

    def describe(self):
        return [r.describe() for r in self.replicas]


def _router(states, handler=None):
    from ninfer.serve.config import ServeConfig
    from ninfer.serve.router import RouterApp
    client = None if handler is None else httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return RouterApp(_StubSupervisor(states), client=client, config=ServeConfig(), slack=4)


def _streamed(status, obj):
    """A response whose body is still to be read, as a real upstream's is."""
    return httpx.Response(status, headers={"content-type": "application/json"},
                          stream=httpx.ByteStream(json.dumps(obj).encode()))


def _call(app, method, path, body=b""):
    """(status, headers, body) of one request to the ASGI app."""
    sent, incoming = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if incoming:
            return incoming.pop()
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"content-length", str(len(body)).encode())]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"")
                                                                  for m in sent[1:])


def test_router_answers_503_in_the_routes_shape_when_no_replica_is_ready():
    app = _router(["starting", "starting"])
    status, headers, body = _call(app, "POST", CHAT, json.dumps(chat("hi")).encode())
    assert status == 503 and headers[b"retry-after"] == b"1"
    err = json.loads(body)["error"]
    assert err["code"] == "no_replica_ready" and err["type"] == "service_unavailable_error"
    assert "2 starting" in err["message"]
    status, _, body = _call(app, "POST", "/v1/messages", b"{}")
    assert status == 503 and json.loads(body)["type"] == "error"
    assert json.loads(body)["error"]["type"] == "overloaded_error"
    status, _, body = _call(app, "GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "loading"
    assert app.stats.num_unavailable == 2


def test_the_router_answers_413_and_408_itself_before_any_replica_is_asked():
    """A body over max_body_bytes (declared, or only found while reading it) is a 413 and one
    that does not arrive within body_timeout_s a 408, both in the route's error shape with the
    connection closed; no replica is chosen for them (the handler would fail the test)."""
    from ninfer.serve.config import ServeConfig
    from ninfer.serve.router import RouterApp

    def handler(request):
        raise AssertionError(f"forwarded {request.url}")
    app = RouterApp(_StubSupervisor(["ready"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(handler)),
        config=ServeConfig(max_body_bytes=100, body_timeout_s=0.2), slack=4)

    def call(chunks, declared):
        sent, incoming = [], list(chunks)

        async def receive():
            if incoming:
                return incoming.pop(0)
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": CHAT, "raw_path": CHAT.encode(),
                 "query_string": b"", "headers": [] if declared is None
                 else [(b"content-length", str(declared).encode())]}
        asyncio.run(app(scope, receive, send))
        return sent[0]["status"], dict(sent[0]["headers"]), json.loads(sent[1]["body"])
    part = {"type": "http.request", "body": b"x" * 60, "more_body": True}
    end = {"type": "http.request", "body": b"", "more_body": False}
    for chunks, declared in (([end], 500), ([part, part, end], None)):
        status, headers, body = call(chunks, declared)
        assert status == 413 and headers[b"connection"] == b"close", (status, headers)
        assert body["error"]["code"] == "request_too_large"
        assert ("500" if declared else "more than 100") in body["error"]["message"]
    status, headers, body = call([part], 90)            # the rest never comes
    assert status == 408 and headers[b"connection"] == b"close"
    assert body["error"]["code"] == "request_timeout"
    assert sum(app.stats.outstanding) == 0 and not app.stats.routed


def test_a_request_moves_to_another_replica_when_its_own_cannot_take_it():
    key = "s:some-conversation"
    home, other = rendezvous_order(key, [0, 1])
    asked = []

    def handler(request):
        i = request.url.port - 9000
        asked.append(i)
        if i == home:
            raise httpx.ConnectError("connection refused", request=request)
        return _streamed(200, {"served_by": i})
    app = _router(["ready", "ready"], handler)
    status, headers, body = _call(app, "POST", CHAT,
                                  json.dumps(chat("hi", prompt_cache_key=key[2:])).encode())
    assert status == 200 and json.loads(body) == {"served_by": other}
    assert headers[b"x-ninfer-replica"] == str(other).encode() and asked == [home, other]
    assert app.supervisor.unreachable == [(home, "connection refused")]
    assert app.stats.failovers[home] == 1 and app.stats.outstanding == [0, 0]

    # a 503 (draining, failed) moves it too, unless no other replica is left: then it is relayed
    def draining(request):
        return _streamed(503, {"error": {"code": "engine_draining"}})
    app = _router(["ready", "ready"], draining)
    status, headers, body = _call(app, "POST", CHAT, json.dumps(chat("hi")).encode())
    assert status == 503 and json.loads(body)["error"]["code"] == "engine_draining"
    assert len(app.supervisor.unreachable) == 1 and sum(app.stats.failovers) == 1


# ---- the real thing: python -m ninfer serve --data-parallel 2 ---------------------------------

def _health(srv):
    return httpx.get(srv.url + "/health", timeout=5).json()


def _health_when(srv, pred, timeout, what):
    """/health's body once `pred(body)` holds."""
    return poll(lambda: h if pred(h := _health(srv)) else None, timeout, what)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def router():
    from test_serve_support import ServerProcess
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", "--data-parallel", "2",
                         "--max-concurrency", "2", "--max-context", "1024", "--drain-grace",
                         "2"], ready_timeout=120)
    pids = set()
    try:
        health = _health_when(srv, lambda h: h["ready"] == 2, 90, "both replicas ready")
        pids.update(r["pid"] for r in health["replicas"])
        srv.replica_pids = pids
        yield srv
    finally:
        try:
            pids.update(r["pid"] for r in _health(srv)["replicas"] if r["pid"])
        except (httpx.HTTPError, ValueError):
            pass
        srv.stop()
        for pid in pids:            # the router drains them; this is only for a failed test
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _metrics(srv):
    out = {}
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_a_session_key_stays_on_its_replica_and_keys_spread(router):
    keys = keys_for_each_replica()
    for expected, key in enumerate(keys):
        seen = set()
        for turn in range(3):
            r = post(router.url, CHAT, chat(f"def f{turn}(x):", max_tokens=2, prompt_cache_key=key))
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-ninfer-replica"])
        assert seen == {str(expected)}, (key, seen)
    # Anthropic's metadata.user_id is a session key too
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": keys[1]}}
    r = post(router.url, "/v1/messages", body)
    assert r.status_code == 200 and r.headers["x-ninfer-replica"] == "1", r.text
    m = _metrics(router)
    assert m['ninfer_router_requests_total{replica="0",rule="session"}'] >= 3
    assert m['ninfer_router_requests_total{replica="1",rule="session"}'] >= 4


def test_a_stream_is_relayed_as_it_is_generated_and_intact(router):
    key = keys_for_each_replica()[0]
    body = chat("def parse(text):", max_tokens=12, prompt_cache_key=key)
    whole = post(router.url, CHAT, body).json()["choices"][0]["message"]["content"]
    assert streamed_text(router.url, body, "0") == whole


def test_a_client_that_leaves_mid_stream_cancels_the_replicas_generation(router):
    key = keys_for_each_replica()[1]
    in_flight = 'ninfer_generations_in_flight{replica="1"}'
    cancelled = 'ninfer_generations_finished_total{reason="cancelled",replica="1"}'
    before = _metrics(router).get(cancelled, 0.0)
    body = chat("class Parser:", max_tokens=900, ignore_eos=True, stream=True,
                prompt_cache_key=key)
    with httpx.stream("POST", router.url + CHAT, json=body, timeout=60) as r:
        assert r.headers["x-ninfer-replica"] == "1"
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]
        assert all(not line or line.startswith("data: {") for line in first)
        # the first events came while the replica was still generating: relayed, not buffered
        assert _metrics(router)[in_flight] == 1
    m = poll(lambda: m if (m := _metrics(router)).get(cancelled) == before + 1 else None, 10,
              "the replica cancelled the abandoned stream")
    assert m[in_flight] == 0 and m['ninfer_router_outstanding{replica="1"}'] == 0


def test_replica_errors_pass_through_unchanged(router):
    r = post(router.url, CHAT, chat("hi", temperature=7))
    assert r.status_code == 400 and r.headers["x-ninfer-replica"] in ("0", "1")
    assert r.json() == {"error": {"message": "'temperature' must be <= 2.0, got 7.0",
                                  "type": "invalid_request_error", "param": "temperature",
                                  "code": "invalid_value"}}
    r = post(router.url, "/v1/messages", {"model": "m", "messages": [{"role": "user",
                                                                    "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    # a body that is not JSON: forwarded, and the replica's 400 relayed
    r = httpx.post(router.url + CHAT, content=b'{"messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "x-ninfer-replica" in r.headers
    r = httpx.get(router.url + "/v1/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(router.url + "/v1/models", timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"]


def test_metrics_label_every_replicas_samples(router):
    text = httpx.get(router.url + "/metrics", timeout=10).text
    m = _metrics(router)
    for i in ("0", "1"):
        assert m[f'ninfer_engine_ready{{replica="{i}"}}'] == 1
        assert m[f'ninfer_router_replica_ready{{replica="{i}"}}'] == 1
        assert f'ninfer_http_requests_total{{replica="{i}",route="/v1/chat/completions",' \
               f'status="200"}}' in text
    # each replica runs with its own GPU visible (its environment, read where Linux shows it)
    replicas = _health(router)["replicas"]
    assert len({r["device"] for r in replicas}) == 2
    for r in replicas if sys.platform.startswith("linux") else ():
        with open(f"/proc/{r['pid']}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert env[b"CUDA_VISIBLE_DEVICES"] == r["device"].encode()
    # one HELP/TYPE per family, and no replica sample left unlabelled
    assert text.count("# TYPE ninfer_engine_ready gauge") == 1
    assert not [name for name in m if name.startswith("ninfer_") and
                not name.startswith("ninfer_router_") and 'replica="' not in name]


def test_a_killed_replica_is_routed_around_and_restarted(router):
    keys = keys_for_each_replica()
    victim = next(r for r in _health(router)["replicas"] if r["index"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)      # its gunicorn master; the worker follows it
    health = _health_when(router, lambda h: h["replicas"][1]["state"] != "ready", 5,
                          "/health reports the dead replica")
    assert health["status"] == "ok" and health["ready"] == 1
    assert health["replicas"][0]["state"] == "ready"
    # its keys go to the other replica meanwhile, and no request fails
    for turn in range(4):
        r = post(router.url, CHAT, chat(f"def g{turn}():", max_tokens=2, prompt_cache_key=keys[1]))
        assert r.status_code == 200 and r.headers["x-ninfer-replica"] == "0", r.text
    health = _health_when(router, lambda h: h["ready"] == 2, 60, "the replica restarted")
    again = health["replicas"][1]
    assert again["restarts"] == 1 and again["pid"] != victim["pid"]
    router.replica_pids.add(again["pid"])
    r = post(router.url, CHAT, chat("def h():", max_tokens=2, prompt_cache_key=keys[1]))
    assert r.status_code == 200 and r.headers["x-ninfer-replica"] == "1"
    assert _metrics(router)['ninfer_router_replica_restarts_total{replica="1"}'] == 1


def test_sigterm_drains_the_replicas_and_exits_0(router):
    pids = [r["pid"] for r in _health(router)["replicas"]]
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(30) == 0, router.output()[-3000:]
    assert not [pid for pid in pids if _pid_alive(pid)]
