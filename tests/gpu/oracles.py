"""float64 numpy oracles and input layouts shared by the GPU tests and the CPU-simulator scripts
(pure numpy: importable where numba runs as the simulator)."""
from __future__ import annotations

import numpy as np


def silu(x):
    return x / (1 + np.exp(-x))


def softplus(x):
    # torch.nn.functional.softplus with threshold 20
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def gated_delta(q, k, v, a, b, A_log, dt_bias, S0, ratio):
    """Sequential gated delta rule in float64 (the gates too), heads vectorised.
    q, k [T, nk, dk] (already normalised / scaled), v [T, nv, dv], a / b [T, nv], S0 [nv, dk, dv];
    value head h reads key head h // ratio. Returns (o [T, nv, dv], S [nv, dk, dv])."""
    S = S0.astype(np.float64).copy()
    kh = np.arange(v.shape[1]) // ratio
    decay = np.exp(-np.exp(np.asarray(A_log, np.float64)) *
                   softplus(np.asarray(a, np.float64) + np.asarray(dt_bias, np.float64)))
    beta = 1 / (1 + np.exp(-np.asarray(b, np.float64)))
    o = np.zeros(v.shape)
    for t in range(v.shape[0]):
        kt, qt = k[t, kh], q[t, kh]                                  # [nv, dk]
        S *= decay[t][:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", S, kt)) * beta[t][:, None]
        S += kt[:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, qt)
    return o, S


def gated_delta_rows(qkv, proj, a_off, b_off, A_log, dt_bias, state, slots, ctx, qs, nk, nv, dk, dv):
    """The kernels' view of a call: rows [qs[r], qs[r+1]) of qkv ([n, 2*nk*dk + nv*dv]: q | k | v)
    and of the proj gates (columns a_off / b_off), each row from its state slot (or zeros when
    ctx[r] == 0). Returns (o [n, nv, dv], the state pool after the call), float64."""
    n = qkv.shape[0]
    ref = np.zeros((n, nv, dv))
    ref_state = state.astype(np.float64).copy()
    for row in range(len(slots)):
        t0, t1 = qs[row], qs[row + 1]
        S0 = state[slots[row]] if ctx[row] > 0 else np.zeros((nv, dk, dv))
        q = qkv[t0:t1, :nk * dk].reshape(-1, nk, dk).astype(np.float64)
        k = qkv[t0:t1, nk * dk: 2 * nk * dk].reshape(-1, nk, dk).astype(np.float64)
        v = qkv[t0:t1, 2 * nk * dk:].reshape(-1, nv, dv).astype(np.float64)
        ref[t0:t1], ref_state[slots[row]] = gated_delta(
            q, k, v, proj[t0:t1, a_off:a_off + nv], proj[t0:t1, b_off:b_off + nv], A_log, dt_bias,
            S0, nv // nk)
    return ref, ref_state


def page_tables(r, lengths, ctxs, ps, spare=3):
    """Block tables of rows needing ctx + length tokens in pages of ps, over a random permutation
    of the pool (pages shuffled across rows), -1 past each row's pages; one spare column.
    Returns (block tables [b, p_cap] int32, p_cap, num_pages)."""
    need = [(c + n + ps - 1) // ps for c, n in zip(ctxs, lengths)]
    num_pages = sum(need) + spare
    p_cap = max(need) + 1
    perm = r.permutation(num_pages)
    bt = np.full((len(lengths), p_cap), -1, np.int32)
    used = 0
    for row, k in enumerate(need):
        bt[row, :k] = perm[used: used + k]
        used += k
    return bt, p_cap, num_pages


def poison_unowned(pools, bt, lengths, ctxs, ps):
    """Set every pool slot [page, offset] that no row owns below its ctx + length keys to bf16
    NaN (0x7FC0) in each bf16-bits pool [num_pages, ps, ...]: a kernel that reads a key past a
    row's length shows it."""
    owned = np.zeros(pools[0].shape[:2], bool)
    for row, (ln, c) in enumerate(zip(lengths, ctxs)):
        keys = np.arange(c + ln)
        owned[bt[row, keys // ps], keys % ps] = True
    for p in pools:
        p[~owned] = 0x7FC0


def gdn_inputs(r, dk, dv, nk, nv, n, strong_decay=False):
    """Random inputs of the delta-rule kernels for n tokens, laid out as the model's buffers:
    qkv [n, 2*nk*dk + nv*dv] (q, k L2-normalised, q also scaled by 1/sqrt(dk)), the proj row with
    the gates at an offset, A_log, dt_bias. Returns (qkv, proj, P, a_off, b_off, A_log, dt_bias)."""
    qk = r.standard_normal((n, 2 * nk, dk))
    qk /= np.linalg.norm(qk, axis=-1, keepdims=True)
    qk[:, :nk] /= np.sqrt(dk)
    qkv = np.concatenate([qk.reshape(n, -1), r.standard_normal((n, nv * dv))], 1).astype(np.float32)
    C = 2 * nk * dk + nv * dv
    P = C + 2 * nv + 3
    proj = r.standard_normal((n, P)).astype(np.float32)
    a_off, b_off = C + 3 + nv, C + 3
    A_log = (0.5 * r.standard_normal(nv)).astype(np.float32)
    dt_bias = (0.5 * r.standard_normal(nv)).astype(np.float32)
    if strong_decay:
        # per-token log decays of -1e-3 .. -60: in-chunk sums in the hundreds, where a float32
        # cumulative sum would lose ~1e-5 of every nearby pair's decay
        A_log = np.log(r.uniform(1.0, 16.0, nv)).astype(np.float32)
        proj[:, a_off:a_off + nv] = r.uniform(-8.0, 4.0, (n, nv)).astype(np.float32)
    return qkv, proj, P, a_off, b_off, A_log, dt_bias


def quantized_device_pages(codes, scale) -> np.ndarray:
    """A quantized KV layer (kv_quant.QuantizedPages' codes [pages, P, nkv, hd] and scale
    [pages, P, nkv]) as the CUDA pool's bytes [pages, page bytes]: each page its codes, zero
    padding to 4 bytes, then its float32 scales (memory_plan.quantized_page_bytes). Written here
    from the layout's statement, not from the pool's code."""
    pages, ps, nkv, hd = codes.shape
    n = ps * nkv * hd
    pad = -n % 4
    return np.concatenate([np.ascontiguousarray(codes).view(np.uint8).reshape(pages, n),
                           np.zeros((pages, pad), np.uint8),
                           np.ascontiguousarray(scale, np.float32).view(np.uint8)
                           .reshape(pages, 4 * ps * nkv)], axis=1)


def quantized_host_layer(dev, shape, kv_dtype):
    """The inverse: device page bytes -> a kv_quant.QuantizedPages of `shape`."""
    from ninfer.ops.kv_quant import QuantizedPages
    pages, ps, nkv, hd = shape
    n = ps * nkv * hd
    dev = np.asarray(dev, np.uint8).reshape(pages, -1)
    qp = QuantizedPages(shape, kv_dtype)
    qp.codes = np.ascontiguousarray(dev[:, :n]).view(qp.codes.dtype).reshape(shape)
    qp.scale = np.ascontiguousarray(dev[:, n + (-n % 4):]).view(np.float32).reshape(shape[:3])
    return qp


def router_oracle(logits: np.ndarray, E: int, K: int, norm: bool):
    """The MoE router in float64: (ids [n, K], weights [n, K]) of the top K experts of softmax
    over the first E logits of each row, a stable sort's order (ties: the lower id), the weights
    renormalised over the K picks with `norm`."""
    lg = np.asarray(logits)[:, :E].astype(np.float64)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-lg, axis=-1, kind="stable")[:, :K]
    w = np.take_along_axis(p, ids, -1)
    if norm:
        w /= w.sum(-1, keepdims=True)
    return ids, w


def conv_oracle(proj, P_cols, w, state, qs, ctxs, slots, K):
    """Full causal conv over [state | row inputs] + SiLU; new state = last K-1 inputs."""
    C = w.shape[0]
    out = np.zeros((proj.shape[0], C))
    new_state = state.astype(np.float64).copy()
    for r in range(len(ctxs)):
        xs = proj[qs[r]: qs[r + 1], :C].astype(np.float64)
        old = state[slots[r]].astype(np.float64).T if ctxs[r] > 0 else np.zeros((K - 1, C))
        seq = np.concatenate([old, xs])                      # [K-1+n, C]
        for i in range(len(xs)):
            out[qs[r] + i] = silu((seq[i: i + K] * w.T).sum(0))
        new_state[slots[r]] = seq[-(K - 1):].T
    return out, new_state
