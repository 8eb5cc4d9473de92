"""CausalScoreCore on a tiny in-process model: windowed scoring equals one-piece scoring and the
float64 log-softmax of the model's own logits; bad input raises RequestError. (Scoring converted
fixtures against transformers is in test_golden.py.)"""
from __future__ import annotations

import math

import numpy as np
import pytest

from ninfer import EngineOptions, RequestError, ScoreResult
from ninfer.contracts import ForwardBatch
from ninfer.runtime.scoring import CausalScoreCore
from test_model import draw_well_routed, rel_err, tiny_model

TOL_LOGPROB = dict(rtol=0, atol=1e-5)     # float32 log-softmax vs its float64 evaluation


def scorer(model, **options) -> CausalScoreCore:
    return CausalScoreCore(model, EngineOptions(**options))


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return tiny_model(request.param)


def _oracle_logprobs(logits, ids):
    out = []
    for t in range(len(ids) - 1):
        row = logits[t].astype(np.float64)
        m = row.max()
        lse = m + math.log(sum(math.exp(a - m) for a in row))
        out.append(row[ids[t + 1]] - lse)
    return np.array(out)


def test_score_matches_one_forward_and_float64_log_softmax(model):
    ids = np.random.default_rng().integers(0, model.config.text.vocab_size, size=30)
    res = scorer(model, prefill_chunk=512, page_size=4).score(ids, return_logits=True)
    assert isinstance(res, ScoreResult)
    assert res.logprobs.shape == (29,) and res.logprobs.dtype == np.float32
    assert res.logits.shape == (30, model.config.text.vocab_size) and res.logits.dtype == np.float32
    kv, st = model.new_kv_pool(8, 4), model.new_state_pool(1)
    direct = model.forward(ForwardBatch.single(ids, 0, np.arange(8)), kv, st, all_logits=True)
    np.testing.assert_array_equal(res.logits, direct)
    np.testing.assert_allclose(res.logprobs, _oracle_logprobs(res.logits, ids), **TOL_LOGPROB)
    assert np.all(res.logprobs <= 0)
    assert res.total_logprob == pytest.approx(float(np.sum(res.logprobs, dtype=np.float64)))


@pytest.mark.parametrize("window", [1, 2, 7, 64])
def test_windows_agree_with_one_piece(model, window):
    ids, one, tol = draw_well_routed(model, 70, lambda ids: scorer(
        model, prefill_chunk=512, page_size=16).score(ids, True))
    got = scorer(model, prefill_chunk=window, page_size=3).score(ids, True)
    assert rel_err(got.logits, one.logits) < tol
    np.testing.assert_allclose(got.logprobs, one.logprobs, rtol=0,
                               atol=2 * tol * float(np.max(np.abs(one.logits))))


def test_two_tokens_and_no_state_leaks_between_calls(model):
    V = model.config.text.vocab_size
    core = scorer(model, prefill_chunk=4, page_size=4)
    r = np.random.default_rng()
    a, b = r.integers(0, V, size=11), r.integers(0, V, size=2)
    first_b = core.score(b, return_logits=True)
    assert first_b.logprobs.shape == (1,)
    core.score(a)
    again_b = core.score(list(map(int, b)), return_logits=True)       # a plain list works too
    np.testing.assert_array_equal(first_b.logits, again_b.logits)
    np.testing.assert_array_equal(first_b.logprobs, again_b.logprobs)
    assert again_b.logits is not None and core.score(b).logits is None


@pytest.mark.parametrize("bad, what", [
    ([], "at least 2"),
    ([3], "at least 2"),
    ([1, -1, 2], "outside the vocabulary"),
    ([1, 61], "outside the vocabulary"),
    ([1.0, 2.0], "integers"),
    (np.array([[1, 2], [3, 4]]), "1-D"),
    (["a", "b"], "integers"),
    ([True, False], "integers"),
])
def test_bad_input_is_a_request_error(model, bad, what):
    core = scorer(model)
    with pytest.raises(RequestError, match=what):
        core.score(bad)


def test_scoring_engine_opens_an_artifact_without_tokenizer(tmp_path):
    """Scoring works from token ids alone; text input then fails with a clear RequestError."""
    import json

    from ninfer import Engine, RequestError
    from ninfer.convert import convert_checkpoint
    from ckpt_helpers import write_checkpoint

    src = tmp_path / "ckpt"
    write_checkpoint(src, "Qwen3_5ForCausalLM", frontend=False)
    assert not (src / "tokenizer.json").exists()
    out = convert_checkpoint(src, tmp_path / "m.ninfer", progress=False)
    with Engine(out, purpose="scoring") as engine:
        vocab = json.loads((src / "config.json").read_text())["vocab_size"]
        res = engine.score([1, 2, 3, vocab - 1])
        assert res.logprobs.shape == (3,) and (res.logprobs < 0).all()
        with pytest.raises(RequestError, match="no tokenizer"):
            engine.tokenize("hello")
