"""Weight-only quantized GEMV (issue 13, decode): y = W x with W stored in the fp8_block /
int8_block layouts of docs/artifact.md 3.2.1, read as packed bytes plus float32 block scales.

NOT wired into the CUDA model and NOT measured on a GPU: tested only on numba-cuda's CPU
simulator against a float64 decode (tests/gpu/sim_quant_gemv.py). One block of THREADS threads per
output row: each thread walks the row's columns with stride THREADS, decodes each code, multiplies
by its block's scale and the input, and the block sums through shared memory (common.py
`tree_reductions`).
"""
from numba import cuda, float32, int32

from .common import inlined, tree_reductions

THREADS = 128


@inlined
def e4m3_to_f32(b):
    """OCP FP8 E4M3 byte -> float32 (bias 7; exponent 0: subnormal m * 2^-9; the NaN code
    S.1111.111 is never written by the converter)."""
    b = int32(b) & 0xFF
    e = (b >> 3) & 15
    m = b & 7
    if e == 0:
        v = float32(m) * float32(1.0 / 512.0)
    else:
        v = float32(8 + m) * float32(1 << e) * float32(1.0 / 1024.0)     # (1 + m/8) 2^(e-7)
    return -v if b & 0x80 else v


def quant_gemv(layout, br, bc):
    """Kernel y[r] = sum_c value(r, c) * x[c], value = code * scale[r // br, c // bc].
    layout "fp8_block": w uint8 bytes (e4m3); "int8_block": w int8. Grid (rows,), block THREADS."""
    fp8 = layout == "fp8_block"
    if layout not in ("fp8_block", "int8_block"):
        raise ValueError(f"quant_gemv: layout {layout!r} (fp8_block or int8_block)")
    tree_sum = tree_reductions(THREADS).sum

    def quant_gemv_kernel(y, w, scale, x, rows, cols):
        # w [rows, cols] codes, scale [ceil(rows/br), ceil(cols/bc)] f32, x [cols] f32 -> y [rows]
        r = cuda.blockIdx.x
        t = cuda.threadIdx.x
        part = cuda.shared.array(THREADS, float32)
        nbc = (cols + bc - 1) // bc
        acc = float32(0.0)
        if r < rows:
            srow = (r // br) * nbc
            base = r * cols
            c = t
            while c < cols:
                q = e4m3_to_f32(w[base + c]) if fp8 else float32(w[base + c])
                acc += q * scale[srow + c // bc] * x[c]
                c += THREADS
        total = tree_sum(acc, part)
        if t == 0 and r < rows:
            y[r] = total
    return quant_gemv_kernel
