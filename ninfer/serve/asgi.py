"""The ASGI flavour of the app (falcon.asgi), the one `python -m ninfer serve` runs (launcher.py).

Route logic is the blocking code of `routes`; it runs on a private thread pool (a non-streamed
request holds a thread until its answer is complete), and the quick GET routes (/health, /metrics,
/v1/models) on a second small one, so they answer even when every generation thread is held. A
connection costs a thread only once its whole body has arrived. A stream holds no thread: its
events are rendered on the event loop, which the Generation's pump thread wakes.

Streams use Falcon's `resp.sse`, whose watcher task reads the connection while the stream runs.
Falcon checks that watcher only after each event it sends, and a queued request sends nothing
until its next keep-alive (`keepalive_s`, 15 s): so the app notes the disconnect itself (every
`receive` of a request goes through AsgiApp, which sets the request's "gone" event), and the
stream's wait for its next event races that event. A client that leaves ends the async generator at once; its `finally`
closes the SseIterator, which cancels the request (a queued one leaves the Engine's queue).
With `watch_disconnects` (what `serve` runs), a non-streamed request watches its connection too
while the answer is computed: a client that goes away cancels the Generations it started. It is
off by default because Falcon's TestClient reports every non-streamed request as disconnected as
soon as it has sent it.

A body over `max_body_bytes` is answered 413 only after the rest of it has been read and dropped
(up to DISCARD_BYTES more, within `body_timeout_s`): a client that writes its whole body before it
reads (Python's http.client, requests) would otherwise see the server close a socket holding
unread data, which the kernel turns into a connection reset instead of the 413.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import falcon
import falcon.asgi

from . import routes
from .errors import ApiError
from .gateway import ClientWatch, Gateway
from .http_common import (GET_ROUTES, POST_ROUTES, error_to_reply, middleware_for, parse_body,
                          write_error, write_json)

_RECEIVE = "ninfer.receive"         # scope key: the ASGI receive callable of the request
_GONE = "ninfer.gone"               # scope key: an asyncio.Event set once the client has left
# how much of a body over the limit is still read (and dropped) so the client can read its 413
DISCARD_BYTES = 64 << 20


class AsgiApp(falcon.asgi.App):
    # executor: generation routes (a non-streamed request holds a thread until it is answered);
    # ops_executor: the quick GET routes, so /health answers even when every stream thread is taken
    __slots__ = ("gateway", "executor", "ops_executor", "watch_disconnects")

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            receive = _noting_disconnect(scope, receive)
        await super().__call__(scope, receive, send)


def _noting_disconnect(scope, receive):
    """`receive` that also sets scope[_GONE] once it returns the client's disconnect."""
    gone = scope[_GONE] = asyncio.Event()

    async def noting_receive():
        message = await receive()
        if message.get("type") == "http.disconnect":
            gone.set()
        return message
    scope[_RECEIVE] = noting_receive        # for _until_disconnect (Falcon keeps it private)
    return noting_receive


class _StreamWait:
    """What an SSE stream waits on between its messages: the Generation's next event (the pump
    thread calls `wake_threadsafe`), the client leaving, or keep-alive time. The keep-alive timer
    re-arms itself once per keepalive_s, not once per message (a timeout around every wait cost
    a tenth of the event loop's time at 8 streams)."""

    def __init__(self, loop, keepalive_s: float):
        self.loop, self.keepalive_s = loop, keepalive_s
        self.ready = asyncio.Event()
        self.last_sent = loop.time()
        self._timer = loop.call_at(self.last_sent + keepalive_s, self._check)

    def wake_threadsafe(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:        # the loop has closed (server shutdown): nobody waits
            pass

    def _check(self) -> None:
        due = self.last_sent + self.keepalive_s
        if self.loop.time() >= due:
            self.ready.set()
            due = self.loop.time() + self.keepalive_s
        self._timer = self.loop.call_at(due, self._check)

    def keepalive_due(self) -> bool:
        return self.loop.time() >= self.last_sent + self.keepalive_s

    def sent(self) -> None:
        self.last_sent = self.loop.time()

    def close(self) -> None:
        self._timer.cancel()


async def _sse_events(loop, executor, it: routes.SseIterator, gone: asyncio.Event,
                      keepalive_s: float):
    """The SSE events of `it`, rendered on the event loop as they arrive: the Generation's pump
    thread wakes the loop (`set_listener`), so no thread waits per event (a thread hop per token
    was a fifth of the server's time at 8 streams). Ends as soon as `gone` is set (Falcon's
    watcher task, which reads the connection during the stream, sets it through AsgiApp's
    receive), not at the next write."""
    wait = _StreamWait(loop, keepalive_s)
    it.set_listener(wait.wake_threadsafe)
    gone_wait = asyncio.ensure_future(gone.wait())
    gone_wait.add_done_callback(lambda _: wait.ready.set())
    try:
        while not gone.is_set():
            wait.ready.clear()      # before poll: an event put after it sets `ready` again
            try:
                msg = it.poll()
            except StopIteration:
                return
            if msg is not None:
                name, data = msg
                yield falcon.asgi.SSEvent(event=name, data=data)
            elif wait.keepalive_due():
                yield falcon.asgi.SSEvent(comment="keep-alive")
            else:
                await wait.ready.wait()
                continue
            wait.sent()
    finally:
        wait.close()
        it.set_listener(None)
        gone_wait.cancel()
        await loop.run_in_executor(executor, it.close)


async def _until_disconnect(receive) -> None:
    """Returns when the client closes its connection (the body has been read already, so the
    server has nothing else to deliver)."""
    while (await receive()).get("type") != "http.disconnect":
        pass


class _Post:
    def __init__(self, app: AsgiApp, fn):
        self.app, self.fn = app, fn

    async def on_post(self, req, resp) -> None:
        gw = self.app.gateway
        limit = gw.config.max_body_bytes
        try:
            data = await asyncio.wait_for(req.bounded_stream.read(limit + 1),
                                          gw.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{gw.config.body_timeout_s:g} s", code="request_timeout") from None
        body = parse_body(data, limit)
        loop = asyncio.get_running_loop()
        watch = ClientWatch()
        work = loop.run_in_executor(self.app.executor, gw.run_watched, watch, self.fn, gw, body)
        if self.app.watch_disconnects:
            gone = asyncio.ensure_future(_until_disconnect(req.scope[_RECEIVE]))
            try:
                await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not work.done():     # the client went away: stop its request, the answer is lost
                watch.cancel()
        reply = await work
        if reply.stream is not None:
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")
            resp.sse = _sse_events(loop, self.app.executor, reply.stream, req.scope[_GONE],
                                   gw.config.keepalive_s)
        else:
            write_json(resp, reply)


async def _discard_body(req, limit: int, timeout_s: float) -> None:
    """Read and drop what is left of a body over the limit, at most DISCARD_BYTES more and within
    `timeout_s`, so the 413 is not lost to a reset (module docstring). A declared length beyond
    that is not read at all: such a client sees the 413 and a closed connection."""
    declared = req.content_length
    if declared is not None and declared > limit + DISCARD_BYTES:
        return

    async def drain():
        budget = DISCARD_BYTES
        while budget > 0:
            chunk = await req.stream.read(min(budget, 1 << 20))
            if not chunk:
                return
            budget -= len(chunk)
    try:
        await asyncio.wait_for(drain(), timeout_s)
    except (asyncio.TimeoutError, ValueError):     # ValueError: Falcon's stream refused a read
        pass            # a slow or odd client: the 413 and a closed connection, as before


class _Get:
    def __init__(self, app: AsgiApp, fn):
        self.app, self.fn = app, fn

    async def on_get(self, req, resp, **params) -> None:
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self.app.ops_executor,
                                           lambda: self.fn(self.app.gateway, req, **params))
        write_json(resp, reply)

    on_head = on_get        # the server drops the body of a HEAD answer, keeps its headers


def build_asgi_app(gw: Gateway, max_threads: int = 64, watch_disconnects: bool = False) -> AsgiApp:
    app = AsgiApp(middleware=middleware_for(gw))
    app.gateway = gw
    app.watch_disconnects = watch_disconnects
    app.executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="ninfer-asgi")
    app.ops_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ninfer-asgi-ops")

    async def handle(req, resp, ex, params):
        err = error_to_reply(req, ex)
        if err.status == 413:
            await _discard_body(req, gw.config.max_body_bytes, gw.config.body_timeout_s)
        write_error(req, resp, err)
        if err.status in (408, 413):    # the rest of the body is never read: end the connection
            resp.set_header("Connection", "close")

    for exc_type in (Exception, falcon.HTTPError, ApiError):
        app.add_error_handler(exc_type, handle)
    for path, fn in POST_ROUTES.items():
        app.add_route(path, _Post(app, fn))
    for path, fn in GET_ROUTES.items():
        app.add_route(path, _Get(app, fn))
    return app
