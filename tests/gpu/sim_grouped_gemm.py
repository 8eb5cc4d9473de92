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


def host_tiles(over, first, bm, t_cap):
    """moe_route_tiles' work list, in numpy: (expert or -1, first row, rows) per entry over each
    expert's `over` rows from row first[e]."""
    out = np.full((3, t_cap), -1, np.int32)
    out[1:] = 0
    i = 0
    for e, m in enumerate(over):
        for j in range(-(-int(m) // bm)):
            out[:, i] = (e, first[e] + j * bm, min(bm, m - j * bm))
            i += 1
    return out, i


def run(rows, n, k, cap=0, bk=None, seed=0):
    """Experts of `rows` routed rows in the device route's layout for block size cap (a padded
    block of cap rows an expert, the rest in the overflow region): the tiles of the overflow
    (every row for cap 0) exactly, their products against float64; the padded block's rows and
    the rows past the layout untouched."""
    gg = _import_kernel_module("grouped_gemm")
    bm = gg.BM
    r = np.random.default_rng(seed)
    rows = np.asarray(rows, np.int32)
    E = len(rows)
    over = np.maximum(rows - cap, 0)
    first = (E * cap + np.concatenate([[0], np.cumsum(over)[:-1]])).astype(np.int32)
    total = E * cap + int(over.sum())                                # rows of the layout
    t_cap = -(-int(rows.sum()) // bm) + E
    mem = Memory(16 << 20)
    d_rows = mem.put(rows)
    d_first = mem.put(first)
    d_tiles = mem.alloc(4 * 3 * t_cap, 0xFF)                         # poisoned
    launch(mem, "moe_route_tiles", dict(E=E, BM=bm), (1,), (-(-E // 32) * 32,),
           (d_tiles, d_rows, d_first, cap, t_cap))
    tiles = mem.get(d_tiles, (3, t_cap), np.int32)
    want, used = host_tiles(over, first, bm, t_cap)
    res = {"tiles_exact": bool(np.array_equal(tiles[0], want[0])
                               and np.array_equal(tiles[1:, :used], want[1:, :used]))}

    # bf16 operands (rounded from fresh normals); the reference is float64 over the same bits
    xb = f32_to_bf16(r.standard_normal((total, k)))
    wb = f32_to_bf16(r.standard_normal((E, n, k)) / np.sqrt(k))
    extra = 5                                                        # rows past the layout
    d_x = mem.put(xb)
    d_w = mem.put(wb)
    d_out = mem.alloc(4 * (total + extra) * n, 0xFF)                 # NaN poison
    launch(mem, "grouped_gemm", {} if bk is None else dict(BK=bk), (t_cap, n // gg.BN),
           (gg.THREADS,),
           (d_out, d_x, d_w, d_tiles, t_cap, n, k))
    out = mem.get(d_out, (total + extra, n), np.float32).astype(np.float64)
    xf = bf16_to_f32(xb).astype(np.float64)
    wf = bf16_to_f32(wb).astype(np.float64)
    ref = np.concatenate([xf[a:a + m] @ wf[e].T for e, (a, m) in enumerate(zip(first, over))])
    got = out[E * cap:total]
    res["finite"] = bool(np.all(np.isfinite(got)))
    res["rel"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if res["finite"] \
        else float("nan")
    res["rows_past_untouched"] = bool(np.all(np.isnan(out[total:]))
                                      and np.all(np.isnan(out[:E * cap])))
    return res


def silu(rows=7, inter=300, seed=1):
    """routed_silu_mul: the rows some pair took (src >= 0) within one bf16 rounding of float64's
    SwiGLU, over two blocks of a row and a partial one; the rows of src -1 untouched."""
    gg = _import_kernel_module("grouped_gemm")
    r = np.random.default_rng(seed)
    gu = r.standard_normal((rows, 2 * inter)).astype(np.float32)
    src = np.array([3, -1, 0, 5, -1, 2, 1], np.int32)[:rows]
    mem = Memory(1 << 20)
    d_out = mem.alloc(2 * rows * inter, 0xAB)
    launch(mem, "routed_silu_mul", {}, (rows, -(-inter // gg.SILU_THREADS)), (gg.SILU_THREADS,),
           (d_out, mem.put(gu), mem.put(src), inter))
    out = mem.get(d_out, (rows, inter), np.uint16)
    g, u = gu[:, :inter].astype(np.float64), gu[:, inter:].astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    live = src >= 0
    got = bf16_to_f32(out[live]).astype(np.float64)
    return {"rel": float(np.max(np.abs(got - want[live]) / (np.abs(want[live]) + 1e-30))),
            "rows_past_untouched": bool((out[~live] == 0xABAB).all())}


CASES = {
    # experts with 0 rows, 1, a whole tile, a tile + 1, and a few; two column blocks, two k steps
    "small": dict(rows=[0, 1, 64, 65, 3], n=128, k=64),
    # a padded block of 16 rows an expert: experts short of it, at it, and 1, 64, 65 rows past
    "cap16": dict(rows=[0, 17, 16, 80, 81, 3], n=64, k=64, cap=16),
    # k steps of 64: a row's 32 words in 8 pieces, 4 pieces a thread; two steps
    "bk64": dict(rows=[0, 1, 64, 65, 3], n=64, k=128, bk=64),
}

if __name__ == "__main__":
    sys.setswitchinterval(1e-4)     # the mma twin meets a warp's 32 threads at a barrier
    names = sys.argv[1:] or list(CASES) + ["silu"]
    print(json.dumps({name: silu() if name == "silu" else run(**CASES[name]) for name in names}))
