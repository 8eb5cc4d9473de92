"""What both app flavours share (app.py: WSGI, asgi.py: falcon.asgi): the route tables, the
Gateway middleware (request id, auth, body limit, request metrics), JSON body parsing and the
error and reply writers. Both flavours import from here; neither imports the other's module
except app.py, which builds the ASGI flavour through asgi.py.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import re
import uuid
from dataclasses import replace
from typing import Optional

import falcon

from . import routes
from .config import ServeConfig
from .errors import ApiError, flavour_of
from .gateway import Gateway
from .plan import dumps

log = logging.getLogger("ninfer.serve")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
_PUBLIC_PATHS = ("/health",)

POST_ROUTES = {
    "/v1/chat/completions": routes.chat_completions,
    "/v1/completions": routes.completions,
    "/v1/embeddings": routes.embeddings,
    "/v1/messages": routes.messages,
    "/v1/messages/count_tokens": routes.count_tokens,
    "/tokenize": routes.tokenize,               # vLLM's tokenizer routes
    "/detokenize": routes.detokenize,
}


def make_gateway(engine, config: Optional[ServeConfig], overrides: dict) -> Gateway:
    if isinstance(engine, Gateway):
        return engine
    config = config or ServeConfig()
    if overrides:
        config = replace(config, **overrides)
    return Gateway(engine, config)


class GatewayMiddleware:
    """Request id, auth, body-size limit and request metrics, for both app flavours."""

    def __init__(self, gw: Gateway):
        self.gw = gw

    def process_request(self, req, resp) -> None:
        given = req.get_header("x-request-id")
        req.context.request_id = given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex
        resp.set_header("x-request-id", req.context.request_id)
        cfg = self.gw.config
        # a CORS preflight (OPTIONS) carries no credentials by design: never ask it for a key
        if cfg.api_key and req.path not in _PUBLIC_PATHS and req.method != "OPTIONS":
            auth = req.get_header("authorization") or ""
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else req.get_header("x-api-key")
            if not key or not hmac.compare_digest(key.encode(), cfg.api_key.encode()):
                raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY' "
                                    "or 'x-api-key: KEY')", code="invalid_api_key")
        if req.content_length is not None and req.content_length > cfg.max_body_bytes:
            raise _too_large(req.content_length, cfg.max_body_bytes)

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        rid = getattr(req.context, "request_id", None)
        if rid:
            resp.set_header("x-request-id", rid)
        route = req.uri_template or "unmatched"
        self.gw.metrics.requests.labels(route, str(resp.status_code)).inc()

    async def process_request_async(self, req, resp) -> None:
        self.process_request(req, resp)

    async def process_response_async(self, req, resp, resource, req_succeeded) -> None:
        self.process_response(req, resp, resource, req_succeeded)


def middleware_for(gw: Gateway) -> list:
    """Both app flavours' middleware: the Gateway's, then CORS when origins are allowed (Falcon's
    CORSMiddleware: preflights answered, Access-Control-Allow-Origin on matching origins)."""
    out = [GatewayMiddleware(gw)]
    origins = gw.config.allowed_origins
    if origins:
        out.append(falcon.CORSMiddleware(allow_origins="*" if "*" in origins else list(origins),
                                         expose_headers=["x-request-id"]))
    return out


def _too_large(n, limit) -> ApiError:
    return ApiError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes",
                    code="request_too_large")


def parse_body(data: bytes, limit: int):
    if len(data) > limit:
        raise _too_large(f"more than {limit}", limit)
    if not data.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object",
                       code="invalid_json")
    try:
        body = json.loads(data, parse_float=_finite_float, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}",
                       code="invalid_json") from exc
    except ValueError as exc:       # an integer past int()'s digit limit, a float out of range
        raise ApiError(400, f"the request body holds a number out of range: {exc}",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse",
                       code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(data):
        _check_no_lone_surrogates(body)
    return body


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):        # 1e400 parses to inf, which no field means
        raise ValueError(f"{text[:40]} does not fit a 64-bit float")
    return value


def _no_constant(name: str):
    # json.loads accepts NaN, Infinity and -Infinity, which JSON does not have
    raise ValueError(f"{name} is not a JSON number")


# JSON may escape a lone UTF-16 surrogate ("\ud800"); json.loads keeps it, but it is no Unicode
# text: the tokenizer and the UTF-8 response writer both fail on it (a 500 instead of a 400).
# Escaped pairs decode to one character, so only bodies with such an escape need the walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_no_lone_surrogates(value) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "the request body holds a lone UTF-16 surrogate escape "
                                    "(\\ud800-\\udfff without its pair); it is not Unicode "
                                    "text", code="invalid_json") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def error_to_reply(req, ex) -> ApiError:
    if isinstance(ex, ApiError):
        return ex
    if isinstance(ex, falcon.HTTPError):
        text = ex.title + (f": {ex.description}" if ex.description else "")
        if ex.status_code == 404:
            text = f"no route for {req.method} {req.path}"
        elif ex.status_code == 405:
            text = f"method {req.method} is not allowed on {req.path}"
        return ApiError(ex.status_code, text)
    log.exception("unhandled error on %s %s", req.method, req.path)
    return ApiError(500, f"internal error: {type(ex).__name__}: {ex}", code="internal_error")


def write_error(req, resp, err: ApiError) -> None:
    resp.status = err.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = dumps(err.body(flavour_of(req.path)))
    resp.stream = None
    if err.status == 401:
        resp.set_header("WWW-Authenticate", "Bearer")
    if err.status == 429:
        resp.set_header("Retry-After", "1")


def write_json(resp, reply: routes.Reply) -> None:
    resp.status = reply.status
    if isinstance(reply.body, bytes):
        resp.content_type = reply.content_type
        resp.data = reply.body
    else:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = dumps(reply.body)


def sse_headers(resp) -> None:
    resp.content_type = "text/event-stream; charset=utf-8"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")


GET_ROUTES = {
    "/health": lambda gw, req: routes.health(gw),
    "/metrics": lambda gw, req: routes.metrics(gw),
    "/v1/models": lambda gw, req: routes.models(gw, bool(req.get_header("anthropic-version"))),
    "/v1/models/{model_name:path}": lambda gw, req, model_name: routes.model(
        gw, model_name, bool(req.get_header("anthropic-version"))),
}
