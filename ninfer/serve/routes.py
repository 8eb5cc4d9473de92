"""Route logic shared by the WSGI and ASGI apps: parsed body in, Reply out (no Falcon types here).

A streaming Reply carries an SseIterator; whoever serves it must call `close()` when done or when
the client goes away: that cancels an unfinished request and releases its Engine capacity.
"""
from __future__ import annotations

import base64
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Optional

from ..api import Finished, choice_params
from .anthropic_render import MessageStream, message_response
from .anthropic_schema import parse_count_tokens, parse_messages
from .errors import ApiError, from_engine_error
from .openai_render import (DONE, ChatStream, ChoicesStream, CompletionStream, Echo, TokenText,
                            chat_response, completion_response)
from . import fields as F
from .errors import invalid
from .gateway import ChoiceGroup, EventQueue
from .metrics import CONTENT_TYPE
from .openai_schema import (chat_messages, chat_tools, parse_chat, parse_completion,
                            parse_embeddings)


@dataclass(slots=True)
class Reply:
    status: int = 200
    body: Optional[object] = None          # JSON-able, or bytes with `content_type`
    content_type: str = "application/json"
    stream: Optional["SseIterator"] = None


class SseIterator:
    """Pulls events from a Generation and yields SSE messages; `close()` always releases it,
    also when iteration never started (a client that vanished before the first byte).
    Iterating blocks (keep-alive messages (None, None) when nothing comes for `keepalive_s`);
    `poll()` with `set_listener()` serve an event loop instead (asgi.py)."""

    def __init__(self, gen, renderer, keepalive_s: float):
        self._gen, self._renderer, self._keepalive = gen, renderer, keepalive_s
        self._pending = deque(renderer.start())
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        msg = self._next(self._keepalive)
        return (None, None) if msg is None else msg     # None: a keep-alive comment

    def poll(self):
        """The next message if one is ready, else None; never waits. StopIteration at the end."""
        return self._next(0.0)

    def _next(self, timeout: float):
        """The next message; None if no event came within `timeout`; StopIteration at the end."""
        while not self._pending:
            if self._done:
                self.close()
                raise StopIteration
            if not self._pull(timeout):
                return None
        return self._pending.popleft()

    def set_listener(self, listener) -> None:
        """Call `listener` (from another thread) whenever a message may be ready; None: stop."""
        self._gen.set_listener(listener)

    def _pull(self, timeout: float) -> bool:
        """Render the next event into _pending; False if none came within `timeout`."""
        try:
            event = self._gen.next_event(timeout=timeout)
        except StopIteration:
            self._done = True
            return True
        except ApiError as err:
            self._pending += self._renderer.on_error(err)
            self._done = True
            return True
        if event is None:
            return False
        messages = self._renderer.on_event(event)
        self._pending += messages
        # a ChoiceGroup's events are (index, event): its renderer ends with [DONE] instead
        if isinstance(event, Finished) or DONE in messages:
            self._done = True
        return True

    def close(self) -> None:
        self._done = True
        self._gen.release()


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _start(gw, plan, response_id: str):
    return gw.start(plan.prompt, plan.params, tools=plan.tools,
                    enable_thinking=plan.enable_thinking, request_id=response_id,
                    session=plan.session, max_tokens_param=plan.max_tokens_param)


def _collect(gen):
    try:
        gen.collect()
    finally:
        gen.release()


# ---- OpenAI ----------------------------------------------------------------------------------------

def chat_completions(gw, body) -> Reply:
    return _openai_generation(gw, parse_chat(body, gw), "chatcmpl-", ChatStream, chat_response)


def completions(gw, body) -> Reply:
    plan = parse_completion(body, gw)
    text = TokenText(gw.engine())
    extra = {"echo": _echo(gw, plan, text)} if plan.echo else {}
    return _openai_generation(gw, plan, "cmpl-", CompletionStream, completion_response,
                              text=text, **extra)


def _openai_generation(gw, plan, id_prefix: str, stream_cls, render, *, text=None,
                       **extra) -> Reply:
    """Submit `plan`; a stream Reply, or the whole answer rendered once the request finishes.
    `extra`: keywords for the renderers (echo)."""
    model_id, response_id = gw.model_id, _new_id(id_prefix)
    text = text or TokenText(gw.engine())
    if plan.n > 1:
        return _openai_choices(gw, plan, model_id, response_id, stream_cls, render, text, extra)
    gen = _start(gw, plan, response_id)
    if plan.stream:
        return Reply(stream=SseIterator(gen, stream_cls(plan, gen, model_id, response_id, text,
                                                        **extra), gw.config.keepalive_s))
    _collect(gen)
    return Reply(body=render(plan, gen, model_id, response_id, int(time.time()), text, **extra))


def _openai_choices(gw, plan, model_id, response_id, stream_cls, render, text, extra) -> Reply:
    """OpenAI `n` > 1: n requests of one prompt (choice_params seeds choice i with seed + i),
    submitted in order, so the context cache prefills the shared prompt once (a queued request
    waits for the checkpoint of a resident one still prefilling its prompt); their events merged
    into one response. A failed submit releases (cancels) the choices already started."""
    sink = EventQueue()
    gens = []
    try:
        for i, params in enumerate(choice_params(plan.params, plan.n)):
            gens.append(gw.start(plan.prompt, params, tools=plan.tools,
                                 enable_thinking=plan.enable_thinking,
                                 request_id=f"{response_id}-{i}", session=plan.session,
                                 sink=sink, index=i, share_prompt=i == 0))
    except BaseException:
        for gen in gens:
            gen.release()
        raise
    group = ChoiceGroup(gens, sink)
    if plan.stream:
        streams = [stream_cls(plan, g, model_id, response_id, text, index=i, solo=False, **extra)
                   for i, g in enumerate(gens)]
        return Reply(stream=SseIterator(group, ChoicesStream(streams, group),
                                        gw.config.keepalive_s))
    try:
        group.collect()
    finally:
        group.release()
    return Reply(body=render(plan, group, model_id, response_id, int(time.time()), text,
                             **extra))


def _echo(gw, plan, text: TokenText) -> Echo:
    """The prompt that leads each choice (`echo`), with its tokens' logprobs when `logprobs` is
    asked for: Engine.score over the prompt (NotSupportedError -> a 400 naming why on a backend
    that cannot score beside generation)."""
    engine = gw.engine()
    prompt = plan.prompt
    try:
        ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        prompt_text = prompt if isinstance(prompt, str) else engine.detokenize(ids)
        if not plan.want_logprobs:
            return Echo(prompt_text, None, None, text)
        scores = engine.score(ids, top_logprobs=plan.params.logprobs or 0) \
            if len(ids) >= 2 else None
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bad id or an unsupported backend: the client's
        raise from_engine_error(exc) from exc
    return Echo(prompt_text, ids, scores, text)


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


def embeddings(gw, body) -> Reply:
    """OpenAI /v1/embeddings: each input's final hidden state at its last token, L2-normalised
    (Engine.embed; Qwen3-Embedding's last-token pooling); `dimensions` truncates and
    renormalises; `encoding_format` "base64" sends the float32 bytes (little-endian)."""
    inputs, fmt, dimensions = parse_embeddings(body, gw)
    engine = gw.engine()
    try:
        ids = [engine.embedding_input_ids(item) for item in inputs]
        vectors = engine.embed(ids, dimensions=dimensions)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - bad input, or a backend that cannot embed
        raise from_engine_error(exc) from exc
    data = []
    for i, vec in enumerate(vectors):
        value = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii") \
            if fmt == "base64" else [float(x) for x in vec]
        data.append({"object": "embedding", "index": i, "embedding": value})
    n_tokens = sum(len(x) for x in ids)
    return Reply(body={"object": "list", "data": data, "model": gw.model_id,
                       "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


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
