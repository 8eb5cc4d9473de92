"""The quantized-KV kernel variants (kv_dtype fp8 / int8: `kvq` of kernels/rope_kv.py,
attention.py, attention_tc.py) on numba-cuda's CPU simulator. `tests/test_cuda_kvq_nogpu.py` runs
this in a subprocess (the simulator must be on before numba is imported) and checks the printed
JSON:

    codec/<fp8|int8>              the device encoder on crafted values (ties, subnormals, the
                                  clip, signed zeros) and the decoder on all 256 codes: mismatches
                                  against ml_dtypes / numpy (0 expected)
    write/<kvq>/<geometry>        qk_norm_rope_kv's quantized store against kv_quant.quantize of
                                  the float32 variant's K/V (same inputs): mismatching bytes of
                                  the written tokens, and bytes changed outside them (0, 0)
    attention/<kvq>/<GS>          paged_attention + attn_combine against float64 attention over
                                  the dequantized pages: relative L2 error
    gather/<kvq>                  kv_gather's bf16 rows against bf16(code * scale): mismatches

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_kv_quant.py
"""
import json
import math
import sys

import ml_dtypes
import numpy as np

# (sim_storage patches the simulator: warp shuffles, libdevice bit casts and rintf)
from sim_storage import cuda, kernel, rel

from ninfer.core.cuda.kernels import _import_kernel_module   # noqa: E402
from ninfer.models.qwen3_5.cuda.runner import combine_launch   # noqa: E402
from ninfer.models.qwen3_5.memory_plan import quantized_page_bytes   # noqa: E402
from oracles import quantized_device_pages, quantized_host_layer   # noqa: E402
from ninfer.ops.kv_quant import QuantizedPages, dequantize, quantize   # noqa: E402

common = _import_kernel_module("common")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


# ---- the codec ---------------------------------------------------------------------------------

@cuda.jit
def _encode(out, x, fp8):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = common.e4m3_code(x[i]) if fp8 else common.int8_code(x[i])


@cuda.jit
def _decode(out, fp8):
    i = cuda.grid(1)
    if i < 256:
        out[i] = common.e4m3_value(np.uint32(i)) if fp8 else common.int8_value(np.uint32(i))


def _crafted(top):
    """Values the encoder must round like numpy: e4m3's ties and their neighbours one float32
    ulp away, subnormal codes, the clip, signed zeros (fp8); halves and their neighbours (int8)."""
    if top == 448.0:
        grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
        grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
        mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
        base = np.concatenate([grid, mids, [448.0, 449.0, 463.9, 2.0 ** -10, 2.0 ** -6]])
    else:
        base = np.concatenate([np.arange(0, 128, 0.5), [126.9, 127.0, 127.49, 127.5, 128.2]])
    base = base.astype(np.float32)
    near = np.concatenate([np.nextafter(base, np.float32(np.inf)),
                           np.nextafter(base, np.float32(-np.inf)), base])
    vals = np.concatenate([near, -near, [np.float32(-0.0)]]).astype(np.float32)
    return vals[np.abs(vals) <= top * 1.05]


def codec(kvq):
    top = float(common.KV_TOP[kvq])
    x = _crafted(top)
    got = np.zeros(x.size, np.uint32)
    _encode[(x.size + 127) // 128, 128](got, x, kvq == "fp8")
    # kv_quant.quantize's rounding of x / scale
    want = np.clip(x, -top, top).astype(E4M3).view(np.uint8) if kvq == "fp8" else \
        np.clip(np.rint(x), -127, 127).astype(np.int8).view(np.uint8)
    bad = int(np.count_nonzero(got.astype(np.uint8) != want))
    vals = np.zeros(256, np.float32)
    _decode[2, 128](vals, kvq == "fp8")
    ref = np.arange(256, dtype=np.uint8).view(E4M3 if kvq == "fp8" else np.int8).astype(np.float32)
    finite = np.isfinite(ref)
    bad += int(np.count_nonzero(vals[finite].view(np.uint32) != ref[finite].view(np.uint32)))
    return bad


# ---- pools: device page bytes from numpy's pages (oracles.py) -------------------------------------

def device_pages(qp: QuantizedPages) -> np.ndarray:
    return quantized_device_pages(qp.codes, qp.scale)


def host_layer(dev: np.ndarray, shape, kvq) -> QuantizedPages:
    return quantized_host_layer(dev, shape, kvq)


# ---- the write kernel ----------------------------------------------------------------------------

def write(kvq, r, hd, rot, nh, nkv, ps):
    """Two rows (3 new tokens from 0; 2 new after 3 cached, across a page boundary) with an
    all-zero K head and an all-zero V head, V spanning 7 decades (fp8's subnormal codes)."""
    lengths, ctxs = [3, 2], [0, 3]
    n = sum(lengths)
    qs = np.array([0, 3, 5], np.int32)
    tok_row = np.repeat(np.arange(2), lengths).astype(np.int32)
    num_pages, p_cap = 6, 3
    bt = np.array([[4, 1, 5], [2, 0, 3]], np.int32)
    P = 2 * nh * hd + 2 * nkv * hd
    proj = r.standard_normal((n, P)).astype(np.float32)
    kv0 = 2 * nh * hd
    proj[2, kv0: kv0 + hd] = 0                                  # token 2, kv head 0: K all zero
    proj[4, kv0 + nkv * hd + (nkv - 1) * hd: kv0 + 2 * nkv * hd] = 0     # a V head all zero
    v = proj[:, kv0 + nkv * hd:]
    v[:] = np.sign(v) * 10.0 ** r.uniform(-7, 0, v.shape)
    positions = np.stack([np.arange(n)] * 3).astype(np.int32) + 3
    qw = (0.1 * r.standard_normal(hd)).astype(np.float32)
    kw = (0.1 * r.standard_normal(hd)).astype(np.float32)
    geo = dict(hd=hd, rot=rot, nh=nh, nkv=nkv, sec_t=rot // 2, sec_h=0, sec_w=0,
               interleaved=False)
    blk = (hd + 31) // 32 * 32

    def launch(k_cache, v_cache, **variant):
        q = np.full(n * nh * hd, np.nan, np.float32)
        kernel("rope_kv", "qk_norm_rope_kv", **geo, **variant)[(n, nh + nkv, 1), (blk, 1, 1)](
            q, proj.reshape(-1), P, qw, kw, k_cache, v_cache, positions.reshape(-1), n, tok_row,
            qs, np.array(ctxs, np.int32), bt.reshape(-1), p_cap, ps, np.float32(1e6),
            np.float32(1e-6))
        return q
    kf = np.zeros(num_pages * ps * nkv * hd, np.float32)
    vf = np.zeros_like(kf)
    q_f = launch(kf, vf, f32=True)
    codes, whole = quantized_page_bytes(ps, nkv, hd)
    poison = r.integers(0, 256, (num_pages, whole)).astype(np.uint8)
    kb, vb = poison.reshape(-1).copy(), poison.reshape(-1).copy()
    q_q = launch(kb, vb, kvq=kvq)
    bad = int(np.count_nonzero(q_q != q_f))                     # the queries: the same values
    outside = 0
    shape = (num_pages, ps, nkv, hd)
    for dev, f in ((kb, kf), (vb, vf)):
        dev = dev.reshape(num_pages, whole)
        f = f.reshape(shape)
        written = np.zeros((num_pages, ps), bool)
        for row in range(2):
            pos = ctxs[row] + np.arange(lengths[row])
            written[bt[row, pos // ps], pos % ps] = True
        want = QuantizedPages(shape, kvq)
        want.codes[written], want.scale[written] = quantize(f[written], kvq)
        got = host_layer(dev, shape, kvq)
        bad += int(np.count_nonzero(got.codes[written].view(np.uint8) !=
                                    want.codes[written].view(np.uint8)))
        bad += int(np.count_nonzero(got.scale[written].view(np.uint32) !=
                                    want.scale[written].view(np.uint32)))
        # every byte of a page that no written token owns keeps its poison (padding included)
        free = device_pages(_owned(shape, written, kvq)) == 0
        outside += int(np.count_nonzero(dev[free] != poison[free]))
    zero_scale = host_layer(kb.reshape(num_pages, whole), shape, kvq).scale[bt[0, 0], 2, 0]
    bad += int(zero_scale != 1.0)                               # the all-zero K head: scale 1
    return [bad, outside]


def _owned(shape, written, kvq):
    """A QuantizedPages whose bytes are nonzero exactly on the codes and scales of the written
    tokens (zero elsewhere, as device_pages' padding is)."""
    qp = QuantizedPages(shape, kvq)
    qp.codes.view(np.uint8)[written] = 1
    qp.scale[:] = 0.0
    qp.scale.view(np.uint32)[written] = 0x01010101
    return qp


# ---- paged attention -----------------------------------------------------------------------------

def attention(kvq, r, GS):
    """Two rows (1 new after 7 cached; 2 new after 0) over 3-key pages (3 * 2 * 6 codes: padded
    to 4 bytes), G = 2, head_dim 6 (a lane past it), 2 splits, poisoned outputs."""
    hd, G, nkv, ps, splits = 6, 2, 2, 3, 2
    nh = G * nkv
    lengths, ctxs = [1, 2], [7, 0]
    m = sum(lengths)
    qs = np.array([0, 1, 3], np.int32)
    tok_row = np.repeat(np.arange(2), lengths).astype(np.int32)
    bt = np.array([[3, 0, 5], [1, 4, -1]], np.int32)
    shape = (6, ps, nkv, hd)
    kq, vq = QuantizedPages(shape, kvq), QuantizedPages(shape, kvq)
    kq[np.arange(6)] = (3 * r.standard_normal(shape)).astype(np.float32)
    vq[np.arange(6)] = r.standard_normal(shape).astype(np.float32)
    vq[np.array([3]), np.array([1])] = np.zeros((1, nkv, hd), np.float32)     # scale 1 codes 0
    q = r.standard_normal((m, nh, hd)).astype(np.float32)
    P = 2 * nh * hd + 2 * nkv * hd
    proj = r.standard_normal((m, P)).astype(np.float32)
    part = np.full(m * nh * splits * hd, np.nan, np.float32)
    ml = np.full(m * nh * splits * 2, np.nan, np.float32)
    scale = np.float32(1 / math.sqrt(hd))
    kernel("attention", "paged_attention", hd=hd, G=G, nkv=nkv, GS=GS, kvq=kvq)[
        (m, nkv * (G // GS), splits), (128, 1, 1)](
        part, ml, q.reshape(-1), device_pages(kq).reshape(-1).view(np.uint16),
        device_pages(vq).reshape(-1).view(np.uint16), tok_row, qs, np.array(ctxs, np.int32),
        bt.reshape(-1), 3, ps, splits, scale, 0)
    o = np.full(m * nh * hd, np.nan, np.float32)
    kernel("attention", "attn_combine", hd=hd, nh=nh, f32=True)[combine_launch(m, nh, hd)](
        o, part, ml, proj.reshape(-1), P, splits, 0)
    K64 = dequantize(kq.codes, kq.scale).astype(np.float64)
    V64 = dequantize(vq.codes, vq.scale).astype(np.float64)
    ref = np.zeros((m, nh, hd))
    for row in range(2):
        for i in range(lengths[row]):
            t = qs[row] + i
            keys = np.arange(ctxs[row] + i + 1)
            pg, of = bt[row, keys // ps], keys % ps
            for h in range(nh):
                s = K64[pg, of, h // G] @ q[t, h].astype(np.float64) * float(scale)
                e = np.exp(s - s.max())
                ref[t, h] = (e / e.sum()) @ V64[pg, of, h // G]
    gate = proj[:, :2 * nh * hd].reshape(m, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    ref = ref / (1 + np.exp(-gate))
    return rel(o.reshape(m, nh, hd), ref)


def gather(kvq, r):
    """kv_gather of one row of 7 keys (3-key pages, padded to 8 rows, head_dim 6 -> 8 wide)."""
    hd, nkv, ps, n_keys, n_pad, g_stride = 6, 2, 3, 7, 8, 9
    HPP = 4
    shape = (5, ps, nkv, hd)
    kq, vq = QuantizedPages(shape, kvq), QuantizedPages(shape, kvq)
    kq[np.arange(5)] = (3 * r.standard_normal(shape)).astype(np.float32)
    vq[np.arange(5)] = r.standard_normal(shape).astype(np.float32)
    bt = np.array([[9, 9, 9], [2, 4, 0]], np.int32)
    poison = np.full(nkv * g_stride * HPP, 0xDEADBEEF, np.uint32)
    kc, vc = poison.copy(), poison.copy()
    poison = poison.view(np.uint16).reshape(nkv, g_stride, 2 * HPP)
    kernel("attention_tc", "kv_gather", hd=hd, nkv=nkv, kvq=kvq)[
        ((n_pad + 7) // 8, nkv, 1), (128, 1, 1)](
        kc, vc, device_pages(kq).reshape(-1).view(np.uint16),
        device_pages(vq).reshape(-1).view(np.uint16), bt.reshape(-1), 1, 3, ps, n_keys, n_pad,
        g_stride)
    bad = 0
    for got, qp in ((kc, kq), (vc, vq)):
        got = got.view(np.uint16).reshape(nkv, g_stride, 2 * HPP)
        keys = np.arange(n_keys)
        vals = dequantize(qp.codes, qp.scale)[bt[1, keys // ps], keys % ps]     # [keys, nkv, hd]
        want = np.zeros((nkv, n_pad, 2 * HPP), np.uint16)
        want[:, :n_keys, :hd] = vals.transpose(1, 0, 2).astype(ml_dtypes.bfloat16).view(np.uint16)
        bad += int(np.count_nonzero(got[:, :n_pad] != want))
        bad += int(np.count_nonzero(got[:, n_pad:] != poison[:, n_pad:]))   # past n_pad: untouched
    return bad


def main():
    r = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    out = {}
    for kvq in ("fp8", "int8"):
        out[f"codec/{kvq}"] = codec(kvq)
        # head_dim 8 over 2 kv heads and 4-token pages; head_dim 6, 1 kv head, 3-token pages
        # (18 code bytes a page: padded to 20); one query head (q is written as before)
        out[f"write/{kvq}/hd8"] = write(kvq, r, 8, 4, 1, 2, 4)
        out[f"write/{kvq}/hd6"] = write(kvq, r, 6, 2, 1, 1, 3)
        for GS in (2, 1) if kvq == "fp8" else (2,):     # GS 1: a kv head's queries in 2 blocks
            out[f"attention/{kvq}/GS{GS}"] = attention(kvq, r, GS)
        out[f"gather/{kvq}"] = gather(kvq, r)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
