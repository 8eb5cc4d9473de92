"""EngineCore on the real numpy model (tiny random fixture via the converter): seeded sampling
is independent of batching and of pauses; logprobs are the raw model distribution."""
import numpy as np
import pytest

from fixture_utils import convert_fixture, load_reference

pytestmark = pytest.mark.timeout(300)

SEEDED = dict(temperature=0.8, top_p=0.95, top_k=50)
LOGPROB_ATOL = 2e-3        # numpy fp32 model vs transformers fp32 logits, after log_softmax


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return convert_fixture("dense", tmp_path_factory.mktemp("runtime_real"))


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 256, n).astype(np.int32) for n in (1, 6, 13, 29, 40, 3, 21, 9)]


def _params(i, **kw):
    from ninfer import SamplingParams
    return SamplingParams(max_tokens=12, ignore_eos=True, seed=100 + i, **{**SEEDED, **kw})


def _alone(path, prompts):
    from ninfer import Engine
    with Engine(path, max_concurrency=1) as engine:
        return [engine.generate(p, _params(i)).token_ids for i, p in enumerate(prompts)]


def test_seeded_concurrent_equals_alone(dense):
    from ninfer import Engine
    prompts = _prompts()
    want = _alone(dense, prompts)
    with Engine(dense, max_concurrency=8, prefill_chunk=7) as engine:
        handles = [engine.submit(p, _params(i)) for i, p in enumerate(prompts)]
        got = [h.result(timeout=120).token_ids for h in handles]
    assert got == want
    assert len({tuple(t) for t in got}) > 1


@pytest.mark.parametrize("snapshot_bytes", [0, 64 << 20], ids=["replay", "snapshot"])
def test_seeded_under_kv_pressure_equals_alone(dense, snapshot_bytes):
    from ninfer import Engine
    prompts = _prompts()
    want = _alone(dense, prompts)
    with Engine(dense, max_concurrency=4, max_context=56, page_size=8, num_kv_pages=8,
                prefill_chunk=8, host_snapshot_bytes=snapshot_bytes) as engine:
        handles = [engine.submit(p, _params(i)) for i, p in enumerate(prompts)]
        got = [h.result(timeout=120).token_ids for h in handles]
        stats = engine.stats()
    assert got == want
    assert stats["pauses"] > 0
    assert (stats["snapshot_resumes"] > 0) == (snapshot_bytes > 0)


def test_logprobs_are_the_raw_model_distribution(dense):
    from ninfer import Engine, SamplingParams
    ref = load_reference("dense")
    with Engine(dense, max_concurrency=2) as engine:
        for seq in ref.sequences[:3]:
            res = engine.generate(seq.ids, SamplingParams(max_tokens=1, logprobs=5,
                                                          temperature=1.5, seed=9))
            x = seq.logits[-1].astype(np.float64)
            want = x - x.max() - np.log(np.exp(x - x.max()).sum())
            lp = res.logprobs[0]
            assert lp.token_id == res.token_ids[0]
            assert lp.logprob == pytest.approx(want[lp.token_id], abs=LOGPROB_ATOL)
            assert [t for t, _ in lp.top] == list(np.argsort(-want, kind="stable")[:5])
            for t, v in lp.top:
                assert v == pytest.approx(want[t], abs=LOGPROB_ATOL)


def test_text_prompts_and_stop_strings_through_the_real_frontend(dense):
    from ninfer import Engine, Finished, GenerationStart, SamplingParams, TextDelta
    with Engine(dense, max_concurrency=2) as engine:
        free = SamplingParams(max_tokens=24, ignore_eos=True)
        events = list(engine.submit("hello there, model", free))
        assert isinstance(events[0], GenerationStart) and isinstance(events[-1], Finished)
        result = events[-1].result
        deltas = [e for e in events if isinstance(e, TextDelta)]
        assert [t for e in deltas for t in e.token_ids] == result.token_ids
        assert "".join(e.text for e in deltas if e.channel == "content") == result.text
        assert "".join(e.text for e in deltas if e.channel == "reasoning") == result.reasoning_text
        full = result.reasoning_text + result.text
        stop = next((full[i:i + 2] for i in range(4, len(full) - 2) if full[i:i + 2].strip()), None)
        if stop is None:
            pytest.skip("the random model wrote no usable text")
        stopped = engine.generate("hello there, model",
                                  SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
        assert stopped.finish_reason == "stop"
        assert stop not in stopped.reasoning_text + stopped.text
        assert stopped.token_ids == result.token_ids[:len(stopped.token_ids)]
        chat = engine.generate([{"role": "user", "content": "hi"}],
                               SamplingParams(max_tokens=4, ignore_eos=True), enable_thinking=False)
        assert chat.finish_reason == "length" and len(chat.token_ids) == 4


def test_closed_engine_raises_engine_closed(dense):
    """After close() (idempotent) generation and scoring raise EngineClosedError (a RequestError
    with HTTP status 503; EngineFailedError is for broken invariants), not a stale purpose
    message or an error from inside the released model."""
    from ninfer import Engine, EngineClosedError, EngineFailedError, RequestError, SamplingParams
    engine = Engine(dense, max_concurrency=1)
    assert engine.health == "ready"
    engine.close()
    engine.close()
    assert engine.health == "closed"
    with pytest.raises(EngineClosedError, match="closed") as info:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=1))
    assert isinstance(info.value, RequestError) and not isinstance(info.value, EngineFailedError)
    assert (info.value.status, info.value.code) == (503, "engine_closed")
    scorer = Engine(dense, purpose="scoring")
    scorer.close()
    with pytest.raises(EngineClosedError, match="closed"):
        scorer.score([1, 2, 3])


def test_engine_start_failure_releases_the_model(dense, monkeypatch):
    import ninfer.models.qwen3_5 as qwen
    from ninfer import Engine, RequestError
    real_load, closed = qwen.load_model, []

    def spying_load(artifact, options):
        model = real_load(artifact, options)
        real_close = model.close
        model.close = lambda: (closed.append(model), real_close())
        return model
    monkeypatch.setattr(qwen, "load_model", spying_load)
    with pytest.raises(RequestError, match="num_kv_pages"):
        Engine(dense, num_kv_pages=1)            # the Program refuses after the model loaded
    assert len(closed) == 1


def test_close_never_releases_the_model_under_a_running_unit(dense, monkeypatch):
    """If the worker is still inside a forward when the shutdown wait ends, close() must leave the
    model loaded (releasing it would crash the worker) and say so; the unit then finishes."""
    import threading

    from ninfer import Engine, SamplingParams
    engine = Engine(dense, max_concurrency=1)
    entered, release, closed = threading.Event(), threading.Event(), []
    real_forward, real_close = engine.model.forward, engine.model.close

    def slow_forward(*args, **kwargs):
        entered.set()
        release.wait(10)
        return real_forward(*args, **kwargs)
    monkeypatch.setattr(engine.model, "forward", slow_forward)
    monkeypatch.setattr(engine.model, "close", lambda: (closed.append(1), real_close()))
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    assert entered.wait(10)
    monkeypatch.setattr(engine._core, "shutdown",
                        lambda timeout=30.0, real=engine._core.shutdown: real(timeout=0.05))
    with pytest.warns(RuntimeWarning, match="did not stop in time"):
        engine.close()
    assert closed == []
    release.set()
    assert handle.result(timeout=10).finish_reason in ("cancelled", "length")
