"""kernels/quant_gemv.py on numba-cuda's CPU simulator against a float64 decode of the same
stored bytes (docs/artifact.md 3.2.1), for fp8_block [128, 128] (every e4m3 code, subnormals
included) and int8_block [1, g]; ragged rows / columns. Prints {"<case>": relative error} as JSON.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_quant_gemv.py
"""
import json

import ml_dtypes
import numpy as np

from ninfer.core.cuda import numba_shim

cuda, _ = numba_shim.import_numba_cuda()
from sim_patches import fix_shared_array_race   # noqa: E402
fix_shared_array_race()

from ninfer.convert.quantize import encode                  # noqa: E402
from ninfer.core.cuda.kernels import _import_kernel_module  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn


def decode64(stored, scale, br, bc, rows, cols):
    s = np.repeat(np.repeat(scale.astype(np.float64), br, 0), bc, 1)[:rows, :cols]
    return stored.astype(np.float64) * s


def run_case(layout, block, rows, cols, rng, codes=None):
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[:, 0] *= 25.0
    stored, scale, _ = encode(layout, w[None], block)
    stored, scale = stored[0], scale[0]
    if codes is not None:                    # every fp8 code but NaN, in the first row block
        flat = stored.view(np.uint8).reshape(-1).copy()
        flat[: codes.size] = codes
        stored = flat.view(FP8).reshape(stored.shape)
    x = rng.standard_normal(cols).astype(np.float32)
    y = np.full(rows, np.nan, np.float32)             # poisoned: every row must be written
    dev_w = stored.view(np.uint8) if layout == "fp8_block" else stored
    mod = _import_kernel_module("quant_gemv")
    kern = cuda.jit(mod.quant_gemv(layout, *block))
    kern[(rows, 1, 1), (mod.THREADS, 1, 1)](y, dev_w.reshape(-1), scale.reshape(-1), x, rows, cols)
    ref = decode64(stored, scale, *block, rows, cols) @ x.astype(np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def decode_all(codes):
    """e4m3_to_f32 of each code, through a one-thread-per-code kernel."""
    mod = _import_kernel_module("quant_gemv")

    @cuda.jit
    def decode_kernel(out, b, n):
        i = cuda.grid(1)
        if i < n:
            out[i] = mod.e4m3_to_f32(b[i])
    out = np.full(codes.size, np.nan, np.float32)
    decode_kernel[(2, 1, 1), (128, 1, 1)](out, codes, codes.size)
    return out


def main():
    rng = np.random.default_rng(13)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    want = codes.view(FP8).astype(np.float32)
    out = {"decode/every_code_max_abs_diff": float(np.abs(decode_all(codes) - want).max()),
           "fp8/128x128/every_code": run_case("fp8_block", (128, 128), 3, 300, rng, codes),
           "fp8/128x128/ragged": run_case("fp8_block", (128, 128), 130, 129, rng),
           "int8/1x128": run_case("int8_block", (1, 128), 5, 300, rng),
           "int8/1x64/ragged": run_case("int8_block", (1, 64), 7, 97, rng)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
