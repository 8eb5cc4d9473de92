"""Test support for the Gateway tests (no tests here): a fake Engine with the Engine's interface.

FakeEngine tokenizes one character per token (id = code point) and answers from a script chosen
by the last user message:
  "tool:NAME {json}" -> one tool call NAME(json) (when tools were given), finish "stop"
  "slow"             -> a long answer produced slowly (disconnect / drain tests)
  anything else      -> reasoning "Let me think." (when thinking is on), then content
                        "echo: <message>" cut at max_tokens / stop strings
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np

from ninfer.api import (Finished, GenerationResult, GenerationStart, TextDelta, TokenLogprob,
                        ToolCall, ToolCallEvent)
from ninfer.errors import EngineFailedError, RequestError

EOS = 0


@dataclass
class FakeOptions:
    max_context: int = 256
    max_concurrency: int = 8
    max_queue: int = 4


class FakeHandle:
    def __init__(self, engine, request_id, events, delay):
        self.engine, self.request_id = engine, request_id
        self._events, self._delay = events, delay
        self._cancel = threading.Event()
        self.closed = False
        self._result = None

    def __iter__(self):
        for ev in self._events:
            if self._cancel.is_set():
                res = self._partial(ev)
                self.engine._finish(self)
                yield Finished(res)
                return
            if isinstance(ev, Finished):
                self._result = ev.result
                self.engine._finish(self)
            elif not isinstance(ev, GenerationStart):
                time.sleep(self._delay)
            yield ev

    def _partial(self, ev) -> GenerationResult:
        return GenerationResult(finish_reason="cancelled")

    def result(self, timeout=None):
        for _ in self:
            pass
        return self._result

    def cancel(self):
        self._cancel.set()

    def close(self):
        if not self.closed:
            self.closed = True
            self.engine._release(self)


class FakeEngine:
    name = "fake-model"

    def __init__(self, delay=0.0, slow_delay=0.05, **options):
        self.options = FakeOptions(**options)
        self.health = "ready"
        self.delay, self.slow_delay = delay, slow_delay
        self.frontend = type("F", (), {"eos_token_ids": (EOS,)})()
        self._lock = threading.Lock()
        self._running: set = set()     # not finished yet
        self._open: set = set()        # not closed yet
        self.submitted = []            # (prompt, params, tools, enable_thinking) of each submit
        self.closed = False

    # ---- frontend ---------------------------------------------------------------------------------
    def tokenize(self, text):
        return np.array([ord(c) for c in text], dtype=np.int32)

    def detokenize(self, ids):
        return "".join(chr(int(i)) for i in ids if int(i) != EOS)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True,
                            enable_thinking=True):
        parts = []
        if tools:
            parts.append("<tools>" + json.dumps(tools, sort_keys=True) + "</tools>\n")
        for m in messages:
            parts.append(f"<{m['role']}>{m.get('content') or ''}\n")
        if add_generation_prompt:
            parts.append("<assistant>" + ("" if enable_thinking else "<nothink>"))
        return "".join(parts)

    # ---- generation -------------------------------------------------------------------------------
    def stats(self):
        with self._lock:
            return {"queue_depth": 0, "residents": len(self._running), "paused": 0,
                    "open_handles": len(self._open)}

    def submit(self, prompt, params, *, tools=None, enable_thinking=None, request_id=None,
               timeout_s=None):
        if self.health != "ready":
            raise EngineFailedError("fake engine failed")
        params.validate()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            text = self.apply_chat_template(prompt, tools, True, enable_thinking)
            last = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
        elif isinstance(prompt, str):
            text, last = prompt, prompt
        else:
            text, last = "".join(chr(t) for t in prompt), ""
        n_prompt = len(text)
        if n_prompt >= self.options.max_context:
            raise RequestError(f"prompt has {n_prompt} tokens; the context holds "
                               f"{self.options.max_context}")
        with self._lock:
            if len(self._running) >= self.options.max_concurrency + self.options.max_queue:
                raise RequestError("queue full", status=429, code="queue_full")
            self.submitted.append((prompt, params, tools, enable_thinking))
        events = self._script(last, params, tools, enable_thinking, n_prompt, request_id)
        delay = self.slow_delay if last == "slow" else self.delay
        handle = FakeHandle(self, request_id, events, delay)
        with self._lock:
            self._running.add(handle)
            self._open.add(handle)
        return handle

    def _finish(self, handle):
        with self._lock:
            self._running.discard(handle)

    def _release(self, handle):
        with self._lock:
            self._open.discard(handle)

    def _script(self, last, params, tools, thinking, n_prompt, request_id):
        events = [GenerationStart(request_id or "r", n_prompt)]
        res = GenerationResult(num_prompt_tokens=n_prompt)
        budget = params.max_tokens

        def emit(channel, text):
            nonlocal budget
            out = []
            for ch in text:
                if budget == 0:
                    break
                budget -= 1
                lp = (TokenLogprob(ord(ch), -0.25, ((ord(ch), -0.25), (ord("?"), -2.0))),) \
                    if params.logprobs is not None else ()
                out.append(TextDelta(channel, ch, (ord(ch),), lp))
                res.token_ids.append(ord(ch))
                if lp:
                    res.logprobs = (res.logprobs or []) + list(lp)
            return out

        if last.startswith("tool:") and tools:
            name, _, args = last[5:].partition(" ")
            call = ToolCall(id=f"call_{request_id[-8:] if request_id else 'x'}", name=name,
                            arguments=json.dumps(json.loads(args or "{}")))
            events.append(ToolCallEvent(0, call))
            res.tool_calls.append(call)
            res.token_ids.extend([1, 2, 3])
            res.finish_reason = "stop"
            events.append(Finished(res))
            return events
        if thinking:
            ev = emit("reasoning", "Let me think.")
            res.reasoning_text = "".join(e.text for e in ev)
            events += ev
        answer = ("x" * 1000) if last == "slow" else f"echo: {last}"
        hits = [(answer.index(s), s) for s in params.stop if s in answer]
        stop = min(hits)[1] if hits else None
        if stop is not None:
            answer = answer[:answer.index(stop)]
        ev = emit("content", answer)
        res.text = "".join(e.text for e in ev)
        if budget == 0:
            res.finish_reason = "length"
        elif stop is not None:      # the stop string's tokens were generated, not shown
            res.token_ids.extend(ord(c) for c in stop[:budget])
            res.finish_reason = "stop"
        else:
            res.token_ids.append(EOS)
            res.finish_reason = "stop"
        events += ev
        events.append(Finished(res))
        return events

    def close(self):
        self.closed = True
