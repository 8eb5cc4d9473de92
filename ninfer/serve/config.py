"""Gateway settings: fixed for the life of one app (the Engine's own options live in EngineOptions)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..errors import RequestError


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model_id: Optional[str] = None          # None -> the Engine's name
    api_key: Optional[str] = None           # None -> no auth
    max_body_bytes: int = 8 << 20           # request bodies above this -> 413
    # sampling defaults for requests that leave a field out; None -> the checkpoint's
    # generation_config.json value, else SamplingParams' (greedy)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    max_tokens: Optional[int] = None        # None -> the checkpoint's, else what fits the context
    # operators' bound on max_tokens: a request asking more is a 400 naming it; one that names
    # none gets at most this many (None: no bound but the context)
    max_tokens_cap: Optional[int] = None
    lenient: bool = False                   # unknown request fields are ignored instead of a 400
    # a generation still running this long after submit is cancelled (the answer so far, finish
    # reason "cancelled"); None -> no limit
    request_timeout_s: Optional[float] = None
    allowed_origins: tuple = ()             # CORS: origins allowed to call from a browser ("*": any)
    # chat template default; requests may override. None -> the Engine's (the model's own default:
    # its artifact's metadata.defaults.enable_thinking, else on)
    enable_thinking: Optional[bool] = None
    keepalive_s: float = 15.0               # SSE comment sent when a stream is idle this long
    drain_grace_s: float = 30.0             # SIGTERM: in-flight requests get this long, then cancel
    # transport (the uvicorn worker under gunicorn; see launcher.py)
    header_timeout_s: float = 10.0          # a request's line + headers must arrive within this
    body_timeout_s: float = 30.0            # ... and its body within this after the headers (408)
    idle_timeout_s: float = 5.0             # a keep-alive connection idle this long is closed
    max_connections: int = 1024             # open connections beyond this get 503 at once
    max_header_bytes: int = 16 << 10        # request line + headers above this -> 431

    def validate(self) -> "ServeConfig":
        def bad(name, rule):
            raise RequestError(f"serve option {name}={getattr(self, name)!r}: {rule}")
        if self.model_id is not None and not self.model_id:
            bad("model_id", "must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            bad("api_key", "must be a non-empty string")
        if self.max_body_bytes < 1:
            bad("max_body_bytes", "must be >= 1")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            bad("temperature", "must be in [0, 2]")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            bad("top_k", "must be >= 0")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty is not None and not (math.isfinite(self.repetition_penalty)
                                                        and self.repetition_penalty > 0):
            bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None and not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if self.request_timeout_s is not None and not (math.isfinite(self.request_timeout_s)
                                                       and self.request_timeout_s > 0):
            bad("request_timeout_s", "must be a finite number of seconds > 0 (or None)")
        if not isinstance(self.allowed_origins, tuple) or not all(
                isinstance(o, str) and o for o in self.allowed_origins):
            bad("allowed_origins", "must be a tuple of origins ('https://host:port' or '*')")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            bad("max_tokens_cap", "must be >= 1")
        # not (x > 0) also refuses NaN, which every comparison lets through
        if not (math.isfinite(self.keepalive_s) and self.keepalive_s > 0):
            bad("keepalive_s", "must be a finite number > 0")
        if not (math.isfinite(self.drain_grace_s) and self.drain_grace_s >= 0):
            bad("drain_grace_s", "must be a finite number >= 0")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                bad(name, "must be a finite number > 0")
        if self.max_connections < 1:
            bad("max_connections", "must be >= 1")
        if not (isinstance(self.max_header_bytes, int) and self.max_header_bytes >= 1024):
            bad("max_header_bytes", "must be an integer >= 1024")
        return self


# ---- `python -m ninfer serve` transport flags ----------------------------------------------------
# (flag, ServeConfig field, type, help); the CLI adds them to `serve` and passes the given ones on
TRANSPORT_FLAGS = (
    ("--header-timeout", "header_timeout_s", float,
     "seconds a request's line and headers may take to arrive (408 after; default 10)"),
    ("--body-timeout", "body_timeout_s", float,
     "seconds a request's body may take after its headers (408 after; default 30)"),
    ("--idle-timeout", "idle_timeout_s", float,
     "seconds an idle keep-alive connection stays open (default 5)"),
    ("--max-connections", "max_connections", int,
     "open connections beyond this get 503 at once (default 1024)"),
    ("--max-header-kb", "max_header_bytes", float,
     "largest request line + headers in KiB (431 above it; default 16)"),
)


def add_transport_flags(parser) -> None:
    group = parser.add_argument_group("transport (slow and idle clients)")
    for flag, field, kind, text in TRANSPORT_FLAGS:
        group.add_argument(flag, dest=f"transport_{field}", type=kind, default=None, help=text,
                           metavar="N")


def transport_overrides(args) -> dict:
    """The ServeConfig fields given by transport flags (ServeConfig.validate checks them)."""
    out = {}
    for _, field, _, _ in TRANSPORT_FLAGS:
        value = getattr(args, f"transport_{field}", None)
        if value is not None:
            if field == "max_header_bytes" and math.isfinite(value):   # nan / inf: validate says
                value = int(value * 1024)
            out[field] = value
    return out
