"""The fp8 prefill GEMM options on the GPU, at Qwen3.5 layer shapes (issue 24's "measure the
options and keep the fastest"):

  bf16      cuBLASLt bf16 x bf16 -> fp32, the unquantized model's GEMM
  dequant   kernels/quant_gemv.dequant of the fp8 codes into a bf16 tile (slabs, as the runner
            does), then the bf16 GEMM: exact weights, 2 more bytes written + read per weight
  w8a8      kernels/act_quant.py's per-token, per-128-column e4m3 quantization of X, then
            cuBLASLt's block-scaled e4m3 GEMM (W's 128 x 128 block scales, X's 1 x 128):
            tensor cores at the fp8 rate, X rounded to 3 mantissa bits

First it checks the block-scaled GEMM against a float64 product of the same codes and scales
(layouts as cublaslt.py documents them; M not a multiple of 4, K of 1..3 blocks, beta = 1, a
column range of a wider output), so a layout cuBLASLt reads differently fails loudly here.

    PYTHONPATH=.:bench python bench/bench_fp8_gemm.py [--shapes 9b,27b] [--ms 512,4096]
"""
from __future__ import annotations

import argparse
import json

import ml_dtypes
import numpy as np

from bench_quant import SHAPES, timed
from ninfer.core.cuda import driver as d
from ninfer.core.cuda.cublaslt import CublasLt, fp8_scale_rows

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
WORKSPACE = 64 << 20


class Buffers:
    def __init__(self, stream):
        self.stream, self.ptrs = stream, []

    def put(self, a) -> int:
        a = np.ascontiguousarray(a)
        p = d.mem_alloc(max(a.nbytes, 256))
        self.ptrs.append(p)
        d.upload(p, a, self.stream)
        return p

    def empty(self, nbytes) -> int:
        p = d.mem_alloc(max(int(nbytes), 256))
        self.ptrs.append(p)
        return p

    def free(self):
        self.stream.synchronize()
        for p in self.ptrs:
            d.mem_free(p)
        self.ptrs = []


def quantize_blocks(a, br, bc):
    """a [R, C] float -> (e4m3 codes, float32 scales [ceil(R/br), C/bc]) with amax / 448."""
    R, C = a.shape
    Rp = -(-R // br) * br
    ap = np.zeros((Rp, C), np.float64)
    ap[:R] = a
    blocks = ap.reshape(Rp // br, br, C // bc, bc)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(Rp, C)[:R]
    return np.clip(q, -448, 448).astype(FP8), scale


def check(lt, stream, rng, m, n, k, beta=0.0, ldc=0, w_pad4=True, x_ld_m=False):
    """Max |error| / max |reference| of gemm_fp8 against float64 on the same codes and scales.
    Layout probes: `w_pad4` W's scale rows padded to a multiple of 4 blocks (what cuBLASLt
    reads; False shows the other layout fails), `x_ld_m` X's scales with leading dimension M
    rather than round_up(M, 4) (cuBLASLt takes no M but multiples of 4)."""
    buf = Buffers(stream)
    try:
        w = rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))
        x = rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1))
        wq, ws = quantize_blocks(w, 128, 128)
        xq, xs = quantize_blocks(x, 1, 128)            # xs [m, k/128]
        mp = m if x_ld_m else fp8_scale_rows(m)
        xs_t = np.ones((k // 128, mp), np.float32)
        xs_t[:, :m] = xs.T                               # [K/128, round_up(M, 4)]
        ref = (xq.astype(np.float64) * np.repeat(xs, 128, axis=1)) @ \
            (wq.astype(np.float64) * np.repeat(np.repeat(ws, 128, axis=0)[:n], 128, axis=1)).T
        ldc = ldc or n
        y0 = rng.standard_normal((m, ldc)).astype(np.float32)
        y_ptr = buf.put(y0)
        lt.gemm_fp8(stream, buf.put(xq.view(np.uint8)), buf.put(xs_t), buf.put(wq.view(np.uint8)),
                    buf.put(np.pad(ws, ((0, 0), (0, -ws.shape[1] % 4)), constant_values=7.0)
                            if w_pad4 else ws), y_ptr, m, n, k, beta, ldc)
        y = d.download(y_ptr, (m, ldc), np.float32, stream)
        want = ref + beta * y0[:, :n]
        untouched = np.array_equal(y[:, n:], y0[:, n:])
        err = float(np.abs(y[:, :n] - want).max() / np.abs(want).max())
        return err if untouched else 2.0
    finally:
        buf.free()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="9b,27b")
    ap.add_argument("--ms", default="512,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = d.Device(0)
    stream = dev.stream
    ws_ptr = d.mem_alloc(WORKSPACE)
    lt = CublasLt(ws_ptr, WORKSPACE)
    rng = np.random.default_rng(5)
    print(f"fp8 block-scaled GEMM supported: {lt.fp8_supported()}")
    errors = {}
    # (M, N, K, beta, ldc, W's scale rows padded, X's scale ld = M); the unpadded and the
    # M = 61 rows show the layouts cuBLASLt does not take
    for (m, n, k, beta, ldc, pad, xm) in (
            (64, 256, 512, 0.0, 0, 1, 0), (61, 256, 512, 0.0, 0, 1, 1), (64, 200, 384, 0.0, 0, 0, 0),
            (64, 200, 384, 0.0, 0, 1, 0), (36, 384, 128, 0.0, 0, 0, 0), (36, 384, 128, 0.0, 0, 1, 0),
            (40, 384, 256, 1.0, 0, 1, 0), (48, 256, 512, 1.0, 640, 1, 0),
            (512, 1024, 1024, 0.0, 0, 1, 0), (512, 256, 128, 0.0, 0, 1, 0),
            (36, 4160, 4096, 1.0, 0, 1, 0)):
        key = f"M={m} N={n} K={k} beta={beta} ldc={ldc or n} w_pad4={pad} x_ld_m={xm}"
        try:
            errors[key] = check(lt, stream, rng, m, n, k, beta, ldc, bool(pad), bool(xm))
        except Exception as exc:          # a shape cuBLASLt refuses: say which and go on
            errors[key] = f"{type(exc).__name__}: {exc}"
        print(f"  check {key}: {errors[key]}")
    rows = []
    buf = Buffers(stream)
    try:
        for shape in args.shapes.split(","):
            for name, n, k in SHAPES[shape]:
                copies = 2
                wb = [buf.empty(2 * n * k) for _ in range(copies)]
                w8 = [buf.empty(n * k) for _ in range(copies)]
                wsc = [buf.put(np.full((-(-n // 128), -(-k // 512) * 4), 0.01, np.float32))
                       for _ in range(copies)]
                for m in (int(v) for v in args.ms.split(",")):
                    x = buf.put(np.zeros((m, k), np.uint16))
                    x8 = buf.put(np.zeros((m, k), np.uint8))
                    xs = buf.put(np.ones((k // 128, fp8_scale_rows(m)), np.float32))
                    y = buf.empty(4 * m * n)
                    lt.plan(m, n, k)
                    lt.plan(m, n, k, fp8=True)
                    t_bf = timed(stream, [lambda i=i: lt.gemm(stream, x, wb[i], y, m, n, k)
                                          for i in range(copies)], args.reps)
                    t_8 = timed(stream, [lambda i=i: lt.gemm_fp8(stream, x8, xs, w8[i], wsc[i], y,
                                                                 m, n, k)
                                         for i in range(copies)], args.reps)
                    tflop = 2.0 * m * n * k / 1e12
                    rows.append(dict(shape=shape, matrix=name, n=n, k=k, m=m, bf16_us=t_bf,
                                     w8a8_us=t_8, bf16_tflops=tflop / (t_bf * 1e-6),
                                     w8a8_tflops=tflop / (t_8 * 1e-6)))
                    r = rows[-1]
                    print(f"  {shape} {name:10s} M={m:5d}: bf16 {t_bf:8.1f} us "
                          f"({r['bf16_tflops']:5.0f} TFLOP/s)  w8a8 {t_8:8.1f} us "
                          f"({r['w8a8_tflops']:5.0f} TFLOP/s)  bf16/w8a8 {t_bf / t_8:.2f}")
    finally:
        buf.free()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(errors=errors, rows=rows), f, indent=1)
    lt.close()
    d.mem_free(ws_ptr)
    dev.close()


if __name__ == "__main__":
    main()
