"""The front of `serve --data-parallel N`: a plain ASGI app on uvicorn that forwards each request
to one replica (replicas.py) and relays the answer as it arrives.

    client --HTTP--> router (this app, on the user's --host/--port: dp_launcher.py runs it)
                       | routing.choose: session hint or prompt digest, rendezvous-hashed over
                       | the READY replicas; the load bound; least-loaded for other routes
                       v
                     replica i: `python -m ninfer serve` on 127.0.0.1:P_i, CUDA_VISIBLE_DEVICES=d_i

What the router answers itself: /health (200 while a replica is ready, each replica's state in the
body), /metrics (router_metrics.py), 503 when no replica is ready or while it drains, 413 for a body
over --max-body-mb (it reads a body whole to route it), 408 for a body slower than
--body-timeout, and the transport limits of serve's own worker (dp_launcher.py). Everything
else, status, headers and body, is the replica's, relayed byte for byte (`x-ninfer-replica: i`
added); a body that is not JSON is forwarded as it is and the replica's 400 relayed.

A request whose replica refuses the connection, drops it before answering, or answers 503 goes to
another ready replica (once per replica): nothing of it reached the client yet, and a generation
has no effect but its answer. A client that disconnects cancels the forward, which closes the
upstream connection, so the replica cancels the generation as it would for a direct client.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from email.utils import formatdate
from typing import Optional, Sequence

import httpx

from . import forwarding, routing
from .config import ServeConfig
from .errors import ApiError, flavour_of
from .metrics import CONTENT_TYPE
from .plan import dumps
from .replicas import ReplicaState, Supervisor
from .router_metrics import RouterStats, render

log = logging.getLogger("ninfer.serve")

# hop-by-hop headers (RFC 9110 7.6.1) and those the client library sets itself: never relayed
_HOP = frozenset((b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                  b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host",
                  b"content-length", b"expect"))
_DISCARD_BYTES = 64 << 20           # of a body over the limit, read and dropped (asgi.py's rule)
_METRICS_TIMEOUT_S = 5.0


class RouterApp:
    """The ASGI app. Only the event loop touches its state (RouterStats, the turn counter)."""

    def __init__(self, supervisor: Supervisor, client: httpx.AsyncClient, config: ServeConfig,
                 slack: int):
        self.supervisor = supervisor
        self.client = client
        self.config = config
        self.slack = slack
        self.stats = RouterStats(len(supervisor.replicas))
        self.is_draining = False
        self._turn = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method in ("GET", "HEAD"):
            await self._health(scope, send)
        elif path == "/metrics" and method in ("GET", "HEAD"):
            await self._metrics(scope, send)
        else:
            await self._proxy(scope, receive, send)

    # ---- the router's own routes --------------------------------------------------------------
    async def _health(self, scope, send) -> None:
        replicas = self._describe()
        num_ready = sum(r["state"] == "ready" for r in replicas)
        if self.is_draining:
            status, state = 503, "draining"
        elif num_ready:
            status, state = 200, "ok"
        elif any(r["state"] == "starting" for r in replicas):
            status, state = 503, "loading"
        else:
            status, state = 503, "unavailable"
        await _send_json(scope, send, status, {"status": state, "ready": num_ready,
                                               "replicas": replicas})

    def _describe(self) -> list:
        out = self.supervisor.describe()
        for r in out:
            r["outstanding"] = self.stats.outstanding[r["index"]]
        return out

    async def _metrics(self, scope, send) -> None:
        if not self._authorized(scope):
            await _send_error(scope, send, ApiError(401, "missing or invalid API key (send "
                                                         "'Authorization: Bearer KEY' or "
                                                         "'x-api-key: KEY')",
                                                    code="invalid_api_key"),
                              [(b"www-authenticate", b"Bearer")])
            return
        auth = {"authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        indices = [r.index for r in self.supervisor.replicas
                   if r.state in (ReplicaState.READY, ReplicaState.UNREADY,
                                  ReplicaState.STARTING)]

        async def fetch(i):
            try:
                resp = await self.client.get(self.supervisor.url(i) + "/metrics", headers=auth,
                                             timeout=_METRICS_TIMEOUT_S)
            except httpx.HTTPError:
                return i, None
            return i, resp.text if resp.status_code == 200 else None
        texts = {i: text for i, text in await asyncio.gather(*map(fetch, indices)) if text}
        body = render(texts, self.stats, self.supervisor.describe())
        await _send(scope, send, 200, [(b"content-type", CONTENT_TYPE.encode())], body)

    def _authorized(self, scope) -> bool:
        """The replicas' rule (http_common.GatewayMiddleware): Bearer KEY or x-api-key KEY."""
        key_wanted = self.config.api_key
        if not key_wanted:
            return True
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else \
            headers.get(b"x-api-key", b"").decode("latin-1")
        return bool(key) and hmac.compare_digest(key.encode("latin-1"), key_wanted.encode())

    # ---- forwarding ---------------------------------------------------------------------------
    async def _proxy(self, scope, receive, send) -> None:
        if self.is_draining:
            await _send_error(scope, send, ApiError(503, "the server is shutting down",
                                                    code="engine_draining"))
            return
        if not (scope.get("raw_path") or scope["path"].encode()).startswith(b"/"):
            await _send_error(scope, send, ApiError(400, "the request target must be a path "
                                                         "('/...')", code="invalid_http"))
            return
        data = await self._read_body(scope, receive, send)
        if data is None:
            return                                  # answered already (408, 413)
        key = await forwarding.affinity_key(scope["method"], scope["path"], data)
        work, started = await forwarding.forward_while_connected(
            lambda out: self._forward(scope, out, data, key), send, receive)
        if work.cancelled() or work.exception() is None:
            return
        log.error("forwarding %s %s failed", scope["method"], scope["path"],
                  exc_info=work.exception())
        if not started:
            exc = work.exception()
            await _send_error(scope, send, ApiError(500, f"internal error: {type(exc).__name__}: "
                                                         f"{exc}", code="internal_error"))

    async def _read_body(self, scope, receive, send) -> Optional[bytes]:
        """The body (forwarding.read_body), or None when it was answered (408, 413) or the client
        left."""
        cfg = self.config
        try:
            return await forwarding.read_body(scope, receive, cfg.max_body_bytes,
                                              cfg.body_timeout_s)
        except forwarding.BodyTooLarge as err:
            await self._too_large(scope, receive, send, err)
        except ApiError as err:                     # 408
            await _send_error(scope, send, err, [(b"connection", b"close")])
        return None

    async def _too_large(self, scope, receive, send, err) -> None:
        """413 after reading and dropping the rest of the body (up to _DISCARD_BYTES, within the
        body timeout), so a client that writes its whole body before reading gets the answer."""
        limit, size = self.config.max_body_bytes, err.size

        async def drain():
            budget = _DISCARD_BYTES
            while budget > 0:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                budget -= len(message.get("body", b""))
        if not (isinstance(size, int) and size > limit + _DISCARD_BYTES):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(drain(), self.config.body_timeout_s)
        await _send_error(scope, send, err, [(b"connection", b"close")])

    def _choose(self, key: Optional[tuple], tried: set) -> Optional[routing.Choice]:
        live = [i for i in self.supervisor.ready() if i not in tried]
        turn = self._turn % max(1, len(live))
        self._turn += 1
        return routing.choose(key, live, dict(enumerate(self.stats.outstanding)), self.slack,
                              any_order=live[turn:] + live[:turn])

    async def _forward(self, scope, send, data: bytes, key: Optional[tuple]) -> None:
        tried: set = set()
        while True:
            choice = self._choose(key, tried)
            if choice is None:
                self.stats.num_unavailable += 1
                await _send_error(scope, send, _unavailable(self.supervisor, bool(tried)),
                                  [(b"retry-after", b"1")])
                return
            i = choice.replica
            tried.add(i)
            self.stats.outstanding[i] += 1
            try:
                try:
                    upstream = await self.client.send(self._upstream_request(i, scope, data),
                                                      stream=True)
                except httpx.TransportError as exc:
                    # no answer came: nothing reached the client, so another replica may serve
                    if isinstance(exc, httpx.ConnectError):
                        self.supervisor.mark_unreachable(i, "connection refused")
                    log.warning("replica %d: %s: %s; trying another", i, type(exc).__name__, exc)
                    self.stats.failovers[i] += 1
                    continue
                try:
                    if upstream.status_code == 503 and self._choose(key, tried) is not None:
                        self.supervisor.mark_unreachable(i, "answered 503")
                        self.stats.failovers[i] += 1
                        continue
                    self.stats.routed[(i, choice.rule)] += 1
                    await _relay(upstream, send, i)
                    return
                finally:
                    await upstream.aclose()
            finally:
                self.stats.outstanding[i] -= 1

    def _upstream_request(self, i: int, scope, data: bytes) -> httpx.Request:
        target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        return self.client.build_request(scope["method"], self.supervisor.url(i) + target,
                                         headers=headers, content=data)


async def _relay(upstream: httpx.Response, send, i: int) -> None:
    headers = [(k, v) for k, v in upstream.headers.raw if k.lower() not in _HOP]
    if "content-length" in upstream.headers:        # the body is relayed byte for byte
        headers.append((b"content-length", upstream.headers["content-length"].encode()))
    headers.append((b"x-ninfer-replica", str(i).encode()))
    await send({"type": "http.response.start", "status": upstream.status_code,
                "headers": headers})
    try:
        async for chunk in upstream.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except httpx.TransportError as exc:
        # the replica went away mid-answer: end without completing the response, so the server
        # closes the connection and the client sees a cut answer, not a whole one
        log.warning("replica %d: the answer broke off (%s: %s)", i, type(exc).__name__, exc)
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _unavailable(supervisor: Supervisor, tried_some: bool) -> ApiError:
    states = [r.state.value for r in supervisor.replicas]
    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
    what = "no replica could take the request" if tried_some else "no replica is ready"
    return ApiError(503, f"{what} ({counts}); retry later", code="no_replica_ready")


async def _send(scope, send, status: int, headers: list, body: bytes) -> None:
    headers = headers + [(b"content-length", str(len(body)).encode()),
                         (b"date", formatdate(usegmt=True).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body",
                "body": b"" if scope["method"] == "HEAD" else body})


async def _send_json(scope, send, status: int, obj, headers: Sequence = ()) -> None:
    await _send(scope, send, status, [(b"content-type", b"application/json"), *headers],
                dumps(obj))


async def _send_error(scope, send, err: ApiError, headers: Sequence = ()) -> None:
    await _send_json(scope, send, err.status, err.body(flavour_of(scope["path"])), headers)
