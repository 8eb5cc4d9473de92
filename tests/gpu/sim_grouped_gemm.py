"""The device-routed MoE prefill's own grouped GEMM (kernels/grouped_gemm.py) and its work list
(kernels/moe.py moe_route_tiles) on numba-cuda's CPU simulator (no GPU), against numpy: the
tiles exactly, the products against float64 over the same bf16 operands.
`tests/test_grouped_gemm_nogpu.py` runs this in a subprocess (the simulator must be switched on
before numba is imported) and checks the printed JSON.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_grouped_gemm.py
"""
import json
import sys

import numpy as np

from sim_attention_tc import NP, Memory, bf16_to_f32, cuda, f32_to_bf16   # (and its shims)

from ninfer.core.cuda.kernels import ARG_TYPES, _import_kernel_module   # noqa: E402
from ninfer.models.qwen3_5.cuda.kernel_set import SIGS   # noqa: E402


def launch(mem, name, params, grid, block, args):
    module, factory, sig = SIGS[name]
    k = cuda.jit(getattr(_import_kernel_module(module), factory)(**params))
    conv = [mem.view(int(a), NP[ARG_TYPES[t][1]]) if ARG_TYPES[t][2] else int(a)
            for t, a in zip(sig, args)]
    k[tuple(grid), tuple(block)](*conv)


def host_tiles(rows, bm, t_cap):
    """moe_route_tiles' work list, in numpy: (expert or -1, first row, rows) per entry."""
    out = np.full((3, t_cap), -1, np.int32)
    out[1:] = 0
    i, r0 = 0, 0
    for e, m in enumerate(rows):
        for j in range(-(-int(m) // bm)):
            out[:, i] = (e, r0 + j * bm, min(bm, m - j * bm))
            i += 1
        r0 += int(m)
    return out, i


def run(rows, n, k, seed=0):
    gg = _import_kernel_module("grouped_gemm")
    bm = gg.BM
    r = np.random.default_rng(seed)
    rows = np.asarray(rows, np.int32)
    E, total = len(rows), int(rows.sum())
    t_cap = -(-total // bm) + E
    mem = Memory(16 << 20)
    d_rows = mem.put(rows)
    d_tiles = mem.alloc(4 * 3 * t_cap, 0xFF)                         # poisoned
    launch(mem, "moe_route_tiles", dict(E=E, BM=bm), (1,), (-(-E // 32) * 32,),
           (d_tiles, d_rows, t_cap))
    tiles = mem.get(d_tiles, (3, t_cap), np.int32)
    want, used = host_tiles(rows, bm, t_cap)
    res = {"tiles_exact": bool(np.array_equal(tiles[0], want[0])
                               and np.array_equal(tiles[1:, :used], want[1:, :used]))}

    # bf16 operands (rounded from fresh normals); the reference is float64 over the same bits
    xb = f32_to_bf16(r.standard_normal((total, k)))
    wb = f32_to_bf16(r.standard_normal((E, n, k)) / np.sqrt(k))
    extra = 5                                                        # rows past the layout
    d_x = mem.put(xb)
    d_w = mem.put(wb)
    d_out = mem.alloc(4 * (total + extra) * n, 0xFF)                 # NaN poison
    launch(mem, "grouped_gemm", {}, (t_cap, n // gg.BN), (gg.THREADS,),
           (d_out, d_x, d_w, d_tiles, t_cap, n, k))
    out = mem.get(d_out, (total + extra, n), np.float32).astype(np.float64)
    xf = bf16_to_f32(xb).astype(np.float64)
    wf = bf16_to_f32(wb).astype(np.float64)
    ref = np.concatenate([xf[a:a + m] @ wf[e].T for e, (a, m) in
                          enumerate(zip(np.concatenate([[0], np.cumsum(rows)[:-1]]), rows))])
    got = out[:total]
    res["finite"] = bool(np.all(np.isfinite(got)))
    res["rel"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if res["finite"] \
        else float("nan")
    res["rows_past_untouched"] = bool(np.all(np.isnan(out[total:])))
    return res


CASES = {
    # experts with 0 rows, 1, a whole tile, a tile + 1, and a few; two column blocks, two k steps
    "small": dict(rows=[0, 1, 64, 65, 3], n=128, k=64),
}

if __name__ == "__main__":
    sys.setswitchinterval(1e-4)     # the mma twin meets a warp's 32 threads at a barrier
    names = sys.argv[1:] or list(CASES)
    print(json.dumps({name: run(**CASES[name]) for name in names}))
