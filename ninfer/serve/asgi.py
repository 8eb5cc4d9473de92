"""The ASGI flavour of the app (falcon.asgi). Route logic is the blocking code of `routes`; it runs
on a private thread pool so eight streams never starve the event loop's default executor, and the
quick GET routes (/health, /metrics, /v1/models) on a second small one, so they answer even when
every generation thread is held by a stream or a queued request.

Streams use Falcon's `resp.sse`, which watches for the client's disconnect and stops iterating; the
async generator then closes (its `finally` runs when it is collected or closed), which closes the
SseIterator and so cancels the request.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import falcon
import falcon.asgi

from . import routes
from .app import (GET_ROUTES, POST_ROUTES, GatewayMiddleware, error_to_reply, parse_body,
                  write_error, write_json)
from .errors import ApiError
from .gateway import Gateway

_END = object()


class AsgiApp(falcon.asgi.App):
    # executor: generation routes (a stream holds a thread while it waits for its next event);
    # ops_executor: the quick GET routes, so /health answers even when every stream thread is taken
    __slots__ = ("gateway", "executor", "ops_executor")


async def _sse_events(loop, executor, it: routes.SseIterator):
    try:
        while True:
            msg = await loop.run_in_executor(executor, next, it, _END)
            if msg is _END:
                return
            name, data = msg
            if data is None:
                yield falcon.asgi.SSEvent(comment="keep-alive")
            else:
                yield falcon.asgi.SSEvent(event=name, data=data)
    finally:
        await loop.run_in_executor(executor, it.close)


class _Post:
    def __init__(self, app: AsgiApp, fn):
        self.app, self.fn = app, fn

    async def on_post(self, req, resp) -> None:
        gw = self.app.gateway
        limit = gw.config.max_body_bytes
        data = await req.bounded_stream.read(limit + 1)
        body = parse_body(data, limit)
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self.app.executor, self.fn, gw, body)
        if reply.stream is not None:
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")
            resp.sse = _sse_events(loop, self.app.executor, reply.stream)
        else:
            write_json(resp, reply)


class _Get:
    def __init__(self, app: AsgiApp, fn):
        self.app, self.fn = app, fn

    async def on_get(self, req, resp, **params) -> None:
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self.app.ops_executor,
                                           lambda: self.fn(self.app.gateway, req, **params))
        write_json(resp, reply)


def build_asgi_app(gw: Gateway, max_threads: int = 64) -> AsgiApp:
    app = AsgiApp(middleware=[GatewayMiddleware(gw)])
    app.gateway = gw
    app.executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="ninfer-asgi")
    app.ops_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ninfer-asgi-ops")

    async def handle(req, resp, ex, params):
        write_error(req, resp, error_to_reply(req, ex))

    for exc_type in (Exception, falcon.HTTPError, ApiError):
        app.add_error_handler(exc_type, handle)
    for path, fn in POST_ROUTES.items():
        app.add_route(path, _Post(app, fn))
    for path, fn in GET_ROUTES.items():
        app.add_route(path, _Get(app, fn))
    return app
