"""The MoE prefill's routed-row layout (ninfer/models/qwen3_5/cuda/moe_rows.py), on the host.

The layout is checked by what the GPU path does with it: gather x rows by `src`, run one strided
batch over the padded block plus one product per overflow expert, read each pair's output through
`row_of_pair`. Emulated here in float64 with per-expert matrices, it must equal the direct
per-pair product, whatever cap the chooser or the test picks."""
import numpy as np
import pytest

from ninfer.models.qwen3_5.cuda import moe_rows as mr
from ninfer.models.qwen3_5.cuda.runner import grouped_rows


def _route(rng, n, E, K, skew=0.0):
    p = np.exp(skew * rng.standard_normal(E))
    p /= p.sum()
    return np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(n)]).reshape(-1)


def _emulate(lay, ids, x, W, K):
    """y[pair] through the layout: block products, overflow products, then the pair map."""
    E = W.shape[0]
    rows = np.full((lay.rows, W.shape[1]), np.nan)
    xg = x[lay.src]                                    # gather (padding rows read token 0)
    c = lay.cap
    for e in range(E):                                 # the strided batch: every expert, cap rows
        rows[e * c:(e + 1) * c] = xg[e * c:(e + 1) * c] @ W[e].T
    for e, r0, cnt in lay.overflow:
        rows[r0:r0 + cnt] = xg[r0:r0 + cnt] @ W[e].T
    return rows[lay.row_of_pair]


@pytest.mark.parametrize("n,E,K,skew,cap", [(1, 8, 2, 0.0, None), (37, 8, 2, 0.0, None),
                                            (200, 16, 4, 2.0, None), (64, 8, 8, 0.0, None),
                                            (50, 8, 2, 0.0, 0), (50, 8, 2, 0.0, 16),
                                            (300, 32, 4, 3.0, 16), (5, 64, 8, 0.0, None)])
def test_layout_reproduces_the_per_pair_products(n, E, K, skew, cap):
    rng = np.random.default_rng(n * 131 + E)
    ids = _route(rng, n, E, K, skew)
    H, N = 6, 5
    x = rng.standard_normal((n, H))
    W = rng.standard_normal((E, N, H))
    lay = mr.expert_rows(ids, K, E, grouped_rows(n, K, E), cap=cap)
    want = np.einsum("ph,pnh->pn", x[np.arange(n * K) // K], W[ids])
    got = _emulate(lay, ids, x, W, K)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    # every pair has its own row, inside its expert's block slot or its overflow range
    assert len(np.unique(lay.row_of_pair)) == n * K
    counts = np.bincount(ids, minlength=E)
    assert lay.rows == E * lay.cap + sum(max(0, int(c) - lay.cap) for c in counts)
    assert [e for e, _, _ in lay.overflow] == [e for e in range(E) if counts[e] > lay.cap]
    if cap is not None:
        assert lay.cap == cap


def test_chooser_prefers_one_batch_for_balanced_routing_and_overflow_for_a_hot_expert():
    rng = np.random.default_rng(7)
    E, K, n = 256, 8, 4096
    ids = _route(rng, n, E, K)
    lay = mr.expert_rows(ids, K, E, grouped_rows(n, K, E))
    counts = np.bincount(ids, minlength=E)
    assert lay.cap >= 16 and lay.rows <= 1.5 * n * K and len(lay.overflow) <= 8
    # one expert gets a tenth of the pairs: it overflows rather than padding every expert to it
    hot = ids.copy()
    hot[: n * K // 10] = 3
    counts = np.bincount(hot, minlength=E)
    lay = mr.expert_rows(hot, K, E, grouped_rows(n, K, E))
    assert 3 in [e for e, _, _ in lay.overflow] and lay.cap < counts[3]
    assert lay.rows <= grouped_rows(n, K, E)


def test_chooser_respects_the_row_budget_and_falls_back_to_per_expert_products():
    counts = np.array([40, 1, 1, 1])
    # a block of 48 rows per expert needs 192 rows: over a budget of 60 rows -> no block at all
    assert mr.choose_cap(counts, max_rows=60, launch_rows=10**6) in (0, 16)
    assert mr.choose_cap(counts, max_rows=43, launch_rows=10**6) == 0
    # launches free: padding never pays
    assert mr.choose_cap(counts, max_rows=10**6, launch_rows=0) == 0
    # launches expensive, room enough: one batch covering the hot expert
    assert mr.choose_cap(counts, max_rows=10**6, launch_rows=10**6) == 48


def test_bad_router_ids_are_rejected():
    with pytest.raises(ValueError, match="outside"):
        mr.expert_rows(np.array([0, 9]), 2, 8, 100)
    with pytest.raises(ValueError, match="top-2"):
        mr.expert_rows(np.array([0, 1, 2]), 2, 8, 100)
    with pytest.raises(ValueError, match="exceed"):
        mr.expert_rows(np.array([0, 0, 0, 0]), 2, 8, 10, cap=16)
