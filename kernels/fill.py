"""Counter-based random fills (benchmark weights made on the GPU, no files)."""
from numba import cuda, float32, uint32, int64

from .common import bf16_round, f32_to_bf16, inlined

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "random_bf16": ("u16*", "i64", "u32", "f32", "f32"),
    "random_f32": ("f32*", "i64", "u32", "f32", "f32"),
}


def _hash():
    @inlined
    def mix(x):
        # splitmix-style 32-bit finaliser
        x = uint32(x)   # numba widens uint32 products to 64 bits: truncate after each step
        x = uint32((x ^ (x >> uint32(16))) * uint32(0x7FEB352D))
        x = uint32((x ^ (x >> uint32(15))) * uint32(0x846CA68B))
        return uint32(x ^ (x >> uint32(16)))
    return mix


def random_bf16(f32=False):
    # `f32`: the same bf16 values, stored as fp32 (a float32 model of the same random weights)
    mix = _hash()
    store = bf16_round if f32 else f32_to_bf16

    def random_bf16_kernel(out, n, seed, scale, offset):
        # out[i] = offset + scale * U(-1, 1), bf16; grid-stride
        i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        stride = int64(cuda.gridDim.x) * cuda.blockDim.x
        while i < n:
            h = mix(uint32(i & 0xFFFFFFFF) ^ mix(uint32(uint32(seed) + uint32(uint32(i >> 32) * uint32(0x9E3779B9)))))
            u = float32(h >> uint32(8)) * float32(1.0 / 8388608.0) - float32(1.0)
            out[i] = store(offset + scale * u)
            i += stride
    return random_bf16_kernel


def random_f32():
    mix = _hash()

    def random_f32_kernel(out, n, seed, scale, offset):
        i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        stride = int64(cuda.gridDim.x) * cuda.blockDim.x
        while i < n:
            h = mix(uint32(i & 0xFFFFFFFF) ^ mix(uint32(uint32(seed) + uint32(uint32(i >> 32) * uint32(0x9E3779B9)))))
            u = float32(h >> uint32(8)) * float32(1.0 / 8388608.0) - float32(1.0)
            out[i] = offset + scale * u
            i += stride
    return random_f32_kernel
