"""A GEMM input quantized for the fp8 tensor cores: the prefill path of fp8 weights that runs
cuBLASLt's block-scaled e4m3 GEMM (W8A8; ninfer/core/cuda/cublaslt.py gemm_fp8).

    x[r, c] ~ code[r, c] * scale[c // 128, r]     code = e4m3(x / scale), scale = amax / 448

amax over the 128 columns of that row and group (all zero: scale 1), the rule of the quantized
KV cache (ninfer/ops/kv_quant.py), so a row's codes depend on that row alone. The scales are laid
out as cuBLASLt reads VEC128_32F for its B operand: groups outer, rows inner, `ld` >= m rows per
group (cublaslt.fp8_scale_rows); rows m..ld-1 get zero codes and scale 1.

`act_quant_fp8`: x bf16 [m, k] (as "u32*" pairs), k a multiple of 128; a warp per (row, group),
a lane's 4 values one 8-byte load and one 4-byte store of codes. Grid (ceil(k / 128 / WARPS),
ld), block 32 * WARPS.

`head_quant_int8` (f32: the float32 model's variant): the MTP drafts' int8 head
(EngineOptions.draft_head; models/qwen3_5/model.py int8_head_values is the spec), made once at
load from the lm_head's first m rows, with the same warps and groups (grid (m, ceil(k / 128 /
WARPS))):

    x[r, c] ~ code[r, c] * scale[r, c // 128]     code = rint(x / scale) in [-127, 127],
                                                   scale = amax / 127 (all zero: 1)

kv_quant.quantize's int8 rule; codes int8 bytes [m, k], scales row-major [m, k / 128]: the
int8_block layout with (1, 128) blocks that the packed-weight GEMVs read (cuda/qweights.py).
"""
from numba import cuda, float32, int64, uint8, uint32

from .common import bf16x2_hi, bf16x2_lo, e4m3_code, kv_codec, storage, warp_max

WARPS = 4
GROUP = 128
FP8_TOP = 448.0

SIGNATURES = {
    "act_quant_fp8": ("u32*", "u32*", "f32*", "i32", "i32", "i32"),
    "head_quant_int8": ("u32*", "u8*", "f32*", "i32", "i32"),
}


def act_quant_fp8():
    def act_quant_kernel(x, codes, scale, m, k, ld):
        lane = cuda.threadIdx.x % 32
        g = cuda.blockIdx.x * WARPS + cuda.threadIdx.x // 32
        r = cuda.blockIdx.y
        if g * GROUP >= k:
            return
        base = int64(r) * k + g * GROUP + 4 * lane          # this lane's first value
        if r >= m:
            codes[base >> 2] = uint32(0)
            if lane == 0:
                scale[int64(g) * ld + r] = float32(1.0)
            return
        p0 = x[base >> 1]
        p1 = x[(base >> 1) + 1]
        v0, v1, v2, v3 = bf16x2_lo(p0), bf16x2_hi(p0), bf16x2_lo(p1), bf16x2_hi(p1)
        amax = warp_max(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))))
        s = amax / float32(FP8_TOP) if amax > float32(0.0) else float32(1.0)
        codes[base >> 2] = (e4m3_code(v0 / s) | (e4m3_code(v1 / s) << uint32(8))
                            | (e4m3_code(v2 / s) << uint32(16)) | (e4m3_code(v3 / s) << uint32(24)))
        if lane == 0:
            scale[int64(g) * ld + r] = s
    act_quant_kernel.__name__ = "act_quant_fp8"
    return act_quant_kernel


def head_quant_int8(f32=False):
    _, _, pair, _ = storage(f32)
    encode, _, top = kv_codec("int8")          # (the quantized KV cache's int8 rule)

    def head_quant_kernel(x, codes, scale, m, k):
        lane = cuda.threadIdx.x % 32
        r = cuda.blockIdx.x                                 # (rows on x: 248,320 > 65,535)
        g = cuda.blockIdx.y * WARPS + cuda.threadIdx.x // 32
        if g * GROUP >= k or r >= m:
            return
        base = int64(r) * k + g * GROUP + 4 * lane          # this lane's first value
        v0, v1 = pair(x, base >> 1)
        v2, v3 = pair(x, (base >> 1) + 1)
        amax = warp_max(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))))
        s = amax / top if amax > float32(0.0) else float32(1.0)
        codes[base] = uint8(encode(v0 / s))
        codes[base + 1] = uint8(encode(v1 / s))
        codes[base + 2] = uint8(encode(v2 / s))
        codes[base + 3] = uint8(encode(v3 / s))
        if lane == 0:
            scale[int64(r) * (k // GROUP) + g] = s
    head_quant_kernel.__name__ = "head_quant_int8"
    return head_quant_kernel
