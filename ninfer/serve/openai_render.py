"""OpenAI response bodies and stream chunks, built from Engine events and results.

finish_reason: the Engine's "stop" becomes "tool_calls" when the answer holds tool calls; "length"
stays; a request cancelled by a server shutdown reports "cancelled".
"""
from __future__ import annotations

import time

from ..api import Finished, GenerationResult, TextDelta, ToolCallEvent
from .errors import ApiError
from .gateway import ChoiceGroup
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
    """`gen`: a Generation, or the ChoiceGroup of n choices."""
    gens = choices_of(gen)
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [_chat_choice(plan, g, i, text) for i, g in enumerate(gens)],
            "usage": choices_usage(gens)}


def _chat_choice(plan, gen, index: int, text: TokenText) -> dict:
    res = gen.result
    if res.finish_reason == "error":
        raise result_error(res, gen.gateway)
    message = {"role": "assistant",
               "content": res.text if (res.text or not res.tool_calls) else None}
    if res.reasoning_text:
        message["reasoning_content"] = res.reasoning_text
    if res.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in res.tool_calls]
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(res.logprobs, text) if plan.want_logprobs else None,
            "finish_reason": finish_reason(res)}


def choices_of(gen) -> list:
    """The Generations of a response: a ChoiceGroup's, or the one Generation."""
    return gen.gens if isinstance(gen, ChoiceGroup) else [gen]


def choices_usage(gens: list, reasoning: bool = True) -> dict:
    """usage of a response of one or more choices of one prompt: the prompt counted once (the
    first choice's, with what the context cache supplied it), every choice's completion tokens."""
    first = gens[0].result
    out = usage(first, gens[0].num_reasoning_tokens if reasoning else 0)
    n_out = sum(len(g.result.token_ids) for g in gens)
    out["completion_tokens"] = n_out
    out["total_tokens"] = first.num_prompt_tokens + n_out
    if reasoning:
        out["completion_tokens_details"]["reasoning_tokens"] = sum(g.num_reasoning_tokens
                                                                   for g in gens)
    return out


class ChatStream:
    """Engine events -> chat.completion.chunk SSE messages. `index`: the choice the chunks name;
    `solo` False (one choice of several, ChoicesStream): the Finished event gives its finish
    chunk only, and ChoicesStream ends the stream once every choice has finished."""

    def __init__(self, plan, gen, model_id: str, response_id: str, text: TokenText, *,
                 index: int = 0, solo: bool = True):
        self.plan, self.gen, self.text = plan, gen, text
        self.index, self.solo = index, solo
        self._head = {"id": response_id, "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": model_id}

    def _chunk(self, delta: dict, finish=None, logprobs=None) -> tuple:
        body = {**self._head, "choices": [{"index": self.index, "delta": delta,
                                           "logprobs": logprobs, "finish_reason": finish}]}
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
            if not self.solo:
                return out
            if self.plan.include_usage:
                out.append((None, dumps({**self._head, "choices": [],
                                         "usage": usage(res, self.gen.num_reasoning_tokens)})))
            return out + [DONE]
        return []

    def on_error(self, err: ApiError) -> list:
        return [(None, dumps(err.openai_body())), DONE]


class ChoicesStream:
    """The stream of n choices (a ChoiceGroup): each choice's chunks (their `index` names it) in
    arrival order, then one usage chunk (when asked for) over all of them, then [DONE]."""

    def __init__(self, streams: list, group):
        self.streams, self.group = streams, group
        self._open = len(streams)

    def start(self) -> list:
        return [m for s in self.streams for m in s.start()]

    def on_event(self, tagged) -> list:
        index, event = tagged
        stream = self.streams[index]
        out = stream.on_event(event)
        if not isinstance(event, Finished):
            return out
        if event.result.finish_reason == "error":
            return out                  # on_error's [DONE] ends the stream (routes close it)
        self._open -= 1
        if self._open:
            return out
        if stream.plan.include_usage:
            reasoning = isinstance(stream, ChatStream)
            out.append((None, dumps({**stream._head, "choices": [],
                                     "usage": choices_usage(self.group.gens, reasoning)})))
        return out + [DONE]

    def on_error(self, err: ApiError) -> list:
        return self.streams[0].on_error(err)


# ---- /v1/completions -----------------------------------------------------------------------------

def completion_response(plan, gen, model_id: str, response_id: str, created: int,
                        text: TokenText, echo=None) -> dict:
    """Raw completions carry every channel as one text, in generation order. `gen`: a
    Generation or a ChoiceGroup; `echo`: the Echo that leads each choice (plan.echo)."""
    gens = choices_of(gen)
    return {"id": response_id, "object": "text_completion", "created": created, "model": model_id,
            "choices": [_completion_choice(plan, g, i, text, echo) for i, g in enumerate(gens)],
            "usage": choices_usage(gens, reasoning=False)}


def _completion_choice(plan, gen, index: int, text: TokenText, echo) -> dict:
    res = gen.result
    if res.finish_reason == "error":
        raise result_error(res, gen.gateway)
    lead = echo.text if echo is not None else ""
    logprobs = None
    if plan.want_logprobs:
        logprobs = completion_logprobs(res.logprobs, text, len(lead))
        if echo is not None:
            logprobs = echo.join(logprobs)
    return {"index": index, "text": lead + gen.raw_text, "logprobs": logprobs,
            "finish_reason": res.finish_reason or "stop"}


class Echo:
    """OpenAI's `echo`: the prompt text that leads each choice, and with `logprobs` its tokens'
    logprobs in the legacy form (the first token has none: `null` logprob and top_logprobs).
    `scores`: Engine.score's ScoreResult of the prompt ids (None for a one-token prompt)."""

    def __init__(self, prompt_text: str, prompt_ids, scores, text: TokenText):
        self.text = prompt_text
        self.logprobs = None
        if scores is None and prompt_ids is None:
            return
        tokens, values, tops, offsets = [], [None], [None], []
        offset = 0
        for tok_id in prompt_ids:
            tok = text(int(tok_id))
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
        if scores is not None:
            values += [float(v) for v in scores.logprobs]
            tops += [{text(t): float(v) for t, v in top} for top in scores.top or ()] \
                if scores.top is not None else [{} for _ in scores.logprobs]
        self.logprobs = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                         "text_offset": offsets}

    def join(self, generated: dict) -> dict:
        """The prompt's logprobs followed by the generated tokens' (offsets already shifted)."""
        if self.logprobs is None:
            return generated
        return {k: self.logprobs[k] + generated[k] for k in generated}


class CompletionStream:
    """`index` / `solo`: as ChatStream's. `echo`: an Echo whose text (and logprobs) the first
    chunk of the choice carries."""

    def __init__(self, plan, gen, model_id: str, response_id: str, text: TokenText, *,
                 index: int = 0, solo: bool = True, echo=None):
        self.plan, self.gen, self.text = plan, gen, text
        self.index, self.solo, self.echo = index, solo, echo
        self._head = {"id": response_id, "object": "text_completion", "created": int(time.time()),
                      "model": model_id}
        self._offset = len(echo.text) if echo is not None else 0

    def _chunk(self, text: str, finish=None, logprobs=None) -> tuple:
        body = {**self._head, "choices": [{"index": self.index, "text": text,
                                           "logprobs": logprobs, "finish_reason": finish}]}
        if self.plan.include_usage:
            body["usage"] = None
        return (None, dumps(body))

    def start(self) -> list:
        if self.echo is None:
            return []
        return [self._chunk(self.echo.text, logprobs=self.echo.logprobs
                            if self.plan.want_logprobs else None)]

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
            if not self.solo:
                return out
            if self.plan.include_usage:
                out.append((None, dumps({**self._head, "choices": [], "usage": usage(res, 0)})))
            return out + [DONE]
        return []

    def on_error(self, err: ApiError) -> list:
        return [(None, dumps(err.openai_body())), DONE]
