"""One GDN layer's gated delta rule at a real head geometry: the chunked prefill kernels
(gdn_chunk_prep + gdn_chunk_scan) against the sequential gdn_recurrent, one row of T tokens from a
fresh state, GPU time by CUDA events (median of --reps), plus how far the two outputs differ.

    PYTHONPATH=. python3 bench/bench_gdn_chunk.py                 # 27B: 16/48 heads of 128
    PYTHONPATH=. python3 bench/bench_gdn_chunk.py --nv 32 --tokens 4096
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from ninfer.core.cuda import driver as d
from ninfer.core.cuda.arena import Arena
from ninfer.core.cuda.kernels import KernelCache
from ninfer.models.qwen3_5.cuda import gdn_chunk as gc
from ninfer.models.qwen3_5.cuda.kernel_set import gdn_chunk_specs, spec


def timed(stream, fn, reps):
    out = []
    for _ in range(reps):
        e0, e1 = d.Event(), d.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        out.append(e0.elapsed_ms(e1))
        e0.destroy()
        e1.destroy()
    return float(np.median(out))


def bench(dev, cache, T, dk, dv, nk, nv, reps, seed=0):
    st = dev.stream
    r = np.random.default_rng(seed)
    C = 2 * nk * dk + nv * dv
    P = C + 2 * nv
    qk = r.standard_normal((T, 2 * nk, dk), dtype=np.float32)
    qk /= np.linalg.norm(qk, axis=-1, keepdims=True)
    qk[:, :nk] /= math.sqrt(dk)
    qkv = np.concatenate([qk.reshape(T, -1), r.standard_normal((T, nv * dv), dtype=np.float32)], 1)
    del qk
    proj = r.standard_normal((T, P), dtype=np.float32)
    A_log = (0.5 * r.standard_normal(nv)).astype(np.float32)
    dt_bias = (0.5 * r.standard_normal(nv)).astype(np.float32)
    cn = gc.chunk_size(dk)
    shapes = gc.buffer_shapes(T, nv, dk, cn)
    need = 4 * (qkv.size + proj.size + 2 * T * nv * dv + 2 * nv * dk * dv) + \
        sum(4 * math.prod(s) for s in shapes.values()) + (1 << 24)
    arena = Arena(need)
    taken = []

    def put(a):
        buf = arena.take(a.shape, a.dtype, "bench buffer")
        d.upload(buf.ptr, np.ascontiguousarray(a), st)
        taken.append(buf)
        return buf

    try:
        d_qkv, d_proj, d_alog, d_dtb = put(qkv), put(proj), put(A_log), put(dt_bias)
        del qkv, proj
        d_qs = put(np.array([0, T], np.int32))
        d_ctx = put(np.array([0], np.int32))
        d_slot = put(np.array([0], np.int32))
        st_c = put(np.zeros((1, nv, dk, dv), np.float32))
        st_r = put(np.zeros((1, nv, dk, dv), np.float32))
        out_c = arena.take((T, nv * dv), np.float32, "out")
        out_r = arena.take((T, nv * dv), np.float32, "out")
        bufs = {k: arena.take(s, np.float32, k) for k, s in shapes.items()}
        specs = gdn_chunk_specs(dk, dv, nk, nv)
        kern = {k: cache.get(s) for k, s in specs.items()}
        rec = cache.get(spec("gdn_recurrent", dk=dk, dv=dv, nk=nk, nv=nv))
        chunks = gc.max_chunks([(0, T, 0)], T, 1, cn)
        prep_args = (out_c, bufs["w"], bufs["p"], bufs["g"], d_qkv, d_proj, P, C + nv, C,
                     d_alog, d_dtb, d_qs)
        scan_args = (out_c, bufs["w"], bufs["p"], bufs["g"], d_qkv, st_c, d_qs, d_ctx, d_slot)

        def prep():
            kern["gdn_chunk_prep"].launch(st, (1, nv, chunks), (gc.PREP_THREADS,), prep_args)

        def scan():
            kern["gdn_chunk_scan"].launch(st, (1, nv, -(-dv // gc.SCAN_VB)), (gc.scan_threads(dk),),
                                          scan_args)

        def recurrent():
            rec.launch(st, (1, nv, (dv + 31) // 32), (128,),
                       (out_r, d_qkv, d_proj, P, C + nv, C, d_alog, d_dtb, st_r, d_qs, d_ctx, d_slot))

        prep(), scan(), recurrent()                    # warm-up (module load), and the outputs
        st.synchronize()
        oc = d.download(out_c.ptr, out_c.shape, np.float32, st)
        orr = d.download(out_r.ptr, out_r.shape, np.float32, st)
        diff = float(np.linalg.norm(oc - orr) / max(np.linalg.norm(orr), 1e-30))
        t_prep = timed(st, prep, reps)
        t_scan = timed(st, lambda: (prep(), scan()), reps) - t_prep   # scan needs a fresh U
        t_rec = timed(st, recurrent, max(1, reps // 2))
        return dict(T=T, dk=dk, dv=dv, nk=nk, nv=nv, chunk=cn, prep_ms=round(t_prep, 4),
                    scan_ms=round(t_scan, 4), chunked_ms=round(t_prep + t_scan, 4),
                    recurrent_ms=round(t_rec, 4), speedup=round(t_rec / (t_prep + t_scan), 2),
                    rel_diff_vs_recurrent=diff)
    finally:
        for b in taken:
            arena.give(b)
        arena.close()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--nk", type=int, default=16)
    ap.add_argument("--nv", type=int, default=48)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    dev = d.Device(0)
    cache = KernelCache(dev.cc)
    try:
        for T in (int(x) for x in args.tokens.split(",")):
            print(json.dumps(bench(dev, cache, T, args.dk, args.dv, args.nk, args.nv, args.reps)),
                  flush=True)
    finally:
        cache.close()
        dev.close()


if __name__ == "__main__":
    main()
