"""kernels/act_quant.py on numba-cuda's CPU simulator: the e4m3 codes and scales it writes equal
ninfer/ops/kv_quant.quantize of the same bf16 rows taken 128 columns at a time (the W8A8 prefill
input), in cuBLASLt's scale layout (groups outer, rows inner, rows padded to 4), on fresh random
rows with wide magnitudes, an all-zero group, values at the clip and subnormal codes; the padded
rows get zero codes and scale 1, and no byte past the written area changes. The same for
head_quant_int8 (the MTP drafts' int8 head: kv_quant.quantize's int8 rule, scales row-major) on
bf16 rows and on the float32 model's rows ("head/..." and "head_f32/..." cases). Prints
{"<case>": [code mismatches, scale mismatches, bytes changed outside]} as JSON.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_act_quant.py [seed]
"""
import json
import sys

import ml_dtypes
import numpy as np

from ninfer.core.cuda import numba_shim

cuda, _ = numba_shim.import_numba_cuda()
import sim_storage   # noqa: E402,F401  (simulator patches: warp shuffle, libdevice bit casts)

from ninfer.core.cuda.cublaslt import fp8_scale_rows         # noqa: E402
from ninfer.core.cuda.kernels import _import_kernel_module   # noqa: E402
from ninfer.ops.kv_quant import quantize                     # noqa: E402

mod = _import_kernel_module("act_quant")
KERNEL = cuda.jit(mod.act_quant_fp8())
HEAD = {f32: cuda.jit(mod.head_quant_int8(f32)) for f32 in (False, True)}
POISON = 0xA5


def case(x):
    """x [m, k] float32 (exactly bf16): run the kernel, compare with kv_quant.quantize."""
    m, k = x.shape
    ld = fp8_scale_rows(m)
    groups = k // mod.GROUP
    bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    pairs = np.ascontiguousarray(bits).view(np.uint32).ravel()
    codes = np.full((ld + 1) * k, POISON, np.uint8)          # one row of slack past the end
    scale = np.full(groups * ld + 8, np.float32(-7.0), np.float32)
    KERNEL[(-(-groups // mod.WARPS), ld), (32 * mod.WARPS,)](
        pairs, codes.view(np.uint32), scale, m, k, ld)
    want_q, want_s = quantize(x.reshape(m, groups, mod.GROUP), "fp8")
    got_q = codes[:m * k].reshape(m, groups, mod.GROUP)
    got_s = scale[:groups * ld].reshape(groups, ld)
    bad_q = int((got_q != want_q.view(np.uint8)).sum())
    bad_s = int((got_s[:, :m].T.view(np.uint32) != want_s.view(np.uint32)).sum())
    # padded rows: zero codes, scale 1; nothing written past the area
    bad_q += int((codes[m * k: ld * k] != 0).sum())
    bad_s += int((got_s[:, m:] != 1.0).sum())
    outside = int((codes[ld * k:] != POISON).sum()) + int((scale[groups * ld:] != -7.0).sum())
    return [bad_q, bad_s, outside]


def head_case(x, f32: bool):
    """x [m, k] float32 (exactly bf16 unless f32): the int8 head's codes and scales against
    kv_quant.quantize(..., "int8") of each row's 128-column groups."""
    m, k = x.shape
    groups = k // mod.GROUP
    if f32:
        src = np.ascontiguousarray(x, np.float32).ravel()
    else:
        bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        src = np.ascontiguousarray(bits).view(np.uint32).ravel()
    codes = np.full((m + 1) * k, POISON, np.uint8)           # one row of slack past the end
    scale = np.full(groups * m + 8, np.float32(-7.0), np.float32)
    HEAD[f32][(m, -(-groups // mod.WARPS)), (32 * mod.WARPS,)](src, codes, scale, m, k)
    want_q, want_s = quantize(x.reshape(m, groups, mod.GROUP), "int8")
    bad_q = int((codes[:m * k].reshape(m, groups, mod.GROUP) != want_q.view(np.uint8)).sum())
    bad_s = int((scale[:groups * m].reshape(m, groups).view(np.uint32)
                 != want_s.view(np.uint32)).sum())
    outside = int((codes[m * k:] != POISON).sum()) + int((scale[groups * m:] != -7.0).sum())
    return [bad_q, bad_s, outside]


def main():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)   # noqa: E731
    out = {}
    # wide magnitudes per row, 5 groups (a block's second warp set partly idle), m not 4k
    x = rng.standard_normal((3, 640)) * np.exp(rng.uniform(-12, 12, (3, 1)))
    x[1, 128:256] = 0.0                                              # an all-zero group
    out["random/m3/k640"] = case(bf(x))
    # values whose quotient lands on 448, subnormal codes (|q| < 2^-6) and ties between codes
    y = rng.standard_normal((4, 128)).astype(np.float32)
    y[:, 0] = 448.0 * 2.0 ** rng.integers(-20, 20, 4)
    y[:, 1:40] = y[:, :1] * (rng.integers(1, 64, (4, 39)) / 2.0 ** 15)
    out["edges/m4/k128"] = case(bf(y))
    out["single_row/k256"] = case(bf(rng.standard_normal((1, 256)) * 3.0))
    # the int8 head: wide magnitudes, an all-zero row group, quotients at the clip and halfway
    # between codes (rint: half to even), 5 groups (a block's second warp set partly idle)
    h = rng.standard_normal((5, 640)) * np.exp(rng.uniform(-10, 10, (5, 1)))
    h[2, 256:384] = 0.0
    h[3, :128] = 127.0 * rng.integers(-3, 4, 128) / 4.0           # x / scale = ..., 63.5, ...
    h[3, 0] = 127.0
    for f32 in (False, True):
        out[f"head{'_f32' if f32 else ''}/m5/k640"] = head_case(h.astype(np.float32) if f32
                                                                 else bf(h), f32)
    out["head/m1/k128"] = head_case(bf(rng.standard_normal((1, 128))), False)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
