"""Elementwise kernels: SiLU-mul (SwiGLU), embedding gather, bf16 casts (`f32`: fp32 storage)."""
from numba import cuda, int64

from .common import bf16_to_f32, f32_to_bf16, silu, storage
from .ptx import ld_v4_f32

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "silu_mul": ("u16*", "f32*", "i32", "i32", "i32"),
    "silu_mul4": ("u16*", "f32*", "i32", "i32", "i32"),
    "embed_gather": ("f32*", "u16*", "i32*", "i32"),
    "widen_bf16": ("f32*", "u16*", "i64"),
    "store_columns": ("u16*", "f32*", "i32", "i32", "i32"),
}


def silu_mul(f32=False):
    store = storage(f32)[0]

    def silu_mul_kernel(out, gu, gu_stride, gu_off, inter):
        # gu[t, off:off+inter] gate, [off+inter:off+2*inter] up (fp32) -> out [n, inter] bf16 / fp32
        # grid (n, ceil(inter/256)): rows on x (up to 2^31 - 1 rows)
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.x
        if j < inter:
            b = t * gu_stride + gu_off
            out[t * inter + j] = store(silu(gu[b + j]) * gu[b + inter + j])
    return silu_mul_kernel


def silu_mul4(f32=False):
    """silu_mul four columns a thread, gate and up each one 16-byte load (gu_stride, gu_off and
    inter multiples of 4, gu 16-byte aligned: StepRunner.swiglu picks it then). A prefill's
    SwiGLU reads 8 bytes and writes 2 a column (27B at 4096 tokens: 0.7 GB a layer), and one
    4-byte load a thread left it at ~60% of the copy rate (25 ms of a 27B prefill of 4096)."""
    store = storage(f32)[0]

    def silu_mul4_kernel(out, gu, gu_stride, gu_off, inter):
        # grid (n, ceil(inter / 4 / 256)), block 256: thread -> columns 4j .. 4j + 3 of row t
        j = 4 * (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x)
        t = cuda.blockIdx.x
        if j < inter:
            b = int64(t) * gu_stride + gu_off + j
            g0, g1, g2, g3 = ld_v4_f32(gu, b)
            u0, u1, u2, u3 = ld_v4_f32(gu, b + inter)
            o = int64(t) * inter + j
            out[o] = store(silu(g0) * u0)
            out[o + 1] = store(silu(g1) * u1)
            out[o + 2] = store(silu(g2) * u2)
            out[o + 3] = store(silu(g3) * u3)
    return silu_mul4_kernel


def embed_gather(f32=False):
    load = storage(f32)[1]

    def embed_gather_kernel(out, table, ids, hidden):
        # out [n, hidden] fp32 = table[ids[t]] (bf16 / fp32); grid (ceil(hidden/256), n)
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.y
        if j < hidden:
            out[t * hidden + j] = load(table[ids[t] * hidden + j])
    return embed_gather_kernel


def cast_f32_bf16():
    def cast_kernel(out, x, n):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < n:
            out[i] = f32_to_bf16(x[i])
    return cast_kernel


def widen_bf16():
    def widen_kernel(out, x, n):
        # out[i] = x[i] (bf16 bits -> fp32, exact): the fp32 model's weights, upcast at load;
        # grid-stride
        i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        stride = int64(cuda.gridDim.x) * cuda.blockDim.x
        while i < n:
            out[i] = bf16_to_f32(x[i])
            i += stride
    return widen_kernel


def store_columns(f32=False):
    store = storage(f32)[0]

    def store_columns_kernel(out, x, width, out_stride, out_off):
        # out[t, out_off + j] = x[t, j] (fp32 [n, width] -> bf16 / fp32 columns of a wider row):
        # the residual stream after a target layer into a DFlash drafter's feature rows.
        # grid (n, ceil(width/256)), block 256
        t = cuda.blockIdx.x
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if j < width:
            out[t * out_stride + out_off + j] = store(x[t * width + j])
    return store_columns_kernel
