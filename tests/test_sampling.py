"""The numpy sampling op against naive float64 oracles (semantics in program/sampling.py)."""
import math

import numpy as np
import pytest

from ninfer.api import SamplingParams
from ninfer.models.qwen3_5.program.sampling import (SamplingSpec, apply_penalties, counter_uniform,
                                                    draw, filtered_probs, raw_logprobs, sample_row)

V = 50
PROB_ATOL = 1e-12          # float64 filter arithmetic vs the loop oracle
LOGPROB_ATOL = 1e-6        # logprobs are returned as float32


def spec(**kw):
    return SamplingSpec(seed=kw.pop("seed", 1234), **kw)


# ---- oracles: straightforward loops, float64 ----------------------------------------------------
def oracle_penalties(logits, s, prompt, generated):
    out = [float(x) for x in logits]
    if s.repetition_penalty != 1.0:
        for t in set(list(prompt) + list(generated)):
            out[t] = out[t] / s.repetition_penalty if out[t] > 0 else out[t] * s.repetition_penalty
    for t in set(generated):
        c = list(generated).count(t)
        out[t] -= s.frequency_penalty * c + s.presence_penalty
    return np.array(out)


def oracle_filter(z, s):
    z = [x / s.temperature for x in z]
    ranked = sorted(range(len(z)), key=lambda i: (-z[i], i))
    if s.top_k > 0:
        ranked = ranked[:s.top_k]
    m = max(z[i] for i in ranked)
    w = {i: math.exp(z[i] - m) for i in ranked}
    total = sum(w.values())
    p = {i: w[i] / total for i in ranked}
    if s.top_p < 1.0:
        kept, cum = [], 0.0
        for i in ranked:
            kept.append(i)
            cum += p[i]
            if cum >= s.top_p:
                break
        ranked = kept
    if s.min_p > 0:
        best = p[ranked[0]]
        ranked = [i for i in ranked if p[i] >= s.min_p * best]
    total = sum(p[i] for i in ranked)
    out = np.zeros(len(z))
    for i in ranked:
        out[i] = p[i] / total
    return out


FILTER_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    dict(temperature=2.0, top_k=1),
    dict(temperature=1.0, top_k=V),
    dict(temperature=1.0, top_p=1e-9),
    dict(temperature=0.5, top_k=V + 7, top_p=0.999),
]


@pytest.mark.parametrize("case", FILTER_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filters_match_oracle(case, seed):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(V) * 2.5
    got = filtered_probs(z, spec(**case))
    want = oracle_filter(z, spec(**case))
    np.testing.assert_allclose(got, want, atol=PROB_ATOL, rtol=0)
    assert got.sum() == pytest.approx(1.0, abs=1e-12)


def test_filters_break_ties_by_lower_id():
    z = np.zeros(8)
    z[[2, 5, 6]] = 1.0                   # three-way tie at the top
    got = filtered_probs(z, spec(temperature=1.0, top_k=2))
    assert set(np.flatnonzero(got)) == {2, 5}
    np.testing.assert_allclose(got, oracle_filter(z, spec(temperature=1.0, top_k=2)), atol=PROB_ATOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_penalties_match_oracle(seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    prompt = rng.integers(0, V, 12)
    generated = rng.integers(0, V, 20)
    s = spec(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=-0.3)
    np.testing.assert_allclose(apply_penalties(logits, s, prompt, generated),
                               oracle_penalties(logits, s, prompt, generated), atol=1e-12, rtol=0)


def test_presence_frequency_ignore_prompt_tokens():
    logits = np.zeros(V, np.float32)
    out = apply_penalties(logits, spec(presence_penalty=1.0, frequency_penalty=1.0),
                          np.array([3, 3, 4]), np.array([7, 7, 7], np.int32))
    assert out[3] == 0 and out[4] == 0 and out[7] == -4.0


def test_greedy_is_argmax_of_penalised_logits():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(V).astype(np.float32)
    top = int(np.argmax(logits))
    assert sample_row(logits, spec(), np.array([1]), np.array([], np.int32), 9)[0] == top
    # a strong repetition penalty on the argmax (it is in the prompt) moves greedy elsewhere
    s = spec(repetition_penalty=100.0)
    token, _ = sample_row(logits, s, np.array([top]), np.array([], np.int32), 9)
    assert token == int(np.argmax(oracle_penalties(logits, s, [top], [])))
    assert token != top or logits[top] <= 0


@pytest.mark.parametrize("case", [dict(temperature=1.0, top_k=1), dict(temperature=3.0, top_p=1e-6),
                                  dict(temperature=1.0, min_p=1.0)])
def test_degenerate_filters_always_give_argmax(case):
    rng = np.random.default_rng(7)
    for position in range(200):
        logits = rng.standard_normal(V).astype(np.float32)
        token, _ = sample_row(logits, spec(**case), np.array([1]), np.array([], np.int32), position)
        assert token == int(np.argmax(logits))


def test_counter_uniform_is_a_function_of_seed_and_position():
    assert counter_uniform(7, 3) == counter_uniform(7, 3)
    values = np.array([counter_uniform(7, p) for p in range(20000)])
    assert values.min() >= 0.0 and values.max() < 1.0
    assert len(np.unique(values)) == len(values)
    assert counter_uniform(8, 3) != counter_uniform(7, 3)
    # roughly uniform: 20 bins of 1000 expected each; 5 sigma ~ 155
    counts = np.histogram(values, bins=20, range=(0, 1))[0]
    assert np.all(np.abs(counts - 1000) < 155), counts
    # neighbouring positions are not correlated
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.05


def test_draw_frequencies_match_probabilities():
    probs = np.array([0.0, 0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625])
    n = 20000
    draws = np.array([draw(probs, counter_uniform(99, p)) for p in range(n)])
    freq = np.bincount(draws, minlength=len(probs)) / n
    sigma = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-12), (freq, probs)
    assert freq[0] == freq[3] == 0.0


def test_sampled_frequencies_over_seeds_follow_the_filtered_distribution():
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(12) * 1.5).astype(np.float32)
    s_kw = dict(temperature=0.8, top_k=6, top_p=0.9)
    want = oracle_filter(logits.astype(np.float64), spec(**s_kw))
    n = 6000
    draws = np.array([sample_row(logits, spec(seed=seed, **s_kw), np.array([1]),
                                 np.array([], np.int32), 17)[0] for seed in range(n)])
    freq = np.bincount(draws, minlength=12) / n
    sigma = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-12), (freq, want)
    assert np.all(freq[want == 0] == 0)


def test_raw_logprobs_and_top_n():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    logits[10] = logits[11] = logits.max() + 1      # tie at the top: lower id first
    x = logits.astype(np.float64)
    want = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    lp = raw_logprobs(logits, 4, 5)
    assert lp.token_id == 4 and lp.logprob == pytest.approx(want[4], abs=LOGPROB_ATOL)
    order = sorted(range(V), key=lambda i: (-want[i], i))[:5]
    assert [t for t, _ in lp.top] == order
    for t, v in lp.top:
        assert v == pytest.approx(want[t], abs=LOGPROB_ATOL)
    assert raw_logprobs(logits, 4, 0).top == ()


def test_logprobs_come_from_the_raw_distribution_not_the_penalised_one():
    logits = np.linspace(-1, 1, V).astype(np.float32)
    s = spec(temperature=0.5, repetition_penalty=3.0, logprobs=2)
    token, lp = sample_row(logits, s, np.array([V - 1]), np.array([], np.int32), 0)
    assert lp.logprob == pytest.approx(raw_logprobs(logits, token, 0).logprob, abs=1e-9)
    assert lp.top[0][0] == V - 1


def test_spec_from_params_keeps_every_field():
    p = SamplingParams(temperature=0.3, top_k=4, top_p=0.5, min_p=0.1, presence_penalty=0.2,
                       frequency_penalty=0.1, repetition_penalty=1.1, logprobs=3)
    s = SamplingSpec.from_params(p, seed=42)
    assert (s.seed, s.temperature, s.top_k, s.top_p, s.min_p, s.presence_penalty,
            s.frequency_penalty, s.repetition_penalty, s.logprobs) == \
        (42, 0.3, 4, 0.5, 0.1, 0.2, 0.1, 1.1, 3)


@pytest.mark.parametrize("case", [dict(temperature=1.0, top_p=0.95), dict(temperature=0.3, top_p=0.5),
                                  dict(temperature=5.0, top_p=0.999), dict(temperature=1.0, top_k=700),
                                  dict(temperature=1.0, min_p=0.01)])
def test_large_vocab_window_matches_the_full_sort_oracle(case):
    # vocab 5000 > the 1024-token top-p window: both the windowed path and its fallback
    rng = np.random.default_rng(21)
    z = rng.standard_normal(5000) * 1.5
    z[100:110] = z.max()                                   # ties at the top
    want = oracle_filter(z, spec(**case))
    np.testing.assert_allclose(filtered_probs(z, spec(**case)), want, atol=PROB_ATOL, rtol=0)


@pytest.mark.parametrize("case", [dict(temperature=1.0, top_p=0.9), dict(temperature=2.0, top_p=0.5),
                                  dict(temperature=1.0, top_p=0.9, min_p=0.3),
                                  dict(temperature=1.0, top_p=1 - 1e-12)])
@pytest.mark.parametrize("seed", [0, 1])
def test_wide_nucleus_matches_the_full_sort_oracle(case, seed):
    """Nuclei far wider than the sorted window take the bucketed path: ties straddling the
    cut (coarse logits), a long tail below the finely bucketed log-prob span, top_p ~ 1."""
    rng = np.random.default_rng(seed)
    z = np.round(rng.standard_normal(20000) * 0.6, 2)      # many exact ties in the nucleus
    z[:5] += 8.0                                            # a head ...
    z[-3000:] -= 80.0                                       # ... and a tail e^-80 below it
    want = oracle_filter(z, spec(**case))
    np.testing.assert_allclose(filtered_probs(z, spec(**case)), want, atol=PROB_ATOL, rtol=0)
