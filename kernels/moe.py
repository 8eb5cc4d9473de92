"""MoE: softmax router + top-k, and grouped expert SwiGLU as warp-per-row GEMVs over the selected
experts (decode and small batches: every weight row is read once per (token, slot)).

Router logits, the shared expert's gate/up and its sigmoid gate come from one fused GEMM upstream.
`f32` (expert kernels): fp32 activations and expert weights instead of bf16 pairs.
"""
import math

from numba import cuda, float32, int32, int64, uint64

from .common import (FULL_MASK, bf16_pair, bf16_round, bf16x2_hi, bf16x2_lo, inlined, sigmoid,
                     silu, storage, warp_max, warp_sum)
from .ptx import grid_wait, ld_v4, ld_v4_stream, prefetch_l2, st_v4

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "router_topk": ("i32*", "f32*", "f32*", "i32"),
    "expert_gate_up": ("f32*", "u32*", "u32*", "i32*", "i32"),
    "expert_gate_up_routed": ("f32*", "u32*", "u32*", "i32*", "f32*", "f32*", "i32"),
    "expert_down": ("f32*", "f32*", "u32*", "i32*"),
    "moe_combine": ("f32*", "f32*", "i32*", "i32", "f32*", "f32*", "f32*", "i32"),
    "moe_down_combine": ("f32*", "f32*", "u32*", "i32*", "f32*", "f32*", "i32", "i32", "u32*"),
    "gather_rows": ("u32*", "u32*", "i32*", "i32"),
    "moe_route_count": ("i32*", "i32*", "i32"),
    "moe_route_scan": ("i32*", "i32*", "i32*", "u64*", "u64*", "i32*", "i32", "i32", "i32",
                       "i32"),
    "moe_route_place": ("i32*", "i32*", "i32*", "i32*", "i32*", "i32", "i32"),
    "moe_route_tiles": ("i32*", "i32*", "i32*", "i32", "i32"),
}

ROUTER_THREADS = 32      # router_topk: one warp a token


def _router_picks(E, K, norm):
    """picks(logits, base, lane) -> (expert, weight) of lane k's pick (the k-th largest logit of
    logits[base .. base + E)) for lanes k < K, as one warp computes them (router_topk)."""
    PER = (E + 31) // 32                 # logits a lane holds: experts lane, lane + 32, ...
    LOW = float32(-3.0e38)

    @inlined
    def picks(logits, base, lane):
        # the warp's logits in registers. K rounds: each lane's best (the largest, ties -> its
        # lowest expert), then the warp's (ties -> the lower id: a stable sort's order; softmax
        # is monotonic, so logits rank as the probabilities do), which its lane retires.
        # Weights: softmax over the E experts, or with `norm` renormalised over the K picks:
        # the softmax over the picks alone.
        vals = cuda.local.array(PER, float32)
        m = LOW
        for q in range(PER):
            e = q * 32 + lane
            v = LOW
            if e < E:
                v = logits[base + e]
            vals[q] = v
            m = max(m, v)
        total = float32(0.0)
        if not norm:
            m = warp_max(m)
            for q in range(PER):
                if q * 32 + lane < E:
                    total += math.exp(vals[q] - m)
            total = warp_sum(total)
        mine = LOW                        # lane k keeps pick k's logit and expert
        mine_e = int32(0)
        first = LOW                       # every lane: the top pick's logit
        for k in range(K):
            bv = LOW
            be = int32(E)
            for q in range(PER):
                if vals[q] > bv:
                    bv = vals[q]
                    be = int32(q * 32 + lane)
            for off in (16, 8, 4, 2, 1):
                ov = cuda.shfl_xor_sync(FULL_MASK, bv, off)
                oe = cuda.shfl_xor_sync(FULL_MASK, be, off)
                if ov > bv or (ov == bv and oe < be):
                    bv = ov
                    be = oe
            for q in range(PER):
                if q * 32 + lane == be:
                    vals[q] = math.nan        # retired: never larger than anything
            if lane == k:
                mine = bv
                mine_e = be
            if k == 0:
                first = bv
        if norm:
            m = first
            p = float32(0.0)
            if lane < K:
                p = math.exp(mine - m)
            total = warp_sum(p)
        return mine_e, math.exp(mine - m) / total
    return picks


def router_topk(E, K, norm):
    picks = _router_picks(E, K, norm)

    def router_topk_kernel(ids, weights, logits, stride):
        # grid (tokens,), block 32: one warp a token (_router_picks). (A 256-thread block, its
        # warps' candidates merged through shared memory, took 9-10 us a token on the H200
        # whether by K warp arg-maxes or by ranking all E at once.)
        t = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        e, wt = picks(logits, t * stride, lane)
        if lane < K:
            ids[t * K + lane] = e
            weights[t * K + lane] = wt
    return router_topk_kernel


DOWN_ROWS = 4            # expert_down: output rows per warp (grid.y = ceil(H / (4 * DOWN_ROWS)))
LINE = 32                # 32-bit words of a 128-byte L2 line (the tail's shared-row prefetch)


@inlined
def dot_bf16x2(a, b):
    # the two bf16 products of words a and b, summed in fp32
    return bf16x2_lo(a) * bf16x2_lo(b) + bf16x2_hi(a) * bf16x2_hi(b)


def _gate_up_row(H, inter, f32):
    """row(act, x, w, e, pair, t, j, lane): a warp's output j of pair `pair` (token t, expert
    e): act[pair, j] = silu(g_j . x_t) * (u_j . x_t)."""
    HP = H // 2
    _, _, ld_pair, rounded = storage(f32)
    # bf16 rows of whole 512-byte warp spans: each lane reads 16-byte words (ld.v4), the
    # weights streamed past L1 (read once); measured 13.6 us a 35B-A3B layer at B=1 with 4-byte
    # loads (2.5 TB/s)
    VEC = not f32 and H % 256 == 0

    @inlined
    def row(act, x, w, e, pair, t, j, lane):
        gb = (int64(e) * 2 * inter + j) * HP
        ub = (int64(e) * 2 * inter + inter + j) * HP
        xb = int64(t) * HP
        g = float32(0.0)
        u = float32(0.0)
        if VEC:
            for it in range(HP // 128):
                c = it * 128 + lane * 4
                x0, x1, x2, x3 = ld_v4(x, xb + c)
                g0, g1, g2, g3 = ld_v4_stream(w, gb + c)
                u0, u1, u2, u3 = ld_v4_stream(w, ub + c)
                g += dot_bf16x2(g0, x0) + dot_bf16x2(g1, x1) + dot_bf16x2(g2, x2) + \
                    dot_bf16x2(g3, x3)
                u += dot_bf16x2(u0, x0) + dot_bf16x2(u1, x1) + dot_bf16x2(u2, x2) + \
                    dot_bf16x2(u3, x3)
        else:
            for c in range(lane, HP, 32):
                x0, x1 = ld_pair(x, xb + c)
                g0, g1 = ld_pair(w, gb + c)
                u0, u1 = ld_pair(w, ub + c)
                g += g0 * x0 + g1 * x1
                u += u0 * x0 + u1 * x1
        g = warp_sum(g)
        u = warp_sum(u)
        if lane == 0:
            # rounded to bf16 like the grouped (cuBLASLt) path's GEMM input, so both paths agree
            # (fp32 storage: not rounded, like that path's fp32 input)
            act[pair * inter + j] = rounded(silu(g) * u)
    return row


def expert_gate_up(H, inter, f32=False):
    row = _gate_up_row(H, inter, f32)

    def expert_gate_up_kernel(act, x, w, ids, K):
        # grid (n*K, ceil(inter/4)), block 128: warp -> output j: silu(g_j . x) * (u_j . x)
        pair = cuda.blockIdx.x
        j = cuda.blockIdx.y * 4 + (cuda.threadIdx.x >> 5)
        lane = cuda.threadIdx.x & 31
        if j >= inter:
            return
        row(act, x, w, ids[pair], pair, pair // K, j, lane)
    return expert_gate_up_kernel


def expert_gate_up_routed(H, inter, E, K, norm):
    """expert_gate_up with the router's top-k in its prologue (a decode MoE layer: one launch
    instead of router_topk's and this one's): every block's first warp ranks its token's E
    logits as router_topk does and takes its pair's expert; the blocks of column 0 of a token's
    first pair also store the token's K ids and weights for the kernels after."""
    picks = _router_picks(E, K, norm)
    row = _gate_up_row(H, inter, False)

    def expert_gate_up_routed_kernel(act, x, w, ids, weights, logits, stride):
        # grid (n*K, ceil(inter/4)), block 128; logits [n, stride] fp32 (the router's E first)
        pair = cuda.blockIdx.x
        t = pair // K
        k = pair % K
        tid = cuda.threadIdx.x
        lane = tid & 31
        pick = cuda.shared.array(1, int32)
        if tid < 32:
            e, wt = picks(logits, t * stride, lane)
            if lane == k:
                pick[0] = e
            if k == 0 and cuda.blockIdx.y == 0 and lane < K:
                ids[t * K + lane] = e
                weights[t * K + lane] = wt
        cuda.syncthreads()
        j = cuda.blockIdx.y * 4 + (tid >> 5)
        if j >= inter:
            return
        row(act, x, w, pick[0], pair, t, j, lane)
    return expert_gate_up_routed_kernel


@inlined
def dot_act(w0, w1, w2, w3, v0, v1, v2, v3, v4, v5, v6, v7):
    # four words of bf16 pairs . eight fp32 activations
    return (bf16x2_lo(w0) * v0 + bf16x2_hi(w0) * v1 + bf16x2_lo(w1) * v2 + bf16x2_hi(w1) * v3 +
            bf16x2_lo(w2) * v4 + bf16x2_hi(w2) * v5 + bf16x2_lo(w3) * v6 + bf16x2_hi(w3) * v7)


@inlined
def rows4_act(a0, a1, a2, a3, w, i, stride, act, j):
    # the sums of bf16 rows i, i + stride, i + 2 * stride, i + 3 * stride (16 bytes each, read
    # once) after their products with the eight fp32 activations act[j .. j + 8)
    v0, v1, v2, v3, v4, v5, v6, v7 = (act[j], act[j + 1], act[j + 2], act[j + 3], act[j + 4],
                                      act[j + 5], act[j + 6], act[j + 7])
    p0, p1, p2, p3 = ld_v4_stream(w, i)
    q0, q1, q2, q3 = ld_v4_stream(w, i + stride)
    r0, r1, r2, r3 = ld_v4_stream(w, i + 2 * stride)
    s0, s1, s2, s3 = ld_v4_stream(w, i + 3 * stride)
    return (a0 + dot_act(p0, p1, p2, p3, v0, v1, v2, v3, v4, v5, v6, v7),
            a1 + dot_act(q0, q1, q2, q3, v0, v1, v2, v3, v4, v5, v6, v7),
            a2 + dot_act(r0, r1, r2, r3, v0, v1, v2, v3, v4, v5, v6, v7),
            a3 + dot_act(s0, s1, s2, s3, v0, v1, v2, v3, v4, v5, v6, v7))


def expert_down(H, inter, f32=False):
    ld_pair = storage(f32)[2]
    IW = inter // 2                  # words of a bf16 row
    R = DOWN_ROWS
    assert R == 4, "the vector path below holds four rows' sums"
    # bf16 rows of whole 512-byte warp spans: 16-byte words, the DOWN_ROWS rows' loads in flight
    # together (measured 9 us a 35B-A3B layer at B=1 with a 4-byte-load warp per 1 KB row)
    VEC = not f32 and IW % 128 == 0

    def expert_down_kernel(y, act, w, ids):
        # grid (n*K, ceil(H/(4*R))), block 128: y[pair, i] = down[e, i, :] . act[pair, :] for
        # the R rows i of each warp
        pair = cuda.blockIdx.x
        i0 = (cuda.blockIdx.y * 4 + (cuda.threadIdx.x >> 5)) * R
        lane = cuda.threadIdx.x & 31
        if i0 >= H:
            return
        e = ids[pair]
        ab = pair * inter
        if VEC and i0 + R <= H:
            wb = (int64(e) * H + i0) * IW
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            for it in range(IW // 128):
                c = it * 128 + lane * 4
                a0, a1, a2, a3 = rows4_act(a0, a1, a2, a3, w, wb + c, IW, act, ab + 2 * c)
            a0 = warp_sum(a0)
            a1 = warp_sum(a1)
            a2 = warp_sum(a2)
            a3 = warp_sum(a3)
            if lane == 0:
                y[pair * H + i0] = a0
                y[pair * H + i0 + 1] = a1
                y[pair * H + i0 + 2] = a2
                y[pair * H + i0 + 3] = a3
            return
        for r in range(R):
            i = i0 + r
            if i < H:
                wb = (int64(e) * H + i) * IW
                acc = float32(0.0)
                for c in range(lane, IW, 32):
                    w0, w1 = ld_pair(w, wb + c)
                    acc += w0 * act[ab + 2 * c] + w1 * act[ab + 2 * c + 1]
                acc = warp_sum(acc)
                if lane == 0:
                    y[pair * H + i] = acc
    return expert_down_kernel


def moe_combine(H, K):
    def moe_combine_kernel(h, y, y_row, use_rows, weights, shared, gate_logit, gate_stride):
        # grid (ceil(H/256), n): h += sigmoid(gate) * shared + sum_k w_k * y[row(t, k)]
        # row(t, k) = y_row[t*K + k] (grouped path, expert-sorted rows) or t*K + k
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.y
        if i >= H:
            return
        acc = sigmoid(gate_logit[t * gate_stride]) * shared[t * H + i]
        for k in range(K):
            row = t * K + k
            if use_rows != 0:
                row = y_row[row]
            acc += weights[t * K + k] * y[row * H + i]
        h[t * H + i] += acc
    return moe_combine_kernel


def moe_down_combine(H, inter, shared, K):
    """The decode MoE layer's tail in one launch: the K routed experts' down projections, the
    shared expert's SwiGLU and down projection, the sigmoid-gated combine and the residual add
    (what silu_mul, the shared down GEMV, expert_down and moe_combine do in four; bf16
    weights). A block is DOWN_ROWS output rows of one token, a warp per expert slot and one for
    the shared expert; the routed warps' sums are expert_down's (the same loads and order) and
    the combine is moe_combine's (the same order), so only the shared expert's sums are ordered
    differently from the four-launch path."""
    IW = inter // 2                  # words of a routed expert's down row
    SW = shared // 2                 # words of the shared expert's down row
    R = DOWN_ROWS
    assert R == 4 and H % R == 0 and inter % 2 == 0 and shared % 2 == 0
    # rows of whole 512-byte warp spans: 16-byte words, the R rows' loads in flight together
    VEC, SVEC = IW % 128 == 0, SW % 128 == 0
    PART = (K + 1) * R               # a block's sums: K routed slots' rows, then the shared's

    def moe_down_combine_kernel(h, act, w, ids, weights, proj, P, E, sw):
        # grid (H / R, n), block 32 * (K + 1). act [n*K, inter] fp32 (expert_gate_up's SwiGLU);
        # w [E, H, inter], sw [H, shared] bf16 pairs; proj [n, P] fp32: the router logits
        # [0, E), the shared gate [E, E + shared), up [E + shared, E + 2 * shared) and the
        # shared expert's gate logit at E + 2 * shared. h [n, H] += the layer's output.
        t = cuda.blockIdx.y
        i0 = cuda.blockIdx.x * R
        slot = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        part = cuda.shared.array(PART, float32)
        if slot == K:
            # the shared expert's R rows (contiguous, weights only) asked of L2 before the wait
            # for the kernel before (ptx.grid_wait); the routed rows depend on its ids
            q = lane * LINE
            while q < R * SW:
                prefetch_l2(sw, int64(i0) * SW + q)
                q += 32 * LINE
        grid_wait()
        a0 = float32(0.0)
        a1 = float32(0.0)
        a2 = float32(0.0)
        a3 = float32(0.0)
        if slot < K:
            pair = t * K + slot
            ab = pair * inter
            wb = (int64(ids[pair]) * H + i0) * IW
            if VEC:
                for it in range(IW // 128):
                    c = it * 128 + lane * 4
                    a0, a1, a2, a3 = rows4_act(a0, a1, a2, a3, w, wb + c, IW, act, ab + 2 * c)
            else:
                for c in range(lane, IW, 32):
                    a0, a1, a2, a3 = rows4_pair(a0, a1, a2, a3, w, wb + c, IW,
                                                act[ab + 2 * c], act[ab + 2 * c + 1])
        else:
            # the shared expert's SwiGLU on the fly, rounded to bf16 as silu_mul stores it
            g = t * P + E
            wb = int64(i0) * SW
            if SVEC:
                for it in range(SW // 128):
                    c = it * 128 + lane * 4
                    p0, p1, p2, p3 = ld_v4_stream(sw, wb + c)
                    q0, q1, q2, q3 = ld_v4_stream(sw, wb + SW + c)
                    r0, r1, r2, r3 = ld_v4_stream(sw, wb + 2 * SW + c)
                    s0, s1, s2, s3 = ld_v4_stream(sw, wb + 3 * SW + c)
                    j = g + 2 * c
                    v0 = swiglu_bf16(proj, j, shared)
                    v1 = swiglu_bf16(proj, j + 1, shared)
                    v2 = swiglu_bf16(proj, j + 2, shared)
                    v3 = swiglu_bf16(proj, j + 3, shared)
                    v4 = swiglu_bf16(proj, j + 4, shared)
                    v5 = swiglu_bf16(proj, j + 5, shared)
                    v6 = swiglu_bf16(proj, j + 6, shared)
                    v7 = swiglu_bf16(proj, j + 7, shared)
                    a0 += dot_act(p0, p1, p2, p3, v0, v1, v2, v3, v4, v5, v6, v7)
                    a1 += dot_act(q0, q1, q2, q3, v0, v1, v2, v3, v4, v5, v6, v7)
                    a2 += dot_act(r0, r1, r2, r3, v0, v1, v2, v3, v4, v5, v6, v7)
                    a3 += dot_act(s0, s1, s2, s3, v0, v1, v2, v3, v4, v5, v6, v7)
            else:
                for c in range(lane, SW, 32):
                    j = g + 2 * c
                    a0, a1, a2, a3 = rows4_pair(a0, a1, a2, a3, sw, wb + c, SW,
                                                swiglu_bf16(proj, j, shared),
                                                swiglu_bf16(proj, j + 1, shared))
        a0 = warp_sum(a0)
        a1 = warp_sum(a1)
        a2 = warp_sum(a2)
        a3 = warp_sum(a3)
        if lane == 0:
            part[slot * R] = a0
            part[slot * R + 1] = a1
            part[slot * R + 2] = a2
            part[slot * R + 3] = a3
        cuda.syncthreads()
        r = cuda.threadIdx.x
        if r < R:
            acc = sigmoid(proj[t * P + E + 2 * shared]) * part[K * R + r]
            for k in range(K):
                acc += weights[t * K + k] * part[k * R + r]
            h[t * H + i0 + r] += acc
    return moe_down_combine_kernel


@inlined
def swiglu_bf16(proj, j, shared):
    # silu(gate) * up of column j of the shared expert's gate (up `shared` columns on), rounded
    # to bf16 as silu_mul stores it
    return bf16_round(silu(proj[j]) * proj[j + shared])


@inlined
def rows4_pair(a0, a1, a2, a3, w, i, stride, x0, x1):
    # the four sums of rows i, i + stride, ... (bf16 pair words) after word i's two products
    p0, p1 = bf16_pair(w, i)
    q0, q1 = bf16_pair(w, i + stride)
    r0, r1 = bf16_pair(w, i + 2 * stride)
    s0, s1 = bf16_pair(w, i + 3 * stride)
    return (a0 + (p0 * x0 + p1 * x1), a1 + (q0 * x0 + q1 * x1), a2 + (r0 * x0 + r1 * x1),
            a3 + (s0 * x0 + s1 * x1))


GATHER_THREADS = 128     # gather_rows: 16 bytes a thread, grid.y = ceil(words / (4 * 128))


def gather_rows():
    # rows as 32-bit words (bf16 pairs or fp32, the same copy): 16-byte loads and stores where
    # a row is whole 16-byte groups (aligned: the workspace's rows start 256-byte aligned);
    # measured 11.3 ms of a 35B-A3B 4096-token prefill with a 2-byte element a thread
    def gather_rows_kernel(out, x, src_row, words):
        # out[p, :] = x[src_row[p], :]; grid (rows, ceil(words / (4 * GATHER_THREADS))); a row
        # whose source is -1 (the device route's padding: moe_route_scan) is left as it is
        p = cuda.blockIdx.x
        j = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) * 4
        r = src_row[p]
        if j >= words or r < 0:
            return
        s = int64(r) * words + j
        d = int64(p) * words + j
        if words % 4 == 0:
            a, b, c, e = ld_v4(x, s)
            st_v4(out, d, a, b, c, e)
        else:
            for q in range(min(4, words - j)):
                out[d + q] = x[s + q]
    return gather_rows_kernel


# The MoE prefill's routed-row layout on the device (no host round trip): the router's pairs
# (token t's k-th pick = pair t*K + k) sorted by expert, each expert's rows in pair order, in
# moe_rows.expert_rows' layout for a block size `cap` the host picks from the pairs alone
# (moe_route.device_cap): expert e's rank-r row (its r-th pair) at e*cap + r while r < cap, the
# rest in the overflow region after the E*cap rows of the padded block, expert by expert; cap 0:
# every expert's rows consecutive. Three launches: count each chunk's pairs per expert, scan the
# counts into each chunk's first rank per expert (and each expert's rows, first overflow row and
# the grouped GEMM's addresses), place.
ROUTE_CHUNK = 512        # pairs a chunk (one block of count and place); counts: [chunks, E]
ROUTE_COUNT_THREADS = 256


def moe_route_count(E):
    def moe_route_count_kernel(counts, ids, pairs):
        # grid (chunks,), block ROUTE_COUNT_THREADS: counts[b, e] = pairs of chunk b routed to e
        # (shared-memory atomics: the totals do not depend on their order)
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        c = cuda.shared.array(E, int32)
        for e in range(tid, E, ROUTE_COUNT_THREADS):
            c[e] = 0
        cuda.syncthreads()
        p0 = b * ROUTE_CHUNK
        for p in range(p0 + tid, min(p0 + ROUTE_CHUNK, pairs), ROUTE_COUNT_THREADS):
            cuda.atomic.add(c, ids[p], 1)
        cuda.syncthreads()
        for e in range(tid, E, ROUTE_COUNT_THREADS):
            counts[b * E + e] = c[e]
    return moe_route_count_kernel


def moe_route_scan(E):
    EP = (E + 31) // 32 * 32

    def moe_route_scan_kernel(counts, rows, first, ptrs, spec, src, chunks, nptr, cap, pairs):
        # grid (1,), block EP: a thread an expert. counts [chunks, E] becomes each chunk's first
        # rank among expert e's pairs (chunks in order); rows[e] = expert e's pairs; first[e] =
        # the row of its rank cap (the overflow region, expert-major after the padded block:
        # for cap 0 its first row); ptrs[j, e] = spec[2j] + spec[2j + 1] * first[e]: the
        # addresses of its rows in the buffers cuBLASLt's grouped GEMM reads and writes (a base
        # and a row's bytes each; cap 0). src (row -> token) gets -1 in the rows no pair takes,
        # up to E*cap + pairs: the padded block's unused rows and the rows past the overflow
        e = cuda.threadIdx.x
        tot = cuda.shared.array(EP, int32)
        total = 0
        if e < E:
            for b in range(chunks):
                total += counts[b * E + e]
        over = max(total - cap, 0)
        tot[e] = over
        cuda.syncthreads()
        # inclusive scan over the experts' overflow rows (Hillis-Steele: log2(EP) rounds)
        step = 1
        while step < EP:
            v = 0
            if e >= step:
                v = tot[e - step]
            cuda.syncthreads()
            tot[e] += v
            cuda.syncthreads()
            step *= 2
        used = E * cap + tot[EP - 1]
        for i in range(used + e, E * cap + pairs, EP):
            src[i] = -1
        if e >= E:
            return
        for r in range(min(total, cap), cap):
            src[e * cap + r] = -1
        f = E * cap + tot[e] - over
        run = 0
        for b in range(chunks):
            c = counts[b * E + e]
            counts[b * E + e] = run
            run += c
        rows[e] = total
        first[e] = f
        for j in range(nptr):
            ptrs[j * E + e] = spec[2 * j] + spec[2 * j + 1] * uint64(f)
    return moe_route_scan_kernel


def moe_route_place(E, K):
    def moe_route_place_kernel(src, row_of_pair, ids, rank0, first, cap, pairs):
        # grid (chunks,), block 32: one warp lays chunk b out 32 pairs at a time in pair order.
        # A pair's rank = its expert's next rank in this chunk (rank0[b, e], after the scan) +
        # the lower lanes routed to the same expert; the highest such lane moves the expert on.
        # Its row: e*cap + rank in the padded block, else first[e] + rank - cap (overflow).
        # src[row] = the pair's token; row_of_pair[pair] = row.
        b = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        nxt = cuda.shared.array(E, int32)
        step_ids = cuda.shared.array(32, int32)
        for e in range(lane, E, 32):
            nxt[e] = rank0[b * E + e]
        p0 = b * ROUTE_CHUNK
        for s in range(0, ROUTE_CHUNK, 32):
            p = p0 + s + lane
            e = -1
            if p < pairs:
                e = ids[p]
            step_ids[lane] = e
            cuda.syncthreads()          # (the block is this one warp)
            rank = 0
            last = True
            for j in range(32):
                if step_ids[j] == e:
                    if j < lane:
                        rank += 1
                    elif j > lane:
                        last = False
            rk = 0
            if e >= 0:
                rk = nxt[e] + rank
                row = e * cap + rk
                if rk >= cap:
                    row = first[e] + rk - cap
                src[row] = p // K
                row_of_pair[p] = row
            cuda.syncthreads()
            if e >= 0 and last:
                nxt[e] = rk + 1
            cuda.syncthreads()
    return moe_route_place_kernel


def moe_route_tiles(E, BM):
    EP = (E + 31) // 32 * 32
    assert EP <= 1024           # a thread an expert in one block (as moe_route_scan)

    def moe_route_tiles_kernel(tiles, rows, first, cap, t_cap):
        # grid (1,), block EP: a thread an expert. The grouped GEMM's work list (kernels/
        # grouped_gemm.py) over the overflow rows (moe_route_scan's rows and first; cap 0:
        # every row): expert e's ceil(max(rows[e] - cap, 0) / BM) tiles of BM rows, experts in
        # order, each tile (expert, its first row, its rows: BM or the expert's last few) at
        # tiles[i], tiles[t_cap + i], tiles[2 t_cap + i]; the entries past the last tile:
        # expert -1. t_cap >= ceil(pairs / BM) + E bounds the tiles of any routing
        e = cuda.threadIdx.x
        nt = cuda.shared.array(EP, int32)
        total = 0
        f = 0
        if e < E:
            total = max(rows[e] - cap, 0)
            f = first[e]
        mine = (total + BM - 1) // BM
        nt[e] = mine
        cuda.syncthreads()
        # inclusive scan over the experts' tiles (Hillis-Steele: log2(EP) rounds)
        step = 1
        while step < EP:
            a = 0
            if e >= step:
                a = nt[e - step]
            cuda.syncthreads()
            nt[e] += a
            cuda.syncthreads()
            step *= 2
        first_tile = nt[e] - mine
        for j in range(mine):
            i = first_tile + j
            tiles[i] = e
            tiles[t_cap + i] = f + j * BM
            tiles[2 * t_cap + i] = min(BM, total - j * BM)
        for i in range(nt[EP - 1] + e, t_cap, EP):
            tiles[i] = -1
    return moe_route_tiles_kernel
