"""logit_bias in the host sampler and the Program's choice of sampling path (the device sampler's
twin: tests/test_cuda_sampler_nogpu.py on the simulator, tests/gpu/test_sample_gpu.py)."""
import numpy as np

from ninfer.api import SamplingParams
from ninfer.contracts import SamplingSpec
from ninfer.models.qwen3_5.program.sampling import raw_logprobs, sample_row

V = 300
EMPTY = np.zeros(0, np.int32)


def _logits(seed=0):
    return np.random.default_rng(seed).standard_normal(V).astype(np.float32) * 2


def test_bias_decides_greedy_and_bans_in_sampling():
    x = _logits()
    low = int(np.argmin(x))
    spec = SamplingSpec(seed=1, logit_bias=((low, 100.0),))
    assert sample_row(x, spec, EMPTY, EMPTY, 5)[0] == low
    # -100 on the 10 best ids: none of them is ever drawn; without the bias they often are
    best = np.argsort(-x)[:10]
    banned = SamplingSpec(seed=2, temperature=1.0,
                          logit_bias=tuple((int(t), -100.0) for t in sorted(best)))
    free = SamplingSpec(seed=2, temperature=1.0)
    got = {sample_row(x, banned, EMPTY, EMPTY, p)[0] for p in range(300)}
    assert not got & set(best.tolist())
    assert {sample_row(x, free, EMPTY, EMPTY, p)[0] for p in range(300)} & set(best.tolist())


def test_bias_after_penalties_and_not_in_raw_logprobs():
    x = _logits(1)
    t = int(np.argmax(x))
    # repetition penalty 2 on t (a positive logit: halved), then +b: t stays best exactly when
    # x[t] / 2 + b beats the runner-up
    second = float(np.sort(x)[-2])
    b = second - x[t] / 2 + 1e-3
    spec = SamplingSpec(seed=0, repetition_penalty=2.0, logit_bias=((t, b),), logprobs=3)
    token, lp = sample_row(x, spec, np.array([t], np.int32), EMPTY, 0)
    assert token == t
    assert lp == raw_logprobs(x, t, 3)                   # raw: before penalty and bias
    spec2 = SamplingSpec(seed=0, repetition_penalty=2.0, logit_bias=((t, b - 2e-3),))
    assert sample_row(x, spec2, np.array([t], np.int32), EMPTY, 0)[0] != t


def test_spec_from_params_sorts_the_bias_and_leaves_plain_greedy():
    spec = SamplingSpec.from_params(SamplingParams(logit_bias={"7": -1.5, 2: 3}), seed=0)
    assert spec.logit_bias == ((2, 3.0), (7, -1.5))
    assert not spec.is_plain_greedy and SamplingSpec(seed=0).is_plain_greedy


def test_engine_applies_logit_bias(tmp_path):
    """Through the Engine (numpy): +100 on one id makes greedy produce only it; -100 on every id
    a seeded run produced keeps the same seeded run off all of them."""
    from fixture_utils import convert_fixture
    from ninfer import Engine
    path = convert_fixture("dense", tmp_path)
    prompt = np.random.default_rng(2).integers(3, 256, 9).astype(np.int32)
    with Engine(path, max_concurrency=2) as engine:
        forced = engine.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True,
                                                        logit_bias={17: 100.0})).token_ids
        seeded = dict(max_tokens=8, ignore_eos=True, temperature=1.0, seed=4)
        free = engine.generate(prompt, SamplingParams(**seeded)).token_ids
        banned = engine.generate(prompt, SamplingParams(
            **seeded, logit_bias={t: -100.0 for t in free})).token_ids
    assert forced == [17] * 5
    assert not set(banned) & set(free)
