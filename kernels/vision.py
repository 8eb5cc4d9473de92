"""The vision tower's kernels around cuBLASLt's GEMMs (ninfer/models/qwen3_5/cuda/vision.py):
LayerNorm with bias, bias + GELU, bias (and the position embedding) added into the fp32 residual,
the 2-D rotary of q and k out of the qkv GEMM into head-major buffers, and the attention scores'
row softmax. Inputs fp32; outputs that feed a GEMM are bf16 (fp32 with `f32`). The numpy tower
(ninfer/models/qwen3_5/vision_tower.py) is the specification of each."""
import math

from numba import cuda, float32, int64

from .common import block_max, block_sum, storage

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "vis_layernorm": ("u16*", "f32*", "f32*", "f32*", "i32", "f32"),
    "vis_bias_act": ("u16*", "f32*", "f32*", "i32", "i32"),
    "vis_add_bias": ("f32*", "f32*", "f32*", "i32", "i32"),
    "vis_qkv_rope": ("u16*", "u16*", "u16*", "f32*", "f32*", "f32*", "f32*", "i32", "i32",
                     "i32"),
    "vis_softmax": ("u16*", "f32*", "i32", "f32"),
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
    def vis_add_bias_kernel(h, bias, pos, width, with_pos):
        # h[t, j] += bias[j] (+ pos[t, j] with with_pos: the patch embedding's position
        # table); grid (rows, ceil(width / blockDim))
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if j < width:
            i = int64(cuda.blockIdx.x) * width + j
            v = h[i] + bias[j]
            if with_pos != 0:
                v += pos[i]
            h[i] = v
    return vis_add_bias_kernel


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
        # query and head); grid (rows,)
        scratch = cuda.shared.array(32, float32)
        base = int64(cuda.blockIdx.x) * cols
        m = float32(-3.0e38)
        for j in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
            m = max(m, s[base + j])
        m = block_max(m, scratch)
        acc = float32(0.0)
        for j in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
            acc += math.exp((s[base + j] - m) * scale)
        inv = float32(1.0) / block_sum(acc, scratch)
        for j in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
            p[base + j] = store(math.exp((s[base + j] - m) * scale) * inv)
    return vis_softmax_kernel
