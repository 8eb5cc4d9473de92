"""Anthropic Messages responses and the standard stream event sequence:

    message_start
      content_block_start / content_block_delta* / content_block_stop    (per block, in order)
    message_delta (stop_reason, usage)
    message_stop

Blocks: thinking (thinking_delta), text (text_delta), tool_use (one input_json_delta with the whole
arguments object). stop_reason: tool_use, max_tokens, stop_sequence or end_turn ("cancelled" when a
server shutdown cancelled the request).
"""
from __future__ import annotations

import json

from ..api import Finished, GenerationResult, GenerationStart, TextDelta, ToolCallEvent
from .errors import ApiError
from .openai_render import result_error
from .plan import dumps


def stop_reason(result: GenerationResult, stop_sequence) -> str:
    if result.tool_calls and result.finish_reason == "stop":
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "cancelled":
        return "cancelled"
    return "stop_sequence" if stop_sequence else "end_turn"


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict:
    """Anthropic's usage: the prompt splits into `cache_read_input_tokens` (what the context cache
    supplied) and `input_tokens` (the rest, prefilled); their sum is what count_tokens counts.
    The cache is written as a side effect of every request, never billed as a write:
    `cache_creation_input_tokens` is 0."""
    return {"input_tokens": num_prompt_tokens - num_cached_tokens,
            "output_tokens": num_output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": num_cached_tokens}


def _tool_input(call) -> dict:
    try:
        value = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        value = {"_raw_arguments": call.arguments}
    return value if isinstance(value, dict) else {"_value": value}


def message_response(plan, gen, model_id: str, message_id: str, engine) -> dict:
    res = gen.result
    if res.finish_reason == "error":
        raise result_error(res, gen.gateway)
    content = []
    if res.reasoning_text:
        content.append({"type": "thinking", "thinking": res.reasoning_text, "signature": ""})
    if res.text or not (res.tool_calls or res.reasoning_text):
        content.append({"type": "text", "text": res.text})
    for call in res.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name,
                        "input": _tool_input(call)})
    stop = res.stop_sequence
    return {"id": message_id, "type": "message", "role": "assistant", "model": model_id,
            "content": content, "stop_reason": stop_reason(res, stop), "stop_sequence": stop,
            "usage": usage(res.num_prompt_tokens, res.num_cached_tokens, len(res.token_ids))}


class MessageStream:
    """Engine events -> Anthropic SSE events."""

    def __init__(self, plan, gen, model_id: str, message_id: str, engine):
        self.plan, self.gen, self.engine = plan, gen, engine
        self.model_id, self.message_id = model_id, message_id
        self._started = False
        self._block = None          # type of the open content block
        self._index = -1            # index of the last opened block

    @staticmethod
    def _event(name: str, body: dict) -> tuple:
        return (name, dumps({"type": name, **body}))

    def start(self) -> list:
        return []

    def _message_start(self, num_prompt_tokens: int, num_cached_tokens: int) -> list:
        self._started = True
        return [self._event("message_start", {"message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model_id,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(num_prompt_tokens, num_cached_tokens, 0)}})]

    def _open(self, kind: str, block: dict) -> list:
        out = self._close()
        self._index += 1
        self._block = kind
        return out + [self._event("content_block_start",
                                  {"index": self._index, "content_block": block})]

    def _close(self) -> list:
        if self._block is None:
            return []
        self._block = None
        return [self._event("content_block_stop", {"index": self._index})]

    def on_event(self, event) -> list:
        out = []
        if not self._started:
            head = event if isinstance(event, GenerationStart) else \
                event.result if isinstance(event, Finished) else None
            out += self._message_start(head.num_prompt_tokens if head else 0,
                                       head.num_cached_tokens if head else 0)
        if isinstance(event, TextDelta) and event.text:
            if event.channel == "reasoning":
                if self._block != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "",
                                                   "signature": ""})
                delta = {"type": "thinking_delta", "thinking": event.text}
            else:
                if self._block != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": event.text}
            out.append(self._event("content_block_delta", {"index": self._index, "delta": delta}))
        elif isinstance(event, ToolCallEvent):
            call = event.call
            out += self._open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name,
                                           "input": {}})
            out.append(self._event("content_block_delta", {
                "index": self._index,
                "delta": {"type": "input_json_delta",
                          "partial_json": json.dumps(_tool_input(call), ensure_ascii=False)}}))
            out += self._close()
        elif isinstance(event, Finished):
            out += self._finish(event.result)
        return out

    def _finish(self, res: GenerationResult) -> list:
        if res.finish_reason == "error":
            return self.on_error(result_error(res, self.gen.gateway))
        out = []
        if self._index < 0:     # no block at all: an empty text block, as the non-stream body
            out += self._open("text", {"type": "text", "text": ""})
        out += self._close()
        stop = res.stop_sequence
        out.append(self._event("message_delta", {
            "delta": {"stop_reason": stop_reason(res, stop), "stop_sequence": stop},
            "usage": usage(res.num_prompt_tokens, res.num_cached_tokens, len(res.token_ids))}))
        out.append(self._event("message_stop", {}))
        return out

    def on_error(self, err: ApiError) -> list:
        return [("error", dumps(err.anthropic_body()))]
