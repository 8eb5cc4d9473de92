"""One GDN layer's gated delta rule at a real head geometry: the chunked prefill kernels
(gdn_chunk_prep + gdn_chunk_scan; first their tensor-core variants, a bf16 model's, where the
geometry takes them: "tc": true) against the sequential gdn_recurrent, one row of T tokens from a
fresh state, GPU time by CUDA events (median of --reps), plus how far the two outputs differ.

    PYTHONPATH=. python3 bench/bench_gdn_chunk.py                 # 27B: 16/48 heads of 128
    PYTHONPATH=. python3 bench/bench_gdn_chunk.py --nv 32 --tokens 4096
    PYTHONPATH=. python3 bench/bench_gdn_chunk.py --tokens 4096 --sweep   # block shapes, chunks

Each line is one configuration; the first is a bf16 model's (the tensor cores: the scan as a
sequential state pass + a parallel output pass), the next a float32 model's (cuda/gdn_chunk.py's
constants).
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
from ninfer.models.qwen3_5.cuda.kernel_set import spec


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


def scan_variants(dk, dv, sweep, tc_sweep=False):
    """(chunk, VB, NC, IB, prep NT, tc) to time: the shipped configurations first (the tensor
    cores', where tc_ok, then the fp32 kernels'), then (--sweep) a curated set of fp32 variants
    (~20: each costs a few seconds of compilation) that the kernels' shared memory and
    thread-count rules accept. A tensor-core variant's VB is the pair (state pass, output pass)
    and its NC / IB are unused. `tc_sweep`: also the tensor-core passes at other block widths
    (VB 16 / 8: more blocks a head, each re-reading the chunk's W and K, or Q, P and S_c)."""
    ks = gc.scan_ks(dk)
    cn0 = gc.chunk_size(dk)
    tc = gc.tc_ok(dk, dv)
    shipped = (gc.TC_VB, gc.TC_VB)
    out = [(gc.TC_CHUNK, shipped, 1, 1, 2 * gc.TC_CHUNK, True)] if tc else []
    out.append((cn0, gc.SCAN_VB, gc.SCAN_NC, gc.SCAN_IB, gc.PREP_THREADS, False))
    if tc_sweep and tc:
        out += [(gc.TC_CHUNK, vbs, 1, 1, 2 * gc.TC_CHUNK, True)
                for vbs in ((16, 32), (8, 32), (16, 16), (32, 16), (8, 16))
                if vbs != shipped and dv % vbs[0] == 0 and dv % vbs[1] == 0]
    if not sweep:
        return out
    out.append((cn0, gc.SCAN_VB, gc.SCAN_NC, gc.SCAN_IB, 128, False))
    for cn in sorted({cn0, max(cn0 // 2, 8)}, reverse=True):
        for vb, nc in ((32, 2), (32, 4), (32, 1), (16, 2), (16, 1), (64, 4)):
            for ib in (4, 8, 2):
                nt = vb // nc * ks
                smem = 4 * cn * (dk + vb + cn + 2)
                v = (cn, vb, nc, ib, gc.PREP_THREADS, False)
                if (nt % 32 or nt < cn or nt > 1024 or cn % ib or smem > gc.STATIC_SMEM_BYTES
                        or v in out or (ib == 2 and nc != 4)):
                    continue
                out.append(v)
    return out


def bench(dev, cache, T, dk, dv, nk, nv, reps, sweep=False, seed=0, tc_sweep=False):
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
    cn_max = max(max(gc.CHUNK_SIZES), gc.TC_CHUNK)
    # big enough for every chunk size; the split scan's S_c at the tensor cores' chunk
    shapes = dict(gc.buffer_shapes(T, nv, dk, cn_max),
                  s=gc.buffer_shapes(T, nv, dk, gc.TC_CHUNK, dv, 1)["s"])
    need = 4 * (qkv.size + proj.size + 2 * T * nv * dv + 2 * nv * dk * dv) + \
        sum(4 * math.prod(s) for s in shapes.values()) + (1 << 24)
    arena = Arena(need)
    taken = []

    def put(a):
        buf = arena.take(a.shape, a.dtype, "bench buffer")
        d.upload(buf.ptr, np.ascontiguousarray(a), st)
        taken.append(buf)
        return buf

    rows = []
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
        taken += [out_c, out_r]
        bufs = {k: arena.take(s, np.float32, k) for k, s in shapes.items()}
        taken += list(bufs.values())
        rec = cache.get(spec("gdn_recurrent", dk=dk, dv=dv, nk=nk, nv=nv))

        def recurrent():
            rec.launch(st, (1, nv, (dv + 31) // 32), (128,),
                       (out_r, d_qkv, d_proj, P, C + nv, C, d_alog, d_dtb, st_r, d_qs, d_ctx, d_slot))

        recurrent()
        st.synchronize()
        orr = d.download(out_r.ptr, out_r.shape, np.float32, st)
        t_rec = timed(st, recurrent, max(1, reps // 2))
        for cn, vb, nc, ib, prep_nt, tc in scan_variants(dk, dv, sweep, tc_sweep):
            chunks = gc.max_chunks([(0, T, 0)], T, 1, cn)
            if tc:
                prep_k = cache.get(spec("gdn_chunk_prep_tc", dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn))
                geo = dict(dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn)
                vb, vb_out = vb
                state_k = cache.get(spec("gdn_chunk_state_tc", **geo, VB=vb))
                out_k = cache.get(spec("gdn_chunk_out_tc", **geo, VB=vb_out))
                nt = prep_nt

                class SplitScan:         # the two passes where the scan kernel would launch
                    passes = 2           # the output pass left out (1): the state pass alone

                    @classmethod
                    def launch(cls, st, grid, block, args):
                        out, w, p, g, qkv, state, qs, ctx, slots = args
                        state_k.launch(st, (grid[0], grid[1], -(-dv // vb)), block,
                                       (out, w, bufs["s"], g, qkv, state, qs, ctx, slots))
                        if cls.passes == 2:
                            out_k.launch(st, (grid[0], grid[1], chunks * -(-dv // vb_out)),
                                         block, (out, p, bufs["s"], g, qkv, qs))
                scan_k = SplitScan
            else:
                prep_k = cache.get(spec("gdn_chunk_prep", dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn,
                                        NT=prep_nt, KT=gc.PREP_KT))
                scan_k = cache.get(spec("gdn_chunk_scan", dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn,
                                        VB=vb, NC=nc, KS=gc.scan_ks(dk), IB=ib))
                nt = vb // nc * gc.scan_ks(dk)

            def prep():
                prep_k.launch(st, (1, nv, chunks), (prep_nt,),
                              (out_c, bufs["w"], bufs["p"], bufs["g"], d_qkv, d_proj, P, C + nv, C,
                               d_alog, d_dtb, d_qs))

            def scan():
                scan_k.launch(st, (1, nv, -(-dv // vb)), (nt,),
                              (out_c, bufs["w"], bufs["p"], bufs["g"], d_qkv, st_c, d_qs, d_ctx,
                               d_slot))

            prep(), scan()
            st.synchronize()
            oc = d.download(out_c.ptr, out_c.shape, np.float32, st)
            diff = float(np.linalg.norm(oc - orr) / max(np.linalg.norm(orr), 1e-30))
            t_prep = timed(st, prep, reps)
            t_scan = timed(st, lambda: (prep(), scan()), reps) - t_prep   # scan needs a fresh U
            passes = {}
            if tc:                   # the state pass alone, and so the output pass's share
                scan_k.passes = 1
                passes["state_ms"] = round(timed(st, lambda: (prep(), scan()), reps) - t_prep, 4)
                passes["out_ms"] = round(t_scan - passes["state_ms"], 4)
                passes["VB_out"] = vb_out
            rows.append(dict(T=T, dk=dk, dv=dv, nk=nk, nv=nv, tc=tc, chunk=cn,
                             VB=vb, NC=nc, IB=ib, **passes,
                             prep_threads=prep_nt, prep_ms=round(t_prep, 4),
                             scan_ms=round(t_scan, 4), chunked_ms=round(t_prep + t_scan, 4),
                             recurrent_ms=round(t_rec, 4),
                             speedup=round(t_rec / (t_prep + t_scan), 2),
                             rel_diff_vs_recurrent=diff))
            print(json.dumps(rows[-1]), flush=True)
        return rows
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
    ap.add_argument("--sweep", action="store_true",
                    help="also time other chunk sizes / scan block shapes (the fastest with "
                         "rel_diff_vs_recurrent < 1e-5 is the one to ship in cuda/gdn_chunk.py)")
    ap.add_argument("--tc-sweep", action="store_true",
                    help="also time the tensor-core scan at block widths VB 32 / 16 / 8")
    args = ap.parse_args(argv)
    dev = d.Device(0)
    cache = KernelCache(dev.cc)
    try:
        for T in (int(x) for x in args.tokens.split(",")):
            bench(dev, cache, T, args.dk, args.dv, args.nk, args.nv, args.reps, args.sweep,
                  tc_sweep=args.tc_sweep)
    finally:
        cache.close()
        dev.close()


if __name__ == "__main__":
    main()
