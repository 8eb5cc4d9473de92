"""MoE: softmax router + top-k, and grouped expert SwiGLU as warp-per-row GEMVs over the selected
experts (decode and small batches: every weight row is read once per (token, slot)).

Router logits, the shared expert's gate/up and its sigmoid gate come from one fused GEMM upstream.
"""
import math

from numba import cuda, float32, int32

from .common import bf16x2_hi, bf16x2_lo, sigmoid, silu, warp_sum

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
            act[pair * inter + j] = silu(g) * u
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
    def moe_combine_kernel(h, y, weights, shared, gate_logit, gate_stride):
        # grid (ceil(H/256), n): h += sigmoid(gate) * shared + sum_k w_k * y_k
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.y
        if i >= H:
            return
        acc = sigmoid(gate_logit[t * gate_stride]) * shared[t * H + i]
        for k in range(K):
            acc += weights[t * K + k] * y[(t * K + k) * H + i]
        h[t * H + i] += acc
    return moe_combine_kernel
