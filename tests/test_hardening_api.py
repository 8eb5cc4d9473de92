"""The Python API under hostile use (issue 17): each test reproduces one failure as it was seen
before the fix: Engine("/dev/zero") never returned, cancel() without result()/close() kept the
request outstanding (429 with an idle engine), a second iteration silently split the events, a lone
surrogate raised a bare TypeError, a 5 MB prompt was tokenized for seconds before the length
check, and a chat template could loop for minutes or build a 100 MB string."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from ninfer import ArtifactError, Engine, RequestError, SamplingParams
from ninfer.api import Finished
from ninfer.models.qwen3_5.frontend.chat_template import ChatTemplate, builtin_template_source

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    from ninfer.demo import ensure_demo_artifact
    with Engine(ensure_demo_artifact(), max_concurrency=2, max_queue=2, max_context=512) as e:
        yield e


def wait_outstanding(engine, want=0, timeout=20.0):
    deadline = time.monotonic() + timeout
    while engine.stats()["outstanding"] != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()


# ---- artifacts that are not files -------------------------------------------------------------------

def _with_timeout(fn, seconds=20.0):
    """Run fn on a thread; its exception, or a failure if it does not return (the old hang)."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - inspected by the caller
            out["exc"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "Engine(path) did not return"
    return out.get("exc")


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_engine_refuses_non_regular_files(tmp_path, kind):
    if kind == "device":
        path = "/dev/zero"
        if not os.path.exists(path):
            pytest.skip("no /dev/zero here")
    elif kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        path = tmp_path / "model.ninfer"
        os.mkfifo(path)                 # open() used to block here until a writer came
    else:
        path = tmp_path
    exc = _with_timeout(lambda: Engine(path))
    assert isinstance(exc, ArtifactError), exc
    assert "not a regular" in str(exc)


@pytest.mark.parametrize("path", ["/proc/self/mem", "/proc/self/pagemap",
                                  "/sys/kernel/mm/transparent_hugepage/enabled"])
def test_engine_refuses_special_files_the_kernel_will_not_read(path):
    """Regular files by fstat that fail on read or mmap (EIO, EINVAL, ENODEV): ArtifactError
    naming the path, not a bare OSError."""
    if not os.path.isfile(path):
        pytest.skip(f"no {path} here")
    exc = _with_timeout(lambda: Engine(path))
    assert isinstance(exc, ArtifactError), repr(exc)
    assert str(exc).startswith(f"{path}: ") and isinstance(exc.__cause__, OSError), exc


# ---- handles ------------------------------------------------------------------------------------

def test_cancel_alone_releases_capacity(engine):
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    held = [engine.submit("count to a thousand", params) for _ in range(4)]   # concurrency + queue
    with pytest.raises(RequestError) as full:
        engine.submit("one more", params)
    assert full.value.status == 429
    for h in held:
        h.cancel()                      # no result(), no close(); the handles stay referenced
    stats = wait_outstanding(engine)
    # every KV page not held by a context-cache checkpoint (a prompt whose prefill ended before
    # the cancel leaves one) is free
    assert stats["outstanding"] == 0 and stats["kv_pages_used"] == stats["prefix_cache_kv_pages"]
    assert stats["state_slots_used"] == 0
    h = engine.submit("now there is room", SamplingParams(max_tokens=2))
    assert h.result(timeout=30).finish_reason in ("length", "stop")
    for h in held:                      # the consumer may still read the settled request
        assert h.result(timeout=5).finish_reason == "cancelled"


def test_iterating_a_handle_twice_raises(engine):
    h = engine.submit("hello", SamplingParams(max_tokens=3))
    events = list(h)
    assert isinstance(events[-1], Finished)
    with pytest.raises(RequestError, match="read once"):
        list(h)
    assert h.result(timeout=5) == events[-1].result


def test_iterating_a_handle_from_two_threads_raises(engine):
    h = engine.submit("hello", SamplingParams(max_tokens=50, ignore_eos=True))
    first = iter(h)
    errors, got = [], []
    t = threading.Thread(target=lambda: _catch(lambda: got.extend(h), errors))
    t.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], RequestError) and not got
    events = list(first)                # the first consumer still gets every event
    assert isinstance(events[-1], Finished) and events[-1].result.finish_reason == "length"
    assert wait_outstanding(engine)["outstanding"] == 0


def _catch(fn, errors):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - inspected by the test
        errors.append(exc)


# ---- prompts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [
    "a lone \ud800 surrogate",
    [{"role": "user", "content": "tail \udfff"}],
    [{"role": "user", "content": [{"type": "text", "text": "x\udc80"}]}],
])
def test_lone_surrogate_prompt_is_a_request_error(engine, prompt):
    with pytest.raises(RequestError, match="surrogate"):
        engine.submit(prompt, SamplingParams(max_tokens=2))
    assert engine.stats()["outstanding"] == 0


def test_over_long_text_is_refused_before_tokenizing(engine, monkeypatch):
    calls = []
    real = engine.frontend.tokenizer.encode
    monkeypatch.setattr(engine.frontend.tokenizer, "encode",
                        lambda text: calls.append(len(text)) or real(text))
    huge = "lorem ipsum " * ((5 << 20) // 12)        # ~5 MB
    with pytest.raises(RequestError, match="at least") as info:
        engine.submit(huge, SamplingParams(max_tokens=2))
    assert info.value.code == "context_length_exceeded"
    assert calls == []                  # refused from the byte length alone
    # the bound is a true lower bound: the longest text it lets through still tokenizes exactly
    from ninfer.models.qwen3_5.frontend.prompt import max_token_bytes
    longest = max_token_bytes(engine.frontend.tokenizer)
    assert longest >= max(len(b) for b in engine.frontend.tokenizer.token_bytes[:1000])
    short = "hi " * 10
    assert engine.generate(short, SamplingParams(max_tokens=1)).num_prompt_tokens > 0
    assert calls


def test_byte_bound_never_refuses_what_fits(engine):
    """ceil(bytes / longest token) <= tokens for every text: checked on fresh random strings
    (the boundary the refusal relies on)."""
    from ninfer.models.qwen3_5.frontend.prompt import max_token_bytes
    tok = engine.frontend.tokenizer
    longest = max_token_bytes(tok)
    rng = np.random.default_rng()
    for _ in range(50):
        pieces = rng.choice([" ", "a", "é", "日本", "\n", "0123", "<|im_end|>", "🙂", " " * 64],
                            size=int(rng.integers(1, 400)))
        text = "".join(pieces)
        n = len(tok.encode(text))
        assert -(-len(text.encode()) // longest) <= n, text


# ---- chat templates -----------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
    "{{ 'x' * 200000000 }}",
    "{{ 'x'.center(10**10) }}",
    "{{ 'x'|center(10**9) }}",
    "{% set a = 'x' * 10000 %}{{ a|replace('x', a)|replace('x', a) }}",
    "{{ 10 ** 100000000 }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "{{ '%*d' % (1000000000, 1) }}",
], ids=["nested-loops", "output-size", "repeat", "center-method", "center-filter", "replace",
        "power", "plus-doubling", "tilde-doubling", "percent-width"])
def test_template_render_budget(source):
    template = ChatTemplate(source, time_budget_s=0.5, max_output_chars=1 << 20)
    t0 = time.monotonic()
    with pytest.raises(RequestError, match="render budget") as info:
        template.render(HI)
    assert info.value.code == "template_budget_exceeded"
    assert time.monotonic() - t0 < 30        # a failure here means the budget did not stop it


def test_builtin_template_fits_its_budget():
    big = [{"role": "user", "content": "word " * 200_000}] * 3
    out = ChatTemplate(builtin_template_source()).render(big, enable_thinking=False)
    assert out.count("word") == 600_000


def test_budget_lets_big_numbers_through_as_data():
    source = "{{ tools[0].maximum|tojson }} {{ tools[0].maximum|string }} {{ 'ab'.center(4) }}"
    out = ChatTemplate(source, max_output_chars=1 << 20).render(HI, tools=[{"maximum": 10**15}])
    assert out == "1000000000000000 1000000000000000  ab "
