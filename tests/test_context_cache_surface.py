"""Issue 12's surface: the context cache's session hints, the usage that reports it, /metrics and
the flags.

- In-process (FakeEngine): each hint field is checked (a 400 naming it, never a 5xx) and reaches
  Engine.submit's `session=`; /metrics renders the cache's stats under their own names.
- Real server (`python -m ninfer serve` on the demo artifact, numpy backend, the new flags) through
  the official `openai` and `anthropic` SDKs: the second turn of a conversation reports the
  prompt tokens the cache supplied, and that count is exactly what the Engine reused for it (the
  growth of ninfer_prefix_cache_reused_tokens_total, one request at a time), streamed and not.
- Python: Engine.generate(session=) and GenerationResult.num_cached_tokens, and the same count
  through the HTTP app in-process.
- Flags: parsed onto EngineOptions; bad values are one line and exit status 2.
No hit is faked: every cached count comes from a real prefix checkpoint of the numpy backend.
"""
from __future__ import annotations

import subprocess
import sys

import anthropic
import openai
import pytest
from falcon import testing

import ninfer
from ninfer.api import MAX_SESSION_CHARS
from ninfer.cli import build_parser
from ninfer.commands import engine_kwargs
from ninfer.options import EngineOptions
from test_serve_support import FakeEngine, ServerProcess

KEY = "k"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
def _turn1(topic: str) -> list:
    """A first turn no other test sends (the server's cache is shared by the module)."""
    return [{"role": "user", "content": f"Write a haiku about {topic}."}]


def _turn2(topic: str, answer: str) -> list:
    return _turn1(topic) + [{"role": "assistant", "content": answer},
                            {"role": "user", "content": "Now one about the mountains."}]


# ---- hints: validated, and passed on as session= (in-process, FakeEngine) ------------------------

@pytest.fixture
def fake():
    engine = FakeEngine()
    from ninfer.serve import create_app
    return engine, testing.TestClient(create_app(engine))


def _chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            **extra}


def _completion(**extra):
    return {"model": "m", "prompt": "hi", "max_tokens": 3, **extra}


def _message(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            **extra}


@pytest.mark.parametrize("path, body, session", [
    (CHAT, _chat(prompt_cache_key="conv-1", user="alice"), "conv-1"),   # the key wins
    (CHAT, _chat(user="alice"), "alice"),
    (CHAT, _chat(prompt_cache_key="", user="alice"), "alice"),          # "" is no hint
    (CHAT, _chat(prompt_cache_key="k" * MAX_SESSION_CHARS), "k" * MAX_SESSION_CHARS),
    (CHAT, _chat(), None),
    (COMPLETIONS, _completion(prompt_cache_key="c", user="u"), "c"),
    (COMPLETIONS, _completion(user="u"), "u"),
    (MESSAGES, _message(metadata={"user_id": "user-7"}), "user-7"),
    (MESSAGES, _message(metadata={"user_id": None}), None),
    (MESSAGES, _message(metadata={}), None),
    (MESSAGES, _message(), None),
])
def test_session_hints_reach_submit(fake, path, body, session):
    engine, client = fake
    r = client.simulate_post(path, json=body)
    assert r.status_code == 200, r.text
    assert engine.sessions == [session]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, _chat(prompt_cache_key=5), "prompt_cache_key"),
    (CHAT, _chat(prompt_cache_key=["a"]), "prompt_cache_key"),
    (CHAT, _chat(prompt_cache_key="k" * (MAX_SESSION_CHARS + 1)), "prompt_cache_key"),
    (CHAT, _chat(user={"id": 1}), "user"),
    (CHAT, _chat(prompt_cache_key="ok", user="u" * (MAX_SESSION_CHARS + 1)), "user"),
    (COMPLETIONS, _completion(user=True), "user"),
    (COMPLETIONS, _completion(prompt_cache_key=1.5), "prompt_cache_key"),
    (MESSAGES, _message(metadata={"user_id": 7}), "metadata.user_id"),
    (MESSAGES, _message(metadata={"user_id": "x" * (MAX_SESSION_CHARS + 1)}), "metadata.user_id"),
    (MESSAGES, _message(metadata="user-7"), "metadata"),
])
def test_bad_session_hints_are_400_naming_the_field(fake, path, body, param):
    engine, client = fake
    r = client.simulate_post(path, json=body)
    assert r.status_code == 400, r.text
    if path == MESSAGES:
        assert r.json["type"] == "error" and f"'{param}'" in r.json["error"]["message"], r.json
    else:
        assert r.json["error"]["param"] == param, r.json
    assert engine.sessions == []            # nothing submitted


def test_metrics_render_the_cache_stats():
    class Stats(FakeEngine):
        def stats(self):
            return {**super().stats(), "prefix_cache_lookups": 8, "prefix_cache_hits": 6,
                    "prefix_cache_tokens_reused": 1234, "prefix_cache_device_bytes": 4096,
                    "prefix_cache_host_bytes": 512, "prefix_cache_entries": 3,
                    "prefix_cache_slots_total": 40, "prefix_cache_copy_seconds_to_host": 0.25,
                    "prefix_cache_copy_seconds_to_device": 0.125,
                    "prefix_cache_capture_seconds": 0.0625}

    from ninfer.serve import create_app
    text = testing.TestClient(create_app(Stats())).simulate_get("/metrics").text
    lines = set(text.splitlines())
    for line in ("ninfer_prefix_cache_lookups_total 8.0", "ninfer_prefix_cache_hits_total 6.0",
                 "ninfer_prefix_cache_reused_tokens_total 1234.0",
                 "ninfer_prefix_cache_hit_rate 0.75",
                 'ninfer_prefix_cache_bytes{tier="device"} 4096.0',
                 'ninfer_prefix_cache_bytes{tier="host"} 512.0',
                 "ninfer_prefix_cache_entries 3.0",
                 "ninfer_prefix_cache_state_slots 40.0",
                 'ninfer_prefix_cache_copy_seconds_total{direction="to_host"} 0.25',
                 'ninfer_prefix_cache_copy_seconds_total{direction="to_device"} 0.125',
                 "ninfer_prefix_cache_capture_seconds_total 0.0625",
                 "# TYPE ninfer_prefix_cache_hits_total counter",
                 "# TYPE ninfer_prefix_cache_copy_seconds_total counter"):
        assert line in lines, (line, text)
    assert "ninfer_engine_prefix_cache" not in text         # exported once, under these names


def test_metrics_hit_rate_before_any_lookup_is_zero():
    class Idle(FakeEngine):
        def stats(self):
            return {**super().stats(), "prefix_cache_lookups": 0, "prefix_cache_hits": 0}

    from ninfer.serve import create_app
    text = testing.TestClient(create_app(Idle())).simulate_get("/metrics").text
    assert "ninfer_prefix_cache_hit_rate 0.0" in text.splitlines()


# ---- Python API ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module")
def engine(demo):
    with ninfer.Engine(demo, max_context=1024) as e:
        yield e


GREEDY = ninfer.SamplingParams(max_tokens=6, temperature=0.0)


def test_engine_session_and_num_cached_tokens(engine, demo):
    first = engine.generate(_turn1("the sea"), GREEDY, enable_thinking=False, session="py-conv")
    before = engine.stats()["prefix_cache_tokens_reused"]
    second = engine.generate(_turn2("the sea", first.text), GREEDY, enable_thinking=False,
                             session="py-conv")
    reused = engine.stats()["prefix_cache_tokens_reused"] - before
    assert 0 < second.num_cached_tokens < second.num_prompt_tokens
    assert second.num_cached_tokens == reused
    # the cache changes no token: the same request with the cache off
    with ninfer.Engine(demo, max_context=1024, prefix_cache=False) as cold:
        again = cold.generate(_turn2("the sea", first.text), GREEDY, enable_thinking=False)
    assert again.num_cached_tokens == 0 and again.token_ids == second.token_ids


@pytest.mark.parametrize("session", [5, b"conv", ["a"], "s" * (MAX_SESSION_CHARS + 1)])
def test_engine_refuses_a_bad_session(engine, session):
    with pytest.raises(ninfer.RequestError, match="session"):
        engine.submit("hi", GREEDY, session=session)


def test_http_usage_equals_the_results_num_cached_tokens(engine):
    """In-process through the HTTP app: usage.cached_tokens is the result's num_cached_tokens."""
    from ninfer.serve import create_app

    handles = []

    class Spy:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def submit(self, *args, **kwargs):
            handles.append(self._inner.submit(*args, **kwargs))
            return handles[-1]

    client = testing.TestClient(create_app(Spy(engine)))
    body = {"model": "m", "max_tokens": 6, "temperature": 0, "prompt_cache_key": "http-conv",
            **NO_THINK}
    first = client.simulate_post(CHAT, json={**body, "messages": _turn1("rivers")}).json
    answer = first["choices"][0]["message"]["content"]
    second = client.simulate_post(CHAT, json={**body, "messages": _turn2("rivers", answer)}).json
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    assert cached == handles[-1].result().num_cached_tokens


# ---- the real server, the official SDKs ----------------------------------------------------------

@pytest.fixture(scope="module")
def server(demo):
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", demo, "--max-context", "1024",
                         "--api-key", KEY, "--log-level", "warning", "--max-concurrency", "2",
                         "--prefix-cache-host-bytes", "64M",
                         "--prefix-cache-device-fraction", "0.25"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def _reused(server) -> float:
    return server.metrics({"Authorization": f"Bearer {KEY}"})[
        "ninfer_prefix_cache_reused_tokens_total"]


def test_openai_second_turn_reports_cached_tokens(oai, server):
    kw = dict(model="m", max_tokens=6, temperature=0, extra_body=NO_THINK,
              prompt_cache_key="oai-conv")
    first = oai.chat.completions.create(messages=_turn1("the sea"), **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages = _turn2("the sea", first.choices[0].message.content)
    before = _reused(server)
    second = oai.chat.completions.create(messages=messages, **kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached == _reused(server) - before

    # streamed: the final usage chunk carries it too (the checkpoint of turn 2 itself is newer:
    # its count is whatever this request reused, read the same way)
    before = _reused(server)
    chunks = list(oai.chat.completions.create(messages=messages, stream=True,
                                              stream_options={"include_usage": True}, **kw))
    usage = chunks[-1].usage
    assert usage.prompt_tokens == second.usage.prompt_tokens
    assert 0 < usage.prompt_tokens_details.cached_tokens == _reused(server) - before


def test_completions_report_cached_tokens(oai, server):
    prompt = "def fibonacci(n):\n    " * 4
    first = oai.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                   user="completion-user")
    before = _reused(server)
    second = oai.completions.create(model="m", prompt=prompt + first.choices[0].text + "\n# next",
                                    max_tokens=4, temperature=0, user="completion-user")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached == _reused(server) - before


def test_anthropic_second_turn_reports_cache_read(claude, server):
    kw = dict(model="m", max_tokens=6, metadata={"user_id": "claude-conv"},
              extra_body={"temperature": 0})
    first = claude.messages.create(messages=_turn1("the desert"), **kw)
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens == 0
    messages = _turn2("the desert", first.content[0].text)
    counted = claude.messages.count_tokens(model="m", messages=messages).input_tokens
    before = _reused(server)
    second = claude.messages.create(messages=messages, **kw)
    read = second.usage.cache_read_input_tokens
    # Anthropic's split: input_tokens is the part not read from the cache
    assert 0 < read < counted and second.usage.input_tokens + read == counted
    assert read == _reused(server) - before

    before = _reused(server)
    with claude.messages.stream(messages=messages, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    read = final.usage.cache_read_input_tokens
    assert 0 < read == _reused(server) - before
    assert (start.input_tokens, start.cache_read_input_tokens) == (final.usage.input_tokens, read)
    assert final.usage.input_tokens + read == counted


def test_metrics_count_the_hits(server, oai):
    kw = dict(model="m", max_tokens=4, temperature=0, extra_body=NO_THINK, user="metrics-conv")
    first = oai.chat.completions.create(messages=_turn1("the forest"), **kw)
    oai.chat.completions.create(messages=_turn2("the forest", first.choices[0].message.content),
                                **kw)
    m = server.metrics({"Authorization": f"Bearer {KEY}"})
    hits, lookups = m["ninfer_prefix_cache_hits_total"], m["ninfer_prefix_cache_lookups_total"]
    assert 1 <= hits <= lookups
    assert m["ninfer_prefix_cache_hit_rate"] == pytest.approx(hits / lookups)
    assert m["ninfer_prefix_cache_reused_tokens_total"] >= hits
    assert m["ninfer_prefix_cache_entries"] >= 1
    held = m['ninfer_prefix_cache_bytes{tier="device"}'] + m['ninfer_prefix_cache_bytes{tier="host"}']
    assert held > 0


# ---- flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_cache_flags_reach_engine_options(command):
    head = [command, "--prompt", "x"] if command == "run" else [command]
    args = build_parser().parse_args(head + ["--no-prefix-cache",
                                             "--prefix-cache-device-fraction", "0.25",
                                             "--prefix-cache-host-bytes", "64M"])
    opts = EngineOptions.from_kwargs(**engine_kwargs(args, concurrency_default=1))
    assert (opts.prefix_cache, opts.prefix_cache_device_fraction) == (False, 0.25)
    assert opts.prefix_cache_host_bytes == 64 << 20
    args = build_parser().parse_args(head + ["--prefix-cache-bytes", "1G"])   # the older name
    opts = EngineOptions.from_kwargs(**engine_kwargs(args, concurrency_default=1))
    assert opts.uses_prefix_cache and opts.prefix_cache_budget_bytes == 1 << 30
    defaults = EngineOptions.from_kwargs(**engine_kwargs(build_parser().parse_args(head),
                                                         concurrency_default=1))
    assert defaults.uses_prefix_cache and defaults.prefix_cache_host_bytes is None


@pytest.mark.parametrize("flags", [
    ["--prefix-cache-device-fraction", "1.5"], ["--prefix-cache-device-fraction", "nan"],
    ["--prefix-cache-device-fraction", "half"], ["--prefix-cache-host-bytes", "-1"],
    ["--prefix-cache-host-bytes", "lots"],
    ["--prefix-cache-host-bytes", "1M", "--prefix-cache-bytes", "2M"],
])
def test_bad_cache_flags_are_one_line_errors(flags):
    r = subprocess.run([sys.executable, "-m", "ninfer", "serve", *flags], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("ninfer: error:") and "prefix" in r.stderr, r.stderr


def test_help_lists_the_cache_flags():
    r = subprocess.run([sys.executable, "-m", "ninfer", "serve", "--help"], capture_output=True,
                       text=True, timeout=60)
    for flag in ("--no-prefix-cache", "--prefix-cache-device-fraction F",
                 "--prefix-cache-host-bytes SIZE", "--prefix-cache-bytes SIZE"):
        assert flag in r.stdout, flag
