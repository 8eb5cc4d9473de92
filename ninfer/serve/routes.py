"""Route logic shared by the WSGI and ASGI apps: parsed body in, Reply out (no Falcon types here).

A streaming Reply carries an SseIterator; whoever serves it must call `close()` when done or when
the client goes away: that cancels an unfinished request and releases its Engine capacity.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Optional

from ..api import Finished
from .anthropic_render import MessageStream, message_response
from .anthropic_schema import parse_count_tokens, parse_messages
from .errors import ApiError, from_engine_error
from .openai_render import (ChatStream, CompletionStream, TokenText, chat_response,
                            completion_response)
from . import fields as F
from .errors import invalid
from .metrics import CONTENT_TYPE
from .openai_schema import chat_messages, chat_tools, parse_chat, parse_completion


@dataclass(slots=True)
class Reply:
    status: int = 200
    body: Optional[object] = None          # JSON-able, or bytes with `content_type`
    content_type: str = "application/json"
    stream: Optional["SseIterator"] = None


class SseIterator:
    """Pulls events from a Generation and yields SSE messages; `close()` always releases it,
    also when iteration never started (a client that vanished before the first byte)."""

    def __init__(self, gen, renderer, keepalive_s: float):
        self._gen, self._renderer, self._keepalive = gen, renderer, keepalive_s
        self._pending = list(renderer.start())
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        while not self._pending:
            if self._done:
                self.close()
                raise StopIteration
            self._pull()
        return self._pending.pop(0)

    def _pull(self) -> None:
        try:
            event = self._gen.next_event(timeout=self._keepalive)
        except StopIteration:
            self._done = True
            return
        except ApiError as err:
            self._pending += self._renderer.on_error(err)
            self._done = True
            return
        if event is None:
            self._pending.append((None, None))          # keep-alive comment
            return
        self._pending += self._renderer.on_event(event)
        if isinstance(event, Finished):
            self._done = True

    def close(self) -> None:
        self._done = True
        self._gen.release()


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _start(gw, plan, response_id: str):
    return gw.start(plan.prompt, plan.params, tools=plan.tools,
                    enable_thinking=plan.enable_thinking, request_id=response_id,
                    session=plan.session)


def _collect(gen):
    try:
        gen.collect()
    finally:
        gen.release()


# ---- OpenAI ----------------------------------------------------------------------------------------

def chat_completions(gw, body) -> Reply:
    return _openai_generation(gw, parse_chat(body, gw), "chatcmpl-", ChatStream, chat_response)


def completions(gw, body) -> Reply:
    return _openai_generation(gw, parse_completion(body, gw), "cmpl-", CompletionStream,
                              completion_response)


def _openai_generation(gw, plan, id_prefix: str, stream_cls, render) -> Reply:
    """Submit `plan`; a stream Reply, or the whole answer rendered once the request finishes."""
    model_id, response_id = gw.model_id, _new_id(id_prefix)
    text = TokenText(gw.engine())
    gen = _start(gw, plan, response_id)
    if plan.stream:
        return Reply(stream=SseIterator(gen, stream_cls(plan, gen, model_id, response_id, text),
                                        gw.config.keepalive_s))
    _collect(gen)
    return Reply(body=render(plan, gen, model_id, response_id, int(time.time()), text))


def models(gw, anthropic: bool = False) -> Reply:
    model_id = gw.model_id
    if anthropic:       # the anthropic SDK's models.list() shape
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(gw.created))
        entry = {"id": model_id, "type": "model", "display_name": model_id, "created_at": created}
        return Reply(body={"data": [entry], "has_more": False, "first_id": model_id,
                           "last_id": model_id})
    entry = {"id": model_id, "object": "model", "created": gw.created, "owned_by": "ninfer"}
    if gw.max_context():
        entry["max_model_len"] = gw.max_context()
    # what a request that leaves sampling fields out gets (checkpoint, then serve flags)
    entry["sampling_defaults"] = gw.sampling_defaults()
    return Reply(body={"object": "list", "data": [entry]})


def model(gw, model_name: str, anthropic: bool = False) -> Reply:
    if model_name != gw.model_id:
        raise ApiError(404, f"model {model_name!r} not found; this server serves "
                            f"{gw.model_id!r}", param="model", code="model_not_found")
    return Reply(body=models(gw, anthropic).body["data"][0])


# ---- Anthropic -------------------------------------------------------------------------------------

def messages(gw, body) -> Reply:
    plan = parse_messages(body, gw)
    model_id, message_id = gw.model_id, _new_id("msg_")
    engine = gw.engine()
    gen = _start(gw, plan, message_id)
    if plan.stream:
        return Reply(stream=SseIterator(gen, MessageStream(plan, gen, model_id, message_id, engine),
                                        gw.config.keepalive_s))
    _collect(gen)
    return Reply(body=message_response(plan, gen, model_id, message_id, engine))


def count_tokens(gw, body) -> Reply:
    messages_, tools, thinking = parse_count_tokens(body, gw)
    engine = gw.engine()
    try:
        n = engine.count_prompt_tokens(messages_, tools=tools, enable_thinking=thinking)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise from_engine_error(exc) from exc
    return Reply(body={"input_tokens": n})


# ---- tokenizer (vLLM's /tokenize and /detokenize) ---------------------------------------------------

_TOKENIZE_FIELDS = frozenset(("model", "prompt", "messages", "add_special_tokens",
                              "add_generation_prompt", "chat_template_kwargs", "tools",
                              "return_token_strs"))


def tokenize(gw, body) -> Reply:
    """{prompt} (text as is) or {messages} (rendered by the chat template) -> {count,
    max_model_len, tokens, token_strs}. The Qwen3.5 tokenizer adds no special tokens to text, so
    `add_special_tokens` changes nothing and is accepted for vLLM clients."""
    body = F.json_object(body, "tokenize")
    F.check_known(body, _TOKENIZE_FIELDS, gw, "tokenize")
    F.get(body, "model", "str")
    F.get(body, "add_special_tokens", "bool")
    want_strs = F.get(body, "return_token_strs", "bool", default=False)
    engine = gw.engine()
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise invalid("send exactly one of 'prompt' (text) or 'messages' (a chat)",
                      "prompt" if has_prompt else "messages")
    try:
        if has_prompt:
            text = F.get(body, "prompt", "str", required=True)
        else:
            messages = chat_messages(F.get(body, "messages", "list", required=True))
            kwargs = F.get(body, "chat_template_kwargs", "dict", default={})
            thinking = F.get(kwargs, "enable_thinking", "bool",
                             param="chat_template_kwargs.enable_thinking",
                             default=gw.default_thinking())
            text = engine.apply_chat_template(
                messages, tools=chat_tools(body),
                add_generation_prompt=F.get(body, "add_generation_prompt", "bool", default=True),
                enable_thinking=thinking)
        ids = [int(t) for t in engine.tokenize(text)]
        strs = [engine.detokenize([t]) for t in ids] if want_strs else None
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise from_engine_error(exc) from exc
    return Reply(body={"count": len(ids), "max_model_len": gw.max_context(), "tokens": ids,
                       "token_strs": strs})


def detokenize(gw, body) -> Reply:
    """{tokens: [ids]} -> {prompt: text}; an id outside the vocabulary is a 400."""
    body = F.json_object(body, "detokenize")
    F.check_known(body, ("model", "tokens"), gw, "detokenize")
    F.get(body, "model", "str")
    ids = F.get(body, "tokens", "list", required=True)
    engine = gw.engine()
    vocab = engine.vocab_size
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab and t >= vocab):
            raise invalid(f"'tokens[{i}]' must be a token id in [0, {vocab or 'vocab'}), got "
                          f"{t!r}", f"tokens[{i}]")
    try:
        return Reply(body={"prompt": engine.detokenize(ids)})
    except Exception as exc:  # noqa: BLE001
        raise from_engine_error(exc) from exc


# ---- operations ------------------------------------------------------------------------------------

def health(gw) -> Reply:
    state = gw.health_state()
    body = {"status": "ok" if state == "ready" else state}
    if state == "ready":
        body["model"] = gw.model_id
        body["in_flight"] = gw.num_in_flight()
    return Reply(status=200 if state == "ready" else 503, body=body)


def metrics(gw) -> Reply:
    return Reply(body=gw.metrics.render(), content_type=CONTENT_TYPE)
