"""The vision tower's kernels around cuBLASLt's GEMMs (ninfer/models/qwen3_5/cuda/vision.py):
LayerNorm with bias, bias + GELU (or a plain cast: the pixels), bias added into the fp32 residual
(with the bilinear position embedding after the patch GEMM),
the 2-D rotary of q and k out of the qkv GEMM into head-major buffers, and the attention scores'
row softmax; in bf16, attention in one kernel on the tensor cores instead (vis_flash_attention:
the scores never leave the chip). Inputs fp32; outputs that feed a GEMM are bf16 (fp32 with
`f32`). The numpy tower
(ninfer/models/qwen3_5/vision_tower.py) is the specification of each."""
import math

from numba import cuda, float32, int64, uint32

from .common import FULL_MASK, block_max, block_sum, inlined, storage
from .ptx import cvt_bf16x2, mma_bf16

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "vis_layernorm": ("u16*", "f32*", "f32*", "f32*", "i32", "f32"),
    "vis_bias_act": ("u16*", "f32*", "f32*", "i32", "i32"),
    "vis_add_bias": ("f32*", "f32*", "i32"),
    "vis_pos_embed": ("f32*", "f32*", "f32*", "i32*", "f32*", "i32"),
    "vis_qkv_rope": ("u16*", "u16*", "u16*", "f32*", "f32*", "f32*", "f32*", "i32", "i32",
                     "i32"),
    "vis_softmax": ("u16*", "f32*", "i32", "f32"),
    "vis_flash_attention": ("u16*", "u32*", "u32*", "u32*", "i32", "i32", "i32", "i32", "f32"),
}

GELU_TANH, GELU_ERF = 1, 2          # vis_bias_act's `act` (0: none, a plain cast)


def vis_layernorm(f32=False):
    store = storage(f32)[0]

    def vis_layernorm_kernel(out, x, w, b, width, eps):
        # out[r] = (x[r] - mean) / sqrt(var + eps) * w + b over fp32 rows of `width` (two passes:
        # the variance of the deviations, as the numpy tower); grid (rows,)
        scratch = cuda.shared.array(32, float32)
        base = int64(cuda.blockIdx.x) * width
        acc = float32(0.0)
        for j in range(cuda.threadIdx.x, width, cuda.blockDim.x):
            acc += x[base + j]
        mean = block_sum(acc, scratch) / float32(width)
        acc = float32(0.0)
        for j in range(cuda.threadIdx.x, width, cuda.blockDim.x):
            d = x[base + j] - mean
            acc += d * d
        inv = float32(1.0) / math.sqrt(block_sum(acc, scratch) / float32(width) + eps)
        for j in range(cuda.threadIdx.x, width, cuda.blockDim.x):
            out[base + j] = store((x[base + j] - mean) * inv * w[j] + b[j])
    return vis_layernorm_kernel


def vis_bias_act(f32=False):
    store = storage(f32)[0]

    def vis_bias_act_kernel(out, y, bias, width, act):
        # out[t, j] = act(y[t, j] + bias[j]): act 0 none, 1 GELU (tanh), 2 GELU (erf);
        # grid (rows, ceil(width / blockDim)): rows on x (up to 2^31 - 1)
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if j < width:
            i = int64(cuda.blockIdx.x) * width + j
            v = y[i] + bias[j]
            if act == 1:
                v = float32(0.5) * v * (float32(1.0) + math.tanh(
                    float32(0.7978845608028654) * (v + float32(0.044715) * v * v * v)))
            elif act == 2:
                v = float32(0.5) * v * (float32(1.0) + math.erf(v * float32(0.7071067811865476)))
            out[i] = store(v)
    return vis_bias_act_kernel


def vis_add_bias():
    def vis_add_bias_kernel(h, bias, width):
        # h[t, j] += bias[j]; grid (rows, ceil(width / blockDim))
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if j < width:
            i = int64(cuda.blockIdx.x) * width + j
            h[i] = h[i] + bias[j]
    return vis_add_bias_kernel


def vis_pos_embed():
    def vis_pos_embed_kernel(h, bias, table, index, weight, width):
        # the patch embedding's bias and its position: h[t, j] += bias[j] + the table's rows
        # index[t, 0..3] times weight[t, 0..3], summed in order (the bilinear resampling's taps,
        # vision_tower.pos_embed_taps); grid (rows, ceil(width / blockDim))
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if j < width:
            t = int64(cuda.blockIdx.x)
            pos = table[int64(index[4 * t]) * width + j] * weight[4 * t]
            for tap in range(1, 4):
                pos += table[int64(index[4 * t + tap]) * width + j] * weight[4 * t + tap]
            i = t * width + j
            h[i] = h[i] + bias[j] + pos
    return vis_pos_embed_kernel


def vis_qkv_rope(f32=False):
    store = storage(f32)[0]

    def vis_qkv_rope_kernel(q, k, v, qkv, bias, cos, sin, n, heads, hd):
        # qkv [n, 3, heads, hd] fp32 (the GEMM's, without its bias) -> q, k, v [heads, n, hd]
        # (the attention GEMMs' operands, one head's rows contiguous); q and k rotated:
        # x * cos + rotate_half(x) * sin with cos, sin [n, hd]; grid (n, heads)
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        width = heads * hd
        half = hd // 2
        src = int64(t) * 3 * width + h * hd
        cs = int64(t) * hd
        dst = (int64(h) * n + t) * hd
        for j in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
            if j < half:
                jr = j + half
                sign = float32(-1.0)
            else:
                jr = j - half
                sign = float32(1.0)
            c = cos[cs + j]
            s = sin[cs + j]
            for part in range(2):
                off = part * width + h * hd
                x = qkv[src + part * width + j] + bias[off + j]
                xr = qkv[src + part * width + jr] + bias[off + jr]
                val = x * c + sign * xr * s
                if part == 0:
                    q[dst + j] = store(val)
                else:
                    k[dst + j] = store(val)
            v[dst + j] = store(qkv[src + 2 * width + j] + bias[2 * width + h * hd + j])
    return vis_qkv_rope_kernel


def vis_softmax(f32=False):
    store = storage(f32)[0]

    def vis_softmax_kernel(p, s, cols, scale):
        # p[r] = softmax(s[r] * scale) over fp32 rows of `cols` (attention scores: one row per
        # query and head); grid (rows,). The row is read twice: each thread's running maximum
        # and its sum rescaled to it in one pass (the "online" softmax), then the outputs.
        scratch = cuda.shared.array(32, float32)
        base = int64(cuda.blockIdx.x) * cols
        m = float32(-3.0e38)
        acc = float32(0.0)
        for j in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
            x = s[base + j]
            if x > m:
                acc *= math.exp((m - x) * scale)
                m = x
            acc += math.exp((x - m) * scale)
        row_max = block_max(m, scratch)
        inv = float32(1.0) / block_sum(acc * math.exp((m - row_max) * scale), scratch)
        for j in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
            p[base + j] = store(math.exp((s[base + j] - row_max) * scale) * inv)
    return vis_softmax_kernel


FA_WARPS = 4                 # vis_flash_attention: warps per block, 16 query rows each
FA_ROWS = 16 * FA_WARPS      # query rows per block
FA_KEYS = 64                 # keys per step (staged in shared memory)


def vis_flash_attention(hd):
    KS = (hd + 15) // 16     # k-steps of S = Q K^T (head dims padded to 16, zeros past hd)
    HP = hd // 2             # bf16 pairs (u32) per q / k / v row
    KP = 8 * KS + 4          # u32 per staged K row: padded dims, + 4 (no shared bank conflicts)
    NT = hd // 8             # 8-wide output tiles (hd a multiple of 8)
    VP = FA_KEYS // 2 + 4    # u32 per staged V column: key pairs, + 4 (no bank conflicts)
    # (array sizes: names of the factory, constants to numba's typing; an expression is not)
    K_WORDS, V_WORDS, Q_REGS, O_REGS = FA_KEYS * KP, hd * VP, 4 * KS, 4 * NT
    # a step's K and V tiles are FA_KEYS * HP consecutive words each (a head's rows are
    # contiguous): each thread loads K_LOADS words of K and V_LOADS pairs of V rows (hd a
    # multiple of 8 makes both whole), into registers a step ahead of their use
    K_LOADS, V_LOADS = FA_KEYS * HP // (32 * FA_WARPS), FA_KEYS * HP // (64 * FA_WARPS)

    @inlined
    def _fa_load(k, v, kreg, vlo, vhi, base, valid, tid):
        # K words base + w (w < valid: the frame's keys; zeros past them), V rows 2jp, 2jp + 1
        # (32-bit offsets: a head's q / k / v hold < 2^31 words, and they take fewer registers)
        for i in range(K_LOADS):
            w = uint32(tid + 32 * FA_WARPS * i)
            val = uint32(0)
            if w < valid:
                val = k[base + w]
            kreg[i] = val
        for i in range(V_LOADS):
            w = uint32(tid + 32 * FA_WARPS * i)
            jp = w // uint32(HP)
            at = w + jp * uint32(HP)                    # row 2jp's word e = w - jp * HP
            lo = uint32(0)
            hi = uint32(0)
            if at < valid:
                lo = v[base + at]
            if at + HP < valid:
                hi = v[base + at + HP]
            vlo[i] = lo
            vhi[i] = hi

    def vis_flash_attention_kernel(out, q, k, v, n, L, start, width, scale):
        # softmax(scale * q k^T) v within one frame, patches [start, start + L), every head:
        # q, k, v bf16 [heads, n, hd] (pairs), out bf16 [n, width] at columns h * hd + d.
        # grid (ceil(L / FA_ROWS), heads), block 32 * FA_WARPS. Each warp holds 16 query rows'
        # Q, running max, sum and output in registers (mma.m16n8k16 fragments) and walks the
        # keys FA_KEYS at a time: S (fp32) -> P = exp(S - max) in bf16 -> O += P V, rescaled
        # as the max moves (the "online" softmax); one division at the end
        ks = cuda.shared.array(K_WORDS, uint32)        # K rows [key, dim pair]
        vt = cuda.shared.array(V_WORDS, uint32)        # V transposed: [dim, key pair]
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t4 = lane & 3
        row0 = cuda.blockIdx.x * FA_ROWS + warp * 16
        head = int64(cuda.blockIdx.y) * n + start        # the frame's first row in head h
        qa = cuda.local.array(Q_REGS, uint32)
        for st in range(KS):
            for part in range(4):
                r = row0 + g + 8 * (part & 1)
                c = 16 * st + 2 * t4 + 8 * (part >> 1)
                val = uint32(0)
                if r < L and c < hd:
                    val = q[(head + r) * HP + c // 2]
                qa[4 * st + part] = val
        o = cuda.local.array(O_REGS, float32)
        for j in range(O_REGS):
            o[j] = float32(0.0)
        sc = cuda.local.array(32, float32)              # S of 16 rows x 64 keys: 8 tiles
        m0 = float32(-3.0e38)                           # rows g and g + 8: max, partial sums
        m1 = float32(-3.0e38)
        l0 = float32(0.0)
        l1 = float32(0.0)
        for idx in range(tid, K_WORDS, 32 * FA_WARPS):  # (the rows' padding stays 0)
            ks[idx] = uint32(0)
        kreg = cuda.local.array(K_LOADS, uint32)
        vlo = cuda.local.array(V_LOADS, uint32)
        vhi = cuda.local.array(V_LOADS, uint32)
        kv0 = uint32((cuda.blockIdx.y * n + start) * HP)  # the frame's first K / V word
        _fa_load(k, v, kreg, vlo, vhi, kv0, uint32(min(FA_KEYS, L) * HP), tid)
        for kb in range(0, L, FA_KEYS):
            cuda.syncthreads()                          # (the last step's reads are done)
            for i in range(K_LOADS):
                w = uint32(tid + 32 * FA_WARPS * i)
                j = w // uint32(HP)
                ks[j * uint32(KP) + w - j * uint32(HP)] = kreg[i]
            for i in range(V_LOADS):
                # key pair jp's dims 2e, 2e + 1, each dim's two keys in one word (V^T)
                w = uint32(tid + 32 * FA_WARPS * i)
                jp = w // uint32(HP)
                e = w - jp * uint32(HP)
                vt[2 * e * uint32(VP) + jp] = (vlo[i] & uint32(0xFFFF)) | (vhi[i] << uint32(16))
                vt[(2 * e + 1) * uint32(VP) + jp] = (vlo[i] >> uint32(16)) \
                    | (vhi[i] & uint32(0xFFFF0000))
            cuda.syncthreads()
            if kb + FA_KEYS < L:                        # the next step's tiles, in flight
                _fa_load(k, v, kreg, vlo, vhi, uint32(kv0 + (kb + FA_KEYS) * HP),
                         uint32(min(FA_KEYS, L - kb - FA_KEYS) * HP), tid)
            mx0 = float32(-3.0e38)
            mx1 = float32(-3.0e38)
            for j in range(8):
                c0 = float32(0.0)
                c1 = float32(0.0)
                c2 = float32(0.0)
                c3 = float32(0.0)
                kr = (8 * j + g) * KP
                for st in range(KS):
                    c0, c1, c2, c3 = mma_bf16(qa[4 * st], qa[4 * st + 1], qa[4 * st + 2],
                                              qa[4 * st + 3], ks[kr + 8 * st + t4],
                                              ks[kr + 8 * st + 4 + t4], c0, c1, c2, c3)
                key = kb + 8 * j + 2 * t4               # D's columns: keys key, key + 1
                if key >= L:
                    c0 = float32(-3.0e38)
                    c2 = float32(-3.0e38)
                else:
                    c0 *= scale
                    c2 *= scale
                if key + 1 >= L:
                    c1 = float32(-3.0e38)
                    c3 = float32(-3.0e38)
                else:
                    c1 *= scale
                    c3 *= scale
                sc[4 * j] = c0
                sc[4 * j + 1] = c1
                sc[4 * j + 2] = c2
                sc[4 * j + 3] = c3
                mx0 = max(mx0, max(c0, c1))
                mx1 = max(mx1, max(c2, c3))
            for lanes in (1, 2):                        # a row's 4 lanes: its 64 keys
                mx0 = max(mx0, cuda.shfl_xor_sync(FULL_MASK, mx0, lanes))
                mx1 = max(mx1, cuda.shfl_xor_sync(FULL_MASK, mx1, lanes))
            mn0 = max(m0, mx0)
            mn1 = max(m1, mx1)
            a0 = math.exp(m0 - mn0)
            a1 = math.exp(m1 - mn1)
            m0 = mn0
            m1 = mn1
            l0 *= a0
            l1 *= a1
            for j in range(NT):
                o[4 * j] *= a0
                o[4 * j + 1] *= a0
                o[4 * j + 2] *= a1
                o[4 * j + 3] *= a1
            for j in range(8):
                sc[4 * j] = math.exp(sc[4 * j] - m0)
                sc[4 * j + 1] = math.exp(sc[4 * j + 1] - m0)
                sc[4 * j + 2] = math.exp(sc[4 * j + 2] - m1)
                sc[4 * j + 3] = math.exp(sc[4 * j + 3] - m1)
                l0 += sc[4 * j] + sc[4 * j + 1]
                l1 += sc[4 * j + 2] + sc[4 * j + 3]
            for t in range(4):                          # O += P V over keys 16t .. 16t + 15:
                # S's tiles 2t, 2t + 1 are P's A fragment as they lie in the registers
                pa0 = cvt_bf16x2(sc[8 * t + 1], sc[8 * t])
                pa1 = cvt_bf16x2(sc[8 * t + 3], sc[8 * t + 2])
                pa2 = cvt_bf16x2(sc[8 * t + 5], sc[8 * t + 4])
                pa3 = cvt_bf16x2(sc[8 * t + 7], sc[8 * t + 6])
                for j in range(NT):
                    # B[key, dim 8j + g]: keys 16t + 2t4, + 1 (b0) and + 8, + 9 (b1)
                    w = (8 * j + g) * VP + 8 * t + t4
                    o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3] = mma_bf16(
                        pa0, pa1, pa2, pa3, vt[w], vt[w + 4], o[4 * j], o[4 * j + 1], o[4 * j + 2],
                        o[4 * j + 3])
        for lanes in (1, 2):
            l0 += cuda.shfl_xor_sync(FULL_MASK, l0, lanes)
            l1 += cuda.shfl_xor_sync(FULL_MASK, l1, lanes)
        inv0 = float32(1.0) / l0
        inv1 = float32(1.0) / l1
        col = cuda.blockIdx.y * hd + 2 * t4
        for j in range(NT):
            for half in range(2):
                r = row0 + g + 8 * half
                if r < L:
                    inv = inv1 if half else inv0
                    pair = cvt_bf16x2(o[4 * j + 2 * half + 1] * inv, o[4 * j + 2 * half] * inv)
                    at = (int64(start) + r) * width + col + 8 * j
                    out[at] = pair & uint32(0xFFFF)
                    out[at + 1] = pair >> uint32(16)
    return vis_flash_attention_kernel
