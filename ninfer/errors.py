"""The typed exceptions users catch. Every error NInfer raises on bad input is one of these."""


class Error(Exception):
    """Base class of every NInfer error."""


class ArtifactError(Error):
    """A .ninfer file (or a checkpoint being converted) breaks a format rule; the message names it."""


class ConvertError(ArtifactError):
    """The converter cannot turn a source checkpoint into an artifact (unknown architecture, missing
    shard or tensor, shape mismatch)."""


class DeviceError(Error):
    """The requested backend cannot run here (no driver, no device, too little memory for the plan)."""


class ShardingError(DeviceError):
    """A model's geometry cannot be split over this many ranks (tensor / expert parallel,
    ninfer/parallel): the message names the numbers and the rule they break."""


class RequestError(Error):
    """A request is invalid or cannot be accepted (bad parameters, prompt too long, queue full).

    `status` is the HTTP status the Gateway maps it to (400 by default, 429 for overload)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status = status
        self.code = code


class NotSupportedError(RequestError):
    """This Engine cannot do what was asked on its backend or model (embeddings on the CUDA
    backend, say); the message names why. HTTP 400 "not_supported", as vLLM answers a task its
    model does not serve (not a 5xx: the SDKs would retry it, and it cannot succeed)."""

    def __init__(self, message: str):
        super().__init__(message, status=400, code="not_supported")


class ContextLengthError(RequestError):
    """prompt + max_tokens exceed the Engine's max_context (a request that sets
    `SamplingParams.clamp_max_tokens` is cut to the context instead). HTTP 400
    "context_length_exceeded"; the Gateway names the field the client used (`describe`)."""

    def __init__(self, max_tokens: int, num_prompt_tokens: int, max_context: int):
        self.max_tokens = int(max_tokens)
        self.num_prompt_tokens = int(num_prompt_tokens)
        self.max_context = int(max_context)
        super().__init__(self.describe("max_tokens"), code="context_length_exceeded")

    def describe(self, param: str) -> str:
        room = self.max_context - self.num_prompt_tokens
        return (f"{param}={self.max_tokens} + {self.num_prompt_tokens} prompt tokens exceeds the "
                f"context of {self.max_context} tokens (at most {room} tokens fit after this "
                f"prompt)")


class EngineClosedError(RequestError):
    """The Engine was closed (`close()`, or the server is shutting down): it takes no new work.
    The caller's mistake or a shutdown race, not a broken invariant: HTTP 503 "engine_closed"."""

    def __init__(self, message: str = "this Engine is closed"):
        super().__init__(message, status=503, code="engine_closed")


class EngineFailedError(Error):
    """The Engine broke an internal invariant and stopped; every pending and new request sees this."""
