"""`ninfer.serve.ray`: the Ray Serve application, on a local Ray cluster (skipped without ray).

Two NInferReplica on the numpy backend with the built-in reference model behind NInferIngress,
called over HTTP through Ray Serve's proxy: a chat completion and its stream, session affinity by
the keys of routing.py (each key on the replica that rendezvous hashing over the replicas' ranks
names, turn after turn), a prompt's digest keeping a conversation together, keyless routes
spread, replica errors passed through unchanged, and a client that leaves mid-stream cancelling the
generation; and the request router alone, on stubbed replicas. The cluster tests are marked slow
(the cluster starts once for the module, in about 20 s) and shut it down even when a test fails.
Every wait polls with a deadline."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import socket
import types

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from ninfer.serve import routing                            # noqa: E402
from ninfer.serve.routing import rendezvous_order           # noqa: E402
from replica_helpers import (CHAT, chat, keys_for_each_replica, poll, post,  # noqa: E402
                             streamed_text)

pytestmark = pytest.mark.timeout(300)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the request router alone: Ray Serve's RunningReplica and PendingRequest, stubbed -----------

@dataclasses.dataclass(frozen=True)
class _ReplicaID:
    unique_id: str


class _Replica:
    """What NInferRequestRouter reads of a RunningReplica."""

    def __init__(self, unique_id, rank=None):
        self.replica_id = _ReplicaID(unique_id)
        self.replica_metadata = {} if rank is None else {"rank": rank}


def _pending(key):
    from ninfer.serve.ray import AFFINITY_KWARG
    return types.SimpleNamespace(kwargs={AFFINITY_KWARG: key},
                                 routing_context=types.SimpleNamespace(should_backoff=False))


def _router(slack=4):
    from ninfer.serve.ray import NInferRequestRouter
    router = NInferRequestRouter.__new__(NInferRequestRouter)   # no Ray Serve handle around it
    router.slack, router.outstanding, router._turn = slack, collections.Counter(), 0
    return router


def _choose(router, replicas, pending):
    return asyncio.run(router.choose_replicas(replicas, pending))


def test_the_router_hashes_keys_over_the_replicas_ranks():
    from ninfer.serve.ray import replica_identities
    replicas = [_Replica("b", rank=1), _Replica("a", rank=0), _Replica("c", rank=2)]
    assert {i: r.replica_id.unique_id for i, r in replica_identities(replicas).items()} == \
        {0: "a", 1: "b", 2: "c"}
    router = _router()
    for n in range(20):
        key = (routing.SESSION, f"s:conversation-{n}")
        pending = _pending(key)
        ranks = _choose(router, replicas, pending)
        home = routing.choose(key, [0, 1, 2], {}, slack=4).replica
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks][0] == ["abc"[home]]
        assert sorted(r.replica_id.unique_id for r in ranks[1]) == \
            sorted(set("abc") - {"abc"[home]})
        assert pending.routing_context.should_backoff
    # the load bound: the key's replica holds while within slack (4) of the least loaded, and
    # gives way to the least loaded beyond it
    key = (routing.SESSION, "s:busy")
    home, runner_up, third = routing.rendezvous_order(key[1], [0, 1, 2])
    by_rank = {r.replica_metadata["rank"]: r for r in replicas}
    router.outstanding.update({by_rank[home].replica_id: 5, by_rank[runner_up].replica_id: 2,
                               by_rank[third].replica_id: 1})
    assert _choose(router, replicas, _pending(key))[0] == [by_rank[home]]
    router.outstanding[by_rank[home].replica_id] = 6
    assert _choose(router, replicas, _pending(key))[0] == [by_rank[third]]
    # outstanding: sends count up, completions down, never below zero
    router.outstanding.clear()
    router._use_replica_queue_len_cache = False         # Ray's own cache: not under test here
    rid = by_rank[home].replica_id
    router.on_send_request(rid)
    router.on_send_request(rid)
    router.on_request_completed(rid, "request-1")
    assert router.outstanding[rid] == 1
    router.on_request_completed(rid, "request-2")
    router.on_request_completed(rid, "request-3")
    assert router.outstanding[rid] == 0 and rid not in router.outstanding


def test_the_router_without_a_key_takes_the_least_loaded_in_turn():
    replicas = [_Replica("a", rank=0), _Replica("b", rank=1)]
    router = _router()
    firsts = [_choose(router, replicas, _pending(None))[0][0].replica_id.unique_id
              for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]
    router.outstanding[replicas[0].replica_id] = 1
    assert [_choose(router, replicas, _pending(None))[0][0].replica_id.unique_id
            for _ in range(2)] == ["b", "b"]


def test_replicas_without_a_distinct_rank_get_a_number_from_their_id():
    from ninfer.serve.ray import replica_identities
    # no rank reported, and a rank reported twice (Ray re-numbers ranks after a scale-down)
    replicas = [_Replica("a", rank=0), _Replica("b", rank=0), _Replica("c")]
    ids = replica_identities(replicas)
    assert ids[0].replica_id.unique_id == "a" and len(ids) == 3
    hashed = sorted(i for i in ids if i != 0)
    assert all(i >= 1 << 32 for i in hashed)
    assert replica_identities(list(reversed(replicas))).keys() == ids.keys()     # stable


@pytest.fixture(scope="module")
def url():
    from ninfer.demo import ensure_reference_artifact
    from ninfer.serve.ray import build_app

    artifact = str(ensure_reference_artifact("dense"))
    port = _free_port()
    saved = {k: os.environ.get(k) for k in ("RAY_USAGE_STATS_ENABLED",)}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=128 << 20)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(artifact, num_replicas=2, backend="numpy", max_concurrency=2,
                            max_context=1024, max_queue=8),
                  name="ninfer", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        # the ingress's router knows both replicas once keyless requests (least loaded, ties in
        # turn) reach both
        seen = set()

        def both_seen():
            try:
                r = httpx.get(base + "/v1/models", timeout=30)
            except httpx.HTTPError:
                return False
            if r.status_code == 200:
                seen.add(r.headers["x-ninfer-replica"])
            return seen == {"0", "1"}
        poll(both_seen, 60, "keyless requests reach both replicas")
        yield base
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.mark.slow
def test_a_chat_completion_and_its_stream(url):
    key = keys_for_each_replica()[0]
    body = chat("def parse(text):", max_tokens=12, prompt_cache_key=key)
    r = post(url, CHAT, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-ninfer-replica"] == "0"
    assert len(r.headers.get_list("x-request-id")) == 1       # Ray's proxy's, not a second one
    reply = r.json()
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1
    whole = reply["choices"][0]["message"]["content"]
    # greedy: the stream carries the same text as the whole answer
    assert streamed_text(url, body, "0") == whole


@pytest.mark.slow
def test_a_session_key_stays_on_its_replica(url):
    for expected, key in enumerate(keys_for_each_replica()):
        seen = [
            post(url, CHAT, chat(f"def f{turn}(x):", max_tokens=2, prompt_cache_key=key))
            for turn in range(4)]
        assert [r.status_code for r in seen] == [200] * 4, [r.text for r in seen]
        assert {r.headers["x-ninfer-replica"] for r in seen} == {str(expected)}, key
        # `user` is the next hint, and /v1/completions keys the same way
        r = post(url, CHAT, chat("def g():", max_tokens=2, user=key))
        assert r.status_code == 200 and r.headers["x-ninfer-replica"] == str(expected)
        r = post(url, "/v1/completions", {"model": "m", "prompt": "def h():", "max_tokens": 2,
                                           "prompt_cache_key": key})
        assert r.status_code == 200 and r.headers["x-ninfer-replica"] == str(expected), r.text
    # Anthropic's metadata.user_id is a session key too
    key = keys_for_each_replica()[1]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": key}}
    r = post(url, "/v1/messages", body)
    assert r.status_code == 200 and r.headers["x-ninfer-replica"] == "1", r.text
    assert r.json()["type"] == "message"


@pytest.mark.slow
def test_without_a_hint_a_conversation_stays_with_its_prompt(url):
    system = "You write small Python helpers."
    first = chat("def add(a, b):", system=system, max_tokens=2)
    later = dict(first, messages=first["messages"] + [
        {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "def sub(a, b):"}])
    rule, hashed = routing.affinity_key(CHAT, first)
    assert rule == routing.PREFIX
    expected = str(rendezvous_order(hashed, [0, 1])[0])
    for body in (first, later, first):
        r = post(url, CHAT, body)
        assert r.status_code == 200 and r.headers["x-ninfer-replica"] == expected, r.text


@pytest.mark.slow
def test_replica_errors_pass_through_unchanged(url):
    r = post(url, CHAT, chat("hi", temperature=7))
    assert r.status_code == 400 and r.headers["x-ninfer-replica"] in ("0", "1")
    assert r.json() == {"error": {"message": "'temperature' must be <= 2.0, got 7.0",
                                  "type": "invalid_request_error", "param": "temperature",
                                  "code": "invalid_value"}}
    r = post(url, "/v1/messages", {"model": "m", "messages": [{"role": "user",
                                                                 "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    # a body that is not JSON: passed on as it is, and the replica's 400 comes back
    r = httpx.post(url + CHAT, content=b'{"messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "x-ninfer-replica" in r.headers
    r = httpx.get(url + "/v1/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def _metrics_of(url, replica):
    """The samples of one replica's /metrics (keyless routes take turns, so poll for it)."""
    def fetch():
        r = httpx.get(url + "/metrics", timeout=30)
        if r.status_code != 200 or r.headers["x-ninfer-replica"] != replica:
            return None
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out
    return poll(fetch, 30, f"/metrics of replica {replica}")


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_cancels_the_generation(url):
    key = keys_for_each_replica()[1]
    cancelled = 'ninfer_generations_finished_total{reason="cancelled"}'
    generated = "ninfer_generated_tokens_total"
    before = _metrics_of(url, "1")
    body = chat("class Parser:", max_tokens=900, ignore_eos=True, stream=True,
                prompt_cache_key=key)
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-ninfer-replica"] == "1"
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]
        assert all(not line or line.startswith("data: {") for line in first)
    # (keyless routes go to the least-loaded replica: replica 1 answers once it is idle again)
    m = poll(lambda: m if (m := _metrics_of(url, "1")).get(cancelled, 0.0)
              == before.get(cancelled, 0.0) + 1 else None,
              30, "the replica cancelled the abandoned stream")
    assert m["ninfer_generations_in_flight"] == 0
    # cut short: the first events were relayed while the replica was still generating
    assert m[generated] - before.get(generated, 0.0) < 900
