"""MoE: softmax router + top-k, and grouped expert SwiGLU as warp-per-row GEMVs over the selected
experts (decode and small batches: every weight row is read once per (token, slot)).

Router logits, the shared expert's gate/up and its sigmoid gate come from one fused GEMM upstream.
`f32` (expert kernels): fp32 activations and expert weights instead of bf16 pairs.
"""
import math

from numba import cuda, float32, int32

from .common import FULL_MASK, inlined, sigmoid, silu, storage, warp_max, warp_sum

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "router_topk": ("i32*", "f32*", "f32*", "i32"),
    "expert_gate_up": ("f32*", "u32*", "u32*", "i32*", "i32"),
    "expert_down": ("f32*", "f32*", "u32*", "i32*"),
    "moe_combine": ("f32*", "f32*", "i32*", "i32", "f32*", "f32*", "f32*", "i32"),
    "gather_rows": ("u16*", "u16*", "i32*", "i32"),
}

THREADS = 256


def router_topk(E, K, norm):
    WARPS = THREADS // 32
    CHUNK = (E + WARPS - 1) // WARPS        # experts per warp
    NCAND = WARPS * K

    @inlined
    def warp_argmax(v, i):
        # (value, index) max over the warp, ties -> lower index; every lane gets the result
        for off in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(FULL_MASK, v, off)
            oi = cuda.shfl_xor_sync(FULL_MASK, i, off)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
        return v, i

    def router_topk_kernel(ids, weights, logits, stride):
        # grid (tokens,), block 256: softmax over E; each warp takes the top K of its slice of
        # experts by warp shuffles, then warp 0 takes the top K of the 8*K candidates
        # (ties -> lower id, like a stable sort); renormalise when `norm`.
        p = cuda.shared.array(E, float32)
        red = cuda.shared.array(WARPS, float32)
        cand_v = cuda.shared.array(NCAND, float32)
        cand_i = cuda.shared.array(NCAND, int32)
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        m = float32(-3.0e38)
        for e in range(tid, E, THREADS):
            m = max(m, logits[t * stride + e])
        m = warp_max(m)
        if lane == 0:
            red[w] = m
        cuda.syncthreads()
        m = red[0]
        for j in range(1, WARPS):
            m = max(m, red[j])
        cuda.syncthreads()
        acc = float32(0.0)
        for e in range(tid, E, THREADS):
            v = math.exp(logits[t * stride + e] - m)
            p[e] = v
            acc += v
        acc = warp_sum(acc)
        if lane == 0:
            red[w] = acc
        cuda.syncthreads()
        total = float32(0.0)
        for j in range(WARPS):
            total += red[j]
        e0 = w * CHUNK
        e1 = min(E, e0 + CHUNK)
        for k in range(K):
            bv = float32(-1.0)
            bi = int32(E)
            for e in range(e0 + lane, e1, 32):
                if p[e] > bv:
                    bv = p[e]
                    bi = e
            bv, bi = warp_argmax(bv, bi)
            if lane == 0:
                cand_v[w * K + k] = bv
                cand_i[w * K + k] = bi
                if bi < E:
                    p[bi] = float32(-2.0)
            cuda.syncwarp(FULL_MASK)
        cuda.syncthreads()
        if w == 0:
            picked = float32(0.0)
            for k in range(K):
                bv = float32(-3.0)
                bi = int32(E + 1)
                slot = int32(0)
                for c in range(lane, NCAND, 32):
                    if cand_v[c] > bv or (cand_v[c] == bv and cand_i[c] < bi):
                        bv = cand_v[c]
                        bi = cand_i[c]
                        slot = c
                bv2, bi2 = warp_argmax(bv, bi)
                if bi == bi2 and bv == bv2:
                    cand_v[slot] = float32(-3.0)       # the owning lane retires the winner
                cuda.syncwarp(FULL_MASK)
                if lane == 0:
                    ids[t * K + k] = bi2
                    weights[t * K + k] = bv2 / total
                picked += bv2 / total
            if norm:
                cuda.syncwarp(FULL_MASK)
                for k in range(lane, K, 32):
                    weights[t * K + k] = weights[t * K + k] / picked
    return router_topk_kernel


def expert_gate_up(H, inter, f32=False):
    HP = H // 2
    _, _, ld_pair, rounded = storage(f32)

    def expert_gate_up_kernel(act, x, w, ids, K):
        # grid (n*K, ceil(inter/4)), block 128: warp -> output j: silu(g_j . x) * (u_j . x)
        pair = cuda.blockIdx.x
        j = cuda.blockIdx.y * 4 + (cuda.threadIdx.x >> 5)
        lane = cuda.threadIdx.x & 31
        if j >= inter:
            return
        e = ids[pair]
        t = pair // K
        gb = (e * 2 * inter + j) * HP
        ub = (e * 2 * inter + inter + j) * HP
        xb = t * HP
        g = float32(0.0)
        u = float32(0.0)
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
    return expert_gate_up_kernel


def expert_down(H, inter, f32=False):
    ld_pair = storage(f32)[2]

    def expert_down_kernel(y, act, w, ids):
        # grid (n*K, ceil(H/4)), block 128: y[pair, i] = down[e, i, :] . act[pair, :]
        pair = cuda.blockIdx.x
        i = cuda.blockIdx.y * 4 + (cuda.threadIdx.x >> 5)
        lane = cuda.threadIdx.x & 31
        if i >= H:
            return
        e = ids[pair]
        wb = (e * H + i) * (inter // 2)
        ab = pair * inter
        acc = float32(0.0)
        for c in range(lane, inter // 2, 32):
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


def gather_rows(f32=False):
    # `f32` only selects the signature (fp32 rows): the copy is the same
    def gather_rows_kernel(out, x, src_row, width):
        # out[p, :] = x[src_row[p], :] (bf16 rows); grid (rows, ceil(width/256))
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        p = cuda.blockIdx.x
        if j < width:
            out[p * width + j] = x[src_row[p] * width + j]
    return gather_rows_kernel

