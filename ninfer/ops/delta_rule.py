"""Gated delta rule (Gated DeltaNet's linear attention), float32, one sequence at a time.

Per value head h, with a state S [dk, dv] (read as o = q^T S) and for each token t:

    S <- exp(g_t) * S                              decay
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T      delta-rule write with the decayed state
    o_t = q_t^T S                                  read after the write

Inputs are already prepared by the caller: q, k L2-normalised, q scaled by 1/sqrt(dk), and k/q
repeated to the value heads. The head axis may be any flattening of independent heads (for example
B rows x H heads for a batched decode step); heads never interact.

    q, k  [T, H, dk]    v [T, H, dv]    g, beta [T, H]    state [H, dk, dv]
    returns (o [T, H, dv], new_state [H, dk, dv])
"""
from __future__ import annotations

import numpy as np

CHUNK_SIZE = 64


def gated_delta_recurrent(q, k, v, g, beta, state):
    """Token-by-token form (decode; also the readable reference for the chunked form)."""
    S = state.astype(np.float32, copy=True)
    T = q.shape[0]
    out = np.empty(v.shape, np.float32)
    decay = np.exp(g.astype(np.float32))
    for t in range(T):
        S *= decay[t][:, None, None]
        kt = k[t][:, None, :]                                   # [H, 1, dk]
        kv_mem = (kt @ S)[:, 0]                                 # [H, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = (q[t][:, None, :] @ S)[:, 0]
    return out, S


def gated_delta_chunked(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """Chunked (WY / UT-transform) form for prefill: the same recurrence, evaluated a chunk of
    `chunk_size` tokens at a time with matmuls; equal to the recurrent form up to rounding.

    Within a chunk (positions i, j; G_i = cumulative log decay from the chunk start):
        A[i, j] = beta_i k_i.k_j exp(G_i - G_j)  (j < i)      (I + A) U = beta V
                                                             (I + A) W = beta K exp(G)
        v_new = U - W S ;  o = (Q exp(G)) S + tril(Q K^T exp(G_i - G_j)) v_new
        S <- exp(G_last) S + (K exp(G_last - G))^T v_new
    """
    T, H, dk = q.shape
    dv = v.shape[-1]
    if T == 0:
        return np.zeros((0, H, dv), np.float32), state.astype(np.float32, copy=True)
    C = min(chunk_size, T)
    n = -(-T // C)
    pad = n * C - T

    def heads_first(x, width):                                  # [T, H, d] -> [H, n, C, d]
        x = np.moveaxis(x.astype(np.float32, copy=False), 1, 0)
        if pad:
            # zero k, v, beta and zero log-decay leave the state untouched and feed no real output
            x = np.concatenate([x, np.zeros((H, pad, width), np.float32)], axis=1)
        return x.reshape(H, n, C, width)

    Q, K, V = heads_first(q, dk), heads_first(k, dk), heads_first(v, dv)
    Bt = heads_first(beta[..., None], 1)[..., 0]                # [H, n, C]
    # Cumulative log decay in float64: G reaches -1e3 within a chunk, and the float32 difference
    # G_i - G_j of two such values would lose ~1e-4 of every nearby pair's decay factor.
    G = np.cumsum(heads_first(g[..., None], 1)[..., 0], axis=-1, dtype=np.float64)
    KB, VB = K * Bt[..., None], V * Bt[..., None]

    causal = np.tril(np.ones((C, C), bool))
    # exp only where j <= i: there the exponent is <= 0, so nothing overflows
    pair = np.exp(np.where(causal, G[..., :, None] - G[..., None, :], -np.inf)).astype(np.float32)
    A = np.tril((KB @ np.swapaxes(K, -1, -2)) * pair, -1)
    intra = (Q @ np.swapaxes(K, -1, -2)) * pair
    U, W = _unit_lower_solve(A, VB, KB * np.exp(G).astype(np.float32)[..., None])

    Qd = Q * np.exp(G).astype(np.float32)[..., None]
    Kd = K * np.exp(G[..., -1:] - G).astype(np.float32)[..., None]
    chunk_decay = np.exp(G[..., -1]).astype(np.float32)[..., None, None]     # [H, n, 1, 1]

    S = state.astype(np.float32, copy=True)
    out = np.empty((H, n, C, dv), np.float32)
    for c in range(n):
        v_new = U[:, c] - W[:, c] @ S
        out[:, c] = Qd[:, c] @ S + intra[:, c] @ v_new
        S = S * chunk_decay[:, c] + np.swapaxes(Kd[:, c], -1, -2) @ v_new
    out = out.reshape(H, n * C, dv)[:, :T]
    return np.ascontiguousarray(np.moveaxis(out, 0, 1)), S


def _unit_lower_solve(A, *rhs):
    """Solve (I + A) X = B for each B in rhs, A strictly lower triangular [..., C, C], by forward
    substitution (what a unit-triangular trsm does; numpy has no triangular solver)."""
    xs = [b.copy() for b in rhs]
    for i in range(1, A.shape[-1]):
        a = A[..., i:i + 1, :i]                                  # [..., 1, i]
        for x in xs:
            x[..., i:i + 1, :] -= a @ x[..., :i, :]
    return xs
