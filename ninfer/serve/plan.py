"""What a parsed protocol request asks of the Engine, and the SSE wire form both protocols share."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

from ..api import SamplingParams


@dataclass(slots=True)
class GenPlan:
    """One generation request, protocol-neutral. `prompt` is a message list (chat) or raw text /
    token ids (completions)."""

    prompt: Union[list, str]
    params: SamplingParams
    tools: Optional[list] = None
    enable_thinking: bool = True
    stream: bool = False
    include_usage: bool = False
    want_logprobs: bool = False
    stop: tuple = field(default_factory=tuple)
    session: Optional[str] = None       # the context cache's session hint (Engine.submit session=)
    n: int = 1                          # choices (OpenAI `n`): one request each, one prefill
    echo: bool = False                  # completions: the prompt leads each choice's text
    max_tokens_param: str = "max_tokens"    # the field that set max_tokens (named by its 400s)


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# An SSE message: (event name or None, data bytes). (None, None) is a keep-alive comment.
SseMessage = tuple


def sse_bytes(message: SseMessage) -> bytes:
    name, data = message
    if data is None:
        return b": keep-alive\n\n"
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + data + b"\n\n"
