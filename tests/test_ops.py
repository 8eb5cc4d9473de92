"""numpy ops vs naive float64 oracles written independently here (loops and direct formulas).

Each test draws fresh random inputs (the seed is printed on failure through the parametrised id)."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from ninfer import ops
from ninfer.ops.attention import kv_slot_mapping

# float32 compute checked against float64 truth
TOL_FP32 = dict(rtol=1e-5, atol=1e-6)        # one rounding per element plus a short reduction
TOL_ACCUM = dict(rtol=1e-4, atol=2e-5)       # long reductions / recurrences in float32
TOL_ANGLE = dict(rtol=1e-5, atol=5e-5)       # float32 rotary angles (position * inv_freq)
MAX_REL_DELTA_DEEP = 5e-6                    # chunked delta rule after a deep cumulative decay

SEEDS = [int(s) for s in np.random.SeedSequence().generate_state(2)]


def rng_for(seed):
    return np.random.default_rng(seed)


def f32(x):
    return np.asarray(x, dtype=np.float32)


# ---- elementwise -------------------------------------------------------------------------------

def test_activations_extremes_and_values():
    x = np.array([-1000.0, -100.0, -20.5, -1.0, 0.0, 0.3, 1.0, 20.5, 100.0, 1000.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no overflow warnings at the extremes
        sg, sl, sp = ops.sigmoid(x), ops.silu(x), ops.softplus(x)
    for i, xi in enumerate(x.astype(np.float64)):
        ref_sg = 1.0 / (1.0 + math.exp(-xi)) if xi > -700 else 0.0
        ref_sp = math.log1p(math.exp(xi)) if xi < 700 else xi
        assert sg[i] == pytest.approx(ref_sg, rel=1e-6, abs=1e-30)
        assert sl[i] == pytest.approx(xi * ref_sg, rel=1e-6, abs=1e-30)
        assert sp[i] == pytest.approx(ref_sp, rel=1e-6, abs=1e-30)
    assert sg.dtype == sl.dtype == sp.dtype == np.float32


@pytest.mark.parametrize("seed", SEEDS)
def test_linear_and_swiglu(seed):
    r = rng_for(seed)
    x, wg, wu, wd = f32(r.normal(size=(5, 12))), f32(r.normal(size=(7, 12))), \
        f32(r.normal(size=(7, 12))), f32(r.normal(size=(12, 7)))
    ref = np.zeros((5, 12))
    for t in range(5):
        hidden = []
        for j in range(7):
            gsum = sum(float(x[t, i]) * float(wg[j, i]) for i in range(12))
            usum = sum(float(x[t, i]) * float(wu[j, i]) for i in range(12))
            hidden.append(gsum / (1 + math.exp(-gsum)) * usum)
        for o in range(12):
            ref[t, o] = sum(hidden[j] * float(wd[o, j]) for j in range(7))
    np.testing.assert_allclose(ops.swiglu(x, wg, wu, wd), ref, **TOL_ACCUM)
    b = f32(r.normal(size=7))
    np.testing.assert_allclose(ops.linear(x, wg, b), x.astype(np.float64) @ wg.T.astype(np.float64) + b,
                               **TOL_FP32)


# ---- norms -------------------------------------------------------------------------------------

def _rms64(row, eps):
    row = [float(v) for v in row]
    return 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_zero_centred(seed, eps):
    r = rng_for(seed)
    x, w = f32(r.normal(size=(3, 4, 33)) * 5), f32(r.normal(size=33))
    got = ops.rmsnorm_zero_centred(x, w, eps)
    ref = np.empty(x.shape)
    for idx in np.ndindex(x.shape[:-1]):
        inv = _rms64(x[idx], eps)
        ref[idx] = [float(x[idx][i]) * inv * (1.0 + float(w[i])) for i in range(33)]
    np.testing.assert_allclose(got, ref, **TOL_FP32)
    # a zero weight is the identity scale (the stored weight is centred on 0, not 1)
    np.testing.assert_allclose(ops.rmsnorm_zero_centred(x, np.zeros(33, np.float32), eps),
                               ref / (1.0 + w.astype(np.float64)), **TOL_FP32)


@pytest.mark.parametrize("seed", SEEDS)
def test_rmsnorm_gated(seed):
    r = rng_for(seed)
    x, z, w = f32(r.normal(size=(6, 2, 10))), f32(r.normal(size=(6, 2, 10)) * 4), f32(r.normal(size=10))
    eps = 1e-6
    ref = np.empty(x.shape)
    for idx in np.ndindex(x.shape[:-1]):
        inv = _rms64(x[idx], eps)
        for i in range(10):
            zi = float(z[idx][i])
            ref[idx + (i,)] = float(w[i]) * float(x[idx][i]) * inv * zi / (1 + math.exp(-zi))
    np.testing.assert_allclose(ops.rmsnorm_gated(x, z, w, eps), ref, **TOL_FP32)


@pytest.mark.parametrize("seed", SEEDS)
def test_l2norm(seed):
    r = rng_for(seed)
    x = f32(r.normal(size=(4, 3, 16)))
    x[0, 0] = 0.0                               # a zero vector stays finite (eps inside the root)
    got = ops.l2norm(x, 1e-6)
    for idx in np.ndindex(x.shape[:-1]):
        v = [float(a) for a in x[idx]]
        inv = 1.0 / math.sqrt(sum(a * a for a in v) + 1e-6)
        np.testing.assert_allclose(got[idx], [a * inv for a in v], **TOL_FP32)
    assert np.all(got[0, 0] == 0)


# ---- causal conv1d -----------------------------------------------------------------------------

def _conv_oracle(x_all, w):
    """Whole sequence from a zero history: y[t, c] = sum_j w[c, j] * x[t - (K-1) + j, c]."""
    T, C = x_all.shape
    K = w.shape[1]
    y = np.zeros((T, C))
    for t in range(T):
        for c in range(C):
            for j in range(K):
                src = t - (K - 1) + j
                if src >= 0:
                    y[t, c] += float(w[c, j]) * float(x_all[src, c])
    return y


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("splits", [(9,), (1, 1, 1, 6), (2, 7), (3, 1, 5)])
def test_causal_conv1d_prefill_split_and_steps(seed, K, splits):
    r = rng_for(seed)
    T, C = sum(splits), 6
    x, w = f32(r.normal(size=(T, C))), f32(r.normal(size=(C, K)))
    ref = _conv_oracle(x, w)
    state = np.zeros((C, K - 1), np.float32)
    outs, start = [], 0
    for n in splits:
        y, state = ops.causal_conv1d(x[start:start + n], state, w)
        outs.append(y)
        start += n
    np.testing.assert_allclose(np.concatenate(outs), ref, **TOL_FP32)
    # the state holds the last K-1 inputs, oldest first
    np.testing.assert_array_equal(state, x[T - (K - 1):].T)


def test_causal_conv1d_short_input_keeps_older_history():
    C, K = 3, 4
    w = f32(np.arange(C * K).reshape(C, K) / 7)
    hist = f32(np.arange(C * (K - 1)).reshape(C, K - 1) + 1)
    x = f32([[10.0, 20.0, 30.0]])
    y, st = ops.causal_conv1d(x, hist, w)
    for c in range(C):
        window = list(hist[c]) + [x[0, c]]
        assert y[0, c] == pytest.approx(sum(float(w[c, j]) * float(window[j]) for j in range(K)))
    np.testing.assert_array_equal(st, np.concatenate([hist[:, 1:], x.T], axis=1))


# ---- gated delta rule --------------------------------------------------------------------------

def _delta_oracle(q, k, v, g, beta, S0):
    """Per head, per token, in float64 with explicit outer products."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    S = S0.astype(np.float64).copy()
    out = np.zeros((T, H, dv))
    for t in range(T):
        for h in range(H):
            S[h] *= math.exp(float(g[t, h]))
            pred = S[h].T @ k[t, h].astype(np.float64)                 # what S recalls for k
            delta = float(beta[t, h]) * (v[t, h].astype(np.float64) - pred)
            S[h] += np.outer(k[t, h].astype(np.float64), delta)
            out[t, h] = S[h].T @ q[t, h].astype(np.float64)
    return out, S


def _delta_inputs(r, T, H=3, dk=8, dv=5, strong_decay=False):
    q = r.normal(size=(T, H, dk))
    k = r.normal(size=(T, H, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / math.sqrt(dk)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.normal(size=(T, H, dv))
    g = -r.uniform(0, 30 if strong_decay else 0.5, size=(T, H))
    beta = r.uniform(0, 1, size=(T, H))
    return [f32(a) for a in (q, k, v, g, beta)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("chunk,T", [(8, 1), (8, 7), (8, 8), (8, 9), (8, 19), (64, 63), (64, 64),
                                     (64, 65)])
@pytest.mark.parametrize("nonzero_state", [False, True])
def test_gated_delta_chunked_and_recurrent_vs_oracle(seed, chunk, T, nonzero_state):
    r = rng_for(seed)
    q, k, v, g, beta = _delta_inputs(r, T)
    S0 = f32(r.normal(size=(3, 8, 5))) if nonzero_state else np.zeros((3, 8, 5), np.float32)
    ref_o, ref_S = _delta_oracle(q, k, v, g, beta, S0)
    S0_copy = S0.copy()
    o_c, S_c = ops.gated_delta_chunked(q, k, v, g, beta, S0, chunk_size=chunk)
    o_r, S_r = ops.gated_delta_recurrent(q, k, v, g, beta, S0)
    np.testing.assert_array_equal(S0, S0_copy)                    # inputs are not mutated
    for o, S in ((o_c, S_c), (o_r, S_r)):
        assert o.dtype == np.float32 and S.dtype == np.float32
        np.testing.assert_allclose(o, ref_o, **TOL_ACCUM)
        np.testing.assert_allclose(S, ref_S, **TOL_ACCUM)


@pytest.mark.parametrize("seed", SEEDS)
def test_gated_delta_chunked_continues_across_calls_and_strong_decay(seed):
    r = rng_for(seed)
    T = 40
    q, k, v, g, beta = _delta_inputs(r, T, strong_decay=True)
    ref_o, ref_S = _delta_oracle(q, k, v, g, beta, np.zeros((3, 8, 5)))
    S = np.zeros((3, 8, 5), np.float32)
    outs = []
    for a, b in ((0, 13), (13, 14), (14, 40)):
        fn = ops.gated_delta_recurrent if b - a == 1 else ops.gated_delta_chunked
        o, S = fn(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], S)
        outs.append(o)
    o = np.concatenate(outs)
    assert np.all(np.isfinite(o))
    np.testing.assert_allclose(o, ref_o, **TOL_ACCUM)
    np.testing.assert_allclose(S, ref_S, **TOL_ACCUM)


@pytest.mark.parametrize("seed", SEEDS)
def test_gated_delta_chunked_keeps_accuracy_after_deep_decay(seed):
    # Strong decay first (the cumulative log decay reaches about -1000), then slow decay over
    # repeated keys: the later pairs' decay factors are exp of a small difference of two large
    # cumulative sums, which float32 cumsums would get wrong by ~5e-5.
    r = rng_for(seed)
    T, H = 64, 2
    q, k, v, _, _ = _delta_inputs(r, T, H, 8, 4)
    k = np.tile(k[:3], (22, 1, 1))[:T]
    g = f32(-np.concatenate([r.uniform(20, 40, size=(32, H)), r.uniform(0, 0.05, size=(32, H))]))
    beta = np.full((T, H), 0.9, np.float32)
    ref_o, _ = _delta_oracle(q, k, v, g, beta, np.zeros((H, 8, 4)))
    o, _ = ops.gated_delta_chunked(q, k, v, g, beta, np.zeros((H, 8, 4), np.float32), chunk_size=64)
    assert np.max(np.abs(o - ref_o)) / np.max(np.abs(ref_o)) < MAX_REL_DELTA_DEEP


def test_gated_delta_empty_input_keeps_state():
    S0 = f32(np.random.default_rng().normal(size=(2, 4, 3)))
    empty_k, empty_v, empty_g = np.zeros((0, 2, 4), np.float32), np.zeros((0, 2, 3), np.float32), \
        np.zeros((0, 2), np.float32)
    for fn in (ops.gated_delta_chunked, ops.gated_delta_recurrent):
        o, S = fn(empty_k, empty_k, empty_v, empty_g, empty_g, S0)
        assert o.shape == (0, 2, 3)
        np.testing.assert_array_equal(S, S0)


# ---- rotary / MRoPE ----------------------------------------------------------------------------

def _axis_table(half, section, interleaved):
    """Frequency index -> position axis (0 t, 1 h, 2 w), built the way the reference does."""
    if interleaved:
        table = [0] * half
        for j in range(1, 3 * section[1], 3):
            if j < half:
                table[j] = 1
        for j in range(2, 3 * section[2], 3):
            if j < half:
                table[j] = 2
        return table
    return [0] * section[0] + [1] * section[1] + [2] * (half - section[0] - section[1])


def _rope_oracle(x, pos3, rd, theta, section, interleaved):
    N, H, hd = x.shape
    half = rd // 2
    table = _axis_table(half, section, interleaved)
    out = x.astype(np.float64).copy()
    for t in range(N):
        for j in range(half):
            ang = float(pos3[table[j], t]) * theta ** (-2.0 * j / rd)
            c, s = math.cos(ang), math.sin(ang)
            for h in range(H):
                a, b = float(x[t, h, j]), float(x[t, h, j + half])
                out[t, h, j] = a * c - b * s
                out[t, h, j + half] = b * c + a * s
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("hd,rd,section", [(16, 8, (2, 1, 1)), (20, 12, (2, 2, 2)),
                                           (32, 16, (3, 3, 2)), (12, 12, (2, 2, 2)),
                                           (16, 16, (4, 1, 3))])
def test_mrope_distinct_positions(seed, interleaved, hd, rd, section):
    r = rng_for(seed)
    N, H = 7, 3
    x = f32(r.normal(size=(N, H, hd)))
    pos3 = r.integers(0, 120, size=(3, N))                     # t, h, w all different
    cos, sin = ops.mrope_cos_sin(pos3, rd, 10000.0, section, interleaved)
    got = ops.apply_rotary(x, cos, sin)
    np.testing.assert_allclose(got, _rope_oracle(x, pos3, rd, 10000.0, section, interleaved),
                               **TOL_ANGLE)
    np.testing.assert_array_equal(got[..., rd:], x[..., rd:])    # the pass-through part


def test_mrope_real_layout_axis_assignment():
    # Qwen3.5's (11, 11, 10) over 32 frequencies: t at 0,3,..,30 ; h at 1,4,..,31 ; w at 2,5,..,29
    from ninfer.ops.rotary import mrope_axis_of_frequency
    axis = mrope_axis_of_frequency(32, (11, 11, 10), True)
    assert list(np.nonzero(axis == 1)[0]) == list(range(1, 32, 3))
    assert list(np.nonzero(axis == 2)[0]) == list(range(2, 30, 3))
    assert list(np.nonzero(axis == 0)[0]) == list(range(0, 31, 3))
    assert axis.tolist() == _axis_table(32, (11, 11, 10), True)


def test_text_positions_reduce_to_plain_rope():
    r = np.random.default_rng()
    x = f32(r.normal(size=(5, 2, 16)))
    p = np.arange(3, 8)
    cos, sin = ops.mrope_cos_sin(np.stack([p, p, p]), 16, 500.0, (3, 3, 2), True)
    np.testing.assert_allclose(ops.apply_rotary(x, cos, sin),
                               _rope_oracle(x, np.stack([p] * 3), 16, 500.0, (8, 0, 0), False),
                               **TOL_ANGLE)


# ---- paged attention ---------------------------------------------------------------------------

def _attention_oracle(q_row, k_hist, v_hist, ctx, scale, group):
    """q_row [n, Hq, hd]; k_hist/v_hist [ctx+n, Hkv, hd] (the row's whole history)."""
    n, Hq, hd = q_row.shape
    out = np.zeros((n, Hq, hd))
    for i in range(n):
        visible = ctx + i + 1
        for h in range(Hq):
            kvh = h // group
            s = [scale * float(np.dot(q_row[i, h].astype(np.float64), k_hist[j, kvh].astype(np.float64)))
                 for j in range(visible)]
            m = max(s)
            e = [math.exp(a - m) for a in s]
            z = sum(e)
            out[i, h] = sum((e[j] / z) * v_hist[j, kvh].astype(np.float64) for j in range(visible))
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b", [1, 4])
def test_paged_attention_gqa_rows_and_page_boundaries(seed, b):
    r = rng_for(seed)
    Hq, Hkv, hd = 6, 2, 8
    group = Hq // Hkv
    # (context_len, new tokens): totals land on b-1, b, b+1 and several pages; decode and prefill
    rows = [(0, b - 1 if b > 1 else 1), (b - 1, 1), (0, b), (b, 1), (b - 1, 2), (2 * b, b + 1)]
    num_pages = sum(-(-(c + n) // b) for c, n in rows) + 3
    k_pool = np.full((num_pages, b, Hkv, hd), np.nan, np.float32)   # unread slots stay NaN
    v_pool = np.full((num_pages, b, Hkv, hd), np.nan, np.float32)
    free = list(r.permutation(num_pages))
    P = max(-(-(c + n) // b) for c, n in rows)
    tables = np.full((len(rows), P), -1, np.int32)
    hist_k, hist_v = [], []
    for i, (c, n) in enumerate(rows):
        need = -(-(c + n) // b)
        tables[i, :need] = [free.pop() for _ in range(need)]
        hist_k.append(f32(r.normal(size=(c + n, Hkv, hd))))
        hist_v.append(f32(r.normal(size=(c + n, Hkv, hd))))
        # the context part is already in the pool (written by an earlier call)
        if c:
            pg, off = kv_slot_mapping(tables[i:i + 1], [0], [0, c], b)
            ops.write_paged_kv(k_pool, v_pool, hist_k[i][:c], hist_v[i][:c], pg, off)
    ctx = np.array([c for c, _ in rows], np.int32)
    qs = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int32)
    pages, offsets = kv_slot_mapping(tables, ctx, qs, b)
    new_k = np.concatenate([hist_k[i][c:] for i, (c, _) in enumerate(rows)])
    new_v = np.concatenate([hist_v[i][c:] for i, (c, _) in enumerate(rows)])
    ops.write_paged_kv(k_pool, v_pool, new_k, new_v, pages, offsets)
    q = f32(r.normal(size=(qs[-1], Hq, hd)))
    scale = 1 / math.sqrt(hd)
    got = ops.paged_attention(q, k_pool, v_pool, tables, ctx, qs, scale)
    for i, (c, n) in enumerate(rows):
        ref = _attention_oracle(q[qs[i]:qs[i + 1]], hist_k[i], hist_v[i], c, scale, group)
        np.testing.assert_allclose(got[qs[i]:qs[i + 1]], ref, **TOL_ACCUM)


def test_kv_slot_mapping_positions():
    tables = np.array([[5, 2, 7], [1, 0, -1]], np.int32)
    pages, offsets = kv_slot_mapping(tables, [3, 0], [0, 3, 5], 2)
    # row 0: positions 3, 4, 5 -> (page 2, 1), (page 7, 0), (page 7, 1); row 1: 0, 1 -> page 1
    assert pages.tolist() == [2, 7, 7, 1, 1]
    assert offsets.tolist() == [1, 0, 1, 0, 1]


# ---- MoE ---------------------------------------------------------------------------------------

def _route_oracle(logits, k, normalize):
    out_w, out_i = [], []
    for row in logits.astype(np.float64):
        m = max(row)
        e = [math.exp(a - m) for a in row]
        z = sum(e)
        p = [a / z for a in e]
        order = sorted(range(len(p)), key=lambda j: (-p[j], j))[:k]     # ties: lower index first
        w = [p[j] for j in order]
        if normalize:
            s = sum(w)
            w = [a / s for a in w]
        out_w.append(w)
        out_i.append(order)
    return np.array(out_w), np.array(out_i)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_route_topk(seed, normalize):
    r = rng_for(seed)
    logits = f32(r.normal(size=(9, 7)) * 2)
    w, ids = ops.route_topk(logits, 3, normalize)
    ref_w, ref_i = _route_oracle(logits, 3, normalize)
    np.testing.assert_array_equal(ids, ref_i)
    np.testing.assert_allclose(w, ref_w, **TOL_FP32)
    if normalize:
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_route_topk_ties_pick_lower_expert_index():
    logits = f32([[0.5, 2.0, 2.0, 0.1, 2.0, 2.0],      # four-way tie for the top 2
                  [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],      # all equal
                  [3.0, 0.0, 3.0, 0.0, 0.0, -1.0]])
    w, ids = ops.route_topk(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1], [0, 2]]
    np.testing.assert_allclose(w, 0.5, rtol=1e-6)
    # the choice of a row does not depend on which other rows share the batch
    w1, ids1 = ops.route_topk(logits[1:2], 2, True)
    assert ids1.tolist() == [[0, 1]]


@pytest.mark.parametrize("seed", SEEDS)
def test_moe_experts_vs_oracle(seed):
    r = rng_for(seed)
    N, H, E, inter, k = 11, 8, 5, 6, 2
    x = f32(r.normal(size=(N, H)))
    gate_up = f32(r.normal(size=(E, 2 * inter, H)) * 0.5)
    down = f32(r.normal(size=(E, H, inter)) * 0.5)
    w, ids = ops.route_topk(f32(r.normal(size=(N, E))), k, True)
    got = ops.moe_experts(x, ids, w, gate_up, down)
    ref = np.zeros((N, H))
    for t in range(N):
        xt = x[t].astype(np.float64)
        for slot in range(k):
            e = ids[t, slot]
            gate = gate_up[e, :inter].astype(np.float64) @ xt          # gate rows first
            up = gate_up[e, inter:].astype(np.float64) @ xt
            act = gate / (1 + np.exp(-gate)) * up
            ref[t] += float(w[t, slot]) * (down[e].astype(np.float64) @ act)
    np.testing.assert_allclose(got, ref, **TOL_ACCUM)
