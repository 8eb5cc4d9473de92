"""q/k zero-centred RMSNorm + partial rotary (interleaved or sectioned MRoPE), fused with the write of
k and v into the paged bf16 KV pools (fp32 pools with `f32`; one-byte codes and a scale per token
and kv head with `kvq` "fp8" / "int8").

grid (tokens, nh + nkv), block = head_dim rounded up to a warp (threads past head_dim idle). Head h < nh: query h -> q_out (fp32).
Head h >= nh: kv head g -> k_cache / v_cache at page block_tables[row, pos // P], offset pos % P,
where pos = context_len + index in row (the sequence index; MRoPE positions only set the angles).
Rotary (rotate-half over the first `rot` dims): frequency i in [0, rot/2) takes its position from
axis t, h or w: interleaved -> i % 3 == 1 and i < 3*sec_h -> h, i % 3 == 2 and i < 3*sec_w -> w;
sectioned -> [0, s_t) t, [s_t, s_t+s_h) h, rest w.

`gated` False (a DFlash drafter's layers): the projection holds q without the output gate,
[q (nh*hd) | k | v] instead of [q_h, gate_h per head | k | v]; `plain`: the norms are Qwen3's
x * rsqrt(mean x^2 + eps) * w instead of zero-centred.

Quantized pools (`kvq`; ninfer/ops/kv_quant.py is the spec, common.kvq_row the page layout):
k_cache / v_cache are bytes; a kv head's block takes amax over its head_dim values (block_max:
every thread of the block reaches it, those past head_dim with 0), scale = amax / top (1 when
all are 0), codes = encode(x / scale): kv_quant.quantize's float32 operations in its order, so
both backends store the same bytes. Thread 0 writes the scale's 4 bytes.
"""
import math

from numba import cuda, float32, uint8, uint32

from .common import block_max, block_sum, inlined, kv_codec, kvq_row, storage

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "qk_norm_rope_kv": (
        "f32*", "f32*", "i32", "f32*", "f32*", "u16*", "u16*", "i32*", "i32", "i32*", "i32*",
        "i32*", "i32*", "i32", "i32", "f32", "f32"),
}


def _quantized_store(kvq):
    """put(cache, x, amax, row, sb, j): codes of the head's values at byte `row` (thread j's at
    row + j), its scale at byte sb (kvq "fp8" / "int8")."""
    encode, _, top = kv_codec(kvq)

    @inlined
    def put(cache, x, amax, row, sb, j):
        scale = float32(1.0)
        if amax > float32(0.0):
            scale = amax / top
        cache[row + j] = uint8(encode(x / scale))
        if j == 0:
            bits = uint32(cuda.libdevice.float_as_int(scale))
            for b in range(4):
                cache[sb + b] = uint8((bits >> uint32(8 * b)) & uint32(0xFF))
    return put


def qk_norm_rope_kv(hd, rot, nh, nkv, sec_t, sec_h, sec_w, interleaved, f32=False, kvq="",
                    gated=True, plain=False):
    # kvq: the k_cache / v_cache arguments are "u8*" (kernel_set.KVQ_VARIANTS), f32 unused
    half = rot // 2
    QS = 2 * hd if gated else hd         # a query head's stride in the projection
    KB = nh * QS                         # where k starts, v after it
    one = float32(0.0 if plain else 1.0)
    store = storage(f32)[0]
    quant = bool(kvq)
    put = _quantized_store(kvq) if quant else None

    def qk_norm_rope_kv_kernel(q_out, proj, proj_stride, q_norm_w, k_norm_w, k_cache, v_cache,
                               positions, pos_stride, token_row, query_start, context_lens,
                               block_tables, bt_stride, page_size, theta, eps):
        scratch = cuda.shared.array(32, float32)
        xs = cuda.shared.array(hd, float32)
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        j = cuda.threadIdx.x
        pb = t * proj_stride
        is_q = h < nh
        live = j < hd
        g = h - nh
        x = float32(0.0)
        w = float32(0.0)
        if live:
            if is_q:
                x = proj[pb + h * QS + j]
                w = q_norm_w[j]
            else:
                x = proj[pb + KB + g * hd + j]
                w = k_norm_w[j]
        tot = block_sum(x * x, scratch)
        x = x / math.sqrt(tot / float32(hd) + eps) * (one + w)
        if live:
            xs[j] = x
        cuda.syncthreads()
        if not live and not quant:
            return
        y = x
        if j < rot:
            i = j % half
            axis = 0
            if interleaved:
                if i % 3 == 1 and i < 3 * sec_h:
                    axis = 1
                elif i % 3 == 2 and i < 3 * sec_w:
                    axis = 2
            else:
                if i >= sec_t + sec_h:
                    axis = 2
                elif i >= sec_t:
                    axis = 1
            p = float32(positions[axis * pos_stride + t])
            inv_freq = float32(1.0) / (theta ** (float32(2 * i) / float32(rot)))
            ang = p * inv_freq
            c = math.cos(ang)
            s = math.sin(ang)
            if j < half:
                y = x * c - xs[j + half] * s
            else:
                y = x * c + xs[j - half] * s
        r = token_row[t]
        if quant:
            if is_q:                     # (the whole block: h is the block's)
                if live:
                    q_out[(t * nh + h) * hd + j] = y
                return
            v = float32(0.0)
            if live:
                v = proj[pb + KB + nkv * hd + g * hd + j]
            else:
                y = float32(0.0)
            amax_k = block_max(abs(y), scratch)
            amax_v = block_max(abs(v), scratch)
            if live:
                pos = context_lens[r] + t - query_start[r]
                page = block_tables[r * bt_stride + pos // page_size]
                row, sb = kvq_row(page, pos % page_size, g, page_size, nkv, hd)
                put(k_cache, y, amax_k, row, sb, j)
                put(v_cache, v, amax_v, row, sb, j)
        elif is_q:
            q_out[(t * nh + h) * hd + j] = y
        else:
            pos = context_lens[r] + t - query_start[r]
            page = block_tables[r * bt_stride + pos // page_size]
            idx = ((page * page_size + pos % page_size) * nkv + g) * hd + j
            k_cache[idx] = store(y)
            v_cache[idx] = store(proj[pb + KB + nkv * hd + g * hd + j])
    return qk_norm_rope_kv_kernel
