"""Device helpers shared by every kernel: bf16 <-> fp32, warp and block reductions, activations.

bf16 is stored as uint16 (or pairs in uint32: element 2i in the low half, 2i+1 in the high half).
"""
import math
from types import SimpleNamespace

from numba import config, cuda, float32, int32, uint32

FULL_MASK = 0xFFFFFFFF


def inlined(fn):
    """A device function NVVM always inlines (`forceinline`: its LLVM IR gets alwaysinline, the
    same PTX as numba's IR-level `inline=True`, which copied and re-typed the callee's IR at every
    call site and made the sampler's kernel ~13 s to compile, now ~3.5 s). numba's CPU simulator
    has no such option: there it is a plain device function."""
    if config.ENABLE_CUDASIM:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


@inlined
def bf16_to_f32(u):
    return cuda.libdevice.int_as_float(int32((int32(u) & 0xFFFF) << 16))


@inlined
def bf16x2_lo(p):
    return cuda.libdevice.int_as_float(int32((p & uint32(0xFFFF)) << uint32(16)))


@inlined
def bf16x2_hi(p):
    return cuda.libdevice.int_as_float(int32(p & uint32(0xFFFF0000)))


@inlined
def f32_to_bf16(x):
    # round to nearest even (finite inputs)
    u = uint32(cuda.libdevice.float_as_int(x))
    u = u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))
    return u >> uint32(16)


@inlined
def warp_sum(v):
    v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
    return v


@inlined
def warp_max(v):
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 8))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 4))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 2))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 1))
    return v


@inlined
def sigmoid(x):
    return float32(1.0) / (float32(1.0) + math.exp(-x))


@inlined
def silu(x):
    return x / (float32(1.0) + math.exp(-x))


@inlined
def softplus(x):
    # torch.nn.functional.softplus with threshold 20
    if x > float32(20.0):
        return x
    return math.log1p(math.exp(x))


@inlined
def block_sum(v, scratch):
    """Sum over the block (blockDim.x a multiple of 32, <= 1024); scratch: shared float32[32]."""
    lane = cuda.threadIdx.x & 31
    wid = cuda.threadIdx.x >> 5
    nw = (cuda.blockDim.x + 31) >> 5
    v = warp_sum(v)
    cuda.syncthreads()
    if lane == 0:
        scratch[wid] = v
    cuda.syncthreads()
    t = float32(0.0)
    if lane < nw:
        t = scratch[lane]
    return warp_sum(t)


# ---- block reductions through shared memory in a fixed tree order ----

def tree_reductions(threads):
    """Block-wide sum, max and argmax for blocks of `threads` threads (a power of two), through a
    shared array of `threads` entries that the caller passes: at each level thread t < step folds
    in entry t + step. The order of the operations depends on `threads` only, so a float sum is
    the same on every run (it is not block_sum's order: a kernel compared with a host reference
    keeps the one it was checked with). Every thread gets the result, and the arrays may be reused
    as soon as the call returns."""
    @inlined
    def tree_sum(v, red):
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        step = threads // 2
        while step > 0:
            if tid < step:
                red[tid] += red[tid + step]
            cuda.syncthreads()
            step //= 2
        s = red[0]
        cuda.syncthreads()
        return s

    @inlined
    def tree_max(v, red):
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        step = threads // 2
        while step > 0:
            if tid < step:
                if red[tid + step] > red[tid]:
                    red[tid] = red[tid + step]
            cuda.syncthreads()
            step //= 2
        s = red[0]
        cuda.syncthreads()
        return s

    @inlined
    def tree_argmax(bv, bi, red_v, red_i):
        """The block's best (value, id): the larger value, the lower id on ties (np.argmax's
        first maximum when each thread offers its own first maximum); every thread gets the id
        (and red_v[0] holds the value until the next use of the arrays)."""
        tid = cuda.threadIdx.x
        red_v[tid] = bv
        red_i[tid] = bi
        cuda.syncthreads()
        step = threads // 2
        while step > 0:
            if tid < step:
                ov = red_v[tid + step]
                oi = red_i[tid + step]
                if ov > red_v[tid] or (ov == red_v[tid] and oi < red_i[tid]):
                    red_v[tid] = ov
                    red_i[tid] = oi
            cuda.syncthreads()
            step //= 2
        best = red_i[0]
        cuda.syncthreads()
        return best

    return SimpleNamespace(sum=tree_sum, max=tree_max, argmax=tree_argmax)


# ---- storage type of activations, KV and weights: bf16 (default) or fp32 (dtype="float32") ----
# Kernels whose factory takes `f32` bake the choice in at compile time (the signature's "u16*" /
# "u32*" become "f32*"); the bf16 variants are the same operations as before the choice existed.

@inlined
def f32_same(x):
    return x


@inlined
def bf16_round(x):
    # x rounded to the nearest bf16, kept as fp32
    return bf16_to_f32(f32_to_bf16(x))


@inlined
def bf16_pair(a, i):
    # the two values of bf16 pair i (one u32 load)
    p = a[i]
    return bf16x2_lo(p), bf16x2_hi(p)


@inlined
def f32_pair(a, i):
    # fp32 storage: "pair i" is elements 2i, 2i+1
    return a[2 * i], a[2 * i + 1]


def storage(f32):
    """(store, load, pair, rounding) of the storage type: fp32 -> bf16 bits (or fp32 as is),
    bits -> fp32, pair i of a "u32*" array -> two fp32, and the rounding a value takes when
    stored (bf16) or none."""
    if f32:
        return f32_same, f32_same, f32_pair, f32_same
    return f32_to_bf16, bf16_to_f32, bf16_pair, bf16_round


# ---- quantized KV codes (kv_dtype "fp8" / "int8": ninfer/ops/kv_quant.py is the spec) ----------
# A token's kv head is stored as head_dim one-byte codes and one float32 scale; the write kernel
# encodes exactly as kv_quant.quantize does (so both backends store the same bytes), the
# attention kernels decode a code to the float it stands for and multiply by the scale.

KV_TOP = {"fp8": 448.0, "int8": 127.0}     # |code| at most: scale = amax / top


@inlined
def e4m3_code(q):
    """float8_e4m3fn code (0..255) of float32 q clipped to [-448, 448], rounded to nearest
    even: what kv_quant.quantize's clip and ml_dtypes' astype do. Normals round the float32 bits
    to 3 mantissa bits (a carry moves into the exponent); below 2^-6 the codes are multiples of
    2^-9, rint(|q| * 512). Finite q (the bits of |q| order as its values: the clip is a min)."""
    u = uint32(cuda.libdevice.float_as_int(q))
    sign = (u >> uint32(24)) & uint32(0x80)
    a = min(u & uint32(0x7FFFFFFF), uint32(0x43E00000))     # 448.0
    if a < uint32(0x3C800000):                       # |q| < 2^-6
        c = uint32(cuda.libdevice.rintf(cuda.libdevice.int_as_float(int32(a)) * float32(512.0)))
    else:
        c = ((a + uint32(0x7FFFF) + ((a >> uint32(20)) & uint32(1))) >> uint32(20)) - uint32(960)
    return sign | c


@inlined
def e4m3_value(c):
    """The float32 an e4m3 code (0..255) stands for, exactly: its 7 bits under float32's
    exponent and mantissa give 2^-120 times the value (subnormal codes too), times 2^120."""
    bits = ((c & uint32(0x7F)) << uint32(20)) | ((c & uint32(0x80)) << uint32(24))
    return cuda.libdevice.int_as_float(int32(bits)) * float32(2.0 ** 120)


@inlined
def int8_code(q):
    """int8 code (as its byte 0..255) of rint(q) clipped to [-127, 127] (rint: half to even)."""
    c = int32(cuda.libdevice.rintf(q))
    c = min(max(c, int32(-127)), int32(127))
    return uint32(c) & uint32(0xFF)


@inlined
def int8_value(c):
    """The float32 of an int8 code's byte c (0..255)."""
    return float32(int32(c ^ uint32(0x80)) - int32(128))


def kv_codec(kvq):
    """(encode(q) -> byte, value(byte) -> float32, top) of kv_dtype `kvq`."""
    if kvq == "fp8":
        return e4m3_code, e4m3_value, float32(KV_TOP["fp8"])
    if kvq == "int8":
        return int8_code, int8_value, float32(KV_TOP["int8"])
    raise ValueError(f"kv_dtype {kvq!r}: expected 'fp8' or 'int8'")


@inlined
def block_max(v, scratch):
    """Max over the block (blockDim.x a multiple of 32, <= 1024; every thread calls it);
    scratch: shared float32[32]."""
    lane = cuda.threadIdx.x & 31
    wid = cuda.threadIdx.x >> 5
    nw = (cuda.blockDim.x + 31) >> 5
    v = warp_max(v)
    cuda.syncthreads()
    if lane == 0:
        scratch[wid] = v
    cuda.syncthreads()
    t = float32(-3.0e38)
    if lane < nw:
        t = scratch[lane]
    return warp_max(t)


@inlined
def kvq_row(page, off, g, page_size, nkv, hd):
    """Byte offsets of (the codes, the float32 scale) of token `off` of `page`, kv head g, in a
    quantized pool layer: each page is its page_size * nkv * hd codes ([token, head, dim]),
    padded to 4 bytes, then its page_size * nkv scales ([token, head]): kv_quant's host copy of
    a page (QuantizedPages.raw) when no padding is needed (head_dim a multiple of 4)."""
    cb = (page_size * nkv * hd + 3) // 4 * 4
    slot = off * nkv + g
    base = page * (cb + 4 * page_size * nkv)
    return base + slot * hd, base + cb + 4 * slot


@inlined
def u16_pair_f32(a, i):
    """The float32 whose bits are u16 elements i (low half) and i + 1 of `a`."""
    return cuda.libdevice.int_as_float(int32(uint32(a[i]) | (uint32(a[i + 1]) << uint32(16))))
