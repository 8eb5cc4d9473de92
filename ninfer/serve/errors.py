"""HTTP errors of the Gateway and their two wire shapes.

    OpenAI:    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
    Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}

Routes under /v1/messages answer in Anthropic's shape, every other route in OpenAI's.
"""
from __future__ import annotations

from typing import Optional

from ..errors import EngineFailedError, RequestError

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    431: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("service_unavailable_error", "overloaded_error"),
}


class ApiError(Exception):
    """An error answered to the client; `param` names the offending request field."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, _TYPES[500])[0],
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error",
                "error": {"type": _TYPES.get(self.status, _TYPES[500])[1], "message": self.message}}

    def body(self, flavour: str) -> dict:
        return self.anthropic_body() if flavour == "anthropic" else self.openai_body()


def invalid(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def from_engine_error(exc: BaseException) -> ApiError:
    """Map an exception raised by the Engine to the answer the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        status = getattr(exc, "status", 400)
        return ApiError(status, str(exc), code=getattr(exc, "code", None))
    if isinstance(exc, EngineFailedError):
        return ApiError(503, f"the engine has failed and cannot serve requests: {exc}",
                        code="engine_failed")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def flavour_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"
