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
