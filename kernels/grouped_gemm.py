"""Grouped bf16 GEMM on the tensor cores over each expert's consecutive rows: the MoE prefill
routed on the device (cuda/moe_route.py) where cuBLASLt has no grouped GEMM (cuBLAS before 13.10).

For every tile of the work list moe_route_tiles wrote (expert e, first row r0, m rows):

    out[r0 + i, n0 + j] (fp32) = sum_k x[r0 + i, k] W_e[n0 + j, k]      i < m, every n0 + j < n

with W_e = w + e * n * k (a layer's experts' [n, k] bf16 weights back to back, as loaded).

A block of 4 warps computes a BM x BN tile (64 x 64; a warp 32 x 32: 2 x 4 mma.sync m16n8k16,
bf16 operands, fp32 accumulators), walking k in steps of BK = 32 (the factory takes 64 too).
Each thread holds its 16-byte pieces of x's tile and of W's for the next step in registers,
loaded while this step's products run, and stores them into shared memory rows padded to
BK / 2 + 4 words (SW = 20 at BK 32), where a fragment's loads (word 20 g + t of a row group)
hit 32 distinct banks. Rows of a tile past m load zeros and are never
stored. Only the tiles of the rows the routing gave an expert run: at most one partial tile an
expert, no padding of every expert to a common capacity (the host path's strided batch).

routed_silu_mul is the SwiGLU between the route's two products, over the rows some pair took
only (the layout's src >= 0: not the padded block's unused rows, nor those past the overflow).
"""
from numba import cuda, float32, int64, uint32

from .common import f32_to_bf16, silu
from .ptx import ld_v4, mma_bf16

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "grouped_gemm": ("f32*", "u32*", "u32*", "i32*", "i32", "i32", "i32"),
    "routed_silu_mul": ("u16*", "f32*", "i32*", "i32"),
}
SILU_THREADS = 256

BM = 64             # rows of a tile (moe_route_tiles' BM)
BN = 64             # output columns of a block
BK = 32             # k a step
THREADS = 128       # 4 warps, 2 x 2 over the tile
SW = BK // 2 + 4    # shared row stride in 32-bit words (bf16 pairs)


def fits(n: int, k: int) -> bool:
    """Whether grouped_gemm takes products of n outputs over k: whole column blocks and steps
    (then x's and W's rows are 16-byte aligned)."""
    return n % BN == 0 and k % BK == 0 and n > 0 and k > 0


def grouped_gemm(BK=BK):
    """BK: k a step (32, the default, or 64: twice the loads in flight a step and half the
    barriers; the route takes it where k is whole steps of 64: moe_route.gemm_kernel)."""
    assert BK % 32 == 0
    KW = BK // 2        # words of a row a step
    SWK = KW + 4        # shared row stride in words (SW at BK 32): a fragment's loads, word
    #                     SWK g + t, hit 32 distinct banks when SWK is 4 mod 8
    SA = BM * SWK       # shared array sizes: compile-time constants
    SB = BN * SWK
    LPR = KW // 4       # 16-byte pieces of a row a step
    RSTEP = THREADS // LPR   # rows one pass of the threads covers
    NL = BM // RSTEP    # pieces a thread loads of x's tile (and of W's: BN == BM) a step
    NR = 4 * NL         # their words

    def grouped_gemm_kernel(out, x, w, tiles, t_cap, n, k):
        # grid (t_cap, n / BN), block THREADS. x [rows, k] and w [E, n, k] bf16 as words;
        # out [rows, n] fp32; tiles [3, t_cap] (moe_route_tiles: expert or -1, r0, m)
        t = cuda.blockIdx.x
        e = tiles[t]
        if e < 0:
            return                    # whole block: past the routing's last tile
        r0 = tiles[t_cap + t]
        m = tiles[2 * t_cap + t]
        n0 = cuda.blockIdx.y * BN
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        q = lane & 3
        wm = (warp >> 1) * 32         # the warp's rows and columns of the tile
        wn = (warp & 1) * 32
        sA = cuda.shared.array(SA, uint32)
        sB = cuda.shared.array(SB, uint32)
        acc = cuda.local.array(32, float32)
        ra = cuda.local.array(NR, uint32)     # this step's pieces of x's and W's tiles
        rb = cuda.local.array(NR, uint32)
        for i in range(32):
            acc[i] = float32(0.0)
        kw = k // 2
        # this thread's 16-byte pieces of each step's tiles: rows lr + RSTEP j, words lc..lc+3
        lr = tid // LPR
        lc = (tid % LPR) * 4
        xa = int64(r0 + lr) * kw + lc
        wa = (int64(e) * n + n0 + lr) * kw + lc
        z = uint32(0)
        for j in range(NL):
            ok = lr + RSTEP * j < m
            for c in range(4):
                ra[4 * j + c] = z
            if ok:
                ra[4 * j], ra[4 * j + 1], ra[4 * j + 2], ra[4 * j + 3] = \
                    ld_v4(x, xa + RSTEP * j * kw)
            rb[4 * j], rb[4 * j + 1], rb[4 * j + 2], rb[4 * j + 3] = \
                ld_v4(w, wa + RSTEP * j * kw)
        sa = lr * SWK + lc
        steps = k // BK
        for kt in range(steps):
            for j in range(NL):
                for c in range(4):
                    sA[sa + RSTEP * j * SWK + c] = ra[4 * j + c]
                    sB[sa + RSTEP * j * SWK + c] = rb[4 * j + c]
            cuda.syncthreads()
            if kt + 1 < steps:        # the next step's pieces, in flight under the products
                off = (kt + 1) * KW
                for j in range(NL):
                    if lr + RSTEP * j < m:
                        ra[4 * j], ra[4 * j + 1], ra[4 * j + 2], ra[4 * j + 3] = \
                            ld_v4(x, xa + RSTEP * j * kw + off)
                    rb[4 * j], rb[4 * j + 1], rb[4 * j + 2], rb[4 * j + 3] = \
                        ld_v4(w, wa + RSTEP * j * kw + off)
            for ks in range(BK // 16):   # the k16 slices of the step
                c = ks * 8 + q
                for mt in range(2):
                    fa = (wm + mt * 16 + g) * SWK + c
                    f0 = sA[fa]
                    f1 = sA[fa + 8 * SWK]
                    f2 = sA[fa + 4]
                    f3 = sA[fa + 8 * SWK + 4]
                    for nt in range(4):
                        fb = (wn + nt * 8 + g) * SWK + c
                        o = (mt * 4 + nt) * 4
                        d0, d1, d2, d3 = mma_bf16(f0, f1, f2, f3, sB[fb], sB[fb + 4],
                                                  acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                        acc[o] = d0
                        acc[o + 1] = d1
                        acc[o + 2] = d2
                        acc[o + 3] = d3
            cuda.syncthreads()        # the next step rewrites sA, sB
        for mt in range(2):
            row = wm + mt * 16 + g
            for nt in range(4):
                o = (mt * 4 + nt) * 4
                col = n0 + wn + nt * 8 + 2 * q
                if row < m:
                    y = int64(r0 + row) * n + col
                    out[y] = acc[o]
                    out[y + 1] = acc[o + 1]
                if row + 8 < m:
                    y = int64(r0 + row + 8) * n + col
                    out[y] = acc[o + 2]
                    out[y + 1] = acc[o + 3]
    return grouped_gemm_kernel


def routed_silu_mul():
    def routed_silu_mul_kernel(out, gu, src, inter):
        # out[r, j] (bf16) = silu(gu[r, j]) * gu[r, inter + j] for the rows r with src[r] >= 0
        # (the device route's row -> token map, -1 where no pair is); grid (rows, ceil(inter /
        # SILU_THREADS)), block SILU_THREADS
        t = cuda.blockIdx.x
        j = cuda.blockIdx.y * SILU_THREADS + cuda.threadIdx.x
        if j >= inter or src[t] < 0:
            return
        b = int64(t) * 2 * inter + j
        out[int64(t) * inter + j] = f32_to_bf16(silu(gu[b]) * gu[b + inter])
    return routed_silu_mul_kernel
