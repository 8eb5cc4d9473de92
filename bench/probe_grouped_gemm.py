"""Probe: cuBLASLt's grouped GEMM (CUBLASLT_BATCH_MODE_GROUPED, experimental: every group's rows,
columns and operand addresses read from device arrays) for the MoE prefill's routed experts, whose
per-expert row counts are known only on the device. Checks it against float64 and times it beside
the host route's layout (one strided-batched GEMM over a padded block + one GEMM per overflowing
expert) and our own grouped GEMM with every row on it (kernels/grouped_gemm.py over
moe_route_tiles' work list, at k steps of 32 and 64; the device route runs it over the rows past
its padded block where cuBLASLt has no grouped GEMM).

    PYTHONPATH=.:bench python bench/probe_grouped_gemm.py [--tokens 512,4096] [--shape 35b-a3b]
"""
from __future__ import annotations

import argparse
import ctypes

import ml_dtypes
import numpy as np

from bench_fp8_gemm import Buffers
from ninfer.core.cuda import driver as d
from ninfer.core.cuda.cublaslt import (CUBLAS_COMPUTE_32F, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF,
                                       CUDA_R_32F, DESC_TRANSA, DESC_TRANSB, HeuristicResult,
                                       CublasLt, lt_check)
from ninfer.core.cuda.kernels import KernelCache
from ninfer.models.qwen3_5.cuda import moe_route, moe_rows
from ninfer.models.qwen3_5.cuda.kernel_set import spec

BF16 = ml_dtypes.bfloat16
DESC_POINTER_MODE = 2
POINTER_MODE_HOST, POINTER_MODE_DEVICE = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
PREF_AVG_K, PREF_AVG_ROWS, PREF_AVG_COLS = 13, 14, 15
WORKSPACE = 64 << 20
# (E, top_k, hidden, moe_intermediate)
SHAPES = {"35b-a3b": (256, 8, 2048, 512), "122b-a10b": (256, 8, 3072, 1024)}


def routing(rng, tokens, E, K, skew):
    """Router ids [tokens * K]: K distinct experts a token, drawn uniformly (skew 0) or from a
    Zipf-like popularity (skew > 0: a few hot experts, as real routers show)."""
    p = 1.0 / np.arange(1, E + 1) ** skew
    p /= p.sum()
    ids = np.empty((tokens, K), np.int32)
    for t in range(tokens):
        ids[t] = rng.choice(E, K, replace=False, p=p)
    return ids.reshape(-1)


class Grouped:
    """One grouped plan: D_e (N x m_e, fp32 or bf16) = W_e^T-product of X_e for every expert e,
    in cuBLASLt's column-major view (row-major y_e[m_e, N] = x_e[m_e, K] @ W_e[N, K]^T)."""

    def __init__(self, lt, buf, E, N, K, avg_m, out_type, pointer_mode):
        lib = self.lib = lt.lib
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        lib.cublasLtGroupedMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, i32, vp, vp, vp]
        lib.cublasLtGroupedMatrixLayoutCreate.restype = i32
        self.lt, self.E, self.N, self.K = lt, E, N, K
        self.out_type, self.pointer_mode = out_type, pointer_mode
        # shape arrays (int32): A = W_e as K x N (ld K), B = X_e as K x m_e (ld K), D N x m_e
        self.m_dev = buf.empty(4 * E)
        self.k_dev = buf.put(np.full(E, K, np.int32))
        self.n_dev = buf.put(np.full(E, N, np.int32))
        self.ptr_a, self.ptr_b, self.ptr_d = (buf.empty(8 * E) for _ in range(3))
        self.alpha = buf.put(np.ones(E, np.float32))
        self.beta = buf.put(np.zeros(E, np.float32))
        desc = self.desc = vp()
        lt_check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "desc")
        for attr, v in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N),
                        (DESC_POINTER_MODE, pointer_mode)):
            c = ctypes.c_int32(v)
            lt_check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(c), 4),
                     f"desc attr {attr}")
        self.a, self.b, self.d = vp(), vp(), vp()
        lt_check(lib.cublasLtGroupedMatrixLayoutCreate(ctypes.byref(self.a), CUDA_R_16BF, E,
                                                       vp(self.k_dev), vp(self.n_dev),
                                                       vp(self.k_dev)), "layout A")
        lt_check(lib.cublasLtGroupedMatrixLayoutCreate(ctypes.byref(self.b), CUDA_R_16BF, E,
                                                       vp(self.k_dev), vp(self.m_dev),
                                                       vp(self.k_dev)), "layout B")
        lt_check(lib.cublasLtGroupedMatrixLayoutCreate(ctypes.byref(self.d), out_type, E,
                                                       vp(self.n_dev), vp(self.m_dev),
                                                       vp(self.n_dev)), "layout D")
        pref = vp()
        lt_check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        lt_check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES,
                                                          ctypes.byref(ws), 8), "pref ws")
        for attr, v in ((PREF_AVG_ROWS, N), (PREF_AVG_COLS, max(1, int(avg_m))), (PREF_AVG_K, K)):
            c = ctypes.c_uint32(v)
            lt_check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(c), 4),
                     f"pref attr {attr}")
        res = (HeuristicResult * 1)()
        count = ctypes.c_int(0)
        lt_check(lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, desc, self.a, self.b, self.d,
                                                    self.d, pref, 1, res, ctypes.byref(count)),
                 "heuristic")
        if count.value < 1:
            raise RuntimeError("grouped: no algorithm")
        self.algo = res[0]
        self.ws_ptr = buf.empty(WORKSPACE)

    def set_groups(self, stream, w, x, y, counts):
        """Host-side fill of the group arrays (the probe's stand-in for the device kernel)."""
        E, N, K = self.E, self.N, self.K
        off = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        ob = 4 if self.out_type == CUDA_R_32F else 2
        d.upload(self.m_dev, counts.astype(np.int32), stream)
        d.upload(self.ptr_a, (w + 2 * N * K * np.arange(E)).astype(np.int64), stream)
        d.upload(self.ptr_b, (x + 2 * K * off).astype(np.int64), stream)
        d.upload(self.ptr_d, (y + ob * N * off).astype(np.int64), stream)

    def run(self, stream):
        if self.pointer_mode == POINTER_MODE_DEVICE:
            alpha, beta = ctypes.c_void_p(self.alpha), ctypes.c_void_p(self.beta)
        else:
            alpha, beta = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))
        lt_check(self.lib.cublasLtMatmul(self.lt.handle, self.desc, alpha, self.ptr_a, self.a,
                                         self.ptr_b, self.b, beta, self.ptr_d, self.d,
                                         self.ptr_d, self.d, ctypes.byref(self.algo.algo),
                                         self.ws_ptr, WORKSPACE,
                                         ctypes.c_void_p(int(stream.handle))), "grouped matmul")


def event_ms(stream, fn, reps=20):
    fn()
    stream.synchronize()
    a, b = d.Event(), d.Event()
    out = []
    for _ in range(reps):
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        out.append(a.elapsed_ms(b))
    return float(np.median(out))


def padded_path(lt, stream, w, xg, y, ids, E, K, N, Kd, max_rows):
    """The runner's path today (its layout from moe_rows): returns a callable."""
    lay = moe_rows.expert_rows(ids, K, E, max_rows)

    def fn():
        if lay.cap:
            lt.gemm(stream, xg, w, y, lay.cap, N, Kd, batch=E,
                    strides=(N * Kd, lay.cap * Kd, lay.cap * N))
        for e, r0, cnt in lay.overflow:
            lt.gemm(stream, xg + 2 * Kd * r0, w + 2 * N * Kd * e, y + 4 * N * r0, cnt, N, Kd)
    return fn, lay


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,512,4096")
    ap.add_argument("--shape", default="35b-a3b")
    ap.add_argument("--skew", type=float, default=0.6)
    args = ap.parse_args()
    dev = d.Device(0)
    stream = dev.stream
    ws_ptr = d.mem_alloc(WORKSPACE)
    lt = CublasLt(ws_ptr, WORKSPACE)
    ver = lt.lib.cublasLtGetVersion()
    print(f"cublasLt version {ver}; grouped layout symbol: "
          f"{hasattr(lt.lib, 'cublasLtGroupedMatrixLayoutCreate')}")
    E, K, H, I = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    buf = Buffers(stream)
    cache = KernelCache(dev.cc)
    # our grouped GEMM at each k step (kernels/grouped_gemm.py: BK 32 is the route's)
    own_gemms = {bk: cache.get(spec("grouped_gemm", **({} if bk == moe_route.GEMM_BK
                                                        else {"BK": bk})))
                 for bk in (32, 64)}
    own_tiles = cache.get(spec("moe_route_tiles", E=E, BM=moe_route.GEMM_BM))
    # 8 distinct random experts, repeated over E (weights' values do not change the timing)
    projs = (("gate_up", 2 * I, H), ("down", H, I))
    weights = {}
    for name, N, Kd in projs:
        base = (rng.standard_normal((8, N, Kd)) * 0.05).astype(BF16)
        w = buf.empty(2 * E * N * Kd)
        d.upload(w, base, stream)
        for e in range(8, E, 8):
            d.copy_dtod_async(w + 2 * N * Kd * e, w, 2 * 8 * N * Kd, stream)
        weights[name] = (w, base)
    stream.synchronize()
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        ids = routing(rng, T, E, K, args.skew)
        counts = np.bincount(ids, minlength=E)
        pairs = T * K
        order = np.argsort(ids, kind="stable")
        for name, N, Kd in projs:
            w, base = weights[name]
            xh = (rng.standard_normal((pairs, Kd))).astype(BF16)
            xg = buf.put(xh)                       # rows already by expert (cap-0 layout)
            for out_type, mode in ((CUDA_R_32F, POINTER_MODE_DEVICE), (CUDA_R_16BF, POINTER_MODE_DEVICE),
                                   (CUDA_R_32F, POINTER_MODE_HOST)):
                tag = f"T={T} {name} out={'f32' if out_type == CUDA_R_32F else 'bf16'} " \
                      f"ptr={'dev' if mode else 'host'}"
                try:
                    g = Grouped(lt, buf, E, N, Kd, pairs / E, out_type, mode)
                    ob = 4 if out_type == CUDA_R_32F else 2
                    y = buf.empty(ob * pairs * N)
                    d.memset_d8_async(y, 0xFF, ob * pairs * N, stream)     # poisoned
                    g.set_groups(stream, w, xg, y, counts)
                    g.run(stream)
                    stream.synchronize()
                    yh = d.download(y, (pairs, N), np.float32 if ob == 4 else BF16, stream)
                    off = np.concatenate([[0], np.cumsum(counts)[:-1]])
                    errs = []
                    for e in (0, 1, 7, E - 1):
                        r0, c = off[e], counts[e]
                        if c == 0:
                            continue
                        ref = xh[r0:r0 + c].astype(np.float64) @ base[e % 8].astype(np.float64).T
                        errs.append(float(np.abs(yh[r0:r0 + c].astype(np.float64) - ref).max()
                                          / np.abs(ref).max()))
                    finite = bool(np.isfinite(yh.astype(np.float32)).all())
                    ms = event_ms(stream, lambda: g.run(stream))
                    print(f"  grouped {tag}: max rel err {max(errs):.2e} all finite {finite} "
                          f"{ms * 1e3:8.1f} us  {2 * pairs * N * Kd / ms / 1e9:6.1f} TFLOP/s")
                    rows.append((tag, ms))
                except Exception as exc:
                    print(f"  grouped {tag}: {type(exc).__name__}: {exc}")
            # ours (every row on it: cap 0): the work list from the counts, then one launch over
            # every expert's tiles
            tc = moe_route.tile_cap(pairs, E)
            off = np.concatenate([[0], np.cumsum(counts)[:-1]])
            d_rows, tiles = buf.put(counts.astype(np.int32)), buf.empty(4 * 3 * tc)
            d_first = buf.put(off.astype(np.int32))
            for bk, own_gemm in own_gemms.items():
                y = buf.empty(4 * pairs * N)
                d.memset_d8_async(y, 0xFF, 4 * pairs * N, stream)       # poisoned

                def ours():
                    own_tiles.launch(stream, (1,), (-(-E // 32) * 32,),
                                     (tiles, d_rows, d_first, 0, tc))
                    own_gemm.launch(stream, (tc, N // moe_route.GEMM_BN),
                                    (moe_route.GEMM_THREADS,), (y, xg, w, tiles, tc, N, Kd))
                ours()
                stream.synchronize()
                yh = d.download(y, (pairs, N), np.float32, stream)
                errs = [float(np.abs(yh[off[e]:off[e] + counts[e]].astype(np.float64)
                                     - xh[off[e]:off[e] + counts[e]].astype(np.float64)
                                     @ base[e % 8].astype(np.float64).T).max()
                              / max(float(np.abs(yh[off[e]:off[e] + counts[e]]).max()), 1e-30))
                        for e in (0, 1, 7, E - 1) if counts[e]]
                ms = event_ms(stream, ours)
                print(f"  ours    T={T} {name} BK {bk}: max rel err {max(errs):.2e} all finite "
                      f"{bool(np.isfinite(yh).all())} {ms * 1e3:8.1f} us  "
                      f"{2 * pairs * N * Kd / ms / 1e9:6.1f} TFLOP/s (useful)")
                rows.append((f"ours T={T} {name} BK {bk}", ms))
            y = buf.empty(4 * (pairs + E * 64) * N)
            xg2 = buf.empty(2 * (pairs + E * 64) * Kd)
            fn, lay = padded_path(lt, stream, w, xg2, y, ids, E, K, N, Kd, pairs + E * 64)
            ms = event_ms(stream, fn)
            print(f"  padded  T={T} {name}: cap {lay.cap} rows {lay.rows} overflow "
                  f"{len(lay.overflow)}: {ms * 1e3:8.1f} us  "
                  f"{2 * pairs * N * Kd / ms / 1e9:6.1f} TFLOP/s (useful)")
        del order
    buf.free()
    cache.close()
    lt.close()
    d.mem_free(ws_ptr)
    dev.close()


if __name__ == "__main__":
    main()
