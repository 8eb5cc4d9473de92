"""The decode attention on tensor cores (kernels/attention_mma.py) on numba-cuda's CPU simulator
against a float64 oracle; `tests/test_decode_kernels_nogpu.py` runs this in a subprocess (the
simulator must be switched on before numba is imported):

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_attention_mma.py [seed]

Every case merges the kernel's split partials in float64 and compares the attention output with
the float64 attention of the same bf16 K/V and fp32 q. The pools are poisoned (NaN) at every
slot no row owns below its length, so a key past a row's length that leaks into a sum shows; the
partials start as NaN, so a (token, head, split) the kernel leaves unwritten shows. Prints one
JSON line: per case the relative error and whether every partial was written.
"""
import json
import math
import sys

import numpy as np

from sim_storage import bf16_bits, kernel   # (the simulator switched on, its patches applied)
from oracles import page_tables, poison_unowned   # noqa: E402

NEG_INF = -3.0e38
# (name, hd, G, nkv, new tokens per row, contexts, splits, page size, t_base, GS)
CASES = [
    ("decode_short_rows", 64, 4, 2, [1, 1], [0, 40], 3, 16, 0, 0),     # L = 1: two splits empty
    ("prefill_rows_g6", 128, 6, 1, [3, 2], [20, 5], 2, 32, 1, 0),      # causal, launch from t 1
    ("decode_g8_warp_tiles", 64, 8, 1, [1], [70], 1, 16, 0, 0),         # 5 tiles over 4 warps
    ("decode_hd256_g6", 256, 6, 1, [1], [33], 2, 16, 0, 0),             # the 27B geometry
    ("pages_of_5_keys", 64, 4, 1, [2, 1], [30, 17], 2, 5, 0, 0),       # a key's page each
    ("g16_in_two_blocks", 64, 16, 1, [1], [20], 1, 16, 0, 8),          # 122B / 397B: GS = 8
]


def bf16_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def case(r, hd, G, nkv, lengths, ctxs, splits, ps, t_base, GS):
    nh = G * nkv
    n = sum(lengths)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    token_row = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    ctx = np.asarray(ctxs, np.int32)
    bt, p_cap, num_pages = page_tables(r, lengths, ctxs, ps)
    kbits = bf16_bits(r.standard_normal((num_pages, ps, nkv, hd)))
    vbits = bf16_bits(r.standard_normal((num_pages, ps, nkv, hd)))
    poison_unowned((kbits, vbits), bt, lengths, ctxs, ps)
    q = (2.0 * r.standard_normal((n, nh, hd))).astype(np.float32)
    m = n - t_base
    part = np.full(m * nh * splits * hd, np.nan, np.float32)
    ml = np.full(m * nh * splits * 2, np.nan, np.float32)
    kernel("attention_mma", "paged_attention_mma", hd=hd, G=G, nkv=nkv, GS=GS)[
        (m, nkv * G // (GS or G), splits), (128, 1, 1)](
        part, ml, q.reshape(-1), kbits.view(np.uint32).reshape(-1),
        vbits.view(np.uint32).reshape(-1), token_row, qs, ctx, bt.reshape(-1), p_cap, ps, splits,
        np.float32(1 / math.sqrt(hd)), t_base)
    part = part.reshape(m, nh, splits, hd).astype(np.float64)
    ml = ml.reshape(m, nh, splits, 2).astype(np.float64)
    written = bool(np.isfinite(part).all() and not np.isnan(ml).any())
    mx, sm = ml[..., 0], ml[..., 1]
    top = mx.max(-1, keepdims=True)
    f = np.where(mx > NEG_INF, np.exp(mx - top), 0.0)
    got = np.einsum("ths,thsd->thd", f, np.nan_to_num(part)) / np.einsum("ths,ths->th", f, sm)[..., None]
    K, V = bf16_f64(kbits), bf16_f64(vbits)
    want = np.zeros((m, nh, hd))
    for tl in range(m):
        t = t_base + tl
        row = token_row[t]
        keys = np.arange(ctx[row] + t - qs[row] + 1)
        pages, offs = bt[row, keys // ps], keys % ps
        for h in range(nh):
            s = K[pages, offs, h // G] @ q[t, h].astype(np.float64) / math.sqrt(hd)
            p = np.exp(s - s.max())
            want[tl, h] = p / p.sum() @ V[pages, offs, h // G]
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return err, written


def main(seed):
    r = np.random.default_rng(seed)
    out = {}
    for name, *args in CASES:
        err, written = case(r, *args)
        out[name] = err
        out[name + "_written"] = written
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
