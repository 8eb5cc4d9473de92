"""kernels/quant_gemv.py on numba-cuda's CPU simulator against a float64 decode of the same stored
bytes (docs/artifact.md 3.2.1): the decode GEMV (`qgemv`) for every layout, batch widths 1..8
with fewer rows than the width, odd output rows, the word path and the scalar path (K not a
multiple of the word, blocks not whole words), beta = 0 over poisoned outputs and beta = 1,
bf16 and fp32 inputs, expert mode; and the prefill tile (`dequant`), bf16 and fp32. Every e4m3
code but NaN is decoded. Prints {"<case>": relative error (or a count)} as JSON.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_quant_gemv.py
"""
import json

import ml_dtypes
import numpy as np

from ninfer.core.cuda import numba_shim

cuda, _ = numba_shim.import_numba_cuda()
import sim_storage   # noqa: E402,F401  (simulator patches: warp shuffle, libdevice bit casts)

from ninfer.convert.quantize import encode                  # noqa: E402
from ninfer.core.cuda.kernels import _import_kernel_module  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
mod = _import_kernel_module("quant_gemv")
_KERNELS = {}


def kernel(factory, *args):
    key = (factory,) + args
    if key not in _KERNELS:
        _KERNELS[key] = cuda.jit(getattr(mod, factory)(*args))
    return _KERNELS[key]


def make(layout, block, rows, cols, rng, asym=False, experts=1, codes=None):
    """(stored uint8 [experts, rows, C'], scale f32, zero uint8 or None, float64 values)."""
    w = rng.standard_normal((experts, rows, cols)).astype(np.float32)
    w[..., 0] *= 25.0
    stored, scale, zero = encode(layout, w, block, asymmetric=asym)
    stored = np.ascontiguousarray(stored).view(np.uint8)
    if codes is not None:
        flat = stored.reshape(-1)
        flat[: codes.size] = codes
    return stored, scale.astype(np.float32), zero, decode64(layout, stored, scale, zero, block,
                                                            rows, cols)


def decode64(layout, stored, scale, zero, block, rows, cols):
    br, bc = block
    if layout == "fp8_block":
        q = stored.view(FP8).astype(np.float64)
    elif layout == "int8_block":
        q = stored.view(np.int8).astype(np.float64)
    else:
        q = np.stack([stored & 15, stored >> 4], -1).reshape(*stored.shape[:-1], -1)[..., :cols]
        q = q.astype(np.float64)

    def expand(a):
        return np.repeat(np.repeat(a.astype(np.float64), br, -2), bc, -1)[..., :rows, :cols]
    z = expand(zero) if zero is not None else (8.0 if layout == "int4_block" else 0.0)
    return (q - z) * expand(scale)


def words(a):
    """uint8 -> the same bytes as uint64 (padded to whole words)."""
    flat = a.reshape(-1)
    pad = (-flat.size) % 8
    return np.concatenate([flat, np.zeros(pad, np.uint8)]).view(np.uint64)


def x_arrays(x, f32):
    if f32:
        return x.astype(np.float32).reshape(-1), np.zeros(1, np.uint64)
    bits = x.astype(BF16).view(np.uint16).reshape(-1)
    pad = (-bits.size) % 4
    bits = np.concatenate([bits, np.zeros(pad, np.uint16)])
    return bits, bits.view(np.uint64)


def x_values(x, f32):
    return x.astype(np.float64) if f32 else x.astype(BF16).astype(np.float64)


def gemv_case(layout, block, n, k, m, bm, rng, asym=False, beta=0.0, f32=False, codes=None):
    stored, scale, zero, val = make(layout, block, n, k, rng, asym, codes=codes)
    x = rng.standard_normal((m, k)).astype(np.float32)
    xa, xw = x_arrays(x, f32)
    ldy = n + 3
    y = np.full((bm + 1, ldy), np.nan, np.float32)      # poisoned: rows b < m, r < n written
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    if beta:
        y[:m, :n] = y0
    vec = int(mod.vector_ok(layout, k, block[1]))
    kern = kernel("qgemv", layout, bm, asym, f32)
    grid = (-(-n // (mod.WARPS * mod.ROWS)), 1, 1)
    zarr = zero.reshape(-1) if zero is not None else np.zeros(1, np.uint8)
    kern[grid, (mod.THREADS, 1, 1)](y.reshape(-1), xa, xw, stored.reshape(-1), words(stored),
                                    scale.reshape(-1), zarr, m, n, k, ldy, block[0], block[1],
                                    scale.shape[-1], beta, vec, np.zeros(1, np.int32), 0, 0, 0, 0)
    ref = x_values(x, f32) @ val[0].T + beta * y0.astype(np.float64)
    got = y[:m, :n]
    untouched = bool(np.isnan(y[m:]).all() and np.isnan(y[:m, n:]).all())
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.isfinite(got).all() else 1.0
    return err if untouched else 2.0


def experts_case(layout, block, n, k, rng, asym=False, x_per_pair=0, f32=False):
    E, topk, tokens = 3, 2, 3
    stored, scale, zero, val = make(layout, block, n, k, rng, asym, experts=E)
    ids = np.array([2, 0, 1, 2, 0, 0], np.int32)[: tokens * topk]
    pairs = ids.size
    xrows = pairs if x_per_pair else tokens
    x = rng.standard_normal((xrows, k)).astype(np.float32)
    xa, xw = x_arrays(x, f32)
    y = np.full((pairs, n), np.nan, np.float32)
    vec = int(mod.vector_ok(layout, k, block[1]))
    kern = kernel("qgemv", layout, 1, asym, f32)
    grid = (-(-n // (mod.WARPS * mod.ROWS)), pairs, 1)
    zarr = zero.reshape(-1) if zero is not None else np.zeros(1, np.uint8)
    kern[grid, (mod.THREADS, 1, 1)](y.reshape(-1), xa, xw, stored.reshape(-1), words(stored),
                                    scale.reshape(-1), zarr, 1, n, k, n, block[0], block[1],
                                    scale.shape[-1], 0.0, vec, ids, topk, x_per_pair,
                                    stored[0].size, scale[0].size)
    xv = x_values(x, f32)
    ref = np.stack([val[ids[p]] @ xv[p if x_per_pair else p // topk] for p in range(pairs)])
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) if np.isfinite(y).all() else 1.0


def mma_case(layout, block, n, k, m, rng, asym=False, beta=0.0, warps=2, unroll=2, experts=0,
             codes=None, tiles=1):
    """qmma (bf16 x only): rows 1..8 of x, or expert mode over 3 experts (x_per_pair when
    experts == 2), or grouped mode (experts == 3: groups of 1..8 consecutive rows, one expert
    each, an expert's rows in two groups). Its weights are exact in bf16 and summed in fp32, so
    it meets the float64 reference as closely as qgemv."""
    E = 3 if experts else 1
    stored, scale, zero, val = make(layout, block, n, k, rng, asym, experts=E, codes=codes)
    words32 = np.ascontiguousarray(stored).reshape(-1).view(np.uint32)
    zarr = zero.reshape(-1) if zero is not None else np.zeros(1, np.uint8)
    assert mod.mma_ok(layout, k, block[1]), (layout, k, block)
    kern = kernel("qmma", layout, asym, warps, unroll, True, False, tiles,
                  mod.mma_split(layout, block[1]))
    if experts == 3:
        # rows 0-7 expert 2, 8-10 expert 2 again, 11 expert 0, 12-16 expert 1 (row 17 unused)
        groups = np.array([[2, 0, 8], [2, 8, 3], [0, 11, 1], [1, 12, 5]], np.int32)
        topk, ids, pairs, xrows = -1, groups.reshape(-1), len(groups), 18
        expert_of_row = np.full(xrows, -1)
        for e, r0, c in groups:
            expert_of_row[r0: r0 + c] = e
    elif experts:
        topk, ids = 2, np.array([2, 0, 1, 2, 0, 0], np.int32)
        pairs = ids.size
        xrows = pairs if experts == 2 else pairs // topk
    else:
        topk, ids, pairs, xrows = 0, np.zeros(1, np.int32), 1, m
    x = rng.standard_normal((xrows, k)).astype(np.float32)
    xb = x.astype(BF16).view(np.uint16).reshape(-1).view(np.uint32)
    ldy = n + 3
    rows_out = xrows - 1 if experts == 3 else pairs if experts else m
    y = np.full((rows_out + 1, ldy), np.nan, np.float32)    # poisoned: only [rows_out, n] written
    y0 = rng.standard_normal((rows_out, n)).astype(np.float32)
    if beta:
        y[:rows_out, :n] = y0
    kern[(-(-n // (16 * tiles)), pairs, 1), (32 * warps, 1, 1)](
        y.reshape(-1), xb, words32, scale.reshape(-1), zarr, m, n, k, ldy, block[0], block[1],
        scale.shape[-1], beta, ids, topk, int(experts == 2), stored[0].size, scale[0].size)
    xv = x_values(x, False)
    if experts == 3:
        ref = np.stack([val[expert_of_row[r]] @ xv[r] for r in range(rows_out)])
    elif experts:
        ref = np.stack([val[ids[q]] @ xv[q if experts == 2 else q // topk] for q in range(pairs)])
    else:
        ref = xv @ val[0].T
    ref = ref + beta * y0.astype(np.float64)
    got = y[:rows_out, :n]
    untouched = bool(np.isnan(y[rows_out:]).all() and np.isnan(y[:rows_out, n:]).all())
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.isfinite(got).all() else 1.0
    return err if untouched else 2.0


def dequant_case(layout, block, n, k, rng, asym=False, f32=False, r0=1, e0=1, experts=1):
    """Rows r0.. of experts e0 .. e0 + experts of a stack of 3 (the word path where vector_ok)."""
    stored, scale, zero, val = make(layout, block, n, k, rng, asym, experts=3)
    rows = n - r0
    size = experts * rows * k
    out = np.full(-(-(size + 8) // 4) * 4, np.nan if f32 else 0xFFFF,
                  np.float32 if f32 else np.uint16)
    kern = kernel("dequant", layout, asym, f32)
    zarr = zero.reshape(-1) if zero is not None else np.zeros(1, np.uint8)
    vec = mod.vector_ok(layout, k, block[1])
    units = stored.shape[-1] // 8 if vec else k
    grid = (-(-units // mod.DEQUANT_THREADS), rows, experts)
    # the simulator copies each argument: a bf16 word-path kernel gets the buffer as words only
    # (on the GPU `out` and `outw` are one buffer)
    words_out = vec and not f32
    outw = out.view(np.uint64) if words_out else np.zeros(1, np.uint64)
    out_arg = np.zeros(1, out.dtype) if words_out else out
    kern[grid, (mod.DEQUANT_THREADS, 1, 1)](out_arg, outw, stored.reshape(-1), words(stored),
                                            scale.reshape(-1), zarr, r0, rows, k, block[0],
                                            block[1], scale.shape[-1], e0, stored[0].size,
                                            scale[0].size, int(vec))
    got = out[:size].reshape(experts, rows, k)
    want = val[e0: e0 + experts, r0:]
    if f32:
        ok = np.isnan(out[size:]).all()
        return float((np.abs(got - want) / np.abs(want).max()).max()) if ok else 2.0
    ok = (out[size:] == 0xFFFF).all()
    exact = want.astype(np.float32).astype(BF16).view(np.uint16)
    return int(np.count_nonzero(got != exact)) if ok else -1


def main():
    rng = np.random.default_rng(13)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    out = {}
    # every e4m3 code (subnormals, both zeros, 448) through the word path and the scalar path
    out["fp8/every_code/word"] = gemv_case("fp8_block", (128, 128), 3, 256, 1, 1, rng, codes=codes)
    out["fp8/every_code/scalar"] = gemv_case("fp8_block", (128, 128), 3, 300, 1, 1, rng,
                                             codes=codes)
    for bm, m in ((1, 1), (2, 2), (4, 3), (8, 8), (8, 5)):
        out[f"fp8/128x128/bm{bm}/m{m}"] = gemv_case("fp8_block", (128, 128), 9 if bm < 8 else 3,
                                                    256 if bm < 4 else 128, m, bm, rng)
        out[f"int4/asym/1x128/bm{bm}/m{m}"] = gemv_case("int4_block", (1, 128), 3, 128, m, bm, rng,
                                                        asym=True)
    out["fp8/1x128/odd_rows"] = gemv_case("fp8_block", (1, 128), 130, 136, 2, 2, rng)
    out["fp8/beta1"] = gemv_case("fp8_block", (128, 128), 9, 128, 3, 4, rng, beta=1.0)
    out["fp8/f32"] = gemv_case("fp8_block", (128, 128), 9, 128, 2, 2, rng, f32=True)
    out["int8/1x128"] = gemv_case("int8_block", (1, 128), 5, 384, 1, 1, rng)
    out["int8/1x64/scalar_k97"] = gemv_case("int8_block", (1, 64), 7, 97, 2, 2, rng)
    out["int8/row/k200"] = gemv_case("int8_block", (1, 200), 3, 200, 1, 1, rng)
    out["int8/1x12/scalar_block"] = gemv_case("int8_block", (1, 12), 3, 48, 1, 1, rng)
    out["int8/beta1/f32"] = gemv_case("int8_block", (1, 128), 5, 128, 2, 2, rng, beta=1.0,
                                      f32=True)
    out["int4/sym/1x128"] = gemv_case("int4_block", (1, 128), 5, 256, 1, 1, rng)
    out["int4/asym/1x32"] = gemv_case("int4_block", (1, 32), 3, 160, 2, 2, rng, asym=True)
    out["int4/asym/scalar_odd_k"] = gemv_case("int4_block", (1, 64), 3, 99, 1, 1, rng, asym=True)
    out["int4/sym/scalar_k24"] = gemv_case("int4_block", (1, 32), 3, 24, 4, 4, rng)
    out["int4/asym/f32"] = gemv_case("int4_block", (1, 128), 3, 128, 1, 1, rng, asym=True,
                                     f32=True)
    out["experts/fp8"] = experts_case("fp8_block", (128, 128), 5, 128, rng)
    out["experts/int4/per_pair"] = experts_case("int4_block", (1, 64), 5, 128, rng, asym=True,
                                                x_per_pair=1)
    out["experts/int8/scalar"] = experts_case("int8_block", (1, 32), 3, 36, rng, f32=True)
    # qmma: every e4m3 code; batch rows 1..8 with partial tiles of 16 rows, K with chunks past
    # its end, one and several steps per warp; beta; asymmetric int4; expert mode
    out["mma/fp8/every_code"] = mma_case("fp8_block", (128, 128), 3, 256, 1, rng, codes=codes)
    out["mma/fp8/m1"] = mma_case("fp8_block", (128, 128), 20, 320, 1, rng)
    out["mma/fp8/m8/beta1"] = mma_case("fp8_block", (128, 128), 20, 192, 8, rng, beta=1.0)
    out["mma/int8/m3"] = mma_case("int8_block", (1, 64), 17, 256, 3, rng, warps=1, unroll=1)
    out["mma/int4/asym/m5"] = mma_case("int4_block", (1, 128), 33, 384, 5, rng, asym=True)
    out["mma/grouped/fp8"] = mma_case("fp8_block", (128, 128), 20, 256, 1, rng, experts=3)
    out["mma/grouped/int4/asym/g64"] = mma_case("int4_block", (1, 64), 17, 128, 1, rng, asym=True,
                                                experts=3)
    out["mma/grouped/int8"] = mma_case("int8_block", (1, 128), 16, 192, 1, rng, experts=3)
    out["mma/int4/sym/k96"] = mma_case("int4_block", (1, 128), 9, 96, 2, rng, warps=4, unroll=1)
    out["mma/int4/5_sets_per_warp"] = mma_case("int4_block", (1, 128), 16, 640, 2, rng,
                                                warps=1, unroll=1)
    out["mma/fp8/odd_sets_per_warp"] = mma_case("fp8_block", (128, 128), 16, 448, 1, rng,
                                                 warps=1, unroll=2)
    out["mma/experts/fp8"] = mma_case("fp8_block", (128, 128), 18, 128, 1, rng, experts=1)
    out["mma/experts/int4/per_pair"] = mma_case("int4_block", (1, 128), 7, 256, 1, rng,
                                                asym=True, experts=2)
    # two 16-row tiles per block: a partial second tile, and a block past the last row
    out["mma/tiles2/int4/asym/m3"] = mma_case("int4_block", (1, 128), 40, 384, 3, rng,
                                              asym=True, tiles=2)
    out["mma/tiles2/fp8/m8/tail"] = mma_case("fp8_block", (128, 128), 20, 448, 8, rng, warps=1,
                                             unroll=2, tiles=2)
    # scale blocks narrower than a step (2 or 4 per step), with a last step of fewer blocks
    out["mma/int4/g64/asym/m4"] = mma_case("int4_block", (1, 64), 19, 320, 4, rng, asym=True)
    out["mma/int4/g32/sym/m2"] = mma_case("int4_block", (1, 32), 17, 160, 2, rng, warps=1,
                                          unroll=2)
    out["mma/int8/g32/m3"] = mma_case("int8_block", (1, 32), 18, 224, 3, rng, warps=2,
                                      unroll=2)
    out["mma/int8/g16/experts"] = mma_case("int8_block", (1, 16), 9, 80, 1, rng, experts=1)
    # dequant: bf16 bits equal the float64 decode rounded to bf16 (mismatch count); fp32: max
    # error relative to the largest value
    out["dequant/fp8/bf16_mismatches"] = dequant_case("fp8_block", (128, 128), 5, 300, rng)
    out["dequant/int4/asym/bf16_mismatches"] = dequant_case("int4_block", (1, 32), 4, 99, rng,
                                                            asym=True, e0=0, experts=3)
    out["dequant/int8/f32_rel"] = dequant_case("int8_block", (1, 64), 4, 130, rng, f32=True)
    out["dequant/fp8/word/bf16_mismatches"] = dequant_case("fp8_block", (128, 128), 5, 256, rng,
                                                           e0=0, experts=2)
    out["dequant/int4/word/bf16_mismatches"] = dequant_case("int4_block", (1, 64), 3, 128, rng,
                                                            asym=True)
    out["dequant/int8/word/f32_rel"] = dequant_case("int8_block", (1, 128), 3, 256, rng,
                                                    f32=True)
    out["dequant/int4/sym/f32_rel"] = dequant_case("int4_block", (1, 128), 3, 256, rng, f32=True,
                                                   r0=0, e0=0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
