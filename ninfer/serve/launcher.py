"""`python -m ninfer serve`: the WSGI app under gunicorn.

One gunicorn worker process (the Engine is resident in it, created after the fork) with a pool of
threads (the gthread worker): each HTTP request holds one thread while it waits on its handle, so
the pool is sized to max_concurrency + max_queue + a few, letting the Engine's own queue (not
gunicorn's accept backlog) decide when to answer 429.

Shutdown: SIGTERM stops accepting, /health turns 503 "draining", in-flight requests get
`drain_grace_s` to finish and are then cancelled (streams end with finish_reason "cancelled");
the worker closes the Engine on exit. SIGINT/SIGQUIT cancel at once.
"""
from __future__ import annotations

from typing import Callable, Optional

from gunicorn.app.base import BaseApplication
from gunicorn.workers.gthread import ThreadWorker

from .app import create_app
from .config import ServeConfig


class DrainingThreadWorker(ThreadWorker):
    """gthread worker that starts the Gateway's drain on SIGTERM."""

    def handle_exit(self, sig, frame):
        gateway = getattr(self.app, "gateway", None)
        if gateway is not None and self.alive:
            gateway.drain()
        super().handle_exit(sig, frame)


def _close_gateway(worker) -> None:
    gateway = getattr(worker.app, "gateway", None)
    if gateway is not None:
        gateway.close()


def _worker_exit(server, worker) -> None:
    _close_gateway(worker)


def _worker_int(worker) -> None:
    _close_gateway(worker)


class GunicornServer(BaseApplication):
    def __init__(self, engine_factory: Callable, config: ServeConfig, *, host: str = "127.0.0.1",
                 port: int = 8000, threads: int = 16, access_log: bool = False,
                 log_level: str = "info", extra: Optional[dict] = None):
        self.engine_factory = engine_factory
        self.serve_config = config.validate()
        self.options = {
            "bind": [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"],
            "workers": 1,
            "worker_class": f"{__name__}.DrainingThreadWorker",
            "threads": threads,
            "worker_connections": max(1000, threads * 2),
            "graceful_timeout": int(config.drain_grace_s) + 5,
            "timeout": 120,
            "keepalive": 5,
            "accesslog": "/dev/stderr" if access_log else None,     # gunicorn: "-" is stdout
            "loglevel": log_level,
            "proc_name": "ninfer-serve",
            "worker_exit": _worker_exit,
            "worker_int": _worker_int,
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
        app = create_app(self.engine_factory, self.serve_config)
        self.gateway = app.gateway
        return app


def serve(engine_factory: Callable, config: ServeConfig, **kwargs) -> None:
    """Run gunicorn in the foreground until it is stopped."""
    GunicornServer(engine_factory, config, **kwargs).run()
