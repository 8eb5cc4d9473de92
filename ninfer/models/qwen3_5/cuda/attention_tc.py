"""Prefill attention of one row on tensor cores: cuBLASLt GEMMs around three small kernels
(kernels/attention_tc.py). Used for rows that bring at least `TC_MIN_TOKENS` new tokens; decode
and short rows keep the split-over-keys CUDA-core kernel (kernels/attention.py).

    q_to_bf16    q fp32 [t, nh, hd] -> qb bf16 [nkv, t_cap, G, hdp]  (a group's heads = GEMM rows)
    kv_gather    the row's paged K, V -> kc, vc bf16 [nkv, l_cap, hdp] (zero past the row's keys)
    per query block [t0, t1) of the row, per kv head g:
        S = qb_g[t0:t1] @ kc_g[:N]^T    M = (t1 - t0) * G, N = pad8(ctx + t1), K = hdp  fp32
        P = causal_softmax(scale * S)   query i of the block sees ctx + t0 + i + 1 keys  bf16
                                        (causal_softmax_reg where N <= SOFTMAX_REG_COLS)
        o_g[t0:t1] = P @ vc_g[:N]       M, N = hdp, K = N (w_kn: V rows as gathered)     fp32
    (hdp = pad8(head_dim), zero-padded: 16-byte leading dimensions for every GEMM operand)
    attn_gate_tc   o * sigmoid(gate) -> bf16 [t, nh*hd] for o_proj

A block's keys stop at its last query (N = ctx + t1), so the masked upper triangle costs at most
one block's width. S and P are fixed buffers of `s_cap` elements; the query block is the largest
that fits them, so nothing is allocated per call.
"""
from __future__ import annotations

from dataclasses import dataclass

# Rows with fewer new tokens use the CUDA-core kernel: below this the GEMMs are tiny and launch
# overhead (3 launches per kv head and block + gather + conversions) dominates. The boundary was
# chosen from the 27B profile, not swept; see docs/performance.md.
TC_MIN_TOKENS = 64
S_CAP_ELEMS = 1 << 26          # S (fp32) + P (bf16): 384 MiB at most
KB = 8                         # keys per kv_gather block (kernels/attention_tc.py)
# rows of S up to this many keys take causal_softmax_reg (the row in registers, read once;
# kernels/attention_tc.SMR_COLS), longer ones the two-pass causal_softmax
SOFTMAX_REG_COLS = 8192
# Query tokens per block at most: a block's keys stop at its last query, so smaller blocks waste
# less of the masked triangle (1024 at 4096 tokens: 1.25x the causal work, S/P traffic alike)
# while M = 1024 * G rows still fill the GEMMs.
QB_MAX = 1024


def pad8(x: int) -> int:
    # key counts padded to 8: 16-byte aligned rows of P and S for the GEMMs
    return (int(x) + 7) // 8 * 8


@dataclass
class TcBuffers:
    """Device addresses and capacities of the tensor-core path's fixed buffers."""
    qb: int          # bf16 [nkv, t_cap, G, hdp]
    o: int           # fp32 [nkv, t_cap, G, hdp]
    kc: int          # bf16 [nkv, l_cap, hdp]
    vc: int          # bf16 [nkv, l_cap, hdp]
    s: int           # fp32 [s_cap]
    p: int           # bf16 [s_cap]
    t_cap: int
    l_cap: int
    s_cap: int


def buffer_sizes(nh: int, nkv: int, hd: int, t_cap: int, max_keys: int) -> dict:
    """name -> element count (t_cap: tokens per call; max_keys: a row's largest key count)."""
    G, hd = nh // nkv, pad8(hd)
    l_cap = pad8(max_keys)
    s_cap = max(min(S_CAP_ELEMS, t_cap * G * l_cap), G * l_cap)   # one query always fits
    return dict(qb=nkv * t_cap * G * hd, o=nkv * t_cap * G * hd, kc=nkv * l_cap * hd,
                vc=nkv * l_cap * hd, s=s_cap, p=s_cap, l_cap=l_cap)


def nbytes(sizes: dict) -> int:
    b = 2 * sizes["qb"] + 4 * sizes["o"] + 2 * sizes["kc"] + 2 * sizes["vc"] + 4 * sizes["s"] + \
        2 * sizes["p"]
    return b + 6 * 256


def query_block(n: int, ctx: int, G: int, s_cap: int) -> int:
    """Query tokens per block: the most (up to QB_MAX) whose S [tokens * G, pad8(ctx + n)]
    fits s_cap."""
    return max(1, min(n, QB_MAX, s_cap // (G * pad8(ctx + n))))


def attend_row(launch, gemm, bufs: TcBuffers, hd: int, G: int, nkv: int, scale: float, *,
               row: int, q_start: int, n: int, ctx: int, q: int, k_cache: int, v_cache: int,
               block_tables: int, bt_stride: int, page_size: int, out: int, proj: int,
               proj_stride: int) -> None:
    """Attention + output gate of row `row` (tokens [q_start, q_start + n) of the call, `ctx`
    keys before them). `launch(name, grid, block, args)` and `gemm(x, w, y, m, n, k, w_kn)` are
    the caller's (the step runner's, or a test harness's)."""
    nh = G * nkv
    hdp = pad8(hd)
    L = ctx + n
    if pad8(L) > bufs.l_cap or q_start + n > bufs.t_cap:
        raise ValueError(f"tensor-core attention: row of {n} tokens after {ctx} exceeds the "
                         f"buffers ({bufs.t_cap} tokens, {bufs.l_cap} keys)")
    hb = min((hdp + 31) // 32 * 32, 256)
    launch("q_to_bf16", (n, nh), (hb,), (bufs.qb, q, q_start, bufs.t_cap))
    launch("kv_gather", ((pad8(L) + KB - 1) // KB, nkv), (128,),
           (bufs.kc, bufs.vc, k_cache, v_cache, block_tables, row, bt_stride, page_size, L,
            pad8(L), bufs.l_cap))
    qb_len = query_block(n, ctx, G, bufs.s_cap)
    for t0 in range(0, n, qb_len):
        t1 = min(n, t0 + qb_len)
        M, N = (t1 - t0) * G, pad8(ctx + t1)
        for g in range(nkv):
            rows_at = (g * bufs.t_cap + q_start + t0) * G * hdp
            kv_at = 2 * g * bufs.l_cap * hdp
            gemm(bufs.qb + 2 * rows_at, bufs.kc + kv_at, bufs.s, M, N, hdp, False)
            launch("causal_softmax_reg" if N <= SOFTMAX_REG_COLS else "causal_softmax", (M,),
                   (256,), (bufs.p, bufs.s, N, ctx + t0 + 1, scale))
            gemm(bufs.p, bufs.vc + kv_at, bufs.o + 4 * rows_at, M, hdp, N, True)
    launch("attn_gate_tc", (n, nh), (hb,), (out, bufs.o, proj, proj_stride, q_start, bufs.t_cap))
