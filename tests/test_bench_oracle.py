"""bench/bench_speculative.py's --oracle: acceptance set by hand, a probability per position or
an acceptance profile (the share of verifies that accept each draft position)."""
import pathlib
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from bench_speculative import _right, parse_oracle  # noqa: E402


def accepted_by_position(p, k: int, verifies: int, seed: int) -> np.ndarray:
    """The share of verifies that accept draft position j (1 .. k) under p: a verify accepts
    position j when drafts 1 .. j are all right."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(k)
    for _ in range(verifies):
        u = rng.random()
        right = [_right(p, u, rng, j) for j in range(k)]
        for j in range(k):
            if not all(right[:j + 1]):
                break
            counts[j] += 1
    return counts / verifies


def test_a_profile_is_the_acceptance_by_draft_position():
    profile = parse_oracle("0.76/0.40/0.25/0.09")
    assert profile == (0.76, 0.40, 0.25, 0.09)
    got = accepted_by_position(profile, 5, 20000, seed=1)
    # binomial standard error at 20,000 verifies <= 0.0036: 4 sigma
    np.testing.assert_allclose(got[:4], profile, atol=0.015)
    assert got[4] == 0.0            # past the profile every draft is wrong
    # tokens a verify at k = 3: 1 + the accepted shares (the reference models' 2.41)
    assert abs(1 + got[:3].sum() - 2.41) < 0.03


def test_a_probability_is_a_draw_per_position():
    p = parse_oracle("0.75")
    assert p == 0.75
    got = accepted_by_position(p, 3, 20000, seed=2)
    np.testing.assert_allclose(got, [0.75, 0.75 ** 2, 0.75 ** 3], atol=0.015)


@pytest.mark.parametrize("text", ["0.5/0.6", "1.2/0.5", "0.5/-0.1"])
def test_a_profile_that_is_not_shares_in_order_is_refused(text):
    with pytest.raises(SystemExit, match="non-increasing"):
        parse_oracle(text)
