"""The kernels with a float32-storage variant (kernels/*.py factories taking `f32`), both
variants, on numba-cuda's CPU simulator against float64 oracles. `tests/test_cuda_dtype_nogpu.py`
runs this in a subprocess (the simulator must be on before numba is imported) and checks the
printed JSON: {"<kernel>/<bf16|f32>": relative L2 error}.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_storage.py
"""
import json
import math
from types import SimpleNamespace

import numpy as np

from ninfer.core.cuda import numba_shim

cuda, _ = numba_shim.import_numba_cuda()
from sim_patches import fix_shared_array_race, warp_shuffles, yield_while_polling   # noqa: E402
fix_shared_array_race()
yield_while_polling()
import numba.cuda.simulator.kernelapi as _fake   # noqa: E402

from ninfer.core.cuda.kernels import _import_kernel_module   # noqa: E402
from ninfer.models.qwen3_5.cuda.runner import combine_launch   # noqa: E402

warp_shuffles()
_fake.FakeCUDAModule.libdevice = SimpleNamespace(
    float_as_int=lambda x: np.array([x], np.float32).view(np.int32)[0],
    int_as_float=lambda i: np.array([int(i) & 0xFFFFFFFF], np.uint32).view(np.float32)[0],
    rintf=lambda x: np.rint(np.float32(x)))          # (half to even: the quantized KV's int8)


def bf16_bits(a):
    import ml_dtypes
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


def bits_f32(u):
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def kernel(module, factory, **params):
    return cuda.jit(getattr(_import_kernel_module(module), factory)(**params))


def store(a, f32):
    """Host image of values in the variant's storage: fp32 as is, bf16 bits."""
    return np.ascontiguousarray(a, np.float32).reshape(-1) if f32 else bf16_bits(a).reshape(-1)


def load(buf, f32):
    return np.asarray(buf, np.float64) if f32 else bits_f32(buf).astype(np.float64)


def pairs(a, f32):
    """A "u32*" argument: bf16 pairs, or fp32 elements."""
    return store(a, f32) if f32 else store(a, f32).view(np.uint32)


def rel(got, ref):
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


def exact(r, shape):
    # values bf16 can hold (the checkpoint's weights): both variants see the same numbers
    return bits_f32(bf16_bits(r.standard_normal(shape))).reshape(shape)


def run(f32, r):
    out = {}
    tag = "f32" if f32 else "bf16"
    # rmsnorm: rows through row_idx, odd width
    n, H, eps = 3, 45, 1e-6
    x = r.standard_normal((5, H)).astype(np.float32)
    w = (0.1 * r.standard_normal(H)).astype(np.float32)
    idx = np.array([4, 0, 2], np.int32)
    o = np.full(n * H, 0x7FC0 if not f32 else np.nan, np.float32 if f32 else np.uint16)
    kernel("norm", "rmsnorm", f32=f32)[(n, 1, 1), (64, 1, 1)](o, x.reshape(-1), w, idx, 1, H,
                                                            np.float32(eps))
    xs = x[idx].astype(np.float64)
    ref = xs / np.sqrt((xs * xs).mean(1, keepdims=True) + eps) * (1 + w)
    out[f"rmsnorm/{tag}"] = rel(load(o, f32).reshape(n, H), ref)
    # gated_rmsnorm4: a warp a (token, head), 5 pairs (the second block's last 3 warps idle),
    # z strided at a 16-byte-aligned offset, the output poisoned
    nv, dv, zs, zoff = 5, 128, 5 * 128 + 12, 8
    x = r.standard_normal((1, nv * dv)).astype(np.float32)
    z = r.standard_normal((1, zs)).astype(np.float32)
    w = (1 + 0.2 * r.standard_normal(dv)).astype(np.float32)
    o = np.full(nv * dv, 0x7FC0 if not f32 else np.nan, np.float32 if f32 else np.uint16)
    kernel("norm", "gated_rmsnorm4", dv=dv, f32=f32)[(2, 1, 1), (128, 1, 1)](
        o, x.reshape(-1), z.reshape(-1), zs, zoff, w, nv, nv, np.float32(eps))
    xh = x.astype(np.float64).reshape(nv, dv)
    zz = z[0, zoff: zoff + nv * dv].astype(np.float64).reshape(nv, dv)
    ref = xh / np.sqrt((xh ** 2).mean(1, keepdims=True) + eps) * w * (zz / (1 + np.exp(-zz)))
    out[f"gated_rmsnorm4/{tag}"] = rel(load(o, f32).reshape(nv, dv), ref)
    # silu_mul from a strided projection
    inter, stride, off = 37, 90, 5
    gu = r.standard_normal((n, stride)).astype(np.float32)
    o = np.zeros(n * inter, np.float32 if f32 else np.uint16)
    kernel("act", "silu_mul", f32=f32)[(n, 1, 1), (64, 1, 1)](o, gu.reshape(-1), stride, off, inter)
    g, u = gu[:, off: off + inter].astype(np.float64), gu[:, off + inter: off + 2 * inter]
    out[f"silu_mul/{tag}"] = rel(load(o, f32).reshape(n, inter), g / (1 + np.exp(-g)) * u)
    # ... four columns a thread (16-byte loads: stride, offset and inter multiples of 4), the
    # output poisoned: a column past the last thread's four or a wrong row shows
    inter, stride, off = 44, 96, 8
    gu = r.standard_normal((n, stride)).astype(np.float32)
    o = np.full(n * inter, np.nan, np.float32) if f32 else np.full(n * inter, 0x7FC1, np.uint16)
    kernel("act", "silu_mul4", f32=f32)[(n, 2, 1), (8, 1, 1)](o, gu.reshape(-1), stride, off,
                                                              inter)
    g, u = gu[:, off: off + inter].astype(np.float64), gu[:, off + inter: off + 2 * inter]
    out[f"silu_mul4/{tag}"] = rel(load(o, f32).reshape(n, inter), g / (1 + np.exp(-g)) * u)
    # embedding gather of bf16-exact weights: exact in both variants
    V = 7
    table = exact(r, (V, H))
    ids = np.array([6, 0, 6], np.int32)
    o = np.zeros(n * H, np.float32)
    kernel("act", "embed_gather", f32=f32)[(1, n, 1), (64, 1, 1)](o, store(table, f32), ids, H)
    out[f"embed_gather/{tag}"] = rel(o.reshape(n, H), table[ids].astype(np.float64))
    # expert GEMVs: H, I even; the f32 variant reads fp32 x and weights
    E, K, H2, I = 3, 2, 40, 6
    xe = r.standard_normal((n, H2)).astype(np.float32)
    wgu = exact(r, (E, 2 * I, H2))
    wdn = exact(r, (E, H2, I))
    eids = np.array([2, 0, 1, 2, 0, 0], np.int32)
    act = np.zeros(n * K * I, np.float32)
    kernel("moe", "expert_gate_up", H=H2, inter=I, f32=f32)[(n * K, (I + 3) // 4, 1), (128, 1, 1)](
        act, pairs(xe, f32), pairs(wgu, f32), eids, K)
    xin = load(store(xe, f32), f32).reshape(n, H2)
    ref_act = np.zeros((n * K, I))
    for p in range(n * K):
        gg = wgu[eids[p], :I].astype(np.float64) @ xin[p // K]
        uu = wgu[eids[p], I:].astype(np.float64) @ xin[p // K]
        ref_act[p] = gg / (1 + np.exp(-gg)) * uu
    out[f"expert_gate_up/{tag}"] = rel(act.reshape(n * K, I), ref_act)
    y = np.zeros(n * K * H2, np.float32)
    kernel("moe", "expert_down", H=H2, inter=I, f32=f32)[(n * K, -(-H2 // 16), 1), (128, 1, 1)](
        y, act, pairs(wdn, f32), eids)
    ref_y = np.stack([wdn[eids[p]].astype(np.float64) @ act.reshape(n * K, I)[p].astype(np.float64)
                      for p in range(n * K)])
    out[f"expert_down/{tag}"] = rel(y.reshape(n * K, H2), ref_y)
    # paged attention (2 splits, 4-key pages, G = 2, head_dim 6 with a padded lane) + combine
    hd, G, nkv, ps = 6, 2, 2, 4
    nh = G * nkv
    ctx, m = 5, 2                           # one row: 5 cached keys, 2 new query tokens
    L = ctx + m
    pages = np.array([3, 0, 1], np.int32)
    kc = r.standard_normal((4, ps, nkv, hd)).astype(np.float32)
    vc = r.standard_normal((4, ps, nkv, hd)).astype(np.float32)
    q = r.standard_normal((m, nh, hd)).astype(np.float32)
    P = 2 * nh * hd + 2 * nkv * hd
    proj = r.standard_normal((m, P)).astype(np.float32)
    splits = 2
    part = np.zeros(m * nh * splits * hd, np.float32)
    ml = np.zeros(m * nh * splits * 2, np.float32)
    tok_row, qs, ctxs = np.zeros(m, np.int32), np.array([0, m], np.int32), np.array([ctx], np.int32)
    scale = np.float32(1 / math.sqrt(hd))
    kernel("attention", "paged_attention", hd=hd, G=G, nkv=nkv, f32=f32)[
        (m, nkv, splits), (128, 1, 1)](part, ml, q.reshape(-1), pairs(kc, f32), pairs(vc, f32),
                                       tok_row, qs, ctxs, pages, 3, ps, splits, scale, 0)
    o = np.zeros(m * nh * hd, np.float32 if f32 else np.uint16)
    kernel("attention", "attn_combine", hd=hd, nh=nh, f32=f32)[combine_launch(m, nh, hd)](
        o, part, ml, proj.reshape(-1), P, splits, 0)
    K64 = load(store(kc, f32), f32).reshape(kc.shape)
    V64 = load(store(vc, f32), f32).reshape(vc.shape)
    ref = np.zeros((m, nh, hd))
    for i in range(m):
        keys = np.arange(ctx + i + 1)
        pg, of = pages[keys // ps], keys % ps
        for h in range(nh):
            s = K64[pg, of, h // G] @ q[i, h].astype(np.float64) * float(scale)
            e = np.exp(s - s.max())
            ref[i, h] = (e / e.sum()) @ V64[pg, of, h // G]
    gate = proj[:, :2 * nh * hd].reshape(m, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    ref = ref / (1 + np.exp(-gate))
    out[f"paged_attention/{tag}"] = rel(load(o, f32).reshape(m, nh, hd), ref)
    assert L <= 3 * ps
    return out


def fills():
    """random_bf16's f32 variant stores the bf16 variant's values (the same random model), and
    widen_bf16 widens bits exactly."""
    nv = 1000
    a = np.zeros(nv, np.uint16)
    b = np.zeros(nv, np.float32)
    kernel("fill", "random_bf16")[(4, 1, 1), (64, 1, 1)](a, nv, np.uint32(9), np.float32(0.3),
                                                        np.float32(0.1))
    kernel("fill", "random_bf16", f32=True)[(4, 1, 1), (64, 1, 1)](b, nv, np.uint32(9),
                                                                  np.float32(0.3), np.float32(0.1))
    w = np.zeros(nv, np.float32)
    kernel("act", "widen_bf16")[(3, 1, 1), (64, 1, 1)](w, a, nv)
    return {"random_bf16 f32 == bf16": bool(np.array_equal(bits_f32(a), b)),
            "widen exact": bool(np.array_equal(bits_f32(a), w)),
            "fill spread": float(np.std(b))}


def conv_chunk(r) -> dict:
    """conv_silu_chunk (a prefill's conv, 16 tokens a block) over rows of 5, 20 and 3 tokens
    after 0, 3 and 2 (two blocks; rows start and end inside them, one crosses them), the output
    poisoned: the float64 oracle's q/k (L2-normed) and v channels, and the same bits as
    conv_silu's (a decode row beside a prefill row takes this kernel)."""
    from oracles import conv_oracle
    K, dk, dv, nk, nv = 4, 32, 64, 2, 2
    C = 2 * nk * dk + nv * dv
    lengths, ctxs = [5, 20, 3], np.array([0, 3, 2], np.int32)
    n, P = sum(lengths), C + 12
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rows = np.repeat(np.arange(3), lengths).astype(np.int32)
    slots = np.array([3, 0, 2], np.int32)
    proj = r.standard_normal((n, P)).astype(np.float32)
    w = (0.5 * r.standard_normal((C, K))).astype(np.float32)
    state = r.standard_normal((4, C, K - 1)).astype(np.float32)
    args = (proj.reshape(-1), P, w.reshape(-1), state.reshape(-1), rows, qs, ctxs, slots)
    got, old = np.full(n * C, np.nan, np.float32), np.full(n * C, np.nan, np.float32)
    kernel("conv", "conv_silu_chunk", K=K, dk=dk, dv=dv, nk=nk, nv=nv)[
        (2, 2 * nk + nv, 1), (64, 1, 1)](got, *args, n)
    kernel("conv", "conv_silu", K=K, dk=dk, dv=dv, nk=nk, nv=nv)[
        (n, 2 * nk + nv, 1), (64, 1, 1)](old, *args, 0)
    ref, _ = conv_oracle(proj, P, w, state, qs, ctxs, slots, K)
    qk = ref[:, :2 * nk * dk].reshape(n, 2 * nk, dk)
    qk = qk / np.sqrt((qk ** 2).sum(-1, keepdims=True) + 1e-6)
    qk[:, :nk] *= 1 / math.sqrt(dk)
    ref[:, :2 * nk * dk] = qk.reshape(n, -1)
    got, old = got.reshape(n, C), old.reshape(n, C)
    return {"conv_silu_chunk/f32": rel(got, ref),
            "conv_silu_chunk == conv_silu": bool(np.array_equal(got, old))}


if __name__ == "__main__":
    r = np.random.default_rng(0)
    res = {}
    for f32 in (False, True):
        res.update(run(f32, r))
    res.update(fills())
    res.update(conv_chunk(r))
    print(json.dumps(res))
