"""Dense bf16 GEMV for decode steps of a few rows: y[t, :] (fp32) = x[t, :] . W^T (+ beta * y).

cuBLASLt runs a small decode product (a 35B-A3B layer's router + shared gate|up, 5 MB; its
shared down, 2 MB) as a split-K GEMM, a memset and a reduction: three graph nodes and a few
microseconds of latency each for well under a microsecond of memory traffic at the copy rate
(measured in the captured graph: 1.55 ms of cuBLASLt for ~3.6 GB a 35B-A3B step, 2.3 TB/s).
Here one launch: a warp per output row, every token of the step on it (M compile-time, at most
MAX_M), the weight row streamed 16 bytes a lane (read once), x's rows read through L1 (every warp
of the block reads the same ones), UNROLL spans of 512 bytes in flight. The sum of each output runs
lane-wise then through warp_sum: independent of the other rows and of M, so a row's result does
not depend on the batch (batch_invariant holds by construction).
"""
from numba import cuda, float32, int64

from .common import bf16x2_hi, bf16x2_lo, inlined, warp_sum
from .ptx import ld_v4, ld_v4_stream

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "gemv": ("f32*", "u32*", "u32*", "i32", "i32", "f32"),
}

WARPS = 4           # output rows a block (a warp each)
MAX_M = 8           # tokens a launch at most (decode rows)
SPAN = 128          # 32-bit words a warp reads at once (32 lanes x 16 bytes)
UNROLL = 4          # spans in flight a warp


def gemv(M):
    assert 1 <= M <= MAX_M

    def gemv_kernel(y, x, w, n, kw, beta):
        # grid (ceil(n / WARPS),), block 32 * WARPS. x [M, 2 * kw], w [n, 2 * kw] bf16 as words
        # (kw a multiple of SPAN: rows of whole 512-byte spans, 16-byte aligned); y [M, n] fp32
        j = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
        lane = cuda.threadIdx.x & 31
        if j >= n:
            return
        acc = cuda.local.array(M, float32)
        for t in range(M):
            acc[t] = float32(0.0)
        wb = int64(j) * kw
        c = lane * 4
        spans = kw // SPAN
        s = 0
        while s + UNROLL <= spans:
            # UNROLL 16-byte weight loads issued before any is used
            w00, w01, w02, w03 = ld_v4_stream(w, wb + c)
            w10, w11, w12, w13 = ld_v4_stream(w, wb + c + SPAN)
            w20, w21, w22, w23 = ld_v4_stream(w, wb + c + 2 * SPAN)
            w30, w31, w32, w33 = ld_v4_stream(w, wb + c + 3 * SPAN)
            for t in range(M):
                xb = int64(t) * kw + c
                x00, x01, x02, x03 = ld_v4(x, xb)
                x10, x11, x12, x13 = ld_v4(x, xb + SPAN)
                x20, x21, x22, x23 = ld_v4(x, xb + 2 * SPAN)
                x30, x31, x32, x33 = ld_v4(x, xb + 3 * SPAN)
                acc[t] += (dot4(w00, w01, w02, w03, x00, x01, x02, x03)
                           + dot4(w10, w11, w12, w13, x10, x11, x12, x13)
                           + dot4(w20, w21, w22, w23, x20, x21, x22, x23)
                           + dot4(w30, w31, w32, w33, x30, x31, x32, x33))
            c += UNROLL * SPAN
            s += UNROLL
        while s < spans:
            w00, w01, w02, w03 = ld_v4_stream(w, wb + c)
            for t in range(M):
                x00, x01, x02, x03 = ld_v4(x, int64(t) * kw + c)
                acc[t] += dot4(w00, w01, w02, w03, x00, x01, x02, x03)
            c += SPAN
            s += 1
        for t in range(M):
            v = warp_sum(acc[t])
            if lane == 0:
                i = int64(t) * n + j
                if beta != 0.0:
                    v += beta * y[i]
                y[i] = v
    return gemv_kernel


@inlined
def dot4(w0, w1, w2, w3, x0, x1, x2, x3):
    # four words of bf16 pairs . four words of bf16 pairs, in fp32
    return (bf16x2_lo(w0) * bf16x2_lo(x0) + bf16x2_hi(w0) * bf16x2_hi(x0)
            + bf16x2_lo(w1) * bf16x2_lo(x1) + bf16x2_hi(w1) * bf16x2_hi(x1)
            + bf16x2_lo(w2) * bf16x2_lo(x2) + bf16x2_hi(w2) * bf16x2_hi(x2)
            + bf16x2_lo(w3) * bf16x2_lo(x3) + bf16x2_hi(w3) * bf16x2_hi(x3))
