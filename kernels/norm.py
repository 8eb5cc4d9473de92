"""RMSNorms. Zero-centred (`x * rsqrt(mean x^2 + eps) * (1 + w)`) over fp32 rows -> bf16 (the next
GEMM's input; fp32 with `f32`); the residual add is fused into the GEMM before it (cuBLASLt beta = 1).
`plain`: Qwen3's `x * rsqrt(mean x^2 + eps) * w` instead (a DFlash drafter's norms).
Gated (GDN output): `x * rsqrt(mean x^2 + eps) * w * silu(z)` per value head."""
import math

from numba import cuda, float32

from .common import block_sum, silu, storage

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "rmsnorm": ("u16*", "f32*", "f32*", "i32*", "i32", "i32", "f32"),
    "gated_rmsnorm": ("u16*", "f32*", "f32*", "i32", "i32", "f32*", "i32", "f32"),
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
