"""Decode-step kernels reworked for speed (issue 26) on numba-cuda's CPU simulator, against float64
oracles; `tests/test_decode_kernels_nogpu.py` runs this in a subprocess (the simulator must be
switched on before numba is imported):

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_decode_kernels.py [seed]

Prints one JSON line of named relative errors and exactness flags.
"""
import json
import sys

import numpy as np

from sim_storage import bf16_bits, kernel   # (the simulator switched on, its shared-array fix applied)
from oracles import router_oracle   # noqa: E402
from ninfer.models.qwen3_5.cuda.runner import EXPERT_DOWN_ROWS, ROUTER_THREADS, combine_launch   # noqa: E402

NEG_INF = np.float32(-3.0e38)


def bf16_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def rel(got, want):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def combine(r, splits: int, hd: int, nh: int, m: int, t_base: int, f32: bool) -> dict:
    """attn_combine over `splits` key splits, some empty (max NEG_INF, partials poisoned NaN),
    head_dim hd (not a multiple of 32: a partial block of dims), launch tokens from t_base."""
    part = r.standard_normal((m, nh, splits, hd)).astype(np.float32)
    mx = r.standard_normal((m, nh, splits)).astype(np.float32) * 3
    sm = r.uniform(0.5, 4.0, (m, nh, splits)).astype(np.float32)
    empty = r.random((m, nh, splits)) < 0.3
    empty[..., 0] = False                     # every (token, head) has a split with keys
    mx[empty] = NEG_INF
    part[empty] = np.nan                      # never read into the sum
    sm[empty] = np.nan
    ml = np.stack([mx, sm], -1)
    P = 2 * nh * hd + 32
    proj = r.standard_normal((t_base + m, P)).astype(np.float32)
    out = np.full((t_base + m) * nh * hd, np.nan if f32 else 0xFFFF,
                  np.float32 if f32 else np.uint16)
    grid, block = combine_launch(m, nh, hd)
    kernel("attention", "attn_combine", hd=hd, nh=nh, f32=f32)[grid, block](out, part.reshape(-1), ml.reshape(-1),
                                                proj.reshape(-1), P, splits, t_base)
    w = np.where(empty, 0.0, np.exp(mx.astype(np.float64) - mx.max(-1, keepdims=True)))
    num = np.einsum("mhs,mhsd->mhd", w, np.where(empty[..., None], 0.0, part.astype(np.float64)))
    den = np.einsum("mhs,mhs->mh", w, np.where(empty, 0.0, sm.astype(np.float64)))
    gate = proj[t_base:, :2 * nh * hd].reshape(m, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    want = num / den[..., None] / (1 + np.exp(-gate))
    got = out.reshape(t_base + m, nh, hd)
    untouched = (np.isnan(got[:t_base]).all() if f32 else (got[:t_base] == 0xFFFF).all())
    got = got[t_base:].astype(np.float64) if f32 else bf16_to_f64(got[t_base:])
    return {"rel": rel(got, want), "untouched": bool(untouched)}


def bf16_exact(r, shape):
    """bf16 bits of random values (and their float64 values)."""
    bits = (r.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, bf16_to_f64(bits)


def experts(r, n: int = 2, K: int = 2, E: int = 3) -> dict:
    """expert_gate_up (H 256, inter 8) and expert_down (H 32, inter 256) on bf16 weights whose
    rows take the 16-byte-load path (gate_up: H % 256 == 0; down: inter % 256 == 0; the shapes
    small for the simulator), outputs poisoned first."""
    H, inter = 256, 8
    xb, x = bf16_exact(r, (n, H))
    wgb, wg = bf16_exact(r, (E, 2 * inter, H))
    ids = np.stack([r.permutation(E)[:K] for _ in range(n)]).astype(np.int32).reshape(-1)
    act = np.full(n * K * inter, np.nan, np.float32)
    kernel("moe", "expert_gate_up", H=H, inter=inter)[(n * K, inter // 4, 1), (128, 1, 1)](
        act, xb.view(np.uint32).reshape(-1), wgb.view(np.uint32).reshape(-1), ids, K)
    g = np.stack([wg[ids[p], :inter] @ x[p // K] for p in range(n * K)])
    u = np.stack([wg[ids[p], inter:] @ x[p // K] for p in range(n * K)])
    out = {"gate_up": rel(act.reshape(n * K, inter), g / (1 + np.exp(-g)) * u)}
    H, inter = 32, 256
    wdb, wd = bf16_exact(r, (E, H, inter))
    act = r.standard_normal(n * K * inter).astype(np.float32)
    y = np.full(n * K * H, np.nan, np.float32)
    kernel("moe", "expert_down", H=H, inter=inter)[
        (n * K, -(-H // (4 * EXPERT_DOWN_ROWS)), 1), (128, 1, 1)](
        y, act, wdb.view(np.uint32).reshape(-1), ids)
    a64 = act.reshape(n * K, inter).astype(np.float64)
    out["down"] = rel(y.reshape(n * K, H), np.stack([wd[ids[p]] @ a64[p] for p in range(n * K)]))
    return out


def moe_tail(r, inter: int, shared: int, n: int = 2, K: int = 3, E: int = 5) -> dict:
    """moe_down_combine (H 12: three blocks of 4 rows): h += sigmoid(gate) *
    shared_down(SwiGLU(gate, up)) + sum_k w_k * down[e_k](act_k), the SwiGLU rounded to bf16 as
    silu_mul stores it. The change of h against float64 (within a bf16 rounding: the oracle's
    SwiGLU rounds its own float64 values), and a row past the n launched untouched."""
    H = 12
    P = E + 2 * shared + 1
    proj = r.standard_normal((n, P)).astype(np.float32)
    ids = np.stack([r.permutation(E)[:K] for _ in range(n)]).astype(np.int32).reshape(-1)
    wts = r.uniform(0.1, 1.0, n * K).astype(np.float32)
    act = r.standard_normal(n * K * inter).astype(np.float32)
    wdb, wd = bf16_exact(r, (E, H, inter))
    sdb, sd = bf16_exact(r, (H, shared))
    h0 = r.standard_normal((n + 1, H)).astype(np.float32)
    h = h0.copy()
    kernel("moe", "moe_down_combine", H=H, inter=inter, shared=shared, K=K)[
        (H // EXPERT_DOWN_ROWS, n, 1), (32 * (K + 1), 1, 1)](
        h.reshape(-1), act, wdb.view(np.uint32).reshape(-1), ids, wts, proj.reshape(-1), P, E,
        sdb.view(np.uint32).reshape(-1))
    p64 = proj.astype(np.float64)
    g, u = p64[:, E:E + shared], p64[:, E + shared:E + 2 * shared]
    swiglu = bf16_to_f64(bf16_bits(g / (1 + np.exp(-g)) * u))
    gate = 1 / (1 + np.exp(-p64[:, E + 2 * shared]))
    a64 = act.reshape(n, K, inter).astype(np.float64)
    want = gate[:, None] * (swiglu @ sd.T) + np.stack(
        [sum(wts[t * K + k] * (wd[ids[t * K + k]] @ a64[t, k]) for k in range(K))
         for t in range(n)])
    return {"rel": rel(h[:n].astype(np.float64) - h0[:n], want),
            "untouched": bool(np.array_equal(h[n], h0[n]))}


def router(r, E: int, K: int, norm: bool, n: int = 2) -> dict:
    """router_topk against a stable sort of float64 softmax probabilities: ids exactly, weights
    within float32's error; ties among the logits (lower id first) and E above the block's 256
    threads (several experts a thread); outputs poisoned first."""
    stride = E + 3
    logits = r.standard_normal((n, stride)).astype(np.float32)
    logits[:, 5:9] = logits[:, 2:3]                  # ties among the logits
    logits[0, 2:9] = logits[0, :E].max() + 1.0       # ... and a tie for the top in row 0
    ids = np.full(n * K, -1, np.int32)
    wts = np.full(n * K, np.nan, np.float32)
    kernel("moe", "router_topk", E=E, K=K, norm=norm)[(n, 1, 1), (ROUTER_THREADS, 1, 1)](
        ids, wts, logits.reshape(-1), stride)
    want_ids, want_w = router_oracle(logits, E, K, norm)
    return {"ids": bool(np.array_equal(ids.reshape(n, K), want_ids)),
            "rel": rel(wts.reshape(n, K).astype(np.float64), want_w)}


def routed(r, E: int, K: int, norm: bool, n: int = 2) -> dict:
    """expert_gate_up_routed (the router's top-k in the gate|up GEMV's prologue; H 256, inter 8:
    two column blocks a pair): the ids it stores exactly router_oracle's, the weights within
    float32's error, and each pair's SwiGLU over the expert it picked itself within a bf16
    rounding; ties among the logits; outputs poisoned first."""
    H, inter, stride = 256, 8, E + 3
    logits = r.standard_normal((n, stride)).astype(np.float32)
    logits[:, 5:9] = logits[:, 2:3]                  # ties among the logits
    xb, x = bf16_exact(r, (n, H))
    wgb, wg = bf16_exact(r, (E, 2 * inter, H))
    ids = np.full(n * K, -1, np.int32)
    wts = np.full(n * K, np.nan, np.float32)
    act = np.full(n * K * inter, np.nan, np.float32)
    kernel("moe", "expert_gate_up_routed", H=H, inter=inter, E=E, K=K, norm=norm)[
        (n * K, inter // 4, 1), (128, 1, 1)](
        act, xb.view(np.uint32).reshape(-1), wgb.view(np.uint32).reshape(-1), ids, wts,
        logits.reshape(-1), stride)
    want_ids, want_w = router_oracle(logits, E, K, norm)
    e = want_ids.reshape(-1)
    g = np.stack([wg[e[p], :inter] @ x[p // K] for p in range(n * K)])
    u = np.stack([wg[e[p], inter:] @ x[p // K] for p in range(n * K)])
    return {"ids": bool(np.array_equal(ids.reshape(n, K), want_ids)),
            "weights": rel(wts.reshape(n, K).astype(np.float64), want_w),
            "act": rel(act.reshape(n * K, inter), g / (1 + np.exp(-g)) * u)}


def argmax(r, threads: int = 32) -> dict:
    """argmax (a small block, so the simulator is quick) against np.argmax: rows of whole 16-byte
    groups through the four-groups loop and its tail, the first maximum kept on ties within a
    group, across threads and across loop rounds, a row of -inf (its first id), and a vocabulary
    not a multiple of 4 (the scalar loop)."""
    got, want = [], []
    for vocab in (4 * 4 * threads * 2 + 4 * 5, 4 * 3 + 2):
        rows = r.standard_normal((5, vocab)).astype(np.float32)
        top = rows.max() + 1
        rows[0, [9, 10, vocab // 2, vocab - 1]] = top   # within a group, then later ones
        rows[1, [vocab - 1, vocab // 3 + 1]] = top      # a later round before the tail
        rows[2, :] = -np.inf
        rows[3, [3, 2]] = top                           # within one group: the lower id
        out = np.full(5, -7, np.int32)
        kernel("sample", "argmax", threads=threads)[(5, 1, 1), (threads, 1, 1)](
            out, rows.reshape(-1), vocab)
        got += out.tolist()
        want += np.argmax(rows, axis=1).tolist()
    return {"exact": got == want}


def rmsnorm(r, H: int, threads: int = 64) -> float:
    """rmsnorm (f32 storage) of rows picked through row_idx: H <= PER * threads keeps the row in
    registers, a wider one takes the two-pass loop; against float64."""
    x = r.standard_normal((4, H)).astype(np.float32)
    w = (0.1 * r.standard_normal(H)).astype(np.float32)
    idx = np.array([3, 1], np.int32)
    o = np.full(2 * H, np.nan, np.float32)
    kernel("norm", "rmsnorm", f32=True)[(2, 1, 1), (threads, 1, 1)](
        o, x.reshape(-1), w, idx, 1, H, np.float32(1e-6))
    xs = x[idx].astype(np.float64)
    return rel(o.reshape(2, H), xs / np.sqrt((xs * xs).mean(1, keepdims=True) + 1e-6) * (1 + w))


def gather(r, words: int, rows: int = 6) -> bool:
    """gather_rows: rows of `words` 32-bit words (whole 16-byte groups: the vector path; else
    the word loop), a source row repeated, every output word written exactly once (poisoned
    first); a row whose source is -1 (the device route's padding) and a row past the grid's
    rows untouched."""
    from ninfer.models.qwen3_5.cuda.runner import GATHER_THREADS
    x = r.integers(0, 2 ** 32, (7, words), dtype=np.uint32)
    src = np.array([3, 0, -1, 6, 3, 5], np.int32)[:rows]
    out = np.full((rows + 1, words), 0xDEADBEEF, np.uint32)
    kernel("moe", "gather_rows")[(rows, -(-words // (4 * GATHER_THREADS)), 1),
                                 (GATHER_THREADS, 1, 1)](out.reshape(-1), x.reshape(-1), src,
                                                         words)
    live = src >= 0
    return bool(np.array_equal(out[:rows][live], x[src[live]])
                and (out[:rows][~live] == 0xDEADBEEF).all() and (out[rows] == 0xDEADBEEF).all())


def route(r, E: int, K: int, tokens: int, skew: float, cap: int = 0) -> bool:
    """The MoE prefill's device layout (moe_route_count, _scan, _place) for block size cap: rows,
    each chunk's first ranks, the first overflow rows, the grouped GEMMs' addresses and the row
    maps exactly moe_rows.expert_rows' layout for that cap (the host's), the rows no pair takes
    marked -1 up to E*cap + pairs, over several chunks and a partial last one, experts routed
    nothing included; nothing written past them."""
    from ninfer.models.qwen3_5.cuda import moe_rows
    from ninfer.models.qwen3_5.cuda.moe_route import COUNT_THREADS, ROUTE_CHUNK
    p = 1.0 / np.arange(1, E + 1) ** skew
    ids = np.stack([r.choice(E, K, replace=False, p=p / p.sum()) for _ in range(tokens)])
    ids = ids.reshape(-1).astype(np.int32)
    pairs = len(ids)
    chunks = -(-pairs // ROUTE_CHUNK)
    counts = np.full(chunks * E, -7, np.int32)
    kernel("moe", "moe_route_count", E=E)[(chunks, 1, 1), (COUNT_THREADS, 1, 1)](
        counts, ids, pairs)
    per_chunk = counts.copy()
    rows = np.full(E + 1, -1, np.int32)
    first = np.full(E + 1, -1, np.int32)
    spec = np.array([1000, 6, 1 << 40, 4096], np.uint64)         # (base, row bytes) x 2
    ptrs = np.zeros(2 * E + 1, np.uint64)
    bound = E * cap + pairs
    src = np.full(bound + 3, -5, np.int32)
    kernel("moe", "moe_route_scan", E=E)[(1, 1, 1), (-(-E // 32) * 32, 1, 1)](
        counts, rows, first, ptrs, spec, src, chunks, 2, cap, pairs)
    row_of_pair = np.full(pairs + 3, -5, np.int32)
    kernel("moe", "moe_route_place", E=E, K=K)[(chunks, 1, 1), (32, 1, 1)](
        src, row_of_pair, ids, counts, first, cap, pairs)
    lay = moe_rows.expert_rows(ids, K, E, bound, cap=cap)
    total = np.bincount(ids, minlength=E)
    over = np.maximum(total - cap, 0)
    want_first = E * cap + np.concatenate([[0], np.cumsum(over)[:-1]])
    chunk_rank = np.cumsum(per_chunk.reshape(chunks, E), axis=0) - per_chunk.reshape(chunks, E)
    want_ptrs = np.concatenate([1000 + 6 * want_first,
                                (1 << 40) + 4096 * want_first]).astype(np.uint64)
    want_src = np.full(bound, -1, np.int32)
    want_src[:lay.rows] = lay.src
    for e in range(E):                 # the host's padding rows read token 0; here -1
        want_src[e * cap + min(total[e], cap): (e + 1) * cap] = -1
    return bool(np.array_equal(per_chunk.reshape(chunks, E).sum(0), total)
                and np.array_equal(counts.reshape(chunks, E), chunk_rank)
                and np.array_equal(rows[:E], total) and rows[E] == -1
                and np.array_equal(first[:E], want_first) and first[E] == -1
                and np.array_equal(ptrs[:2 * E], want_ptrs) and ptrs[2 * E] == 0
                and np.array_equal(src[:bound], want_src) and (src[bound:] == -5).all()
                and np.array_equal(row_of_pair[:pairs], lay.row_of_pair)
                and (row_of_pair[pairs:] == -5).all() and (total == 0).any()
                and (cap == 0 or (over > 0).any() and (total < cap).any()))


def gemv(r, M: int, n: int, k: int, beta: float) -> float:
    """The decode GEMV (kernels/gemv.py): M tokens, n rows not a multiple of its block's, k of
    one span (the tail loop alone) or five (the unrolled loop and the tail), beta 0 over a
    poisoned output and 1 over a live one: relative error against float64."""
    from ninfer.models.qwen3_5.cuda.runner import GEMV_WARPS
    x = bf16_bits(r.standard_normal((M, k)))
    w = bf16_bits(0.05 * r.standard_normal((n, k)))
    y0 = r.standard_normal((M, n)).astype(np.float32) if beta else \
        np.full((M, n), np.nan, np.float32)
    y = y0.copy()
    kernel("gemv", "gemv", M=M)[(-(-n // GEMV_WARPS), 1, 1), (32 * GEMV_WARPS, 1, 1)](
        y.reshape(-1), x.view(np.uint32).reshape(-1), w.view(np.uint32).reshape(-1), n, k // 2,
        np.float32(beta))
    want = bf16_to_f64(x) @ bf16_to_f64(w).T + (beta * y0.astype(np.float64) if beta else 0.0)
    return rel(y.astype(np.float64), want)


def gemv_norm(r, M: int, n: int, hidden: int) -> dict:
    """gemv_norm (kernels/gemv.py): the RMS norm of M fp32 rows in the prologue, then the product
    of its bf16 rows; beta 1 over a live output. The normed rows it stores (block 0) against
    float64's norm (within a bf16 rounding), the product against float64 over those rows."""
    from ninfer.models.qwen3_5.cuda.runner import GEMV_WARPS
    eps = 1e-6
    h = (3.0 * r.standard_normal((M, hidden))).astype(np.float32)
    nw = (0.1 * r.standard_normal(hidden)).astype(np.float32)
    w = bf16_bits(0.05 * r.standard_normal((n, hidden)))
    y0 = r.standard_normal((M, n)).astype(np.float32)
    y = y0.copy()
    xout = np.full((M + 1) * hidden, 0xFFFF, np.uint16)         # a row past M: untouched
    kernel("gemv", "gemv_norm", M=M, hidden=hidden)[(-(-n // GEMV_WARPS), 1, 1),
                                                    (32 * GEMV_WARPS, 1, 1)](
        y.reshape(-1), h.reshape(-1), w.view(np.uint32).reshape(-1), n, hidden // 2,
        np.float32(1.0), nw, xout, np.float32(eps))
    h64 = h.astype(np.float64)
    normed = h64 / np.sqrt((h64 ** 2).mean(-1, keepdims=True) + eps) * (1 + nw.astype(np.float64))
    x = bf16_to_f64(xout[:M * hidden].reshape(M, hidden))
    want = x @ bf16_to_f64(w).T + y0.astype(np.float64)
    return {"x": rel(x, normed), "y": rel(y.astype(np.float64), want),
            "untouched": bool((xout[M * hidden:] == 0xFFFF).all())}


def main(seed: int) -> dict:
    r = np.random.default_rng(seed)
    out = {}
    for splits, hd, f32 in ((37, 40, True), (128, 32, False), (5, 24, True), (1, 64, False)):
        res = combine(r, splits, hd, nh=3, m=2, t_base=1, f32=f32)
        out[f"attn_combine/{splits}x{hd}/{'f32' if f32 else 'bf16'}"] = res["rel"]
        out[f"attn_combine/{splits}x{hd}/untouched"] = res["untouched"]
    for E, K, norm in ((40, 5, True), (300, 10, False)):
        res = router(r, E, K, norm)
        out[f"router_topk/{E}x{K}/ids"] = res["ids"]
        out[f"router_topk/{E}x{K}/f32"] = res["rel"]
    for E, K, norm in ((40, 5, True), (300, 3, False)):
        res = routed(r, E, K, norm)
        out[f"expert_gate_up_routed/{E}x{K}/ids"] = res["ids"]
        out[f"expert_gate_up_routed/{E}x{K}/weights/f32"] = res["weights"]
        out[f"expert_gate_up_routed/{E}x{K}/bf16"] = res["act"]
    out["argmax/ids"] = argmax(r)["exact"]
    for H in (500, 600):                   # registers (500 <= 8 * 64), the two-pass loop
        out[f"rmsnorm/{H}/f32"] = rmsnorm(r, H)
    for key, v in experts(r).items():
        out[f"expert_{key}/vec/bf16"] = v
    # rows of whole warp spans (the 16-byte loads; the shared one two spans), and rows that
    # are not (two words a lane and a partial last one)
    for inter, shared in ((256, 512), (36, 90)):
        res = moe_tail(r, inter, shared)
        out[f"moe_down_combine/{inter}x{shared}/bf16"] = res["rel"]
        out[f"moe_down_combine/{inter}x{shared}/untouched"] = res["untouched"]
    for words in (1024, 150):              # 16-byte groups over two blocks; a partial group
        out[f"gather_rows/{words}w/ids"] = gather(r, words)
    # 3 chunks, the last partial, some experts routed nothing; E not a multiple of 32
    out["moe_route/300x4/ids"] = route(r, 300, 4, 300, 1.2)
    # the padded block: experts short of cap and experts overflowing it
    out["moe_route/300x4/cap16/ids"] = route(r, 300, 4, 300, 1.2, cap=16)
    for M, n, k, beta in ((1, 37, 256, 0.0), (3, 9, 1280, 1.0), (8, 5, 1280, 0.0)):
        out[f"gemv/{M}x{n}x{k}/f32"] = gemv(r, M, n, k, beta)
    # one span a row (the tail loop alone); five (unrolled + tail); 8 tokens of two spans
    for M, n, hidden in ((1, 37, 256), (3, 9, 1280), (8, 5, 512)):
        res = gemv_norm(r, M, n, hidden)
        out[f"gemv_norm/{M}x{n}x{hidden}/x/bf16"] = res["x"]
        out[f"gemv_norm/{M}x{n}x{hidden}/f32"] = res["y"]
        out[f"gemv_norm/{M}x{n}x{hidden}/untouched"] = res["untouched"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)))
