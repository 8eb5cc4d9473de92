"""`python -m ninfer serve`: the ASGI app (asgi.py) on uvicorn's event loop, under gunicorn.

gunicorn stays the process manager (one worker process: the Engine is resident in it, created
after the fork); the worker serves with uvicorn's event loop and h11 parser, so an open connection
costs a socket, not a thread: slow or idle clients cannot starve the others. Route logic runs on
the app's thread pools once a request's body has arrived (asgi.py). The transport limits:

    header_timeout_s   request line + headers must arrive within it, else 408 and close
    body_timeout_s     the body within it after the headers, else 408 and close (asgi.py)
    idle_timeout_s     a keep-alive connection idle this long is closed
    max_connections    connections beyond it get 503 "too many connections" (JSON) at once
    max_header_bytes   a request line + headers above it get 431 (JSON)

Shutdown: SIGTERM starts the drain: the worker keeps its listening socket, every new request and
/health answer 503 "draining" at once, in-flight requests get `drain_grace_s` to finish and are
then cancelled (streams end with finish_reason "cancelled"); the worker exits when none is left.
SIGINT/SIGQUIT cancel at once. If the gunicorn master dies (even by SIGKILL), the worker gets a
parent-death signal (Linux; elsewhere a once-a-second watchdog sees its parent change), closes its
listening socket at once, cancels what is in flight and exits, so a restart can bind the port.
The worker closes the Engine on exit.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Callable, Optional

import h11
import uvicorn
from gunicorn.app.base import BaseApplication
from gunicorn.workers.base import Worker
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_common import make_gateway
from .asgi import build_asgi_app
from .config import ServeConfig
from .errors import ApiError, flavour_of
from .plan import dumps

log = logging.getLogger("ninfer.serve")

# the parent-death signal: one gunicorn's workers do not otherwise use
_ORPHAN_SIGNAL = signal.SIGUSR2
_PR_SET_PDEATHSIG = 1


def _error_response(status: int, message: str, code: str, flavour: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, JSON in the API's shape."""
    body = dumps(ApiError(status, message, code=code).body(flavour))
    reason = _REASONS.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


def _flavour_of_raw(data: bytes) -> str:
    """The error shape for a request whose headers never parsed: its path, if the line got in."""
    _, _, rest = data[:256].partition(b" ")
    path = rest.split(b" ", 1)[0].decode("latin-1")
    return flavour_of(path)


class GatewayProtocol(H11Protocol):
    """uvicorn's h11 connection with the transport limits the Gateway needs (a subclass per
    server carries `serve_config`)."""

    serve_config: ServeConfig = ServeConfig()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._arm_header_timer(self.serve_config.header_timeout_s)
        if len(self.connections) > self.serve_config.max_connections:
            self.app = _too_many_connections        # answered once its request line arrives

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:         # still reading a request line + headers
            limit = self.serve_config.max_header_bytes
            head = self.conn.trailing_data[0] + data
            end = head.find(b"\r\n\r\n", 0, limit + 4)
            if end < 0 and len(head) > limit:
                self._too_large_headers(head)
                return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:     # the headers are in (or the request broke)
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():           # keep-alive: the next request's headers
            self._arm_header_timer(self.timeout_keep_alive + self.serve_config.header_timeout_s)

    def send_400_response(self, msg: str) -> None:
        buffered = self.conn.trailing_data[0]
        if len(buffered) > self.serve_config.max_header_bytes:
            self._too_large_headers(buffered)
        else:
            self._reply_and_close(400, "the request is not valid HTTP/1.1", "invalid_http",
                                  _flavour_of_raw(buffered))

    def _too_large_headers(self, head: bytes) -> None:
        self._reply_and_close(431, f"the request line and headers exceed "
                                   f"{self.serve_config.max_header_bytes} bytes",
                              "request_header_fields_too_large", _flavour_of_raw(head))

    def _arm_header_timer(self, seconds: float) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(seconds, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        buffered = self.conn.trailing_data[0]
        if not buffered:            # an idle keep-alive connection: close it without a word
            self.transport.close()
            return
        self._reply_and_close(408, f"the request headers did not arrive within "
                                   f"{self.serve_config.header_timeout_s:g} s", "request_timeout",
                              _flavour_of_raw(buffered))

    def _reply_and_close(self, status: int, text: str, code: str, flavour: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(_error_response(status, text, code, flavour))
            self.transport.close()


async def _too_many_connections(scope, receive, send) -> None:
    body = dumps(ApiError(503, "the server has too many open connections; retry later",
                          code="too_many_connections").body(flavour_of(scope.get("path", ""))))
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handling: the worker installs its own."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class GatewayWorker(Worker):
    """The gunicorn worker: uvicorn's event loop over the ASGI app, with the drain and the
    orphan rules of this module's docstring."""

    def init_signals(self) -> None:
        # gunicorn's handlers would run on whatever thread; the loop installs its own in run()
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, self.handle_usr1)
        signal.siginterrupt(signal.SIGUSR1, False)

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        for name, source in (("uvicorn.error", self.log.error_log),
                             ("uvicorn.access", self.log.access_log)):
            logger = logging.getLogger(name)        # uvicorn's logs go where gunicorn's go
            logger.handlers, logger.propagate = source.handlers, False
            logger.setLevel(source.level)
        if self.cfg.accesslog == "/dev/stderr":
            # gunicorn opens "/dev/stderr" as a file of its own (O_APPEND): with stderr redirected
            # to a regular file, the later writes through fd 2 overwrote the access lines
            access = logging.getLogger("uvicorn.access")
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(access.handlers[0].formatter if access.handlers else None)
            access.handlers = [handler]
        app = self.wsgi                 # gunicorn's name for the loaded app: ours is ASGI
        self.gateway = app.gateway
        cfg = self.gateway.config
        protocol = type("ServeProtocol", (GatewayProtocol,), {"serve_config": cfg})
        config = uvicorn.Config(
            app, http=protocol, lifespan="off", log_config=None, access_log=self.cfg.accesslog
            is not None, timeout_keep_alive=cfg.idle_timeout_s, timeout_notify=1,
            callback_notify=self._tick, h11_max_incomplete_event_size=cfg.max_header_bytes,
            timeout_graceful_shutdown=5, server_header=False)
        self.server = _Server(config)
        self._is_draining = False
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._drain)
        loop.add_signal_handler(signal.SIGINT, self._stop_now)
        loop.add_signal_handler(signal.SIGQUIT, self._stop_now)
        loop.add_signal_handler(_ORPHAN_SIGNAL, self._orphaned)
        _set_parent_death_signal(_ORPHAN_SIGNAL)
        if os.getppid() != self.ppid:       # the master died before prctl took effect
            self._orphaned()
        await self.server.serve(sockets=self.sockets)

    async def _tick(self) -> None:
        self.notify()                       # gunicorn's liveness heartbeat
        if os.getppid() != self.ppid:       # the watchdog where no parent-death signal exists
            self._orphaned()

    def _drain(self) -> None:
        if self._is_draining:
            return
        self._is_draining = True
        log.info("SIGTERM: draining (grace %g s)", self.gateway.config.drain_grace_s)
        self.gateway.drain()
        asyncio.get_running_loop().create_task(self._exit_when_idle())

    async def _exit_when_idle(self) -> None:
        # The drain's timer cancels what is left after the grace; a cancelled request ends at its
        # next step boundary, so one more second bounds the wait.
        deadline = time.monotonic() + self.gateway.config.drain_grace_s + 1.0
        while self.gateway.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.server.should_exit = True

    def _stop_now(self) -> None:
        self.gateway.cancel_all()
        if self.server.should_exit:
            self.server.force_exit = True
        self.server.should_exit = True

    def _orphaned(self) -> None:
        if getattr(self, "_is_orphaned", False):
            return
        self._is_orphaned = True
        log.warning("the gunicorn master (pid %s) is gone: releasing the port and exiting",
                    self.ppid)
        for server in getattr(self.server, "servers", ()):
            server.close()                  # stop accepting; the listening socket closes
        for sock in self.sockets:
            sock.close()
        self._stop_now()


def _worker_exit(server, worker) -> None:
    gateway = getattr(worker, "gateway", None) or getattr(worker.app, "gateway", None)
    if gateway is not None:
        gateway.close()


class GunicornServer(BaseApplication):
    def __init__(self, engine_factory: Callable, config: ServeConfig, *, host: str = "127.0.0.1",
                 port: int = 8000, threads: int = 16, access_log: bool = False,
                 log_level: str = "info", extra: Optional[dict] = None):
        self.engine_factory = engine_factory
        self.serve_config = config.validate()
        self.threads = threads
        self.options = {
            "bind": [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"],
            "workers": 1,
            "worker_class": f"{__name__}.GatewayWorker",
            # the master SIGKILLs a worker still there this long after SIGTERM
            "graceful_timeout": int(config.drain_grace_s) + 10,
            "timeout": 120,
            "accesslog": "/dev/stderr" if access_log else None,     # gunicorn: "-" is stdout
            "loglevel": log_level,
            "proc_name": "ninfer-serve",
            "worker_exit": _worker_exit,
            "control_socket_disable": True,     # gunicorn >= 26: no shared ~/.gunicorn socket
            **(extra or {}),
        }
        self.gateway = None
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            if value is not None and key in self.cfg.settings:
                self.cfg.set(key, value)

    def load(self):
        # Runs in the worker after the fork: the Engine (and its worker thread) lives there.
        app = build_asgi_app(make_gateway(self.engine_factory, self.serve_config, {}),
                             max_threads=self.threads, watch_disconnects=True)
        self.gateway = app.gateway
        return app


def serve(engine_factory: Callable, config: ServeConfig, **kwargs) -> None:
    """Run gunicorn in the foreground until it is stopped."""
    GunicornServer(engine_factory, config, **kwargs).run()
