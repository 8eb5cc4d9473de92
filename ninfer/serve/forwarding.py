"""What the two routers in front of replicas share (the `--data-parallel` router, router.py, and
the Ray Serve ingress, ray.py): reading a request's body whole before it is forwarded, the
request's affinity key (routing.py) from that body, and noticing that the client left."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Optional

from . import routing
from .errors import ApiError

INLINE_PARSE_BYTES = 256 << 10      # larger bodies are parsed for routing on a thread


class BodyTooLarge(ApiError):
    """413: the body is over the limit; `size` is its declared length (int) or a description."""

    def __init__(self, size, limit: int):
        super().__init__(413, f"request body of {size} bytes exceeds the limit of {limit} bytes",
                         code="request_too_large")
        self.size = size


async def read_body(scope, receive, limit: int, timeout_s: float) -> Optional[bytes]:
    """The whole body, or None when the client left before it was in. Raises BodyTooLarge (a
    declared or received length over `limit`; the rest of the body is not read) and a 408
    ApiError when it does not arrive within `timeout_s`."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(int(declared), limit)
    parts, size = [], 0

    async def read_all() -> bool:
        nonlocal size
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit or not message.get("more_body", False):
                return True
    try:
        complete = await asyncio.wait_for(read_all(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None
    if not complete:
        return None
    if size > limit:
        raise BodyTooLarge(f"more than {limit}", limit)
    return b"".join(parts)


async def affinity_key(method: str, path: str, data: bytes) -> Optional[tuple]:
    """routing.affinity_key of a request to `path` with body `data` (None: not a generation
    route, or a body that is not JSON, which the replica answers with its 400)."""
    if method != "POST" or path not in routing.AFFINE_ROUTES:
        return None
    try:
        if len(data) <= INLINE_PARSE_BYTES:
            body = json.loads(data)
        else:
            body = await asyncio.to_thread(json.loads, data)
    except (ValueError, RecursionError):
        return None
    return routing.affinity_key(path, body)


async def until_disconnect(receive) -> None:
    """Returns when the client has gone (uvicorn also says so once the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def forward_while_connected(forward, send, receive) -> tuple:
    """Run `forward(send)` (a coroutine function relaying an answer through `send`) until it
    ends or the client disconnects, which cancels it (closing the upstream call cancels the
    replica's generation). Returns (the finished task, whether anything was sent): the task is
    cancelled when the client left, else it holds the forward's result or exception."""
    started = []

    async def tracked_send(message):
        started.append(True)
        await send(message)
    work = asyncio.ensure_future(forward(tracked_send))
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():         # the client left (or this request was cancelled)
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    return work, bool(started)
