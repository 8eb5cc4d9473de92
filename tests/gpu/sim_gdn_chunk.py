"""The chunked gated delta rule (kernels/gdn_chunk.py) on numba-cuda's CPU simulator (no GPU),
with the recurrent kernel (kernels/gdn.py) run on the same inputs: both against a float64
sequential oracle. `tests/test_gdn_chunk_nogpu.py` runs this in a subprocess (the simulator must be
switched on before numba is imported) and checks the printed JSON errors. Case "snap": the
recurrent kernel's snapshot variant (gdn_recurrent_snap, a speculative verify's) instead.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_gdn_chunk.py [small] [decay] [snap]
"""
import json
import sys

import numpy as np

import threading

from oracles import gated_delta_rows, gdn_inputs
from sim_attention_tc import NP, Memory, _fake, cuda   # (also sets the simulator's libdevice shims)


def _shfl_xor_sync(self, mask, value, lane_mask):
    """The simulator has no warp shuffles. This one exchanges through a per-block table behind a
    block-wide barrier, so it is exact only where every thread of the block shuffles at the same
    point, as in gdn_chunk_scan and gdn_recurrent (their shuffles sit in block-uniform code). Two
    tables alternate: a thread can only write shuffle n + 2's table after the barrier of shuffle
    n + 1, which every thread reaches after reading shuffle n's."""
    th = threading.current_thread()
    tables = th._manager.__dict__.setdefault("_shfl_tables", ({}, {}))
    n = getattr(th, "_shfl_count", 0)
    th._shfl_count = n + 1
    table = tables[n % 2]
    table[th.thread_id] = value
    th.syncthreads()
    return table[th.thread_id ^ lane_mask]


_fake.FakeCUDAModule.shfl_xor_sync = _shfl_xor_sync


from ninfer.core.cuda.kernels import ARG_TYPES, _import_kernel_module   # noqa: E402
from ninfer.models.qwen3_5.cuda import gdn_chunk as gc   # noqa: E402
from ninfer.models.qwen3_5.cuda.kernel_set import SIGS   # noqa: E402


def run(dk, dv, nk, nv, cn, lengths, ctxs, prep_threads=64, seed=0, strong_decay=False,
        recurrent=True, vb=gc.SCAN_VB, nc=gc.SCAN_NC, ib=gc.SCAN_IB, tc=False):
    """Returns the relative L2 errors of (chunked out, chunked state, recurrent out, recurrent
    state) against the float64 oracle, and chunked against recurrent (out, state). `tc`: the
    tensor-core variants (kernels/gdn_chunk_tc.py) with chunks of `cn` (cn / 16 warps), their
    scan as the state and output passes (gdn_chunk_state_tc + gdn_chunk_out_tc)."""
    r = np.random.default_rng(seed)
    mem = Memory(8 << 20)
    n, nb = sum(lengths), len(lengths)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    qkv, proj, P, a_off, b_off, A_log, dt_bias = gdn_inputs(r, dk, dv, nk, nv, n, strong_decay)
    slots = r.permutation(nb + 1)[:nb].astype(np.int32)
    state0 = (0.3 * r.standard_normal((nb + 1, nv, dk, dv))).astype(np.float32)
    ctx = np.asarray(ctxs, np.int32)

    ref, ref_state = gated_delta_rows(qkv, proj, a_off, b_off, A_log, dt_bias, state0, slots, ctx,
                                      qs, nk, nv, dk, dv)

    d = {name: mem.put(a) for name, a in (("qkv", qkv), ("proj", proj), ("a_log", A_log),
                                           ("dt_bias", dt_bias), ("qs", qs), ("ctx", ctx),
                                           ("slots", slots))}
    shapes = gc.buffer_shapes(n, nv, dk, cn, dv if tc else 0, nb)
    params = {"gdn_chunk_prep": dict(dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn, NT=prep_threads,
                                     KT=gc.PREP_KT),
              "gdn_chunk_scan": dict(dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn, VB=vb, NC=nc,
                                     KS=gc.scan_ks(dk), IB=ib),
              "gdn_recurrent": dict(dk=dk, dv=dv, nk=nk, nv=nv),
              "gdn_chunk_prep_tc": dict(dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn),
              "gdn_chunk_state_tc": dict(dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn, VB=vb),
              "gdn_chunk_out_tc": dict(dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn, VB=vb)}
    launched = []

    def launch(name, grid, block, args):
        module, factory, sig = SIGS[name]
        k = cuda.jit(getattr(_import_kernel_module(module), factory)(**params[name]))
        conv = [mem.view(int(a), NP[ARG_TYPES[t][1]]) if ARG_TYPES[t][2] else
                (np.float32(a) if t == "f32" else int(a)) for t, a in zip(sig, args)]
        k[tuple(grid), tuple(block)](*conv)
        launched.append(name)

    results = {}
    paths = ("chunked",) + (("recurrent",) if recurrent else ())
    for path in paths:
        state = mem.put(state0)
        out = mem.alloc(n * nv * dv * 4, 0xFF)                       # NaN poison
        if path == "chunked":
            bufs = {k: mem.alloc(4 * int(np.prod(s)), 0xFF) for k, s in shapes.items()}
            rows = [(int(qs[i]), lengths[i], int(ctx[i])) for i in range(nb)]
            gc.launch(launch, dk, dv, nv, cn, nb, gc.max_chunks(rows, n, nb, cn),
                      core=out, w=bufs["w"], p=bufs["p"], g=bufs["g"], qkv=d["qkv"],
                      proj=d["proj"], proj_stride=P, a_off=a_off, b_off=b_off,
                      a_log=d["a_log"], dt_bias=d["dt_bias"], state=state,
                      query_start=d["qs"], context_lens=d["ctx"], state_slots=d["slots"],
                      prep_threads=prep_threads, scan_vb=vb,
                      scan_nt=vb // nc * gc.scan_ks(dk), tc=tc, s=bufs.get("s"))
        else:
            launch("gdn_recurrent", (nb, nv, -(-dv // 32)), (128,),
                   (out, d["qkv"], d["proj"], P, a_off, b_off, d["a_log"], d["dt_bias"],
                    state, d["qs"], d["ctx"], d["slots"]))
        results[path] = (mem.get(out, (n, nv, dv), np.float32).astype(np.float64),
                         mem.get(state, state0.shape, np.float32).astype(np.float64))

    def rel(x, y):
        if not np.all(np.isfinite(x)):
            return float("nan")
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

    # the slot no row uses must be untouched (bitwise)
    spare = np.setdiff1d(np.arange(nb + 1), slots)
    co, cs = results["chunked"]
    res = {"chunk_out": rel(co, ref), "chunk_state": rel(cs, ref_state),
           "spare_slot_untouched": bool(np.array_equal(cs[spare], state0[spare])),
           "kernels": sorted({k for k in launched if k.startswith("gdn_chunk")})}
    if recurrent:
        ro, rs = results["recurrent"]
        res.update(rec_out=rel(ro, ref), rec_state=rel(rs, ref_state),
                   chunk_vs_rec_out=rel(co, ro), chunk_vs_rec_state=rel(cs, rs),
                   rec_spare_slot_untouched=bool(np.array_equal(rs[spare], state0[spare])))
    return res


def run_snap(dk, dv, nk, nv, lengths, ctxs, snaps, seed=0):
    """gdn_recurrent_snap and conv_state_update_snap (a speculative verify's State): rows of
    `lengths` tokens, row r writing S and its conv window after each of its tokens into State
    slots snaps[r] + i (snaps[r] < 0: none).
    Returns the relative errors against the float64 oracle of the outputs, the final states and
    every snapshot (the state after the row's first i + 1 tokens), the outputs' difference from
    gdn_recurrent's on the same inputs, and whether the slots nobody writes kept their bits."""
    r = np.random.default_rng(seed)
    mem = Memory(8 << 20)
    n, nb = sum(lengths), len(lengths)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    qkv, proj, P, a_off, b_off, A_log, dt_bias = gdn_inputs(r, dk, dv, nk, nv, n)
    num_slots = nb + sum(max(length, 0) for length, s in zip(lengths, snaps) if s >= 0) + 2
    state0 = (0.3 * r.standard_normal((num_slots, nv, dk, dv))).astype(np.float32)
    slots = np.arange(nb, dtype=np.int32)[::-1].copy()
    ctx = np.asarray(ctxs, np.int32)
    snap_base = np.asarray(snaps, np.int32)
    ref, ref_state = gated_delta_rows(qkv, proj, a_off, b_off, A_log, dt_bias, state0, slots, ctx,
                                      qs, nk, nv, dk, dv)
    want = {}                                           # slot -> the state it should hold
    for row in range(nb):
        for i in range(lengths[row] if snaps[row] >= 0 else 0):
            cut = np.array([qs[row], qs[row] + i + 1], np.int32)
            _, st = gated_delta_rows(qkv, proj, a_off, b_off, A_log, dt_bias, state0,
                                     slots[row:row + 1], ctx[row:row + 1], cut, nk, nv, dk, dv)
            want[int(snaps[row]) + i] = st[slots[row]]
    d = {name: mem.put(a) for name, a in (("qkv", qkv), ("proj", proj), ("a_log", A_log),
                                           ("dt_bias", dt_bias), ("qs", qs), ("ctx", ctx),
                                           ("slots", slots), ("snap", snap_base))}
    # the conv windows: conv_state_update_snap on the first C proj columns (the conv inputs)
    K, C = 4, 2 * nk * dk + nv * dv
    conv0 = r.standard_normal((num_slots, C, K - 1)).astype(np.float32)
    conv_want = {}
    for row in range(nb):
        old = conv0[slots[row]] if ctx[row] > 0 else np.zeros((C, K - 1), np.float32)
        seq = np.concatenate([old, proj[qs[row]:qs[row + 1], :C].T], 1)      # [C, K-1+n]
        for i in range(lengths[row] if snaps[row] >= 0 else 0):
            conv_want[int(snaps[row]) + i] = seq[:, i + 1:i + K]
        conv_want[int(slots[row])] = seq[:, -(K - 1):]
    module, factory, sig = SIGS["conv_state_update_snap"]
    kconv = cuda.jit(getattr(_import_kernel_module(module), factory)(K=K, C=C))
    conv = mem.put(conv0)
    args = [conv, d["proj"], P, d["qs"], d["ctx"], d["slots"], d["snap"]]
    kconv[(-(-C // 32), nb), (32,)](*[mem.view(int(a), NP[ARG_TYPES[t][1]]) if ARG_TYPES[t][2]
                                      else int(a) for t, a in zip(sig, args)])
    conv_got = mem.get(conv, conv0.shape, np.float32)
    conv_rest = [s for s in range(num_slots) if s not in conv_want]
    params = dict(dk=dk, dv=dv, nk=nk, nv=nv)
    got = {}
    for name in ("gdn_recurrent", "gdn_recurrent_snap"):
        module, factory, sig = SIGS[name]
        k = cuda.jit(getattr(_import_kernel_module(module), factory)(**params))
        state = mem.put(state0)
        out = mem.alloc(n * nv * dv * 4, 0xFF)                       # NaN poison
        args = [out, d["qkv"], d["proj"], P, a_off, b_off, d["a_log"], d["dt_bias"], state,
                d["qs"], d["ctx"], d["slots"]] + ([d["snap"]] if name.endswith("snap") else [])
        conv = [mem.view(int(a), NP[ARG_TYPES[t][1]]) if ARG_TYPES[t][2] else
                (np.float32(a) if t == "f32" else int(a)) for t, a in zip(sig, args)]
        k[(nb, nv, -(-dv // 32)), (128,)](*conv)
        got[name] = (mem.get(out, (n, nv, dv), np.float32).astype(np.float64),
                     mem.get(state, state0.shape, np.float32).astype(np.float64))

    def rel(x, y):
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) \
            if np.all(np.isfinite(x)) else float("nan")
    out_s, state_s = got["gdn_recurrent_snap"]
    untouched = [s for s in range(num_slots) if s not in want and s not in slots]
    return {"out": rel(out_s, ref), "state": rel(state_s[slots], ref_state[slots]),
            "snaps": max(rel(state_s[s], w) for s, w in want.items()),
            "num_snaps": len(want),
            "vs_plain_out": rel(out_s, got["gdn_recurrent"][0]),
            "others_untouched": bool(np.array_equal(state_s[untouched], state0[untouched])),
            "conv_windows_exact": all(np.array_equal(conv_got[s], w) for s, w in conv_want.items()),
            "conv_others_untouched": bool(np.array_equal(conv_got[conv_rest], conv0[conv_rest]))}


CASES = {
    # dk 12 (4 lanes x 3 odd rows), dv 20 < 32 (idle columns), ratio 3, chunk 4: rows of
    # 1, Cn-1, Cn, Cn+1 and 3 chunks, fresh and continued states
    # (the recurrent kernel runs on the same inputs here)
    "small": dict(dk=12, dv=20, nk=1, nv=3, cn=4, lengths=[1, 3, 4, 5, 11], ctxs=[0, 7, 0, 2, 0]),
    # dk 32 (8 lanes x 4 rows: one group of 4 adjacent rows, the real geometry's layout), dv 40:
    # a full and a partial column block; ratio 2, chunk 8 (rows of Cn+1, 1, 2 Cn + 1), strong
    # decay, the real prep block size
    "decay": dict(dk=32, dv=40, nk=1, nv=2, cn=8, lengths=[9, 1, 17], ctxs=[3, 0, 0],
                  prep_threads=gc.PREP_THREADS, strong_decay=True, recurrent=False),
    # the benchmark sweep's other scan variants (run by hand: not part of the CPU suite)
    "nc4": dict(dk=16, dv=40, nk=1, nv=2, cn=8, lengths=[9, 1, 17], ctxs=[3, 0, 0],
                recurrent=False, vb=32, nc=4, ib=8),
    "vb16": dict(dk=12, dv=20, nk=1, nv=3, cn=8, lengths=[1, 9, 17], ctxs=[0, 7, 2],
                 recurrent=False, vb=16, nc=1, ib=2),
    "vb16nc2": dict(dk=16, dv=20, nk=1, nv=2, cn=8, lengths=[1, 9, 17], ctxs=[0, 7, 2],
                    recurrent=False, vb=16, nc=2, ib=4),
}

# the tensor-core variants (tf32 mma): chunk 32 = 2 warps, dk 32 (one 16-row state tile a
# warp), dv 64 (two value blocks, two U groups), ratio 2; rows of 1, Cn - 1, Cn, Cn + 1 and 2 Cn + 6
# tokens, fresh and continued states. "tc64": the real chunk of 64 (4 warps), dk 64, strong decay
TC_CASES = {
    "tc": dict(dk=32, dv=32, nk=1, nv=1, cn=32, lengths=[1, 40],
               ctxs=[5, 0], tc=True),
    "tc64": dict(dk=64, dv=32, nk=1, nv=2, cn=64, lengths=[65, 1, 64], ctxs=[3, 0, 0],
                 strong_decay=True, recurrent=False, tc=True),
    # narrower scan blocks (VB 16, 8): more blocks a head
    "tc16": dict(dk=32, dv=32, nk=1, nv=1, cn=32, lengths=[1, 40], ctxs=[5, 0], tc=True, vb=16),
    "tc8": dict(dk=32, dv=32, nk=1, nv=1, cn=32, lengths=[40], ctxs=[5], tc=True, vb=8),
    # the scan over rows whose chunk slots interleave (starts not multiples of cn), two value
    # blocks and two heads a key head: rows of 33, 1, 31 and 70 tokens
    "tcsplit": dict(dk=32, dv=32, nk=1, nv=2, cn=32, lengths=[33, 1, 31, 70], ctxs=[0, 4, 2, 0],
                    tc=True, vb=16, recurrent=False),
}
CASES.update(TC_CASES)

# a verify's rows: k + 1 = 1 .. 5 tokens with snapshots, a row without (plain decode beside
# them), fresh and continued states; dk 12 (odd rows per lane), dv 20 (idle columns), ratio 3
SNAP_CASE = dict(dk=12, dv=20, nk=1, nv=3, lengths=[4, 1, 5, 2, 3], ctxs=[5, 9, 0, 3, 2],
                 snaps=[5, 9, 10, -1, 15])

if __name__ == "__main__":
    names = sys.argv[1:] or ["small", "decay"]
    if set(names) & set(TC_CASES):
        # the mma twin meets a warp's 32 threads at a barrier per instruction: switching the
        # GIL among them every 0.1 ms instead of 5 ms halves the case's time
        sys.setswitchinterval(1e-4)
    print(json.dumps({name: run_snap(**SNAP_CASE) if name == "snap" else run(**CASES[name])
                      for name in names}))
