"""Elementwise kernels: SiLU-mul (SwiGLU), embedding gather, bf16 casts."""
from numba import cuda

from .common import bf16_to_f32, f32_to_bf16, silu


def silu_mul():
    def silu_mul_kernel(out, gu, gu_stride, gu_off, inter):
        # gu[t, off:off+inter] gate, [off+inter:off+2*inter] up (fp32) -> out [n, inter] bf16
        # grid (n, ceil(inter/256)): rows on x (up to 2^31 - 1 rows)
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.x
        if j < inter:
            b = t * gu_stride + gu_off
            out[t * inter + j] = f32_to_bf16(silu(gu[b + j]) * gu[b + inter + j])
    return silu_mul_kernel


def embed_gather():
    def embed_gather_kernel(out, table, ids, hidden):
        # out [n, hidden] fp32 = table[ids[t]] (bf16); grid (ceil(hidden/256), n)
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.y
        if j < hidden:
            out[t * hidden + j] = bf16_to_f32(table[ids[t] * hidden + j])
    return embed_gather_kernel


def cast_f32_bf16():
    def cast_kernel(out, x, n):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < n:
            out[i] = f32_to_bf16(x[i])
    return cast_kernel
