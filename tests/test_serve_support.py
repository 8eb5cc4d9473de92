"""Test support for the Gateway tests (no tests here): a fake Engine with the Engine's interface.

FakeEngine tokenizes one character per token (id = code point) and answers from a script chosen
by the last user message:
  "tool:NAME {json}" -> one tool call NAME(json) (when tools were given), finish "stop"
  "slow"             -> a long answer produced slowly (disconnect / drain tests)
  "fail"             -> "echo: " then a Finished with finish_reason "error"
  "crash"            -> "echo: " then the handle's iterator raises EngineFailedError
  anything else      -> reasoning "Let me think." (when thinking is on), then content
                        "echo: <message>" cut at max_tokens / stop strings
"""
from __future__ import annotations

import json
import pathlib
import re
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from ninfer.api import (Finished, GenerationResult, GenerationStart, TextDelta, TokenLogprob,
                        ToolCall, ToolCallEvent)
from ninfer.errors import EngineFailedError, NotSupportedError, RequestError

EOS = 0


@dataclass
class FakeOptions:
    max_context: int = 1024
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
            if ev == "crash":
                self.engine._finish(self)
                raise EngineFailedError("the fake worker crashed")
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
    """The Engine facade's interface (ninfer.api.ServedEngine) over a scripted answer per prompt."""

    name = "fake-model"
    sampling_defaults: dict = {}    # the fake checkpoint recommends nothing
    vocab_size = None               # its character "tokenizer" has no fixed vocabulary

    def __init__(self, delay=0.0, slow_delay=0.05, **options):
        self.options = FakeOptions(**options)
        self.health = "ready"
        self.delay, self.slow_delay = delay, slow_delay
        self.frontend = type("F", (), {"eos_token_ids": (EOS,)})()
        self._lock = threading.Lock()
        self._running: set = set()     # not finished yet
        self._open: set = set()        # not closed yet
        self.submitted = []            # (prompt, params, tools, enable_thinking) of each submit
        self.sessions = []             # the session hint of each submit
        self.shared = []               # the share_prompt flag of each submit (OpenAI n)
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

    def count_prompt_tokens(self, messages, *, tools=None, enable_thinking=True):
        return len(self.tokenize(self.apply_chat_template(messages, tools, True,
                                                          enable_thinking)))

    # ---- scoring and embeddings: a backend that cannot (the real ones run on the demo server) --
    def score(self, token_ids, return_logits=False, top_logprobs=0):
        raise NotSupportedError("the fake engine does not score")

    def embedding_input_ids(self, item):
        return self.tokenize(item) if isinstance(item, str) else np.asarray(item, np.int32)

    def embed(self, inputs, *, dimensions=None):
        raise NotSupportedError("the fake engine does not embed")

    # ---- generation -------------------------------------------------------------------------------
    def stats(self):
        with self._lock:
            return {"queue_depth": 0, "residents": len(self._running), "paused": 0,
                    "open_handles": len(self._open)}

    def submit(self, prompt, params, *, tools=None, enable_thinking=None, request_id=None,
               timeout_s=None, session=None, share_prompt=False):
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
            self.sessions.append(session)
            self.shared.append(share_prompt)
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
        if last in ("fail", "crash"):
            events += emit("content", "echo: ")
            res.finish_reason, res.error = "error", "injected failure"
            events.append("crash" if last == "crash" else Finished(res))
            return events
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
            res.finish_reason, res.stop_sequence = "stop", stop
        else:
            res.token_ids.append(EOS)
            res.finish_reason = "stop"
        events += ev
        events.append(Finished(res))
        return events

    def close(self):
        self.closed = True


# ---- the real Engine stack with forced output ------------------------------------------------------
#
# ScriptedModel wraps the real numpy model of an artifact (the demo model): the forward pass, KV and
# State are real, but when a row's history (prompt + generated so far) contains "[[script:NAME]]",
# the logits force the next token of SCRIPTS[NAME] (tokenized by the real tokenizer), then EOS. So
# the real EngineCore schedules it and the real Frontend's OutputSession parses reasoning and tool
# calls out of it. Rows without a marker keep the model's own (random) logits.

SCRIPTS = {
    # thinking on: the prompt ends inside <think>, so the script closes it
    "reason": "The user says hello; answer briefly.\n</think>\n\nHello! How can I help?",
    # thinking off: a Qwen3.5 XML tool call
    "tool": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "fox": "The quick brown fox jumps over the lazy dog.",
    # three parallel calls (a max_tokens inside the third cuts it: issue 23)
    "calls3": "\n".join(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + city + "\n</parameter>\n"
        "<parameter=days>\n" + days + "\n</parameter>\n</function>\n</tool_call>"
        for city, days in (("Paris", "3"), ("Lyon", "1"), ("Rome", "2"))),
    # one call, then the newline a model writes before another call, then EOS
    "call_nl": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "</function>\n</tool_call>\n"),
    # the Qwen3 JSON form inside <tool_call>, which the parser takes as a fallback
    "jsoncall": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
                 "\n</tool_call>"),
    # one call of a tool with a free-text (string) parameter
    "say": ("<tool_call>\n<function=say>\n<parameter=text>\nhello, world\n</parameter>\n"
            "</function>\n</tool_call>"),
    "json": '{"city": "Paris", "days": 3}',
    "long": " ".join(f"w{i}" for i in range(400)),
}
SCRIPTS.update({f"client{i}": f"I am client {i}: " + " ".join(f"c{i}t{j}" for j in range(12))
                for i in range(8)})
_MARKER = re.compile(r"\[\[script:(\w+)\]\]")
SAY_TOOL = {"type": "function", "function": {
    "name": "say", "description": "Say a text aloud",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}


class ScriptedModel:
    FORCED_LOGIT = 50.0

    def __init__(self, model, frontend, scripts=SCRIPTS):
        self._model, self._frontend = model, frontend
        self._scripts = {k: [int(t) for t in frontend.tokenize(v)] for k, v in scripts.items()}
        self._eos = int(frontend.eos_token_ids[0])
        self._history: dict = {}           # state slot -> token ids the row has consumed

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, batch, kv, state, *, all_logits=False):
        logits = self._model.forward(batch, kv, state, all_logits=all_logits)
        if all_logits:
            return logits
        for r in range(batch.num_rows):
            a, b = int(batch.query_start[r]), int(batch.query_start[r + 1])
            slot = int(batch.state_slots[r])
            new = [int(t) for t in batch.token_ids[a:b]]
            hist = new if int(batch.context_lens[r]) == 0 else self._history.get(slot, []) + new
            self._history[slot] = hist
            forced = self._forced_next(hist)
            if forced is not None:
                logits[r] = 0.0
                logits[r, forced] = self.FORCED_LOGIT
        return logits

    def _forced_next(self, hist):
        m = None
        for m in _MARKER.finditer(self._frontend.detokenize(hist)):
            pass
        if m is None or m.group(1) not in self._scripts:
            return None
        script = self._scripts[m.group(1)]
        # tokens of the script already generated = longest history suffix that is a script prefix
        done = max((k for k in range(min(len(script), len(hist)), 0, -1)
                    if hist[-k:] == script[:k]), default=0)
        return script[done] if done < len(script) else self._eos


class ScriptedEngine:
    """The Engine facade's interface over EngineCore(ScriptedModel(real model), real Frontend)."""

    def __init__(self, path, **options):
        from ninfer.artifact import Artifact
        from ninfer.models.qwen3_5 import load_model
        from ninfer.models.qwen3_5.frontend import Frontend
        from ninfer.options import EngineOptions
        from ninfer.runtime.engine_core import EngineCore

        # ScriptedModel rebuilds each row's history from its context-0 chunk: an installed prefix
        # checkpoint would start a row mid-history, so the context cache is off here
        self.options = EngineOptions.from_kwargs(**{"prefix_cache": False, **options})
        self.artifact = Artifact(path)
        self.frontend = Frontend.from_artifact(self.artifact)
        self.model = ScriptedModel(load_model(self.artifact, self.options), self.frontend)
        from ninfer.models.qwen3_5.program import Program
        self._core = EngineCore(Program(self.model, self.options), self.frontend, self.options)
        self.name = "scripted-demo"
        # score / embed as the Engine offers them beside generation (its own methods, below)
        from ninfer.models import model_config
        from ninfer.runtime.scoring import SideScorer
        self.config = model_config(self.artifact)
        self._scorer = SideScorer(self.model, self.options)
        self._is_closed = False

    def _frontend(self):
        return self.frontend

    from ninfer.engine import Engine as _Engine
    score, embed = _Engine.score, _Engine.embed
    embedding_input_ids = _Engine.embedding_input_ids
    del _Engine

    def submit(self, prompt, params=None, **kwargs):
        from ninfer.api import SamplingParams
        return self._core.submit(prompt, params or SamplingParams(), **kwargs)

    def stats(self):
        return self._core.stats()

    @property
    def health(self):
        return self._core.health

    sampling_defaults: dict = {}    # the scripted model answers from its script, not by sampling

    @property
    def vocab_size(self):
        return self.frontend.vocab_size

    def count_prompt_tokens(self, messages, *, tools=None, enable_thinking=True):
        return len(self.frontend.prepare(messages, tools=tools,
                                         enable_thinking=enable_thinking).token_ids)

    def tokenize(self, text):
        return self.frontend.tokenize(text)

    def detokenize(self, ids):
        return self.frontend.detokenize(ids)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True,
                            enable_thinking=True):
        return self.frontend.apply_chat_template(messages, tools=tools,
                                                 add_generation_prompt=add_generation_prompt,
                                                 enable_thinking=enable_thinking)

    def close(self):
        self._core.shutdown()
        self.artifact.close()


class ServerProcess:
    """A server in a subprocess on a free loopback port; `stop()` sends SIGTERM and waits."""

    def __init__(self, argv, *, env=None, ready_timeout=90.0):
        import os
        import socket
        import subprocess
        import tempfile

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile("w+")      # a file, not a pipe: it never fills up
        # the checkout under test first on the path: the script's own directory (tests/) comes
        # first otherwise, and `ninfer` would resolve to whatever installation the venv has
        root = str(pathlib.Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([str(a) for a in argv] + ["--port", str(self.port)],
                                     env={**os.environ, "PYTHONPATH": path, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT, text=True)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout):
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def metrics(self, headers=None) -> dict:
        """{sample name with labels: value} from /metrics."""
        import httpx

        text = httpx.get(self.url + "/metrics", headers=headers or {}, timeout=5).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self, timeout=30.0) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except Exception:  # noqa: BLE001 - a hung server must not hang the suite
            self.proc.kill()
            self.proc.wait(5)
        return self.proc.returncode


def main(argv=None) -> int:
    """Serve a ScriptedEngine on the demo artifact: gunicorn (default) or uvicorn (--asgi)."""
    import argparse

    from ninfer.serve.config import ServeConfig

    p = argparse.ArgumentParser()
    p.add_argument("--artifact", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--asgi", action="store_true")
    p.add_argument("--api-key")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-tokens-cap", type=int, default=None)
    args = p.parse_args(argv)
    config = ServeConfig(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                         drain_grace_s=2.0, max_tokens_cap=args.max_tokens_cap)

    def factory():
        return ScriptedEngine(args.artifact, max_concurrency=args.max_concurrency,
                              max_queue=args.max_queue, max_context=args.max_context)

    if args.asgi:
        import uvicorn

        from ninfer.serve import create_asgi_app
        app = create_asgi_app(factory, config)
        try:
            uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
        finally:
            app.gateway.close()
    else:
        from ninfer.serve.launcher import serve
        serve(factory, config, host="127.0.0.1", port=args.port,
              threads=args.max_concurrency + args.max_queue + 4, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
