"""Logits -> token ids on the GPU: greedy argmax and temperature sampling by the Gumbel-max trick
with a counter-based RNG (seed, step, vocab index) -> reproducible, no RNG state on the device."""
import math

from numba import cuda, float32, int32, uint32

THREADS = 1024


def _mix():
    @cuda.jit(device=True, inline=True)
    def mix(x):
        # numba widens uint32 products to 64 bits: truncate after each step
        x = uint32(x)
        x = uint32((x ^ (x >> uint32(16))) * uint32(0x7FEB352D))
        x = uint32((x ^ (x >> uint32(15))) * uint32(0x846CA68B))
        return uint32(x ^ (x >> uint32(16)))
    return mix



def argmax():
    def argmax_kernel(out, logits, vocab):
        # grid (rows,), block 1024; ties -> lowest id
        red_v = cuda.shared.array(THREADS, float32)
        red_i = cuda.shared.array(THREADS, int32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        bv = float32(-3.4e38)
        bi = int32(0x7FFFFFFF)
        for i in range(tid, vocab, THREADS):
            v = logits[r * vocab + i]
            if v > bv:
                bv = v
                bi = i
        red_v[tid] = bv
        red_i[tid] = bi
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                ov = red_v[tid + step]
                oi = red_i[tid + step]
                if ov > red_v[tid] or (ov == red_v[tid] and oi < red_i[tid]):
                    red_v[tid] = ov
                    red_i[tid] = oi
            cuda.syncthreads()
            step //= 2
        if tid == 0:
            out[r] = red_i[0]
    return argmax_kernel


def gumbel_sample():
    mix = _mix()

    def gumbel_sample_kernel(out, logits, vocab, temperature, seeds, step):
        # argmax_i(logits_i / T + Gumbel(seed_r, step, i)); T <= 0 -> greedy
        red_v = cuda.shared.array(THREADS, float32)
        red_i = cuda.shared.array(THREADS, int32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        T = temperature[r]
        key = mix(uint32(seeds[r]) ^ mix(uint32(uint32(step[r]) * uint32(0x9E3779B9))))
        bv = float32(-3.4e38)
        bi = int32(0x7FFFFFFF)
        for i in range(tid, vocab, THREADS):
            v = logits[r * vocab + i]
            if T > float32(0.0):
                u = (float32(mix(key ^ mix(uint32(i))) >> uint32(8)) + float32(0.5)) \
                    * float32(1.0 / 16777216.0)
                v = v / T - math.log(-math.log(u))
            if v > bv:
                bv = v
                bi = i
        red_v[tid] = bv
        red_i[tid] = bi
        cuda.syncthreads()
        st = THREADS // 2
        while st > 0:
            if tid < st:
                ov = red_v[tid + st]
                oi = red_i[tid + st]
                if ov > red_v[tid] or (ov == red_v[tid] and oi < red_i[tid]):
                    red_v[tid] = ov
                    red_i[tid] = oi
            cuda.syncthreads()
            st //= 2
        if tid == 0:
            out[r] = red_i[0]
    return gumbel_sample_kernel
