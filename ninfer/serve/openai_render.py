"""OpenAI response bodies and stream chunks, built from Engine events and results.

finish_reason: the Engine's "stop" becomes "tool_calls" when the answer holds tool calls; "length"
stays; a request cancelled by a server shutdown reports "cancelled".
"""
from __future__ import annotations

import time

from ..api import Finished, GenerationResult, TextDelta, ToolCallEvent
from .errors import ApiError
from .plan import dumps

DONE = (None, b"[DONE]")


def finish_reason(result: GenerationResult) -> str:
    if result.finish_reason == "stop" and result.tool_calls:
        return "tool_calls"
    return result.finish_reason or "stop"


def result_error(result: GenerationResult, gateway) -> ApiError:
    """The error a failed request answers with: 503 when the whole Engine failed."""
    status = 503 if gateway.health_state() == "failed" else 500
    return ApiError(status, f"generation failed: {result.error or 'unknown error'}",
                    code="engine_failed" if status == 503 else "generation_error")


def usage(result: GenerationResult, num_reasoning_tokens: int) -> dict:
    """OpenAI's usage: `prompt_tokens` counts the whole prompt; `cached_tokens` is the part of it
    the context cache supplied (not prefilled again)."""
    n_prompt, n_out = result.num_prompt_tokens, len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": num_reasoning_tokens}}


def tool_call_json(call, index=None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


class TokenText:
    """Token id -> its text, cached per request (logprobs name tokens by their text)."""

    def __init__(self, engine):
        self._engine, self._cache = engine, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._engine.detokenize([int(token_id)])
        return text

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self(token_id)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(logprobs, text: TokenText) -> dict:
    return {"content": [{**text.entry(lp.token_id, lp.logprob),
                         "top_logprobs": [text.entry(t, v) for t, v in lp.top]}
                        for lp in logprobs or ()]}


def completion_logprobs(logprobs, text: TokenText, offset0: int = 0) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    offset = offset0
    for lp in logprobs or ():
        tok = text(lp.token_id)
        tokens.append(tok)
        values.append(float(lp.logprob))
        tops.append({text(t): float(v) for t, v in lp.top})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


# ---- /v1/chat/completions --------------------------------------------------------------------------

def chat_response(plan, gen, model_id: str, response_id: str, created: int, text: TokenText) -> dict:
    res = gen.result
    if res.finish_reason == "error":
        raise result_error(res, gen.gateway)
    message = {"role": "assistant",
               "content": res.text if (res.text or not res.tool_calls) else None}
    if res.reasoning_text:
        message["reasoning_content"] = res.reasoning_text
    if res.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in res.tool_calls]
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [{"index": 0, "message": message,
                         "logprobs": chat_logprobs(res.logprobs, text) if plan.want_logprobs
                         else None,
                         "finish_reason": finish_reason(res)}],
            "usage": usage(res, gen.num_reasoning_tokens)}


class ChatStream:
    """Engine events -> chat.completion.chunk SSE messages."""

    def __init__(self, plan, gen, model_id: str, response_id: str, text: TokenText):
        self.plan, self.gen, self.text = plan, gen, text
        self._head = {"id": response_id, "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": model_id}

    def _chunk(self, delta: dict, finish=None, logprobs=None) -> tuple:
        body = {**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": finish}]}
        if self.plan.include_usage:
            body["usage"] = None
        return (None, dumps(body))

    def start(self) -> list:
        return [self._chunk({"role": "assistant", "content": ""})]

    def on_event(self, event) -> list:
        if isinstance(event, TextDelta):
            logprobs = chat_logprobs(event.logprobs, self.text) if self.plan.want_logprobs \
                and event.logprobs else None
            if not event.text and logprobs is None:
                return []
            key = "reasoning_content" if event.channel == "reasoning" else "content"
            return [self._chunk({key: event.text}, logprobs=logprobs)]
        if isinstance(event, ToolCallEvent):
            return [self._chunk({"tool_calls": [tool_call_json(event.call, event.index)]})]
        if isinstance(event, Finished):
            res = event.result
            if res.finish_reason == "error":
                return self.on_error(result_error(res, self.gen.gateway))
            out = [self._chunk({}, finish=finish_reason(res))]
            if self.plan.include_usage:
                out.append((None, dumps({**self._head, "choices": [],
                                         "usage": usage(res, self.gen.num_reasoning_tokens)})))
            return out + [DONE]
        return []

    def on_error(self, err: ApiError) -> list:
        return [(None, dumps(err.openai_body())), DONE]


# ---- /v1/completions -----------------------------------------------------------------------------

def completion_response(plan, gen, model_id: str, response_id: str, created: int,
                        text: TokenText) -> dict:
    """Raw completions carry every channel as one text, in generation order."""
    res = gen.result
    if res.finish_reason == "error":
        raise result_error(res, gen.gateway)
    return {"id": response_id, "object": "text_completion", "created": created, "model": model_id,
            "choices": [{"index": 0, "text": gen.raw_text,
                         "logprobs": completion_logprobs(res.logprobs, text)
                         if plan.want_logprobs else None,
                         "finish_reason": res.finish_reason or "stop"}],
            "usage": usage(res, 0)}


class CompletionStream:
    def __init__(self, plan, gen, model_id: str, response_id: str, text: TokenText):
        self.plan, self.gen, self.text = plan, gen, text
        self._head = {"id": response_id, "object": "text_completion", "created": int(time.time()),
                      "model": model_id}
        self._offset = 0

    def _chunk(self, text: str, finish=None, logprobs=None) -> tuple:
        body = {**self._head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                           "finish_reason": finish}]}
        if self.plan.include_usage:
            body["usage"] = None
        return (None, dumps(body))

    def start(self) -> list:
        return []

    def on_event(self, event) -> list:
        if isinstance(event, TextDelta):
            logprobs = None
            if self.plan.want_logprobs and event.logprobs:
                logprobs = completion_logprobs(event.logprobs, self.text, self._offset)
            self._offset += len(event.text)
            if not event.text and logprobs is None:
                return []
            return [self._chunk(event.text, logprobs=logprobs)]
        if isinstance(event, Finished):
            res = event.result
            if res.finish_reason == "error":
                return self.on_error(result_error(res, self.gen.gateway))
            out = [self._chunk("", finish=res.finish_reason or "stop")]
            if self.plan.include_usage:
                out.append((None, dumps({**self._head, "choices": [], "usage": usage(res, 0)})))
            return out + [DONE]
        return []

    def on_error(self, err: ApiError) -> list:
        return [(None, dumps(err.openai_body())), DONE]
