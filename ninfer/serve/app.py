"""The Falcon apps: `create_app` (WSGI, any WSGI server) and `create_asgi_app` (falcon.asgi, e.g.
under uvicorn). Both are thin: they read bodies, call `routes`, and write Replies.

    GET  /health                     no auth; 200 ready, 503 loading / draining / failed
    GET  /metrics                    Prometheus text
    GET  /v1/models, /v1/models/{id} OpenAI list (Anthropic's shape with an anthropic-version header)
    POST /v1/chat/completions, /v1/completions          OpenAI
    POST /v1/embeddings                                  OpenAI (numpy backend; else a 400)
    POST /v1/messages, /v1/messages/count_tokens        Anthropic
"""
from __future__ import annotations

from typing import Optional

import falcon

from . import routes
from .asgi import build_asgi_app
from .config import ServeConfig
from .errors import ApiError
from .gateway import Gateway
from .http_common import (GET_ROUTES, POST_ROUTES, error_to_reply, make_gateway, middleware_for,
                          parse_body, sse_headers, write_error, write_json)
from .plan import sse_bytes


# ---- WSGI ----------------------------------------------------------------------------------------

class _WsgiStream:
    """SSE bytes for the WSGI server. The server calls close() when the response ends or the
    client's connection breaks; that cancels an unfinished request."""

    def __init__(self, it: routes.SseIterator):
        self._it = it

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        return sse_bytes(next(self._it))

    def close(self) -> None:
        self._it.close()


class _Post:
    def __init__(self, gw: Gateway, fn):
        self.gw, self.fn = gw, fn

    def on_post(self, req, resp) -> None:
        body = parse_body(req.bounded_stream.read(self.gw.config.max_body_bytes + 1),
                          self.gw.config.max_body_bytes)
        reply = self.fn(self.gw, body)
        if reply.stream is not None:
            sse_headers(resp)
            resp.stream = _WsgiStream(reply.stream)
        else:
            write_json(resp, reply)


class _Get:
    def __init__(self, gw: Gateway, fn):
        self.gw, self.fn = gw, fn

    def on_get(self, req, resp, **params) -> None:
        write_json(resp, self.fn(self.gw, req, **params))

    on_head = on_get        # the server drops the body of a HEAD answer, keeps its headers


class App(falcon.App):
    """falcon.App carrying its Gateway (`app.gateway`: engine, metrics, drain/close)."""

    __slots__ = ("gateway",)


def create_app(engine, config: Optional[ServeConfig] = None, **overrides) -> App:
    """WSGI app over one Engine. `engine`: an Engine (you keep ownership), or a zero-argument
    callable returning one (loaded in the background; the app closes it). `overrides` are
    ServeConfig fields (api_key=..., model_id=...)."""
    gw = make_gateway(engine, config, overrides)
    app = App(middleware=middleware_for(gw))
    app.gateway = gw
    app.req_options.auto_parse_form_urlencoded = False

    def handle(req, resp, ex, params):
        write_error(req, resp, error_to_reply(req, ex))

    for exc_type in (Exception, falcon.HTTPError, ApiError):
        app.add_error_handler(exc_type, handle)
    for path, fn in POST_ROUTES.items():
        app.add_route(path, _Post(gw, fn))
    for path, fn in GET_ROUTES.items():
        app.add_route(path, _Get(gw, fn))
    return app


def create_asgi_app(engine, config: Optional[ServeConfig] = None, *,
                    watch_disconnects: bool = False, **overrides):
    """The same API as a falcon.asgi app (uvicorn, hypercorn, ...); see `create_app`.
    `watch_disconnects=True` cancels a non-streamed request whose client goes away (what `serve`
    runs; off by default: Falcon's TestClient disconnects as soon as it has sent a request)."""
    return build_asgi_app(make_gateway(engine, config, overrides),
                          watch_disconnects=watch_disconnects)
