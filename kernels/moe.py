"""MoE: softmax router + top-k, and grouped expert SwiGLU as warp-per-row GEMVs over the selected
experts (decode and small batches: every weight row is read once per (token, slot)).

Router logits, the shared expert's gate/up and its sigmoid gate come from one fused GEMM upstream.
"""
import math

from numba import cuda, float32, int32

from .common import (bf16_to_f32, bf16x2_hi, bf16x2_lo, block_sum, f32_to_bf16, sigmoid, silu,
                     warp_sum)

THREADS = 256


def router_topk(E, K, norm):
    def router_topk_kernel(ids, weights, logits, stride):
        # grid (tokens,), block 256: softmax over E, top-K (ties -> lower id), renormalise
        p = cuda.shared.array(E, float32)
        red_v = cuda.shared.array(THREADS, float32)
        red_i = cuda.shared.array(THREADS, int32)
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        m = float32(-3.0e38)
        for e in range(tid, E, THREADS):
            m = max(m, logits[t * stride + e])
        red_v[tid] = m
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                red_v[tid] = max(red_v[tid], red_v[tid + step])
            cuda.syncthreads()
            step //= 2
        m = red_v[0]
        cuda.syncthreads()
        acc = float32(0.0)
        for e in range(tid, E, THREADS):
            v = math.exp(logits[t * stride + e] - m)
            p[e] = v
            acc += v
        red_v[tid] = acc
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                red_v[tid] += red_v[tid + step]
            cuda.syncthreads()
            step //= 2
        total = red_v[0]
        cuda.syncthreads()
        picked = float32(0.0)
        for k in range(K):
            bv = float32(-1.0)
            bi = int32(E)
            for e in range(tid, E, THREADS):
                if p[e] > bv:
                    bv = p[e]
                    bi = e
            red_v[tid] = bv
            red_i[tid] = bi
            cuda.syncthreads()
            step = THREADS // 2
            while step > 0:
                if tid < step:
                    ov = red_v[tid + step]
                    oi = red_i[tid + step]
                    if ov > red_v[tid] or (ov == red_v[tid] and oi < red_i[tid]):
                        red_v[tid] = ov
                        red_i[tid] = oi
                cuda.syncthreads()
                step //= 2
            if tid == 0:
                ids[t * K + k] = red_i[0]
                weights[t * K + k] = red_v[0] / total
                p[red_i[0]] = float32(-2.0)
            picked += red_v[0] / total
            cuda.syncthreads()
        if norm and tid < K:
            weights[t * K + tid] = weights[t * K + tid] / picked
    return router_topk_kernel


def expert_gate_up(H, inter):
    HP = H // 2

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
            xp = x[xb + c]
            x0 = bf16x2_lo(xp)
            x1 = bf16x2_hi(xp)
            gp = w[gb + c]
            up = w[ub + c]
            g += bf16x2_lo(gp) * x0 + bf16x2_hi(gp) * x1
            u += bf16x2_lo(up) * x0 + bf16x2_hi(up) * x1
        g = warp_sum(g)
        u = warp_sum(u)
        if lane == 0:
            # rounded to bf16 like the grouped (cuBLASLt) path's GEMM input, so both paths agree
            act[pair * inter + j] = bf16_to_f32(f32_to_bf16(silu(g) * u))
    return expert_gate_up_kernel


def expert_down(H, inter):
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
            p = w[wb + c]
            acc += bf16x2_lo(p) * act[ab + 2 * c] + bf16x2_hi(p) * act[ab + 2 * c + 1]
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


def gather_rows():
    def gather_rows_kernel(out, x, src_row, width):
        # out[p, :] = x[src_row[p], :] (bf16 rows); grid (rows, ceil(width/256))
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        p = cuda.blockIdx.x
        if j < width:
            out[p * width + j] = x[src_row[p] * width + j]
    return gather_rows_kernel


def router_fp32(H, E):
    HP = H // 2

    def router_fp32_kernel(logits, stride, w, h, norm_w, eps):
        # grid (tokens,), block 256: logits[t, e] = W_e . rmsnorm(h_t) with the normalised row in
        # fp32 (the GEMMs take it in bf16; routing is kept at fp32 input precision because a
        # rounded input flips near-tie top-k choices). W (bf16 pairs) = the first E rows of w_rs.
        xs = cuda.shared.array(H, float32)
        scratch = cuda.shared.array(32, float32)
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        acc = float32(0.0)
        for j in range(tid, H, 256):
            v = h[t * H + j]
            acc += v * v
        inv = float32(1.0) / math.sqrt(block_sum(acc, scratch) / float32(H) + eps)
        for j in range(tid, H, 256):
            xs[j] = h[t * H + j] * inv * (float32(1.0) + norm_w[j])
        cuda.syncthreads()
        lane = tid & 31
        for e in range(tid >> 5, E, 8):
            d = float32(0.0)
            for c in range(lane, HP, 32):
                p = w[e * HP + c]
                d += bf16x2_lo(p) * xs[2 * c] + bf16x2_hi(p) * xs[2 * c + 1]
            d = warp_sum(d)
            if lane == 0:
                logits[t * stride + e] = d
    return router_fp32_kernel
