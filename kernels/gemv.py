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

Under programmatic dependent launch (ninfer/core/cuda/kernels.py) a warp first asks L2 for its
weight row's lines, then waits for the kernel before (ptx.grid_wait): the row is on its way
while that kernel (a norm, 2-3 us) runs, instead of after it.

gemv_norm: the same product of the RMS-normed residual stream, the norm in the prologue (a
MoE layer's post-attention norm into its router + shared gate|up product: one launch instead
of two). Every block norms the M rows of h itself (hidden fp32 a token, from L2), rounds them
to bf16 as the norm kernel stores them, and keeps them in shared memory in a lane-major order
(the 32 lanes' k-th words of a span are 32 consecutive words: one bank each, no conflicts);
block 0 also stores them for the kernels after (the experts read the normed rows).
"""
import math

from numba import cuda, float32, int64, uint32

from .common import bf16x2_hi, bf16x2_lo, f32_to_bf16, inlined, warp_sum
from .ptx import grid_wait, ld_v4, ld_v4_stream, prefetch_l2

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "gemv": ("f32*", "u32*", "u32*", "i32", "i32", "f32"),
    "gemv_norm": ("f32*", "f32*", "u32*", "i32", "i32", "f32", "f32*", "u16*", "f32"),
}

WARPS = 4           # output rows a block (a warp each)
MAX_M = 8           # tokens a launch at most (decode rows)
SPAN = 128          # 32-bit words a warp reads at once (32 lanes x 16 bytes)
UNROLL = 4          # spans in flight a warp
LINE = 32           # 32-bit words of a 128-byte L2 line
NORM_SMEM = 48 * 1024   # static shared memory: gemv_norm's bf16 rows and its M * WARPS partial sums


@inlined
def _global_x(x, i, lane):
    return ld_v4(x, i)


@inlined
def _shared_x(xs, i, lane):
    # the lane's four words of a span sit 32 words apart (gemv_norm's lane-major layout)
    b = i - 3 * lane
    return xs[b], xs[b + 32], xs[b + 64], xs[b + 96]


@inlined
def _prefetch_row(w, wb, lane, kw):
    # the row's 128-byte lines into L2, the warp's lanes taking them in turn
    i = lane * LINE
    while i < kw:
        prefetch_l2(w, wb + i)
        i += 32 * LINE


def _row_product(M, xload):
    """y[t, j] (+ beta * y) = x[t, :] . w[row j] for the M tokens: the lane's words of each
    span (UNROLL 16-byte weight loads issued before any is used), the warp's sums through
    warp_sum, lane 0 storing them."""
    @inlined
    def row_product(y, x, w, wb, j, n, lane, kw, beta):
        acc = cuda.local.array(M, float32)
        for t in range(M):
            acc[t] = float32(0.0)
        c = lane * 4
        spans = kw // SPAN
        s = 0
        while s + UNROLL <= spans:
            w00, w01, w02, w03 = ld_v4_stream(w, wb + c)
            w10, w11, w12, w13 = ld_v4_stream(w, wb + c + SPAN)
            w20, w21, w22, w23 = ld_v4_stream(w, wb + c + 2 * SPAN)
            w30, w31, w32, w33 = ld_v4_stream(w, wb + c + 3 * SPAN)
            for t in range(M):
                xb = int64(t) * kw + c
                x00, x01, x02, x03 = xload(x, xb, lane)
                x10, x11, x12, x13 = xload(x, xb + SPAN, lane)
                x20, x21, x22, x23 = xload(x, xb + 2 * SPAN, lane)
                x30, x31, x32, x33 = xload(x, xb + 3 * SPAN, lane)
                acc[t] += (dot4(w00, w01, w02, w03, x00, x01, x02, x03)
                           + dot4(w10, w11, w12, w13, x10, x11, x12, x13)
                           + dot4(w20, w21, w22, w23, x20, x21, x22, x23)
                           + dot4(w30, w31, w32, w33, x30, x31, x32, x33))
            c += UNROLL * SPAN
            s += UNROLL
        while s < spans:
            w00, w01, w02, w03 = ld_v4_stream(w, wb + c)
            for t in range(M):
                x00, x01, x02, x03 = xload(x, int64(t) * kw + c, lane)
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
    return row_product


def gemv(M):
    assert 1 <= M <= MAX_M
    row_product = _row_product(M, _global_x)

    def gemv_kernel(y, x, w, n, kw, beta):
        # grid (ceil(n / WARPS),), block 32 * WARPS. x [M, 2 * kw], w [n, 2 * kw] bf16 as words
        # (kw a multiple of SPAN: rows of whole 512-byte spans, 16-byte aligned); y [M, n] fp32
        j = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
        lane = cuda.threadIdx.x & 31
        if j >= n:
            return
        wb = int64(j) * kw
        _prefetch_row(w, wb, lane, kw)
        grid_wait()
        row_product(y, x, w, wb, j, n, lane, kw, beta)
    return gemv_kernel


def gemv_norm(M, hidden):
    """gemv over rmsnorm(h) (zero-centred weights: x * rsqrt(mean x^2 + eps) * (1 + nw), bf16 as
    kernels/norm.rmsnorm stores it); `hidden` fixes the shared rows' size."""
    assert 1 <= M <= MAX_M and hidden % (2 * SPAN) == 0 \
        and M * hidden * 2 + M * WARPS * 4 <= NORM_SMEM
    KW = hidden // 2
    XS, PARTS = M * KW, M * WARPS               # (shared arrays take literal sizes)
    row_product = _row_product(M, _shared_x)

    def gemv_norm_kernel(y, h, w, n, kw, beta, nw, xout, eps):
        # grid (ceil(n / WARPS),), block 32 * WARPS; h [M, hidden] fp32, nw [hidden] fp32, xout
        # [M, hidden] bf16 (block 0 writes it), w [n, hidden] bf16 as words, kw = hidden / 2
        xs = cuda.shared.array(XS, uint32)
        part = cuda.shared.array(PARTS, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        j = cuda.blockIdx.x * WARPS + wid
        wb = int64(j) * KW
        if j < n:
            _prefetch_row(w, wb, lane, KW)
        grid_wait()
        for t in range(M):
            acc = float32(0.0)
            for i in range(tid, KW, 32 * WARPS):
                a = h[t * hidden + 2 * i]
                b = h[t * hidden + 2 * i + 1]
                acc += a * a + b * b
            acc = warp_sum(acc)
            if lane == 0:
                part[t * WARPS + wid] = acc
        cuda.syncthreads()
        for t in range(M):
            tot = float32(0.0)
            for k in range(WARPS):
                tot += part[t * WARPS + k]
            inv = float32(1.0) / math.sqrt(tot / float32(hidden) + eps)
            for i in range(tid, KW, 32 * WARPS):
                e = t * hidden + 2 * i
                lo = f32_to_bf16(h[e] * inv * (float32(1.0) + nw[2 * i]))
                hi = f32_to_bf16(h[e + 1] * inv * (float32(1.0) + nw[2 * i + 1]))
                q = i % SPAN
                xs[t * KW + i - q + (q % 4) * 32 + q // 4] = lo | (hi << uint32(16))
                if cuda.blockIdx.x == 0:
                    xout[e] = lo
                    xout[e + 1] = hi
        cuda.syncthreads()
        if j >= n:
            return
        row_product(y, xs, w, wb, j, n, lane, KW, beta)
    return gemv_norm_kernel


@inlined
def dot4(w0, w1, w2, w3, x0, x1, x2, x3):
    # four words of bf16 pairs . four words of bf16 pairs, in fp32
    return (bf16x2_lo(w0) * bf16x2_lo(x0) + bf16x2_hi(w0) * bf16x2_hi(x0)
            + bf16x2_lo(w1) * bf16x2_lo(x1) + bf16x2_hi(w1) * bf16x2_hi(x1)
            + bf16x2_lo(w2) * bf16x2_lo(x2) + bf16x2_hi(w2) * bf16x2_hi(x2)
            + bf16x2_lo(w3) * bf16x2_lo(x3) + bf16x2_hi(w3) * bf16x2_hi(x3))
