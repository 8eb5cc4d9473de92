"""The Python API of issue 23 item 4 on the demo artifact (numpy): Engine.submit_n (n choices,
seed + i each, one prefill through the context cache), Engine.score beside generation (with
top_logprobs), Engine.embed (last-token pooling, normalised, Matryoshka dimensions) and the typed
errors of a backend that cannot."""
from __future__ import annotations

import numpy as np
import pytest

import ninfer
from ninfer.api import MAX_CHOICES, SamplingParams, choice_params
from ninfer.errors import EngineClosedError, NotSupportedError, RequestError

PROMPT = "Once upon a time " + " ".join(f"there was a tree number {i}" for i in range(8))


@pytest.fixture(scope="module")
def demo():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module")
def engine(demo):
    with ninfer.Engine(demo, max_context=1024) as e:
        yield e


def test_choice_params_seed_each_choice():
    base = SamplingParams(temperature=1.0, seed=10)
    assert [p.seed for p in choice_params(base, 3)] == [10, 11, 12]
    assert base.seed == 10                                        # the caller's copy untouched
    assert [p.seed for p in choice_params(SamplingParams(), 2)] == [None, None]
    top = SamplingParams(seed=(1 << 63) - 1)
    assert [p.seed for p in choice_params(top, 2)] == [(1 << 63) - 1, 0]   # stays 63-bit
    for n in (0, MAX_CHOICES + 1, 2.0, True):
        with pytest.raises(RequestError, match="number of choices"):
            choice_params(base, n)


def test_submit_n_shares_one_prefill_and_seeds_per_choice(engine):
    prompt = PROMPT + " (submit_n)"
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=321)
    results = [h.result(timeout=60) for h in engine.submit_n(prompt, params, n=3)]
    n_prompt = results[0].num_prompt_tokens
    assert n_prompt > 16
    # the first prefilled the prompt; the others started one token short of its end
    assert [r.num_cached_tokens for r in results] == [0, n_prompt - 1, n_prompt - 1]
    assert len({tuple(r.token_ids) for r in results}) > 1
    for i, r in enumerate(results):
        alone = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0,
                                                       seed=321 + i))
        assert alone.token_ids == r.token_ids


def test_share_prompt_leaves_a_checkpoint_one_token_short(engine):
    prompt = PROMPT + " (share_prompt)"
    greedy = SamplingParams(max_tokens=2)
    first = engine.submit(prompt, greedy, share_prompt=True).result(timeout=60)
    second = engine.generate(prompt, greedy)
    assert second.num_cached_tokens == first.num_prompt_tokens - 1
    assert second.token_ids == first.token_ids


def test_submit_n_bad_n_is_a_request_error(engine):
    with pytest.raises(RequestError, match="number of choices"):
        engine.submit_n("hi", SamplingParams(max_tokens=1), n=MAX_CHOICES + 1)
    (only,) = engine.submit_n("hi", SamplingParams(max_tokens=1), n=1)
    assert only.result(timeout=60).num_generated_tokens == 1


def test_score_beside_generation_equals_the_scoring_engine(engine, demo):
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog.")
    got = engine.score(ids, top_logprobs=2)
    with ninfer.Engine(demo, purpose="scoring") as scorer:
        want = scorer.score(ids, return_logits=True)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    assert len(got.top) == len(ids) - 1 and all(len(t) == 2 for t in got.top)
    for i, top in enumerate(got.top):
        row = want.logits[i].astype(np.float64)
        best = np.argsort(-row)[:2]
        assert [t for t, _ in top] == [int(t) for t in best]
        lse = row.max() + np.log(np.exp(row - row.max()).sum())
        np.testing.assert_allclose([v for _, v in top], row[best] - lse, atol=1e-5)
    with pytest.raises(RequestError, match="top_logprobs"):
        engine.score(ids, top_logprobs=21)


def test_embed_is_the_normalised_last_hidden_state(engine, demo):
    from ninfer.artifact import Artifact
    from ninfer.contracts import ForwardBatch
    from ninfer.models.qwen3_5 import load_model
    from ninfer.options import EngineOptions

    vecs = engine.embed(["a first text", "and a second, longer one"])
    H = engine.config.text.hidden_size
    assert vecs.shape == (2, H) and vecs.dtype == np.float32
    ids = engine.embedding_input_ids("a first text")
    assert ids[-1] == engine.frontend.token_id("<|endoftext|>")
    assert list(ids[:-1]) == list(engine.tokenize("a first text"))
    with Artifact(demo) as art:
        model = load_model(art, EngineOptions(purpose="scoring"))
        pages = -(-len(ids) // 16)
        hidden = model.final_hidden(ForwardBatch.single(ids, 0, np.arange(pages)),
                                    model.new_kv_pool(pages, 16), model.new_state_pool(1))[-1]
        model.close()
    np.testing.assert_allclose(vecs[0], hidden / np.linalg.norm(hidden), atol=1e-6)
    # one string, token ids, and Matryoshka truncation
    np.testing.assert_array_equal(engine.embed("a first text"), vecs[:1])
    np.testing.assert_array_equal(engine.embed(list(ids)), vecs[:1])
    short = engine.embed("a first text", dimensions=4)
    np.testing.assert_allclose(short[0], vecs[0, :4] / np.linalg.norm(vecs[0, :4]), atol=1e-6)


@pytest.mark.parametrize("inputs, kwargs, match", [
    ("", {}, "must not be empty"),
    ([], {}, "non-empty list"),
    ([[]], {}, "non-empty"),
    ([[1, -1]], {}, "outside the vocabulary"),
    ("x", {"dimensions": 0}, "dimensions"),
    ("x", {"dimensions": 10 ** 6}, "hidden size"),
    (["x"] * 2049, {}, "at most 2048"),
    ("word " * 1100, {}, "longer than the context"),
])
def test_embed_bad_input_is_a_request_error(engine, inputs, kwargs, match):
    with pytest.raises(RequestError, match=match):
        engine.embed(inputs, **kwargs)


def test_a_backend_that_cannot_says_so():
    from ninfer.options import EngineOptions
    from ninfer.runtime.scoring import CausalScoreCore, SideScorer

    class DeviceModel:              # what the CUDA model declares: no host pools, no hidden
        backend = "cuda"
        final_hidden = None
        config = type("C", (), {"text": type("T", (), {"vocab_size": 10})()})()

    with pytest.raises(NotSupportedError, match="numpy backend only") as info:
        SideScorer(DeviceModel(), EngineOptions()).embed([1, 2])
    assert info.value.status == 400 and info.value.code == "not_supported"
    with pytest.raises(NotSupportedError):
        SideScorer(DeviceModel(), EngineOptions()).score([1, 2])
    with pytest.raises(NotSupportedError, match="cuda backend does not return"):
        CausalScoreCore(DeviceModel(), EngineOptions()).embed([1, 2])


def test_closed_engine_refuses_embed_and_score(demo):
    e = ninfer.Engine(demo, max_context=256)
    e.close()
    with pytest.raises(EngineClosedError):
        e.embed("x")
    with pytest.raises(EngineClosedError):
        e.score([1, 2])
