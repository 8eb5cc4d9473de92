"""`python -m ninfer serve --data-parallel N`: the router process (router.py's app on uvicorn)
and its replicas (replicas.py), with the signals a process manager sends.

    SIGTERM          drain: new requests and /health answer 503 "draining", every replica gets
                     SIGTERM and drains (--drain-grace for its in-flight requests, as a single
                     server does), the answers still being relayed end with them, the router
                     exits 0 once the replicas have exited (SIGKILL for one still there
                     --drain-grace + 15 s later)
    SIGINT, SIGQUIT  the replicas get SIGINT (they cancel at once) and the router stops

The router binds the user's --host/--port before any replica starts (a taken port is one error
line), and serves with serve's own transport limits (launcher.GatewayProtocol: header timeout,
431, connection cap).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import Callable, Sequence

import httpx
import uvicorn

from .config import ServeConfig
from ..errors import Error
from .launcher import GatewayProtocol, _Server    # _Server: uvicorn minus its signal handlers
from .replicas import Supervisor
from .router import RouterApp

log = logging.getLogger("ninfer.serve")


def _listen(host: str, port: int) -> socket.socket:
    """The router's listening socket, bound before any replica starts (not inherited by them)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


def _setup_logging(level: str, access_log: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] [%(process)d] [%(levelname)s] "
                                           "router: %(message)s", "%Y-%m-%d %H:%M:%S %z"))
    for name in ("ninfer.serve", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(level.upper())
    if not access_log:
        logging.getLogger("uvicorn.access").disabled = True


def serve_replicas(argv_for: Callable[[int], list], devices: Sequence[str], config: ServeConfig,
                   *, host: str, port: int, slack: int, env: dict, access_log: bool = False,
                   log_level: str = "info") -> None:
    """Run the router and its replicas in the foreground until SIGTERM (drain: the router answers
    503 to new requests, the replicas get SIGTERM and drain, the router exits once they have) or
    SIGINT / SIGQUIT (the replicas get SIGINT and cancel at once). `argv_for(port)`: a replica's
    command line; `devices`: each replica's CUDA_VISIBLE_DEVICES."""
    _setup_logging(log_level, access_log)
    sock = _listen(host, port)
    try:
        asyncio.run(_run(sock, argv_for, devices, config, slack, env, access_log))
    finally:
        sock.close()


async def _run(sock, argv_for, devices, config: ServeConfig, slack: int, env: dict,
               access_log: bool) -> None:
    supervisor = Supervisor(argv_for, devices, env)
    # httpx: a pooled async client that streams a response as it arrives and closes its
    # connection when a forward is cancelled (the replica then cancels the generation); h11 or
    # http.client alone would need a hand-written pool and stream reader. trust_env=False: no
    # HTTP(S)_PROXY detour for loopback traffic. Idle connections are let go well before the
    # replicas' --idle-timeout closes them, so a reused one is never half-closed.
    client = httpx.AsyncClient(
        trust_env=False, timeout=httpx.Timeout(5.0, read=None, write=config.body_timeout_s,
                                               pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                            keepalive_expiry=config.idle_timeout_s / 2))
    app = RouterApp(supervisor, client, config, slack)
    protocol = type("RouterProtocol", (GatewayProtocol,), {"serve_config": config})
    server = _Server(uvicorn.Config(
        app, http=protocol, lifespan="off", log_config=None, access_log=access_log,
        timeout_keep_alive=config.idle_timeout_s, h11_max_incomplete_event_size=
        config.max_header_bytes, timeout_graceful_shutdown=5, server_header=False, ws="none",
        date_header=False))     # the replica's Date header is relayed
    loop = asyncio.get_running_loop()
    drain_task = []

    def drain() -> None:
        if app.is_draining:
            return
        app.is_draining = True
        log.info("SIGTERM: draining the replicas (grace %g s)", config.drain_grace_s)
        supervisor.stop(signal.SIGTERM)
        drain_task.append(loop.create_task(_exit_after_drain(app, server, config)))

    def stop_now() -> None:
        app.is_draining = True
        supervisor.stop(signal.SIGINT)
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    loop.add_signal_handler(signal.SIGTERM, drain)
    loop.add_signal_handler(signal.SIGINT, stop_now)
    loop.add_signal_handler(signal.SIGQUIT, stop_now)
    supervisor.start()
    watch = loop.create_task(supervisor.watch(client))
    watch.add_done_callback(_report_crash)
    try:
        await server.serve(sockets=[sock])
    finally:
        supervisor.stop(signal.SIGTERM)     # a no-op after a drain; else (an error) stop them
        watch.cancel()
        await supervisor.wait_stopped(config.drain_grace_s + 15)
        await client.aclose()


async def _exit_after_drain(app: RouterApp, server: uvicorn.Server, config: ServeConfig) -> None:
    """The replicas drain (their in-flight requests get --drain-grace) and exit; answers still
    being relayed end with them; then the router stops."""
    await app.supervisor.wait_stopped(config.drain_grace_s + 15)
    deadline = asyncio.get_running_loop().time() + 2.0
    while sum(app.stats.outstanding) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    server.should_exit = True


def _report_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("the replica supervisor stopped: replicas are no longer watched or "
                     "restarted", exc_info=task.exception())
