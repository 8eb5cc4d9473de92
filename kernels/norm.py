"""RMSNorms. Zero-centred (`x * rsqrt(mean x^2 + eps) * (1 + w)`) over fp32 rows -> bf16 (the next
GEMM's input; fp32 with `f32`); the residual add is fused into the GEMM before it (cuBLASLt beta = 1).
`plain`: Qwen3's `x * rsqrt(mean x^2 + eps) * w` instead (a DFlash drafter's norms).
Gated (GDN output): `x * rsqrt(mean x^2 + eps) * w * silu(z)` per value head."""
import math

from numba import cuda, float32, int64

from .common import block_sum, silu, storage, warp_sum
from .ptx import ld_v4_f32

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "rmsnorm": ("u16*", "f32*", "f32*", "i32*", "i32", "i32", "f32"),
    "gated_rmsnorm": ("u16*", "f32*", "f32*", "i32", "i32", "f32*", "i32", "f32"),
    "gated_rmsnorm4": ("u16*", "f32*", "f32*", "i32", "i32", "f32*", "i32", "i32", "f32"),
    "mtp_prologue": ("u16*", "f32*", "u16*", "f32*", "f32*", "i32", "f32"),
}


PER = 8          # rmsnorm: values a thread keeps in registers (rows up to PER * blockDim)


def rmsnorm(f32=False, plain=False):
    store = storage(f32)[0]
    one = float32(0.0 if plain else 1.0)       # the weight's offset: w (plain) or 1 + w

    def rmsnorm_kernel(out, x, w, row_idx, use_idx, hidden, eps):
        # out[r, :] = norm(x[src, :]), src = row_idx[r] if use_idx else r; grid (rows,)
        scratch = cuda.shared.array(32, float32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        src = r
        if use_idx != 0:
            src = row_idx[r]
        base = src * hidden
        ob = r * hidden
        acc = float32(0.0)
        if hidden <= PER * nt:
            # one read of the row and the weights, every load issued before the first use and
            # kept in registers (two serial passes took 3.5-5 us a row on the H200 at B = 1);
            # the sum runs in the loop's order below, so the result is the same bits
            xs = cuda.local.array(PER, float32)
            ws = cuda.local.array(PER, float32)
            for k in range(PER):
                j = tid + k * nt
                xv = float32(0.0)
                wv = float32(0.0)
                if j < hidden:
                    xv = x[base + j]
                    wv = w[j]
                xs[k] = xv
                ws[k] = wv
            for k in range(PER):
                acc += xs[k] * xs[k]
            tot = block_sum(acc, scratch)
            inv = float32(1.0) / math.sqrt(tot / float32(hidden) + eps)
            for k in range(PER):
                j = tid + k * nt
                if j < hidden:
                    out[ob + j] = store(xs[k] * inv * (one + ws[k]))
            return
        for j in range(tid, hidden, nt):
            v = x[base + j]
            acc += v * v
        tot = block_sum(acc, scratch)
        inv = float32(1.0) / math.sqrt(tot / float32(hidden) + eps)
        for j in range(tid, hidden, nt):
            out[ob + j] = store(x[base + j] * inv * (one + w[j]))
    return rmsnorm_kernel


def gated_rmsnorm(f32=False):
    store = storage(f32)[0]

    def gated_rmsnorm_kernel(out, x, z, z_stride, z_off, w, dv, eps):
        # grid (tokens, value heads); x [n, nv*dv] fp32, z at z[t*z_stride + z_off + h*dv + j]
        scratch = cuda.shared.array(32, float32)
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        nv = cuda.gridDim.y
        base = (t * nv + h) * dv
        acc = float32(0.0)
        for j in range(cuda.threadIdx.x, dv, cuda.blockDim.x):
            v = x[base + j]
            acc += v * v
        tot = block_sum(acc, scratch)
        inv = float32(1.0) / math.sqrt(tot / float32(dv) + eps)
        zb = t * z_stride + z_off + h * dv
        for j in range(cuda.threadIdx.x, dv, cuda.blockDim.x):
            out[base + j] = store(x[base + j] * inv * w[j] * silu(z[zb + j]))
    return gated_rmsnorm_kernel


GATED_WARPS = 4   # gated_rmsnorm4: (token, head) pairs a block, a warp each


def gated_rmsnorm4(dv, f32=False):
    """gated_rmsnorm with a warp per (token, value head) instead of a block: each lane four
    consecutive columns a step (x, z and w as 16-byte loads, dv a multiple of 128), the sum of
    squares through warp_sum, no shared memory and no barrier. A block of dv threads a head,
    one column each, ran the 9B prefill's 24 layers x 4096 tokens x 32 heads at ~0.9 TB/s
    (4.6 ms). z_stride and z_off multiples of 4 (StepRunner.gated_norm picks it then)."""
    assert dv % 128 == 0
    store = storage(f32)[0]
    G = dv // 128            # a lane's groups of four
    NL = 4 * G               # (local arrays take literal sizes)

    def gated_rmsnorm4_kernel(out, x, z, z_stride, z_off, w, nv, pairs, eps):
        # grid (ceil(pairs / GATED_WARPS),), block 32 * GATED_WARPS; pair p = t * nv + h of
        # x, out [pairs, dv] (x fp32); token t's head h of z at t * z_stride + z_off + h * dv
        p = cuda.blockIdx.x * GATED_WARPS + (cuda.threadIdx.x >> 5)
        lane = cuda.threadIdx.x & 31
        if p >= pairs:
            return
        t = p // nv
        xs = cuda.local.array(NL, float32)
        zs = cuda.local.array(NL, float32)
        base = int64(p) * dv
        zb = int64(t) * z_stride + z_off + (p - t * nv) * dv
        acc = float32(0.0)
        for g in range(G):          # (z's loads in flight beside x's, before the sum waits)
            j = g * 128 + 4 * lane
            x0, x1, x2, x3 = ld_v4_f32(x, base + j)
            zs[4 * g], zs[4 * g + 1], zs[4 * g + 2], zs[4 * g + 3] = ld_v4_f32(z, zb + j)
            xs[4 * g] = x0
            xs[4 * g + 1] = x1
            xs[4 * g + 2] = x2
            xs[4 * g + 3] = x3
            acc += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3
        acc = warp_sum(acc)
        inv = float32(1.0) / math.sqrt(acc / float32(dv) + eps)
        for g in range(G):
            j = g * 128 + 4 * lane
            w0, w1, w2, w3 = ld_v4_f32(w, j)
            out[base + j] = store(xs[4 * g] * inv * w0 * silu(zs[4 * g]))
            out[base + j + 1] = store(xs[4 * g + 1] * inv * w1 * silu(zs[4 * g + 1]))
            out[base + j + 2] = store(xs[4 * g + 2] * inv * w2 * silu(zs[4 * g + 2]))
            out[base + j + 3] = store(xs[4 * g + 3] * inv * w3 * silu(zs[4 * g + 3]))
    return gated_rmsnorm4_kernel


def mtp_prologue(f32=False):
    store, load = storage(f32)[:2]

    def mtp_prologue_kernel(out, e, h, w_e, w_h, hidden, eps):
        # the MTP head's fc input (models/qwen3_5/mtp.py): out[r, :H] = norm(e[r]) * (1 + w_e)
        # (the next token's embedding, fp32), out[r, H:] = norm(h[r]) * (1 + w_h) (the hidden
        # state it continues, stored); grid (rows, 2), blockIdx.y the half
        scratch = cuda.shared.array(32, float32)
        r = cuda.blockIdx.x
        half = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        base = r * hidden
        acc = float32(0.0)
        for j in range(tid, hidden, nt):
            v = e[base + j] if half == 0 else load(h[base + j])
            acc += v * v
        tot = block_sum(acc, scratch)
        inv = float32(1.0) / math.sqrt(tot / float32(hidden) + eps)
        ob = (2 * r + half) * hidden
        for j in range(tid, hidden, nt):
            if half == 0:
                out[ob + j] = store(e[base + j] * inv * (float32(1.0) + w_e[j]))
            else:
                out[ob + j] = store(load(h[base + j]) * inv * (float32(1.0) + w_h[j]))
    return mtp_prologue_kernel
