"""Prefill attention on tensor cores: the small kernels around two cuBLASLt GEMMs per kv head and
query block (ninfer/models/qwen3_5/cuda/attention_tc.py drives them).

    kv_gather   paged bf16 K, V of one row -> contiguous kc[g, j, :], vc[g, j, :] (rows past the
                row's keys zero-filled up to the padded length, so GEMMs over padded keys read 0);
                `kvq` "fp8" / "int8": from pools of codes (read as "u16*" pairs) and scales
                (common.kvq_row), each value decoded, times its scale, rounded to bf16
    q_to_bf16   fp32 q [t, nh, hd] -> bf16 qb[g, t, gi, :] (a kv group's query heads stacked as
                consecutive GEMM rows: one S = Q K^T per group serves all its G heads)
Rows of qb, kc, vc and o are HDP = hd rounded up to 8 wide, zero past hd: every GEMM operand's
leading dimension is then a multiple of 16 bytes (head_dim 20 exists: the odd_heads fixture).
    causal_softmax  S (fp32, one query row per block) -> P (bf16) = softmax(scale * S) over the
                row's causal keys, 0 past them
    attn_gate_tc  o[g, t, gi, :] * sigmoid(gate) -> bf16 [t, nh*hd] for o_proj
"""
import math

from numba import cuda, float32, int64, uint32

from .common import block_sum, f32_to_bf16, inlined, kv_codec, kvq_row, sigmoid, u16_pair_f32, \
    warp_max
from .ptx import ld_v4_f32

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "kv_gather": ("u32*", "u32*", "u32*", "u32*", "i32*", "i32", "i32", "i32", "i32", "i32", "i32"),
    "q_to_bf16": ("u16*", "f32*", "i32", "i32"),
    "causal_softmax": ("u16*", "f32*", "i32", "i32", "f32"),
    "causal_softmax_reg": ("u16*", "f32*", "i32", "i32", "f32"),
    "attn_gate_tc": ("u16*", "f32*", "f32*", "i32", "i32", "i32"),
}

NEG_INF = float32(-3.0e38)
KB = 8            # keys per kv_gather block


def _hdp(hd):
    return (hd + 7) // 8 * 8
SM_THREADS = 256  # causal_softmax block (a power of two: tree reduction)


def _code_pairs(kvq):
    """pair(cache, i, scale) -> the bf16 pair (u32) of u16 code pair i times scale."""
    value = kv_codec(kvq)[1]

    @inlined
    def pair(cache, i, scale):
        p = uint32(cache[i])
        return f32_to_bf16(value(p & uint32(0xFF)) * scale) | \
            (f32_to_bf16(value(p >> uint32(8)) * scale) << uint32(16))
    return pair


def kv_gather(hd, nkv, kvq=""):
    # kvq: the k_cache / v_cache arguments are "u16*" (kernel_set.KVQ_VARIANTS)
    HP = hd // 2         # u32 (bf16 pairs; kvq: u16 code pairs) per pool row
    HPP = _hdp(hd) // 2  # u32 per gathered row
    quant = bool(kvq)
    pair = _code_pairs(kvq) if quant else None

    def kv_gather_kernel(kc, vc, k_cache, v_cache, block_tables, row, bt_stride, page_size,
                         n_keys, n_pad, g_stride):
        # grid (ceil(n_pad / KB), nkv); kc/vc: u32 [nkv, g_stride, HPP]
        g = cuda.blockIdx.y
        j0 = cuda.blockIdx.x * KB
        for idx in range(cuda.threadIdx.x, KB * HPP, cuda.blockDim.x):
            j = j0 + idx // HPP
            e = idx % HPP
            if j < n_pad:
                dst = (g * g_stride + j) * HPP + e
                if j < n_keys and e < HP:
                    page = block_tables[row * bt_stride + j // page_size]
                    if quant:
                        r0, sb = kvq_row(page, j % page_size, g, page_size, nkv, hd)
                        kc[dst] = pair(k_cache, r0 // 2 + e, u16_pair_f32(k_cache, sb // 2))
                        vc[dst] = pair(v_cache, r0 // 2 + e, u16_pair_f32(v_cache, sb // 2))
                    else:
                        src = ((page * page_size + j % page_size) * nkv + g) * HP + e
                        kc[dst] = k_cache[src]
                        vc[dst] = v_cache[src]
                else:
                    kc[dst] = 0
                    vc[dst] = 0
    return kv_gather_kernel


def q_to_bf16(hd, G, nkv):
    nh = G * nkv
    HDP = _hdp(hd)

    def q_to_bf16_kernel(qb, q, t_base, t_stride):
        # grid (tokens, nh); token t = t_base + blockIdx.x; qb: u16 [nkv, t_stride, G, HDP]
        t = t_base + cuda.blockIdx.x
        h = cuda.blockIdx.y
        g = h // G
        gi = h % G
        for d in range(cuda.threadIdx.x, HDP, cuda.blockDim.x):
            v = float32(0.0)
            if d < hd:
                v = q[(t * nh + h) * hd + d]
            qb[((g * t_stride + t) * G + gi) * HDP + d] = f32_to_bf16(v)
    return q_to_bf16_kernel


def causal_softmax(G):
    def causal_softmax_kernel(p, s, n_cols, first_len, scale):
        # grid (rows,), block SM_THREADS. Row r = (local token r // G, head r % G) sees keys
        # [0, first_len + r // G); s: f32 [rows, n_cols], p: u16 [rows, n_cols]
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        valid = first_len + r // G
        base = r * n_cols
        m = NEG_INF
        sm = float32(0.0)
        for j in range(tid, valid, SM_THREADS):
            x = s[base + j] * scale
            if x > m:
                sm = sm * math.exp(m - x) + float32(1.0)
                m = x
            else:
                sm += math.exp(x - m)
        # block reduce of (max, rescaled sum): a shared-memory tree (the row's one reduction)
        sh_m = cuda.shared.array(SM_THREADS, float32)
        sh_s = cuda.shared.array(SM_THREADS, float32)
        sh_m[tid] = m
        sh_s[tid] = sm
        cuda.syncthreads()
        half = SM_THREADS // 2
        while half > 0:
            if tid < half:
                m1 = sh_m[tid]
                m2 = sh_m[tid + half]
                mm = max(m1, m2)
                t1 = float32(0.0)
                t2 = float32(0.0)
                if m1 > NEG_INF:
                    t1 = sh_s[tid] * math.exp(m1 - mm)
                if m2 > NEG_INF:
                    t2 = sh_s[tid + half] * math.exp(m2 - mm)
                sh_m[tid] = mm
                sh_s[tid] = t1 + t2
            cuda.syncthreads()
            half //= 2
        tm = sh_m[0]
        ts = sh_s[0]
        inv = float32(1.0) / ts
        for j in range(tid, n_cols, SM_THREADS):
            v = float32(0.0)
            if j < valid:
                v = math.exp(s[base + j] * scale - tm) * inv
            p[base + j] = f32_to_bf16(v)
    return causal_softmax_kernel


SMR_COLS = 8192   # causal_softmax_reg: rows of up to this many columns (SM_THREADS x 32 floats)


def causal_softmax_reg(G):
    """causal_softmax with the row in registers: each thread's columns (groups of four, 16-byte
    loads) read once, the max and the sum of exp(x - max) each through warp shuffles and one
    shared-memory step, one exp an element, the bf16 row written from the registers. The
    online form above reads the row twice and takes two exps an element (27B prefill of 4096:
    18 ms). Rows of at most SMR_COLS columns, n_cols a multiple of 4 (attend_row's pad8)."""
    GROUPS = SMR_COLS // (4 * SM_THREADS)    # a thread's 16-byte groups
    NL = 4 * GROUPS
    WARPS = SM_THREADS // 32

    def causal_softmax_reg_kernel(p, s, n_cols, first_len, scale):
        # grid (rows,), block SM_THREADS; as causal_softmax: row r = (local token r // G, head
        # r % G) sees keys [0, first_len + r // G); s f32 [rows, n_cols], p u16 [rows, n_cols]
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        red = cuda.shared.array(WARPS, float32)
        scratch = cuda.shared.array(32, float32)
        valid = first_len + r // G
        base = int64(r) * n_cols
        xs = cuda.local.array(NL, float32)
        m = NEG_INF
        for k in range(GROUPS):
            j = 4 * (tid + k * SM_THREADS)
            x0 = NEG_INF
            x1 = NEG_INF
            x2 = NEG_INF
            x3 = NEG_INF
            if j < valid:           # (j + 3 < n_cols: rows of whole groups of four)
                a0, a1, a2, a3 = ld_v4_f32(s, base + j)
                x0 = a0 * scale
                if j + 1 < valid:
                    x1 = a1 * scale
                if j + 2 < valid:
                    x2 = a2 * scale
                if j + 3 < valid:
                    x3 = a3 * scale
            xs[4 * k] = x0
            xs[4 * k + 1] = x1
            xs[4 * k + 2] = x2
            xs[4 * k + 3] = x3
            m = max(m, max(max(x0, x1), max(x2, x3)))
        m = warp_max(m)
        if lane == 0:
            red[wid] = m
        cuda.syncthreads()
        m = red[0]
        for w in range(1, WARPS):
            m = max(m, red[w])
        sm = float32(0.0)
        for i in range(NL):
            e = float32(0.0)
            if xs[i] > NEG_INF:
                e = math.exp(xs[i] - m)
            xs[i] = e
            sm += e
        inv = float32(1.0) / block_sum(sm, scratch)
        for k in range(GROUPS):
            j = 4 * (tid + k * SM_THREADS)
            if j < n_cols:
                o = base + j
                p[o] = f32_to_bf16(xs[4 * k] * inv)
                p[o + 1] = f32_to_bf16(xs[4 * k + 1] * inv)
                p[o + 2] = f32_to_bf16(xs[4 * k + 2] * inv)
                p[o + 3] = f32_to_bf16(xs[4 * k + 3] * inv)
    return causal_softmax_reg_kernel


def attn_gate_tc(hd, G, nkv):
    nh = G * nkv
    HDP = _hdp(hd)

    def attn_gate_tc_kernel(out, o, proj, proj_stride, t_base, t_stride):
        # grid (tokens, nh); o: f32 [nkv, t_stride, G, HDP] -> out u16 [t, nh*hd]
        t = t_base + cuda.blockIdx.x
        h = cuda.blockIdx.y
        g = h // G
        gi = h % G
        for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
            gate = proj[t * proj_stride + h * 2 * hd + hd + d]
            v = o[((g * t_stride + t) * G + gi) * HDP + d]
            out[(t * nh + h) * hd + d] = f32_to_bf16(v * sigmoid(gate))
    return attn_gate_tc_kernel
