"""Packed-weight kernels on the GPU at Qwen3.5 layer shapes (kernels/quant_gemv.py):

  decode  the GEMVs over packed bytes for B = 1, 2, 4, 8 rows: microseconds, GB/s of the bytes
          they read (codes + scales + zero points) and that over the device copy rate; beside
          them cuBLASLt's bf16 product of the same shape (M = B), the path a bf16 model takes.
          "B=b/r": the CUDA-core qgemv, r output rows per warp (the float32 model's and odd
          shapes' path); "mma B=b wW uU": the tensor-core qmma (a bf16 model's), W warps per
          block, U steps unrolled (--mma sweeps them; a suffix l: plain loads instead of
          streaming ones, p: the loads alone, no math, to time the access pattern itself, d: two
          16-row tiles per block sharing x).
  prefill dequantize the matrix into bf16 (slabs, as the runner does) + the bf16 GEMM at
          M = 4096 rows, against the bf16 GEMM alone.

    python bench/bench_quant.py [--shapes 9b,27b] [--copy-gbs 4250] [--reps 50] [--mma 4:4,8:2]

Prints one table; every figure is the median of `reps` replays of a CUDA graph holding one launch
per copy of the weights (copies enough to span L2_SPAN bytes, so weights come from HBM as in a
model), timed with CUDA events, divided by the copies.
"""
from __future__ import annotations

import argparse

import numpy as np

from bench_gdn_chunk import timed as timed_ms
from ninfer.core.cuda import driver as d
from ninfer.core.cuda.arena import Arena
from ninfer.core.cuda.cublaslt import CublasLt
from ninfer.core.cuda.kernels import KernelCache
from ninfer.models.qwen3_5.cuda import qweights as qw
from ninfer.models.qwen3_5.cuda.kernel_set import (dequant_name, qgemv_name, qmma_name,
                                                    quant_specs, spec)

# (name, N, K): the projections of each shape (fused as the CUDA model holds them)
SHAPES = {
    "9b": [("gdn w_in", 12288 + 4096 + 64, 4096), ("w_gu", 2 * 12288, 4096),
           ("w_down", 4096, 12288), ("gdn w_out", 4096, 4096)],
    "27b": [("gdn w_in", 16384 + 6144 + 96, 5120), ("w_gu", 2 * 17408, 5120),
            ("w_down", 5120, 17408), ("gdn w_out", 5120, 6144)],
}
FORMATS = [("fp8_block", (128, 128), False), ("int8_block", (1, 128), False),
           ("int4_block", (1, 128), True), ("int4_block", (1, 64), True)]


L2_SPAN = 256 << 20     # weight bytes cycled through per timing: several times the H200's L2


def timed(stream, fns, reps):
    """Median GPU microseconds per call of `fns` (one call per weight copy, so repeats read HBM,
    not L2): the calls are captured in a CUDA graph and the graph's replays timed with events
    (bench_gdn_chunk.timed is in ms), so the host's launch time never enters the figure."""
    from ninfer.core.cuda.graph import Graph
    graph = Graph(stream, lambda st: [fn() for fn in fns])
    try:
        return timed_ms(stream, graph.launch, reps) * 1e3 / len(fns)
    finally:
        graph.destroy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="9b,27b")
    ap.add_argument("--copy-gbs", type=float, default=4250.0, help="device copy rate, GB/s")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--prefill-m", type=int, default=4096)
    ap.add_argument("--rows", default=str(qw.ROWS),
                    help="output rows per warp of the GEMV to time, comma-separated (the model "
                         f"runs {qw.ROWS})")
    ap.add_argument("--mma", default=qw.MMA_GEOMETRY,
                    help="qmma geometries to time, warps:unroll[:flags] comma-separated, flags l "
                         "(plain loads, not streaming), p (probe: loads only), d (two 16-row tiles "
                         "per block); the model runs "
                         f"{qw.MMA_GEOMETRY}")
    ap.add_argument("--gemv-batches", default="1,8", help="B of the qgemv rows ('' for none)")
    args = ap.parse_args()
    dev = d.Device(0)
    st = dev.stream
    cache = KernelCache(dev.cc)
    arena = Arena(12 << 30)
    lt_ws = arena.take((32 << 20,), np.uint8, "lt")
    lt = CublasLt(lt_ws.ptr, 32 << 20)
    kset = quant_specs({(lay, asym, qw.mma_split(lay, blk[1])) for lay, blk, asym in FORMATS})
    M = args.prefill_m
    rows = []
    for shape in args.shapes.split(","):
        for name, N, K in SHAPES[shape]:
            x = arena.take((M, K), np.uint16, "x")
            d.memset_d8_async(x.ptr, 0x3C, x.nbytes, st)             # bf16 ~0.011
            y = arena.take((M, N), np.float32, "y")
            ncb = max(2, -(-L2_SPAN // (N * K * 2)))
            wbs = [arena.take((N, K), np.uint16, "w bf16") for _ in range(ncb)]
            for wb in wbs:
                d.memset_d8_async(wb.ptr, 0x3C, wb.nbytes, st)
            tile = arena.take((qw.SLAB_ELEMENTS,), np.uint16, "tile")
            bf16_decode = {B: timed(st, [lambda B=B, wb=wb: lt.gemm(st, x.ptr, wb.ptr, y.ptr, B, N, K)
                                         for wb in wbs], args.reps) for B in (1, 8)}
            bf16_prefill = timed(st, [lambda: lt.gemm(st, x.ptr, wbs[0].ptr, y.ptr, M, N, K)], 10)
            for layout, block, asym in FORMATS:
                split = qw.mma_split(layout, block[1])
                label = layout if split == 1 else f"{layout[:4]}/g{block[1]}"
                rb = qw.SegmentPlan(0, N, K, layout, block, asym).row_bytes
                sshape = (-(-N // block[0]), -(-K // block[1]))
                ncq = max(2, -(-L2_SPAN // (N * rb)))
                ws = [arena.take((N * rb,), np.uint8, "codes") for _ in range(ncq)]
                for w in ws:
                    d.memset_d8_async(w.ptr, 0x31, w.nbytes, st)
                s = arena.take(sshape, np.float32, "scale")
                d.memset_d8_async(s.ptr, 0x3C, s.nbytes, st)
                z = arena.take(sshape, np.uint8, "zero") if asym else None
                if z is not None:
                    d.memset_d8_async(z.ptr, 0x07, z.nbytes, st)
                zp = z.ptr if z is not None else 0
                nbytes = ws[0].nbytes + s.nbytes + (z.nbytes if z is not None else 0)
                vec = int(qw.vector_ok(layout, K, block[1]))
                gemv_b = [int(b) for b in args.gemv_batches.split(",") if b]
                for B, R in [(B, int(r)) for B in gemv_b for r in args.rows.split(",")]:
                    kern = cache.get(kset[qgemv_name(layout, B, asym)] if R == qw.ROWS else
                                     spec("qgemv", layout=layout, bm=B, asym=asym, rows=R))
                    us = timed(st, [lambda w=w: kern.launch(
                        st, (-(-N // (qw.WARPS * R)), 1), (qw.THREADS,),
                        (y, x, x, w, w, s, zp, B, N, K, N, block[0], block[1], sshape[1], 0.0,
                         vec, 0, 0, 0, 0, 0)) for w in ws], args.reps)
                    gbs = nbytes / us / 1e3
                    rows.append((shape, name, label, f"B={B}/{R}", f"{us:8.1f}", f"{gbs:7.0f}",
                                 f"{gbs / args.copy_gbs:5.2f}",
                                 f"{bf16_decode[B]:8.1f}" if B in bf16_decode else "",
                                 f"{bf16_decode[B] / us:5.2f}" if B in bf16_decode else ""))
                for geo in args.mma.split(","):
                    W, U, *flags = geo.split(":")
                    W, U, flags = int(W), int(U), "".join(flags)
                    extra = {"split": split} if split > 1 else {}
                    kern = cache.get(kset[qmma_name(layout, asym, split)]
                                     if geo == qw.MMA_GEOMETRY
                                     else spec("qmma", layout=layout, asym=asym, warps=W, unroll=U,
                                               **extra,
                                               stream="l" not in flags, probe="p" in flags,
                                               tiles=2 if "d" in flags else 1))
                    for B in (1, 8) if "p" not in flags else (1,):
                        us = timed(st, [lambda w=w: kern.launch(
                            st, (-(-N // (qw.MMA_ROWS * (2 if "d" in flags else 1))), 1),
                            (32 * W,),
                            (y, x, w, s, zp, B, N, K, N, block[0], block[1], sshape[1], 0.0, 0,
                             0, 0, 0, 0)) for w in ws], args.reps)
                        gbs = nbytes / us / 1e3
                        rows.append((shape, name, label, f"mma B={B} w{W}u{U}{flags}", f"{us:8.1f}",
                                     f"{gbs:7.0f}", f"{gbs / args.copy_gbs:5.2f}",
                                     f"{bf16_decode[B]:8.1f}", f"{bf16_decode[B] / us:5.2f}"))
                dq = cache.get(kset[dequant_name(layout, asym)])
                seg = qw.SegmentPlan(0, N, K, layout, block, asym)
                step = qw.slab_rows(seg, qw.SLAB_ELEMENTS)
                w = ws[0]

                def prefill():
                    for r0 in range(0, N, step):
                        n = min(step, N - r0)
                        dq.launch(st, (-(-(rb // 8) // qw.DEQUANT_THREADS), n, 1),
                                  (qw.DEQUANT_THREADS,),
                                  (tile, tile, w, w, s, zp, r0, n, K, block[0], block[1],
                                   sshape[1], 0, 0, 0, vec))
                        lt.gemm(st, x.ptr, tile.ptr, y.ptr + 4 * r0, M, n, K, ldc=N)
                us = timed(st, [prefill], 10)
                rows.append((shape, name, label, f"M={M}", f"{us:8.1f}", "", "",
                             f"{bf16_prefill:8.1f}", f"{bf16_prefill / us:5.2f}"))
                for a in [z, s] + ws[::-1]:
                    if a is not None:
                        arena.give(a)
            for a in [tile] + wbs[::-1] + [y, x]:
                arena.give(a)
    print(f"{'shape':5} {'matrix':10} {'layout':11} {'rows':15} {'us':>8} {'GB/s':>7} {'/copy':>5} "
          f"{'bf16 us':>8} {'bf16/q':>6}")
    for r in rows:
        print(f"{r[0]:5} {r[1]:10} {r[2]:11} {r[3]:15} {r[4]} {r[5]:>7} {r[6]:>5} {r[7]:>8} {r[8]:>6}")
    lt.close()
    arena.close()
    dev.close()


if __name__ == "__main__":
    main()
