"""NInfer on a Ray cluster: a Ray Serve application with one Engine replica per GPU, routed as
`serve --data-parallel` routes (routing.py), for serving across machines.

    client --HTTP--> Ray Serve's proxy (every node) --> NInferIngress (a light CPU replica)
        | reads the body whole, keys it: routing.affinity_key (session hint, else prompt digest)
        | DeploymentHandle call; NInferRequestRouter (Ray Serve's custom request-router API) picks
        | the replica: rendezvous hashing of the key over the replicas' ranks, the load bound
        v
    NInferReplica rank r (one Engine, num_gpus=1 on cuda): the Falcon ASGI app of `ninfer serve`
        (asgi.build_asgi_app) answers the request in process; its ASGI messages stream back
        through the ingress to the client, with `x-ninfer-replica: r` added

Every route, answer and error is the replica's ASGI app's, as with `ninfer serve`; the ingress
answers only 413 (a body over max_body_bytes), 408 (a body slower than body_timeout_s) and 503
(`no_replica_ready`: Ray could not hand the request to a replica) itself, in the route's error shape.

The router sees the affinity key the ingress computed (a keyword argument of the handle call) and
runs routing.choose over the replicas' identities: a replica's identity is the Ray Serve rank it
started with (its `record_replica_metadata`; Ray starts a replacement for a failed replica under the
freed rank, so that replica's keys come back to it), or a number hashed from its replica id where no
distinct rank is known. `outstanding` is this router's count of requests sent to a replica and not
ended (one router per ingress replica: with several ingress replicas, each bounds its own share).
A replica at Ray's `max_ongoing_requests` (max_concurrency + max_queue) is passed over for the
least-loaded of the others.

    serve run ninfer.serve.ray:app artifact=/models/qwen3.5-9b.ninfer num_replicas=8
    serve.run(build_app("/models/qwen3.5-9b.ninfer", num_replicas=8, max_context=8192))

docs/serving.md "Across machines: Ray Serve". Nothing else in ninfer imports this module (or ray).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import os
from email.utils import formatdate
from typing import Any, List, Optional

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from . import forwarding, routing
from .config import ServeConfig
from .errors import ApiError, flavour_of
from .plan import dumps

log = logging.getLogger("ninfer.serve")

AFFINITY_KWARG = "ninfer_affinity"     # the handle call's keyword the router reads
REPLICA_HEADER = b"x-ninfer-replica"
# request headers not passed to the replica's app: the hop's own framing (the body arrives whole,
# its content-length is set again)
_FRAMING = frozenset((b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding",
                      b"upgrade", b"content-length", b"expect"))
_ID_NUMBERS_FROM = 1 << 32              # identities hashed from replica ids: never a rank


# ---- the router (runs inside each DeploymentHandle to NInferReplica, i.e. in the ingress) -------

def replica_identities(replicas: List[RunningReplica]) -> dict:
    """{identity: replica}: the rank each replica reported when it started, else (no rank, or a
    rank another replica holds: Ray re-numbers ranks after a scale-down) a number hashed from its
    replica id."""
    out = {}
    for r in sorted(replicas, key=lambda r: r.replica_id.unique_id):
        rank = (getattr(r, "replica_metadata", None) or {}).get("rank")
        if not (isinstance(rank, int) and 0 <= rank < _ID_NUMBERS_FROM and rank not in out):
            digest = hashlib.blake2b(r.replica_id.unique_id.encode(), digest_size=6).digest()
            rank = _ID_NUMBERS_FROM + int.from_bytes(digest, "little")
        out[rank] = r
    return out


class NInferRequestRouter(RequestRouter):
    """Ray Serve request router: routing.choose over the replicas' identities (module docstring).
    request_router_kwargs: {"slack": N}, the load bound (the replicas' max_concurrency)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slack = 4
        self.outstanding: collections.Counter = collections.Counter()    # by ReplicaID
        self._turn = 0

    def initialize_state(self, slack: int = 4, **kwargs) -> None:
        self.slack = int(slack)

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self.outstanding[replica_id] += 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self.outstanding[replica_id] > 1:
            self.outstanding[replica_id] -= 1
        else:
            self.outstanding.pop(replica_id, None)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_identity = replica_identities(candidate_replicas)
        live = sorted(by_identity)
        key = None
        if pending_request is not None:
            # the routing loop retries with backoff when no rank below can take the request
            pending_request.routing_context.should_backoff = True
            given = pending_request.kwargs.get(AFFINITY_KWARG)
            if isinstance(given, (tuple, list)) and len(given) == 2:
                key = tuple(given)
        outstanding = {i: self.outstanding[by_identity[i].replica_id] for i in live}
        turn = self._turn % len(live)
        self._turn += 1
        choice = routing.choose(key, live, outstanding, self.slack,
                                any_order=live[turn:] + live[:turn])
        # the chosen replica, then (should it be at max_ongoing_requests) the others, of which
        # Ray's routing loop takes the least loaded
        rest = [by_identity[i] for i in live if i != choice.replica]
        return [[by_identity[choice.replica]], rest] if rest else [[by_identity[choice.replica]]]


# ---- the Engine replica -----------------------------------------------------------------------

@serve.deployment
class NInferReplica:
    """One Engine and the ASGI app of `ninfer serve` over it. `artifact`: a .ninfer path that
    exists on every node (None: the built-in reference model, built on each node on first use);
    `engine_kwargs`: Engine's; `serve_config`: ServeConfig's fields."""

    def __init__(self, artifact: Optional[str], engine_kwargs: dict, serve_config: dict):
        from ..engine import Engine
        from .asgi import build_asgi_app
        from .gateway import Gateway

        if artifact is None:
            from ..demo import ensure_reference_artifact
            artifact = str(ensure_reference_artifact())
        context = serve.get_replica_context()
        rank = getattr(context, "rank", None)
        rank = getattr(rank, "rank", rank)          # a ReplicaRank (or a plain int)
        self.rank = rank if isinstance(rank, int) else None
        self._label = str(self.rank if self.rank is not None else context.replica_tag).encode()
        kwargs = dict(engine_kwargs)
        self.engine = Engine(artifact, **kwargs)
        config = ServeConfig(**serve_config).validate()
        self.gateway = Gateway(self.engine, config)
        # watch_disconnects: a request whose ingress call is cancelled (its client left) is
        # cancelled here, as `ninfer serve` does for a client that disconnects
        self.app = build_asgi_app(self.gateway, watch_disconnects=True,
                                  max_threads=min(self.engine.options.max_concurrency
                                                  + self.engine.options.max_queue + 4, 512))
        self._tasks: set = set()
        log.info("ninfer replica %s: %s ready", self._label.decode(), artifact)

    def record_replica_metadata(self) -> dict:
        """Read once by Ray Serve when the replica is ready, and shown to request routers."""
        return {"rank": self.rank} if self.rank is not None else {}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if self.gateway.health_state() == "failed":
            raise RuntimeError("the engine has failed")

    async def handle_http(self, request: dict, body: bytes, **_routing_hints):
        """Run one HTTP request (the ingress's `request_fields`) through the ASGI app; yield its
        ASGI send messages, in batches, as they come. Closing this generator (the ingress's
        client left) tells the app that the client disconnected."""
        headers = [(k, v) for k, v in request["headers"] if k.lower() not in _FRAMING]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": request.get("http_version", "1.1"),
                 "method": request["method"], "scheme": request.get("scheme", "http"),
                 "path": request["path"], "raw_path": request["raw_path"], "root_path": "",
                 "query_string": request["query_string"], "headers": headers,
                 "client": request.get("client"), "server": request.get("server")}
        gone = asyncio.Event()
        messages: asyncio.Queue = asyncio.Queue()
        body_given = False

        async def receive():
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()),
                                                  (REPLICA_HEADER, self._label)])
            messages.put_nowait(message)
        task = asyncio.ensure_future(self.app(scope, receive, send))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                batch = [await messages.get()]
                while not messages.empty():
                    batch.append(messages.get_nowait())
                done = batch[-1] is None
                batch = [m for m in batch if m is not None]
                if batch:
                    yield batch
                if done:
                    break
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        finally:
            gone.set()      # an unfinished answer: the app sees its client leave, and cancels

    def __del__(self):
        """Ray Serve calls this after the replica's requests have ended (or after
        graceful_shutdown_timeout_s, which build_app sets to drain_grace_s)."""
        gateway, engine = getattr(self, "gateway", None), getattr(self, "engine", None)
        if gateway is not None:
            gateway.close()
            self.app.executor.shutdown(wait=False)
            self.app.ops_executor.shutdown(wait=False)
        if engine is not None:
            engine.close()


# ---- the HTTP ingress ---------------------------------------------------------------------------

class IngressApp:
    """The ASGI app of NInferIngress: reads a request's body, keys it, calls a replica through
    `replicas` (a DeploymentHandle to NInferReplica) and relays what the replica's app sends."""

    def __init__(self, replicas, config: ServeConfig):
        self.replicas = replicas.options(stream=True)
        self.config = config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        try:
            data = await forwarding.read_body(scope, receive, self.config.max_body_bytes,
                                              self.config.body_timeout_s)
        except ApiError as err:                     # 408, 413
            await _send_error(scope, send, err, [(b"connection", b"close")])
            return
        if data is None:
            return                                  # the client left before its body was in
        key = await forwarding.affinity_key(scope["method"], _route_path(scope), data)
        work, started = await forwarding.forward_while_connected(
            lambda out: self._forward(scope, out, data, key), send, receive)
        if work.cancelled() or work.exception() is None:
            return
        exc = work.exception()
        log.warning("%s %s: no replica answered (%s: %s)", scope["method"], scope["path"],
                    type(exc).__name__, exc)
        if not started:
            await _send_error(scope, send, ApiError(
                503, f"no replica could take the request ({type(exc).__name__}); retry later",
                code="no_replica_ready"), [(b"retry-after", b"1")])

    async def _forward(self, scope, send, data: bytes, key: Optional[tuple]) -> None:
        path = scope["path"]
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        raw_path = scope.get("raw_path") or path.encode()
        if root and raw_path.startswith(root.encode()):
            raw_path = raw_path[len(root.encode()):] or b"/"
        request = {"method": scope["method"], "path": path, "raw_path": raw_path,
                   "query_string": scope.get("query_string", b""),
                   "headers": list(scope["headers"]), "scheme": scope.get("scheme", "http"),
                   "http_version": scope.get("http_version", "1.1"),
                   "client": _address(scope.get("client")), "server": _address(scope.get("server"))}
        # Ray Serve's proxy gives every request an x-request-id (the client's, else its own),
        # which the replica's app adopts, and adds it to the response: the app's copy is dropped
        proxy_sets_id = any(k.lower() == b"x-request-id" for k, _ in scope["headers"])
        stream = self.replicas.handle_http.remote(request, data, **{AFFINITY_KWARG: key})
        try:
            async for batch in stream:
                for message in batch:
                    if proxy_sets_id and message["type"] == "http.response.start":
                        message = dict(message, headers=[
                            (k, v) for k, v in message["headers"] if k.lower() != b"x-request-id"])
                    await send(message)
        except asyncio.CancelledError:
            stream.cancel()             # the replica's generator closes: its app cancels
            raise


def _address(value):
    return None if value is None else [str(value[0]), int(value[1])]


def _route_path(scope) -> str:
    """The request's path below the application's root (Ray Serve's route prefix)."""
    path, root = scope["path"], scope.get("root_path") or ""
    return path[len(root):] if root and path.startswith(root) else path


async def _send_error(scope, send, err: ApiError, headers=()) -> None:
    body = dumps(err.body(flavour_of(scope["path"])))
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), *headers,
                            (b"content-length", str(len(body)).encode()),
                            (b"date", formatdate(usegmt=True).encode())]})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


@serve.deployment
@serve.ingress()
class NInferIngress:
    """The HTTP face of the application (Ray Serve's proxy calls it): IngressApp over a handle to
    NInferReplica."""

    def __init__(self, replicas, serve_config: dict):
        self._replicas = replicas
        self._config = ServeConfig(**serve_config).validate()

    def __serve_build_asgi_app__(self):
        return IngressApp(self._replicas, self._config)


# ---- building the application -------------------------------------------------------------------

_SERVE_FIELDS = frozenset(f.name for f in dataclasses.fields(ServeConfig))


def build_app(artifact: Optional[str] = None, *, num_replicas: int = 1, backend: str = "cuda",
              ingress_replicas: int = 1, num_cpus: float = 1, **options: Any):
    """The Ray Serve application (for serve.run): `num_replicas` NInferReplica (one GPU each on
    cuda, none on numpy) behind `ingress_replicas` NInferIngress. `options`: Engine keyword
    arguments (max_concurrency, max_context, ..., chat_template) and ServeConfig fields (api_key,
    model_id, max_body_bytes, temperature, drain_grace_s, ...). Checked here, before any replica
    starts. `artifact` must be a path that exists on every node (None: the reference model)."""
    from ..options import EngineOptions

    if not (isinstance(num_replicas, int) and num_replicas >= 1):
        raise ValueError(f"num_replicas={num_replicas!r}: must be an integer >= 1")
    if not (isinstance(ingress_replicas, int) and ingress_replicas >= 1):
        raise ValueError(f"ingress_replicas={ingress_replicas!r}: must be an integer >= 1")
    serve_fields = {k: options.pop(k) for k in list(options) if k in _SERVE_FIELDS}
    if isinstance(serve_fields.get("allowed_origins"), list):
        serve_fields["allowed_origins"] = tuple(serve_fields["allowed_origins"])
    config = ServeConfig(**serve_fields).validate()
    engine_kwargs = dict(options, backend=backend)
    engine_options = EngineOptions.from_kwargs(
        **{k: v for k, v in engine_kwargs.items() if k != "chat_template"})
    if artifact is not None:
        artifact = os.path.abspath(os.fspath(artifact))
    replicas = NInferReplica.options(
        num_replicas=num_replicas,
        # Ray's backpressure where the Engine's own queue ends (beyond it the Engine says 429)
        max_ongoing_requests=engine_options.max_concurrency + engine_options.max_queue,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": 1 if backend == "cuda" else 0},
        request_router_config=RequestRouterConfig(
            request_router_class=NInferRequestRouter,
            request_router_kwargs={"slack": engine_options.max_concurrency}),
        graceful_shutdown_timeout_s=config.drain_grace_s,
    ).bind(artifact, engine_kwargs, dataclasses.asdict(config))
    return NInferIngress.options(
        num_replicas=ingress_replicas, max_ongoing_requests=config.max_connections,
        ray_actor_options={"num_cpus": 0},
    ).bind(replicas, dataclasses.asdict(config))


def app(args: dict):
    """Ray Serve's application builder (`serve run ninfer.serve.ray:app key=value ...`): build_app
    with `artifact` as given and every other value read as JSON where it parses (4096, 0.5, true,
    null, ["*"]), else as a string (numpy, cuda)."""
    args = dict(args)
    artifact = args.pop("artifact", None)
    kwargs = {}
    for name, value in args.items():
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        kwargs[name] = value
    return build_app(artifact, **kwargs)
