"""The tensor-core prefill attention of one geometry on numba-cuda's CPU simulator (no GPU):
the three small kernels of kernels/attention_tc.py run as Python threads over a flat byte array
that stands for device memory, the GEMMs are numpy products of the bf16 operands.
`tests/test_cuda_nogpu.py` runs this in a subprocess (the simulator must be switched on before
numba is imported) and checks the printed error against the float64 oracle.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_attention_tc.py
"""
import math
import sys
from types import SimpleNamespace

import numpy as np

from ninfer.core.cuda import numba_shim
from oracles import page_tables

cuda, _ = numba_shim.import_numba_cuda()
from sim_patches import fix_shared_array_race, warp_shuffles, yield_while_polling   # noqa: E402
fix_shared_array_race()
yield_while_polling()
warp_shuffles()     # (sim_gdn_chunk.py, importing this, puts its block-wide one in their place)
import numba.cuda.simulator.kernelapi as _fake   # noqa: E402

from ninfer.core.cuda.kernels import ARG_TYPES, _import_kernel_module   # noqa: E402
from ninfer.models.qwen3_5.cuda import attention_tc as tc   # noqa: E402
from ninfer.models.qwen3_5.cuda.kernel_set import SIGS   # noqa: E402

# the simulator has no libdevice: the two bit casts common.py uses
_fake.FakeCUDAModule.libdevice = SimpleNamespace(
    float_as_int=lambda x: np.array([x], np.float32).view(np.int32)[0],
    int_as_float=lambda i: np.array([int(i) & 0xFFFFFFFF], np.uint32).view(np.float32)[0])

NP = {"float32": np.float32, "uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}


class Memory:
    """Addresses are offsets into one byte array; a pointer argument becomes a typed view that
    ends with its allocation (the simulator copies each view back after a launch, so views of
    different buffers must not overlap)."""

    def __init__(self, nbytes):
        self.mem = np.zeros(nbytes, np.uint8)
        self.top, self.allocs = 256, []

    def alloc(self, nbytes, poison=0):
        a = self.top
        self.top = (a + nbytes + 255) // 256 * 256
        self.allocs.append((a, a + nbytes))
        self.mem[a: a + nbytes] = poison
        return a

    def put(self, arr):
        arr = np.ascontiguousarray(arr)
        a = self.alloc(arr.nbytes)
        self.mem[a: a + arr.nbytes] = arr.view(np.uint8).reshape(-1)
        return a

    def get(self, a, shape, dt):
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        return self.mem[a: a + n].view(dt).reshape(shape).copy()

    def view(self, a, dt):
        end = next(hi for lo, hi in self.allocs if lo <= a < hi)
        return self.mem[a:end].view(dt)


def bf16_to_f32(u):
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a):
    import ml_dtypes
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


LAUNCHED = set()     # kernel names attend_row launched

def run(hd, G, nkv, lengths, ctxs, ps, s_cap=None, seed=0) -> float:
    mem = Memory(16 << 20)
    r = np.random.default_rng(seed)
    nh, n, b = G * nkv, sum(lengths), len(lengths)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    bt, p_cap, num_pages = page_tables(r, lengths, ctxs, ps)
    kbits = f32_to_bf16(r.standard_normal((num_pages, ps, nkv, hd)))
    vbits = f32_to_bf16(r.standard_normal((num_pages, ps, nkv, hd)))
    q = (2.0 * r.standard_normal((n, nh, hd))).astype(np.float32)
    P = 2 * nh * hd + 5
    proj = r.standard_normal((n, P)).astype(np.float32)
    sz = tc.buffer_sizes(nh, nkv, hd, n, p_cap * ps)
    if s_cap:
        sz["s"] = sz["p"] = s_cap
    item = dict(qb=2, o=4, kc=2, vc=2, s=4, p=2)
    bufs = tc.TcBuffers(**{k: mem.alloc(item[k] * sz[k], 0xFF) for k in item}, t_cap=n,
                        l_cap=sz["l_cap"], s_cap=sz["s"])
    out = mem.alloc(n * nh * hd * 2, 0xFF)
    d_q, d_k, d_v, d_bt, d_proj = (mem.put(a) for a in (q, kbits, vbits, bt, proj))
    params = {"q_to_bf16": dict(hd=hd, G=G, nkv=nkv), "kv_gather": dict(hd=hd, nkv=nkv),
              "causal_softmax": dict(G=G), "causal_softmax_reg": dict(G=G),
              "attn_gate_tc": dict(hd=hd, G=G, nkv=nkv)}
    jitted = {}

    def launch(name, grid, block, args):
        LAUNCHED.add(name)
        module, factory, sig = SIGS[name]
        if name not in jitted:
            jitted[name] = cuda.jit(getattr(_import_kernel_module(module), factory)(**params[name]))
        conv = [mem.view(int(a), NP[ARG_TYPES[t][1]]) if ARG_TYPES[t][2] else
                (np.float32(a) if t == "f32" else int(a)) for t, a in zip(sig, args)]
        jitted[name][tuple(grid) + (1,) * (3 - len(grid)), tuple(block)](*conv)

    def gemm(x, w, y, m, nn, k, w_kn):
        X = bf16_to_f32(mem.get(x, (m, k), np.uint16)).astype(np.float64)
        W = bf16_to_f32(mem.get(w, (k, nn) if w_kn else (nn, k), np.uint16)).astype(np.float64)
        Y = (X @ W if w_kn else X @ W.T).astype(np.float32)
        mem.mem[y: y + Y.nbytes] = Y.view(np.uint8).reshape(-1)

    for row in range(b):
        tc.attend_row(launch, gemm, bufs, hd, G, nkv, 1 / math.sqrt(hd), row=row,
                      q_start=int(qs[row]), n=lengths[row], ctx=ctxs[row], q=d_q, k_cache=d_k,
                      v_cache=d_v, block_tables=d_bt, bt_stride=p_cap, page_size=ps, out=out,
                      proj=d_proj, proj_stride=P)
    got = bf16_to_f32(mem.get(out, (n, nh, hd), np.uint16)).astype(np.float64)
    if not np.all(np.isfinite(got)):
        return float("nan")
    kc, vc = bf16_to_f32(kbits).astype(np.float64), bf16_to_f32(vbits).astype(np.float64)
    ref = np.zeros((n, nh, hd))
    for row in range(b):
        for i in range(lengths[row]):
            t = qs[row] + i
            keys = np.arange(ctxs[row] + i + 1)
            pg, off = bt[row, keys // ps], keys % ps
            for h in range(nh):
                s = kc[pg, off, h // G] @ q[t, h].astype(np.float64) / math.sqrt(hd)
                w = np.exp(s - s.max())
                ref[t, h] = (w / w.sum()) @ vc[pg, off, h // G]
    gate = proj[:, :2 * nh * hd].reshape(n, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    ref = ref / (1 + np.exp(-gate))
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def softmax_rows(n_cols=1032, first_len=1020, rows=6, G=2) -> float:
    """causal_softmax_reg alone over rows longer than one pass of the block (columns past
    4 * SM_THREADS: a thread's second group), the output poisoned, against float64."""
    r = np.random.default_rng(3)
    s = (4.0 * r.standard_normal((rows, n_cols))).astype(np.float32)
    p = np.full(rows * n_cols, 0x7FC0, np.uint16)
    fn = cuda.jit(getattr(_import_kernel_module("attention_tc"), "causal_softmax_reg")(G=G))
    fn[(rows, 1, 1), (256, 1, 1)](p, s.reshape(-1), n_cols, first_len, np.float32(0.125))
    got = bf16_to_f32(p.reshape(rows, n_cols)).astype(np.float64)
    ref = np.zeros((rows, n_cols))
    for i in range(rows):
        x = s[i, :first_len + i // G].astype(np.float64) * 0.125
        e = np.exp(x - x.max())
        ref[i, :len(x)] = e / e.sum()
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(got)) \
        else float("nan")


if __name__ == "__main__":
    # two rows (the second continuing after 6 keys, crossing 4-key pages), G = 2, head_dim 6
    # (rows padded to 8), an S/P buffer of 2 * 16 elements: at most two query tokens per block
    # (rows of S within SOFTMAX_REG_COLS: causal_softmax_reg; then with it 0: causal_softmax)
    reg = run(6, 2, 1, [3, 2], [0, 6], 4, s_cap=32)
    assert "causal_softmax_reg" in LAUNCHED and "causal_softmax" not in LAUNCHED, LAUNCHED
    tc.SOFTMAX_REG_COLS = 0
    LAUNCHED.clear()
    online = run(6, 2, 1, [3, 2], [0, 6], 4, s_cap=32)
    assert "causal_softmax" in LAUNCHED and "causal_softmax_reg" not in LAUNCHED, LAUNCHED
    print(reg, online, softmax_rows())
    sys.exit(0)
