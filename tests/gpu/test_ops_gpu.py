"""Every CUDA kernel against a naive float64 numpy oracle: fresh random inputs, poisoned outputs,
boundary sizes, named tolerances (gpu_harness)."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from oracles import (conv_oracle, gated_delta_rows, gdn_inputs, page_tables, poison_unowned,
                     router_oracle)
from ninfer.models.qwen3_5.cuda.runner import EXPERT_DOWN_ROWS, ROUTER_THREADS, combine_launch
from gpu_harness import (TOL_BF16_OUT, TOL_F32, TOL_ROPE_F32, bf16_bits, bf16_round, bits_to_f64,
                         rel_err)

pytestmark = pytest.mark.gpu


@pytest.fixture
def g(gpu):
    yield gpu
    gpu.reset()


def rng(seed):
    return np.random.default_rng(seed)


def silu(x):
    return x / (1 + np.exp(-x))


# Storage variants (dtype="float32"): the kernels with an `f32` factory parameter run both ways;
# f32 -> fp32 arrays where the bf16 variant takes bf16 bits, and fp32-only error.
STORAGE = pytest.mark.parametrize("f32", [False, True], ids=["bf16", "f32"])


def store_as(a, f32):
    """Host image of values in the variant's storage (bf16 bits or fp32)."""
    return np.ascontiguousarray(a, np.float32) if f32 else bf16_bits(a)


def load_from(a, f32):
    return np.asarray(a, np.float64) if f32 else bits_to_f64(a)


def gin(f32):
    return np.float32 if f32 else np.uint16


def out_tol(f32):
    return TOL_F32 if f32 else TOL_BF16_OUT


# ---- norms / elementwise ----------------------------------------------------------------------

@STORAGE
@pytest.mark.parametrize("rows,H", [(1, 1), (3, 7), (5, 1000), (2, 5120)])
def test_rmsnorm_zero_centred(g, rows, H, f32):
    r = rng(rows * H)
    x = r.standard_normal((rows + 2, H)).astype(np.float32)
    w = (0.3 * r.standard_normal(H)).astype(np.float32)
    idx = r.permutation(rows + 2)[:rows].astype(np.int32)
    out = g.empty((rows, H), gin(f32))
    for use_idx in (0, 1):
        g.run("rmsnorm", (rows,), (256,), (out, g.put(x), g.put(w), g.put(idx), use_idx, H, 1e-6),
              dict(f32=f32))
        src = x[idx] if use_idx else x[:rows]
        src = src.astype(np.float64)
        ref = src / np.sqrt((src ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + w)
        assert rel_err(load_from(g.get(out), f32), ref) < out_tol(f32)


@STORAGE
@pytest.mark.parametrize("n,nv,dv", [(1, 1, 32), (3, 4, 128), (2, 3, 64)])
def test_gated_rmsnorm(g, n, nv, dv, f32):
    r = rng(n * nv + dv)
    x = r.standard_normal((n, nv * dv)).astype(np.float32)
    zs, zoff = nv * dv + 5, 3
    z = r.standard_normal((n, zs)).astype(np.float32)
    w = (1 + 0.2 * r.standard_normal(dv)).astype(np.float32)
    out = g.empty((n, nv * dv), gin(f32))
    g.run("gated_rmsnorm", (n, nv), (min(128, dv),), (out, g.put(x), g.put(z), zs, zoff, g.put(w), dv, 1e-6),
          dict(f32=f32))
    xh = x.astype(np.float64).reshape(n, nv, dv)
    zz = z[:, zoff: zoff + nv * dv].astype(np.float64).reshape(n, nv, dv)
    ref = xh / np.sqrt((xh ** 2).mean(-1, keepdims=True) + 1e-6) * w * silu(zz)
    assert rel_err(load_from(g.get(out), f32).reshape(n, nv, dv), ref) < out_tol(f32)


@STORAGE
@pytest.mark.parametrize("n,nv,dv", [(1, 1, 128), (5, 3, 128), (2, 4, 256), (3, 48, 128)])
def test_gated_rmsnorm4(g, n, nv, dv, f32):
    """A warp a (token, head) pair, four columns a lane, z at a 16-byte-aligned offset and
    stride; the block's tail warps past the last pair (pairs not a multiple of 4) idle."""
    r = rng(n * nv + dv + 1)
    x = r.standard_normal((n, nv * dv)).astype(np.float32)
    zs, zoff = nv * dv + 12, 8
    z = r.standard_normal((n, zs)).astype(np.float32)
    w = (1 + 0.2 * r.standard_normal(dv)).astype(np.float32)
    out = g.empty((n, nv * dv), gin(f32))
    g.run("gated_rmsnorm4", (-(-n * nv // 4),), (128,),
          (out, g.put(x), g.put(z), zs, zoff, g.put(w), nv, n * nv, 1e-6), dict(dv=dv, f32=f32))
    xh = x.astype(np.float64).reshape(n, nv, dv)
    zz = z[:, zoff: zoff + nv * dv].astype(np.float64).reshape(n, nv, dv)
    ref = xh / np.sqrt((xh ** 2).mean(-1, keepdims=True) + 1e-6) * w * silu(zz)
    assert rel_err(load_from(g.get(out), f32).reshape(n, nv, dv), ref) < out_tol(f32)


@STORAGE
@pytest.mark.parametrize("n,inter,off", [(1, 1, 0), (4, 255, 3), (2, 257, 0)])
def test_silu_mul(g, n, inter, off, f32):
    r = rng(inter)
    stride = 2 * inter + off + 1
    gu = r.standard_normal((n, stride)).astype(np.float32)
    out = g.empty((n, inter), gin(f32))
    g.run("silu_mul", (n, (inter + 255) // 256), (256,), (out, g.put(gu), stride, off, inter),
          dict(f32=f32))
    gg = gu.astype(np.float64)
    ref = silu(gg[:, off: off + inter]) * gg[:, off + inter: off + 2 * inter]
    assert rel_err(load_from(g.get(out), f32), ref) < out_tol(f32)


@STORAGE
@pytest.mark.parametrize("n,V,H", [(1, 5, 3), (7, 100, 257)])
def test_embed_gather(g, n, V, H, f32):
    r = rng(V * H)
    table = store_as(bits_to_f64(bf16_bits(r.standard_normal((V, H)))), f32)   # weights: bf16 values
    ids = r.integers(0, V, n).astype(np.int32)
    ids[0] = V - 1
    out = g.empty((n, H), np.float32)
    g.run("embed_gather", ((H + 255) // 256, n), (256,), (out, g.put(table), g.put(ids), H),
          dict(f32=f32))
    assert np.array_equal(g.get(out), load_from(table, f32)[ids].astype(np.float32))


# ---- GEMM ---------------------------------------------------------------------------------------

# (M past 8: the algorithm of the next power of two's rows, cublaslt.algo_rows)
@pytest.mark.parametrize("m,n,k", [(1, 1, 8), (3, 129, 64), (17, 256, 520), (8, 5120, 5120),
                                   (12, 40, 64), (65, 96, 128), (337, 256, 520)])
def test_cublaslt_gemm(g, m, n, k):
    from ninfer.core.cuda.cublaslt import CublasLt
    r = rng(m * n + k)
    ws = g.empty((32 << 20,), np.uint8)
    lt = CublasLt(ws.ptr, 32 << 20)
    x = bf16_bits(r.standard_normal((m, k)))
    w = bf16_bits(r.standard_normal((n, k)) / math.sqrt(k))
    y0 = r.standard_normal((m, n)).astype(np.float32)
    y = g.put(y0)
    lt.gemm(g.stream, g.put(x).ptr, g.put(w).ptr, y.ptr, m, n, k, beta=1.0)
    ref = bits_to_f64(x) @ bits_to_f64(w).T + y0
    assert rel_err(g.get(y), ref) < TOL_F32 * 10     # exact bf16 products, fp32 sums
    lt.gemm(g.stream, g.put(x).ptr, g.put(w).ptr, y.ptr, m, n, k)
    assert rel_err(g.get(y), bits_to_f64(x) @ bits_to_f64(w).T) < TOL_F32 * 10
    # w_kn: the second operand stored [k, n] (prefill attention's O = P @ V)
    wkn = np.ascontiguousarray(w.T)
    y2 = g.empty((m, n), np.float32)
    lt.gemm(g.stream, g.put(x).ptr, g.put(wkn).ptr, y2.ptr, m, n, k, w_kn=True)
    assert rel_err(g.get(y2), bits_to_f64(x) @ bits_to_f64(wkn)) < TOL_F32 * 10


# (M past 8: the algorithm of the next power of two's rows, cublaslt.algo_rows)
@pytest.mark.parametrize("m,n,k", [(1, 1, 8), (3, 129, 64), (17, 256, 520), (8, 5120, 5120),
                                   (12, 40, 64), (65, 96, 128), (337, 256, 520)])
def test_cublaslt_gemm_float32(g, m, n, k):
    """dtype="float32": fp32 X and W (not bf16-representable) under strict CUBLAS_COMPUTE_32F.
    TF32 (10-bit mantissa) would leave ~5e-4 here; fp32 sums leave < 1e-6."""
    from ninfer.core.cuda.cublaslt import CublasLt
    r = rng(m * n + k + 1)
    ws = g.empty((32 << 20,), np.uint8)
    lt = CublasLt(ws.ptr, 32 << 20, f32=True)
    try:
        x = r.standard_normal((m, k)).astype(np.float32)
        w = (r.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32)
        y0 = r.standard_normal((m, n)).astype(np.float32)
        y = g.put(y0)
        lt.gemm(g.stream, g.put(x).ptr, g.put(w).ptr, y.ptr, m, n, k, beta=1.0)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        assert rel_err(g.get(y), ref + y0) < TOL_F32
        lt.gemm(g.stream, g.put(x).ptr, g.put(w).ptr, y.ptr, m, n, k)
        assert rel_err(g.get(y), ref) < TOL_F32
    finally:
        lt.close()


# ---- Gated DeltaNet: conv + gating + delta rule -------------------------------------------------

def _rows(r, lengths, ctxs):
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    token_row = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    return qs, token_row, np.asarray(ctxs, np.int32)


def _conv_case(seed, lengths, ctxs, pad):
    """Random inputs of the conv kernels' tests (K 4, dk 32, dv 64, nk 2, nv 4; projection rows
    `pad` columns wider than the conv's), and the oracle: outputs with q/k L2-normed, state."""
    K, dk, dv, nk, nv = 4, 32, 64, 2, 4
    C = 2 * nk * dk + nv * dv
    r = rng(seed)
    n, b = sum(lengths), len(lengths)
    P = C + pad
    proj = r.standard_normal((n, P)).astype(np.float32)
    w = (0.5 * r.standard_normal((C, K))).astype(np.float32)
    slots = r.permutation(b + 2)[:b].astype(np.int32)
    state = r.standard_normal((b + 2, C, K - 1)).astype(np.float32)
    qs, token_row, ctx = _rows(r, lengths, ctxs)
    ref, ref_state = conv_oracle(proj, P, w, state, qs, ctx, slots, K)
    qk = ref[:, :2 * nk * dk].reshape(n, 2 * nk, dk)
    qk = qk / np.sqrt((qk ** 2).sum(-1, keepdims=True) + 1e-6)
    qk[:, :nk] *= 1 / math.sqrt(dk)
    ref[:, :2 * nk * dk] = qk.reshape(n, -1)
    return SimpleNamespace(K=K, C=C, n=n, b=b, P=P, proj=proj, w=w, slots=slots, state=state,
                           qs=qs, token_row=token_row, ctx=ctx, heads=2 * nk + nv, ref=ref,
                           ref_state=ref_state, params=dict(K=K, dk=dk, dv=dv, nk=nk, nv=nv))


@pytest.mark.parametrize("lengths,ctxs", [([1], [0]), ([1, 1, 1], [5, 0, 2]), ([2, 7, 1], [3, 0, 9])])
def test_conv_silu_l2norm_and_state(g, lengths, ctxs):
    c = _conv_case(sum(lengths) * 31 + sum(ctxs), lengths, ctxs, 11)
    out = g.empty((c.n, c.C), np.float32)
    dstate, dproj = g.put(c.state), g.put(c.proj)
    decode = int(c.n == c.b)    # one token per row: the conv kernel updates the state itself
    args = (out, dproj, c.P, g.put(c.w), dstate, g.put(c.token_row), g.put(c.qs), g.put(c.ctx),
            g.put(c.slots), decode)
    g.run("conv_silu", (c.n, c.heads), (64,), args, c.params)
    if not decode:
        g.run("conv_state_update", ((c.C + 127) // 128, c.b), (128,),
              (dstate, dproj, c.P, g.put(c.qs), g.put(c.ctx), g.put(c.slots)),
              dict(K=c.K, C=c.C))
    assert rel_err(g.get(out), c.ref) < TOL_F32
    assert rel_err(g.get(dstate), c.ref_state) < TOL_F32


@pytest.mark.parametrize("lengths,ctxs", [([5, 20, 3], [0, 3, 2]), ([40], [7]), ([1, 2], [0, 5])])
def test_conv_silu_chunk(g, lengths, ctxs):
    """A prefill's conv 16 tokens a block (rows starting and ending inside blocks, a row across
    blocks): the oracle's outputs, and the same bits as conv_silu's (a decode row beside a
    prefill row takes this kernel: batch-invariant mode needs them equal)."""
    c = _conv_case(sum(lengths) * 7 + sum(ctxs), lengths, ctxs, 12)
    common = (g.put(c.proj), c.P, g.put(c.w), g.put(c.state), g.put(c.token_row), g.put(c.qs),
              g.put(c.ctx), g.put(c.slots))
    out, old = g.empty((c.n, c.C), np.float32), g.empty((c.n, c.C), np.float32)
    g.run("conv_silu_chunk", (-(-c.n // 16), c.heads), (64,), (out,) + common + (c.n,), c.params)
    g.run("conv_silu", (c.n, c.heads), (64,), (old,) + common + (0,), c.params)
    got = g.get(out)
    assert rel_err(got, c.ref) < TOL_F32
    assert np.array_equal(got, g.get(old))


@pytest.mark.parametrize("lengths,ctxs,dk,dv", [([1], [0], 32, 32), ([1, 1], [4, 0], 128, 128),
                                                ([5, 1, 9], [0, 3, 2], 64, 32)])
def test_gdn_recurrent(g, lengths, ctxs, dk, dv):
    nk, nv = 2, 4
    r = rng(dk + dv + sum(lengths))
    n, nb = sum(lengths), len(lengths)
    qs, token_row, ctx = _rows(r, lengths, ctxs)
    qkv, proj, P, a_off, b_off, A_log, dt_bias = gdn_inputs(r, dk, dv, nk, nv, n)
    slots = (r.permutation(nb + 1)[:nb]).astype(np.int32)
    state = (0.3 * r.standard_normal((nb + 1, nv, dk, dv))).astype(np.float32)
    out = g.empty((n, nv * dv), np.float32)
    dstate = g.put(state)
    g.run("gdn_recurrent", (nb, nv, dv // 32), (128,),
          (out, g.put(qkv), g.put(proj), P, a_off, b_off, g.put(A_log), g.put(dt_bias), dstate,
           g.put(qs), g.put(ctx), g.put(slots)), dict(dk=dk, dv=dv, nk=nk, nv=nv))
    ref, ref_state = gated_delta_rows(qkv, proj, a_off, b_off, A_log, dt_bias, state, slots, ctx,
                                      qs, nk, nv, dk, dv)
    assert rel_err(g.get(out).reshape(n, nv, dv), ref) < 1e-5
    assert rel_err(g.get(dstate), ref_state) < 1e-5


# ---- attention: q/k norm + MRoPE + paged KV write, paged attention + gate ----------------------

def mrope_angles(pos3, rot, theta, sections, interleaved):
    half = rot // 2
    inv = 1.0 / theta ** (np.arange(half) * 2.0 / rot)
    axis = np.zeros(half, int)
    for i in range(half):
        if interleaved:
            if i % 3 == 1 and i < 3 * sections[1]:
                axis[i] = 1
            elif i % 3 == 2 and i < 3 * sections[2]:
                axis[i] = 2
        else:
            axis[i] = 0 if i < sections[0] else (1 if i < sections[0] + sections[1] else 2)
    p = pos3[axis, :].T.astype(np.float64)                  # [N, half]
    return p * inv


def rope_oracle(x, ang, rot):
    half = rot // 2
    out = x.copy()
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:rot]
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rot] = x2 * c + x1 * s
    return out


def zc_norm(x, w, eps=1e-6):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * (1 + w)


@STORAGE
@pytest.mark.parametrize("hd,rot,nh,nkv,secs,inter", [(64, 16, 4, 2, (3, 3, 2), True),
                                                      (256, 64, 6, 1, (11, 11, 10), True),
                                                      (128, 32, 2, 2, (6, 5, 5), False)])
def test_qk_norm_rope_kv_write(g, hd, rot, nh, nkv, secs, inter, f32):
    r = rng(hd + nh)
    lengths, ctxs, ps = [3, 1], [5, 17], 4
    n, b = sum(lengths), len(lengths)
    qs, token_row, ctx = _rows(r, lengths, ctxs)
    P = 2 * nh * hd + 2 * nkv * hd
    proj = r.standard_normal((n, P)).astype(np.float32)
    qn, kn = (0.2 * r.standard_normal((2, hd))).astype(np.float32)
    num_pages, p_cap = 16, 8
    bt = np.full((b, p_cap), -1, np.int32)
    perm = r.permutation(num_pages)
    for row in range(b):
        need = (ctx[row] + lengths[row] + ps - 1) // ps
        bt[row, :need] = perm[row * 6: row * 6 + need]
    n_cap = n + 3
    pos = np.zeros((3, n_cap), np.int32)
    pos[:, :n] = r.integers(0, 2048, (3, n))
    kc = g.empty((num_pages, ps, nkv, hd), gin(f32), poison=0)
    vc = g.empty((num_pages, ps, nkv, hd), gin(f32), poison=0)
    qout = g.empty((n, nh, hd), np.float32)
    g.run("qk_norm_rope_kv", (n, nh + nkv), (hd,),
          (qout, g.put(proj), P, g.put(qn), g.put(kn), kc, vc, g.put(pos), n_cap, g.put(token_row),
           g.put(qs), g.put(ctx), g.put(bt), p_cap, ps, 1e6, 1e-6),
          dict(hd=hd, rot=rot, nh=nh, nkv=nkv, sec_t=secs[0], sec_h=secs[1], sec_w=secs[2],
               interleaved=inter, f32=f32))
    ang = mrope_angles(pos[:, :n], rot, 1e6, secs, inter)
    pr = proj.astype(np.float64)
    q = pr[:, :2 * nh * hd].reshape(n, nh, 2 * hd)[:, :, :hd]
    qref = rope_oracle(zc_norm(q, qn), ang[:, None, :], rot)
    assert rel_err(g.get(qout), qref) < TOL_ROPE_F32
    k = pr[:, 2 * nh * hd: 2 * nh * hd + nkv * hd].reshape(n, nkv, hd)
    v = pr[:, 2 * nh * hd + nkv * hd:].reshape(n, nkv, hd)
    kref = rope_oracle(zc_norm(k, kn), ang[:, None, :], rot)
    kcache, vcache = load_from(g.get(kc), f32), load_from(g.get(vc), f32)
    # fp32 pools: k carries the rotary angles' error, v is copied exactly
    ktol, vtol = (TOL_ROPE_F32, 0.0) if f32 else (TOL_BF16_OUT, TOL_BF16_OUT)
    for t in range(n):
        row = token_row[t]
        p = ctx[row] + t - qs[row]
        page, off = bt[row, p // ps], p % ps
        assert rel_err(kcache[page, off], kref[t]) < ktol
        assert rel_err(vcache[page, off], v[t]) <= vtol


def attention_oracle(q, kcache, vcache, bt, ctx, qs, token_row, ps, gate, G):
    n, nh, hd = q.shape
    out = np.zeros((n, nh, hd))
    for t in range(n):
        row = token_row[t]
        L = ctx[row] + t - qs[row] + 1
        keys = np.arange(L)
        pages, offs = bt[row, keys // ps], keys % ps
        for h in range(nh):
            K = kcache[pages, offs, h // G]
            V = vcache[pages, offs, h // G]
            s = K @ q[t, h] / math.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ V
    return out * (1 / (1 + np.exp(-gate)))


@pytest.mark.parametrize("hd,G,nkv,lengths,ctxs,splits,GS", [
    (64, 2, 2, [1], [0], 1, 2), (64, 2, 2, [1, 1, 1], [0, 31, 100], 7, 2),
    (256, 6, 1, [1], [300], 32, 6), (128, 1, 3, [5, 3], [0, 9], 1, 1), (128, 4, 2, [4], [13], 3, 4),
    (256, 6, 2, [9, 2], [0, 40], 1, 3), (128, 4, 1, [3], [5], 2, 2),
    (256, 16, 2, [1, 3], [70, 0], 4, 8)])          # 122B-A10B / 397B-A17B: G = 16 in two blocks
@STORAGE
def test_paged_attention_and_gate(g, hd, G, nkv, lengths, ctxs, splits, GS, f32):
    r = rng(hd * G + sum(ctxs))
    nh, ps = G * nkv, 16
    n, b = sum(lengths), len(lengths)
    qs, token_row, ctx = _rows(r, lengths, ctxs)
    bt, p_cap, num_pages = page_tables(r, lengths, ctxs, ps)
    kbits = store_as(r.standard_normal((num_pages, ps, nkv, hd)), f32)     # fp32 pools: fp32 K/V
    vbits = store_as(r.standard_normal((num_pages, ps, nkv, hd)), f32)
    q = (2.0 * r.standard_normal((n, nh, hd))).astype(np.float32)
    P = 2 * nh * hd + 5
    proj = r.standard_normal((n, P)).astype(np.float32)
    part = g.empty((n * splits, nh, hd), np.float32)
    ml = g.empty((n * splits, nh, 2), np.float32)
    out = g.empty((n, nh * hd), gin(f32))
    args = [g.put(q), g.put(kbits), g.put(vbits), g.put(token_row), g.put(qs), g.put(ctx), g.put(bt),
            p_cap, ps, splits, 1 / math.sqrt(hd)]
    # one launch per token range [t0, t1) (t_base = t0: the runner's runs of short rows); with
    # several rows, the first row alone, then the rest
    for t0, t1 in ([(0, int(qs[1])), (int(qs[1]), n)] if b > 1 else [(0, n)]):
        g.run("paged_attention", (t1 - t0, nkv * (G // GS), splits), (128,),
              (part, ml, *args, t0), dict(hd=hd, G=G, nkv=nkv, GS=GS, f32=f32))
        g.run("attn_combine", *combine_launch(t1 - t0, nh, hd), (out, part, ml, g.put(proj), P, splits, t0),
              dict(hd=hd, nh=nh, f32=f32))
    gate = proj[:, :2 * nh * hd].reshape(n, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    ref = attention_oracle(q.astype(np.float64), load_from(kbits, f32), load_from(vbits, f32), bt,
                           ctx, qs, token_row, ps, gate, G)
    assert rel_err(load_from(g.get(out), f32).reshape(n, nh, hd), ref) < out_tol(f32)


# Decode attention on tensor cores (kernels/attention_mma.py): bf16 q and P into the mma, fp32
# accumulation (the simulator's float64 check: 0.9-3.1e-3). Pools poisoned (NaN) wherever no row
# owns a key, partials NaN first; the release geometries (G 4 / 6 / 8 at head_dim 256), splits
# past the keys (empty), several tiles a warp, prefill tokens, a launch from t_base > 0, G = 16
# in blocks of 8 heads.
@pytest.mark.parametrize("hd,G,nkv,lengths,ctxs,splits,ps,GS", [
    (256, 6, 4, [1] * 8, [0, 15, 16, 17, 300, 1000, 64, 2047], 17, 16, 6),   # 27B decode, B = 8
    (256, 4, 2, [1], [4095], 66, 16, 4),                                    # 9B / 2B, 66 splits
    (256, 8, 2, [1, 1], [70, 200], 1, 16, 8),                                # 35B-A3B, one split
    (64, 2, 2, [5, 3], [0, 33], 3, 32, 2),                                  # prefill, pages of 32
    (128, 6, 1, [9, 2], [0, 40], 2, 16, 6),
    (256, 6, 2, [1, 2], [37, 100], 5, 4, 6),                                 # pages of 4 keys
    (256, 16, 2, [1, 1], [90, 513], 3, 16, 8)])                              # 122B / 397B: G = 16
def test_paged_attention_mma(g, hd, G, nkv, lengths, ctxs, splits, ps, GS):
    r = rng(hd * G + sum(ctxs) + splits)
    nh = G * nkv
    n, b = sum(lengths), len(lengths)
    qs, token_row, ctx = _rows(r, lengths, ctxs)
    bt, p_cap, num_pages = page_tables(r, lengths, ctxs, ps)
    kbits = bf16_bits(r.standard_normal((num_pages, ps, nkv, hd)))
    vbits = bf16_bits(r.standard_normal((num_pages, ps, nkv, hd)))
    poison_unowned((kbits, vbits), bt, lengths, ctxs, ps)
    q = (2.0 * r.standard_normal((n, nh, hd))).astype(np.float32)
    P = 2 * nh * hd + 5
    proj = r.standard_normal((n, P)).astype(np.float32)
    part = g.put(np.full((n * splits, nh, hd), np.nan, np.float32))
    ml = g.put(np.full((n * splits, nh, 2), np.nan, np.float32))
    out = g.put(np.full((n, nh * hd), 0x7FC0, np.uint16))
    args = [g.put(q), g.put(kbits), g.put(vbits), g.put(token_row), g.put(qs), g.put(ctx), g.put(bt),
            p_cap, ps, splits, 1 / math.sqrt(hd)]
    for t0, t1 in ([(0, int(qs[1])), (int(qs[1]), n)] if b > 1 else [(0, n)]):
        g.run("paged_attention_mma", (t1 - t0, nkv * G // GS, splits), (128,),
              (part, ml, *args, t0), dict(hd=hd, G=G, nkv=nkv, **({"GS": GS} if GS != G else {})))
        g.run("attn_combine", *combine_launch(t1 - t0, nh, hd), (out, part, ml, g.put(proj), P, splits, t0),
              dict(hd=hd, nh=nh))
    gate = proj[:, :2 * nh * hd].reshape(n, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    kv = [bits_to_f64(x).reshape(x.shape) for x in (kbits, vbits)]
    ref = attention_oracle(q.astype(np.float64), *kv, bt, ctx, qs, token_row, ps, gate, G)
    assert rel_err(bits_to_f64(g.get(out)).reshape(n, nh, hd), ref) < TOL_BF16_OUT


@pytest.mark.parametrize("G,n_cols,first_len,rows", [(1, 8, 1, 3), (6, 520, 300, 12),
                                                      (4, 4104, 4000, 9), (2, 8192, 8100, 6)])
def test_causal_softmax_reg(g, G, n_cols, first_len, rows):
    """The softmax with the row in registers (the tensor-core prefill's rows of at most
    SOFTMAX_REG_COLS keys) against float64 and against the two-pass kernel: row r sees
    first_len + r // G keys, zeros past them up to n_cols (the poisoned output written)."""
    from ninfer.models.qwen3_5.cuda.attention_tc import SOFTMAX_REG_COLS
    assert n_cols <= SOFTMAX_REG_COLS
    r = rng(n_cols + rows)
    s = (4.0 * r.standard_normal((rows, n_cols))).astype(np.float32)
    scale = 0.125
    d_s = g.put(s)
    outs = []
    for name in ("causal_softmax_reg", "causal_softmax"):
        out = g.empty((rows, n_cols), np.uint16)
        g.run(name, (rows,), (256,), (out, d_s, n_cols, first_len, np.float32(scale)), dict(G=G))
        outs.append(bits_to_f64(g.get(out)))
    ref = np.zeros((rows, n_cols))
    for i in range(rows):
        v = first_len + i // G
        x = s[i, :v].astype(np.float64) * scale
        e = np.exp(x - x.max())
        ref[i, :v] = e / e.sum()
    assert rel_err(outs[0], ref) < TOL_BF16_OUT
    assert np.abs(outs[0] - outs[1]).max() <= 2.0 ** -8 * np.abs(ref).max()   # a bf16 ulp
    assert np.all(outs[0][ref == 0] == 0)


# Tensor-core prefill attention (cuda/attention_tc.py): bf16 q and bf16 softmax weights P into
# the cuBLASLt GEMMs, fp32 accumulation; a CPU emulation of those roundings gives 2.3-2.6e-3 on
# these shapes, within TOL_BF16_OUT. s_cap: S/P buffer elements (None: the model's default),
# small values force several query blocks per row (the last one partial).
@pytest.mark.parametrize("hd,G,nkv,lengths,ctxs,ps,s_cap", [
    (64, 2, 2, [5], [0], 16, None),                  # one short row from an empty context
    (64, 2, 2, [1], [7], 16, None),                  # one query token over a partial page
    (128, 1, 3, [9], [15], 4, None),                 # G = 1, keys cross page boundaries
    (128, 4, 2, [33, 17], [40, 0], 16, 4 * 80 * 3),  # two rows, 3 query tokens per block
    (20, 3, 2, [31], [6], 16, 3 * 40 * 7),           # odd_heads' head_dim 20: unaligned GEMM rows
    (256, 6, 1, [64], [300], 16, 6 * 368 * 5),       # 27B geometry, ctx > 0, 13 blocks
    (256, 6, 4, [130], [0], 16, None)])              # 27B head counts, one block
def test_prefill_attention_tensor_core(g, hd, G, nkv, lengths, ctxs, ps, s_cap):
    from ninfer.core.cuda.cublaslt import CublasLt
    from ninfer.models.qwen3_5.cuda import attention_tc as tc
    r = rng(hd * G + sum(ctxs) + len(lengths))
    nh = G * nkv
    n, b = sum(lengths), len(lengths)
    qs, token_row, ctx = _rows(r, lengths, ctxs)
    bt, p_cap, num_pages = page_tables(r, lengths, ctxs, ps)
    kbits = bf16_bits(r.standard_normal((num_pages, ps, nkv, hd)))
    vbits = bf16_bits(r.standard_normal((num_pages, ps, nkv, hd)))
    q = (2.0 * r.standard_normal((n, nh, hd))).astype(np.float32)
    P = 2 * nh * hd + 5
    proj = r.standard_normal((n, P)).astype(np.float32)
    sz = tc.buffer_sizes(nh, nkv, hd, n, p_cap * ps)
    if s_cap is not None:
        assert s_cap >= G * sz["l_cap"] and s_cap < sz["s"], "s_cap must force query blocks"
        sz["s"] = sz["p"] = s_cap
    # poisoned (NaN) buffers: the gather must zero the padded keys, every output be written
    bufs = {k: g.empty((sz[k],), dt) for k, dt in (("qb", np.uint16), ("o", np.float32),
                                                   ("kc", np.uint16), ("vc", np.uint16),
                                                   ("s", np.float32), ("p", np.uint16))}
    tb = tc.TcBuffers(**{k: a.ptr for k, a in bufs.items()}, t_cap=n, l_cap=sz["l_cap"],
                      s_cap=sz["s"])
    out = g.empty((n, nh * hd), np.uint16)
    ws = g.empty((32 << 20,), np.uint8)
    lt = CublasLt(ws.ptr, 32 << 20)
    params = {"q_to_bf16": dict(hd=hd, G=G, nkv=nkv), "kv_gather": dict(hd=hd, nkv=nkv),
              "causal_softmax": dict(G=G), "causal_softmax_reg": dict(G=G),
              "attn_gate_tc": dict(hd=hd, G=G, nkv=nkv)}
    d_q, d_k, d_v, d_bt, d_proj = g.put(q), g.put(kbits), g.put(vbits), g.put(bt), g.put(proj)
    for row in range(b):
        tc.attend_row(lambda name, grid, block, args: g.run(name, grid, block, args, params[name]),
                      lambda x, w, y, m, nn, k, w_kn: lt.gemm(g.stream, x, w, y, m, nn, k, 0.0, w_kn),
                      tb, hd, G, nkv, 1 / math.sqrt(hd), row=row, q_start=int(qs[row]),
                      n=lengths[row], ctx=int(ctx[row]), q=d_q.ptr, k_cache=d_k.ptr, v_cache=d_v.ptr,
                      block_tables=d_bt.ptr, bt_stride=p_cap, page_size=ps, out=out.ptr,
                      proj=d_proj.ptr, proj_stride=P)
    gate = proj[:, :2 * nh * hd].reshape(n, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    ref = attention_oracle(q.astype(np.float64), bits_to_f64(kbits), bits_to_f64(vbits), bt, ctx,
                           qs, token_row, ps, gate, G)
    assert rel_err(bits_to_f64(g.get(out)).reshape(n, nh, hd), ref) < TOL_BF16_OUT


# ---- MoE ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("E,K,norm,n", [(4, 2, True, 1), (256, 8, True, 5), (60, 3, False, 2)])
def test_router_topk(g, E, K, norm, n):
    r = rng(E * K + n)
    stride = E + 7
    logits = r.standard_normal((n, stride)).astype(np.float32)
    ids, wts = g.empty((n, K), np.int32), g.empty((n, K), np.float32)
    g.run("router_topk", (n,), (ROUTER_THREADS,), (ids, wts, g.put(logits), stride), dict(E=E, K=K, norm=norm))
    ref_ids, ref_w = router_oracle(logits, E, K, norm)
    assert np.array_equal(g.get(ids), ref_ids)
    assert rel_err(g.get(wts), ref_w) < TOL_F32


@STORAGE
@pytest.mark.parametrize("H,I,E,K,n", [(64, 32, 4, 2, 1), (2048, 512, 16, 8, 3)])
def test_grouped_experts_and_combine(g, H, I, E, K, n, f32):
    r = rng(H + I + n)
    # f32: fp32 activations; the weights keep bf16 values (a checkpoint's, widened at load)
    x = store_as(r.standard_normal((n, H)), f32)
    wgu = store_as(bits_to_f64(bf16_bits(r.standard_normal((E, 2 * I, H)) / math.sqrt(H))), f32)
    wd = store_as(bits_to_f64(bf16_bits(r.standard_normal((E, H, I)) / math.sqrt(I))), f32)
    pairs = (lambda a: a) if f32 else (lambda a: a.view(np.uint32))
    ids = np.stack([r.permutation(E)[:K] for _ in range(n)]).astype(np.int32)
    wts = r.random((n, K)).astype(np.float32)
    shared = r.standard_normal((n, H)).astype(np.float32)
    gst = 3
    glog = r.standard_normal((n, gst)).astype(np.float32)
    h0 = r.standard_normal((n, H)).astype(np.float32)
    act, y = g.empty((n * K, I), np.float32), g.empty((n * K, H), np.float32)
    h = g.put(h0)
    g.run("expert_gate_up", (n * K, (I + 3) // 4), (128,), (act, g.put(pairs(x)),
          g.put(pairs(wgu)), g.put(ids), K), dict(H=H, inter=I, f32=f32))
    g.run("expert_down", (n * K, -(-H // (4 * EXPERT_DOWN_ROWS))), (128,), (y, act, g.put(pairs(wd)), g.put(ids)),
          dict(H=H, inter=I, f32=f32))
    g.run("moe_combine", ((H + 255) // 256, n), (256,),
          (h, y, 0, 0, g.put(wts), g.put(shared), g.put(glog), gst), dict(H=H, K=K))
    xf, gu, dn = load_from(x, f32), load_from(wgu, f32), load_from(wd, f32)
    rounded = (lambda a: a) if f32 else bf16_round
    ref = h0.astype(np.float64) + shared / (1 + np.exp(-glog[:, :1].astype(np.float64)))
    for t in range(n):
        for k in range(K):
            e = ids[t, k]
            a = rounded(silu(gu[e, :I] @ xf[t]) * (gu[e, I:] @ xf[t]))   # act feeds a bf16 GEMM
            ref[t] += wts[t, k] * (dn[e] @ a)
    assert rel_err(g.get(h), ref) < out_tol(f32)
    # the same combine reading expert-sorted rows through a row map (grouped path)
    perm = r.permutation(n * K).astype(np.int32)
    y_sorted = np.empty_like(g.get(y))
    y_sorted[perm] = g.get(y)
    h2 = g.put(h0)
    g.run("moe_combine", ((H + 255) // 256, n), (256,),
          (h2, g.put(y_sorted), g.put(perm), 1, g.put(wts), g.put(shared), g.put(glog), gst),
          dict(H=H, K=K))
    assert np.array_equal(g.get(h2), g.get(h))


@STORAGE
@pytest.mark.parametrize("width", [300, 2048, 4104])
def test_gather_rows(g, f32, width):
    # rows as 32-bit words: whole 16-byte groups (2048; 4104 bf16 past one block of 512 words),
    # a partial group (300 bf16 = 150 words); one kernel for both storages
    from ninfer.models.qwen3_5.cuda.runner import GATHER_THREADS
    r = rng(11)
    x = store_as(r.standard_normal((9, width)), f32)
    words = x.nbytes // 9 // 4
    src = r.integers(0, 9, 23).astype(np.int32)
    out = g.empty((23, width), gin(f32))
    g.run("gather_rows", (23, -(-words // (4 * GATHER_THREADS))), (GATHER_THREADS,),
          (out, g.put(x), g.put(src), words))
    assert np.array_equal(g.get(out), x[src])


def _route_on_device(g, r, tokens, E, K, spec_, cap=0):
    """Skewed routing of `tokens` tokens laid out by the route kernels (count, scan, place) for
    block size cap: the pairs' expert ids, each expert's rows and the device arrays; asserts the
    layout is moe_rows' layout for that cap exactly (experts routed nothing, chunks whose last
    is partial; the rows no pair takes -1 up to E*cap + pairs)."""
    from ninfer.models.qwen3_5.cuda import moe_route, moe_rows
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    ids = np.stack([r.choice(E, K, replace=False, p=p / p.sum()) for _ in range(tokens)])
    ids = ids.reshape(-1).astype(np.int32)
    pairs = len(ids)
    bound = E * cap + pairs
    nb = moe_route.chunks(pairs)
    counts, rows = g.empty((nb * E,), np.int32), g.empty((E,), np.int32)
    first = g.empty((E,), np.int32)
    ptrs = g.empty((moe_route.NPTR, E), np.uint64)
    src, rop = g.empty((bound + 1,), np.int32, 0x7F), g.empty((pairs + 1,), np.int32)
    dids = g.put(ids)
    g.run("moe_route_count", (nb,), (moe_route.COUNT_THREADS,), (counts, dids, pairs), dict(E=E))
    g.run("moe_route_scan", (1,), (-(-E // 32) * 32,),
          (counts, rows, first, ptrs, g.put(spec_), src, nb, moe_route.NPTR, cap, pairs),
          dict(E=E))
    g.run("moe_route_place", (nb,), (32,), (src, rop, dids, counts, first, cap, pairs),
          dict(E=E, K=K))
    lay = moe_rows.expert_rows(ids, K, E, bound, cap=cap)
    total = np.bincount(ids, minlength=E)
    assert (total == 0).any() or tokens * K > 2 * E      # the small case routes some nothing
    assert np.array_equal(g.get(rows), total)
    want = np.full(bound, -1, np.int32)
    want[:lay.rows] = lay.src
    for e in range(E):                  # the host's padding rows read token 0; here -1
        want[e * cap + min(total[e], cap): (e + 1) * cap] = -1
    got = g.get(src)
    assert np.array_equal(got[:bound], want) and got[bound] == 0x7F7F7F7F
    assert np.array_equal(g.get(rop)[:pairs], lay.row_of_pair) and g.get(rop)[pairs] == -1
    return ids, total, rows, first, ptrs


def _expert_products(x, w, total):
    """float64 reference: each expert's consecutive rows of x times its weights' transpose."""
    first = np.concatenate([[0], np.cumsum(total)[:-1]])
    xf, wf = bits_to_f64(x), bits_to_f64(w)
    return np.concatenate([xf[first[e]: first[e] + total[e]] @ wf[e].T
                           for e in range(len(total))])


@pytest.mark.parametrize("tokens,E,K", [(3, 40, 4), (700, 64, 8), (1100, 256, 8)])
def test_moe_route_and_grouped_gemm(g, tokens, E, K):
    """The MoE prefill routed on the device (cuda/moe_route.py): the layout kernels give
    moe_rows' cap-0 layout exactly, and cuBLASLt's grouped GEMM over the rows and addresses they
    wrote gives each routed row its expert's product within fp32's error of float64 (bf16
    operands, fp32 out)."""
    from ninfer.core.cuda.cublaslt import CublasLt
    from ninfer.errors import DeviceError
    r = rng(tokens + E)
    pairs, N, Kd = tokens * K, 96, 200
    x = bf16_bits(r.standard_normal((pairs, Kd)))
    w = bf16_bits(0.1 * r.standard_normal((E, N, Kd)))
    xg, y = g.put(x), g.empty((pairs, N), np.float32)
    spec_ = np.array([xg.ptr, 2 * Kd, y.ptr, 4 * N, 0, 0, 0, 0], np.uint64)
    ids, total, rows, _, ptrs = _route_on_device(g, r, tokens, E, K, spec_)
    ws = g.empty((32 << 20,), np.uint8)
    lt = CublasLt(ws.ptr, 32 << 20)
    try:
        dims = g.put(np.repeat(np.array([N, Kd], np.int32), E))
        plan = lt.grouped_plan(N, Kd, E, rows.ptr, dims.ptr, dims.ptr + 4 * E, pairs // E)
    except DeviceError as exc:
        pytest.skip(f"no grouped GEMM in this cuBLASLt: {exc}")
    wd = g.put(w)
    wtab = g.put(np.uint64(wd.ptr) + np.arange(E, dtype=np.uint64) * np.uint64(2 * N * Kd))
    one = g.put(np.array([1.0, 0.0], np.float32))
    # the rows gathered by expert: x holds them in expert order already (the test's stand-in
    # for gather_rows); ptrs[0] / ptrs[1] are each expert's first row in xg / y
    lt.grouped_gemm(g.stream, plan, wtab.ptr, ptrs.ptr, ptrs.ptr + 8 * E, one.ptr, one.ptr + 4)
    assert rel_err(g.get(y), _expert_products(x, w, total)) < TOL_F32
    lt.close()


@pytest.mark.parametrize("tokens,E,K,N,Kd,cap", [
    (3, 40, 4, 128, 64, 0), (700, 64, 8, 192, 256, 0), (1100, 256, 8, 1024, 2048, 0),
    (900, 256, 8, 2048, 512, 0), (700, 64, 8, 192, 256, 80), (1100, 256, 8, 1024, 2048, 32)])
def test_moe_route_and_own_grouped_gemm(g, tokens, E, K, N, Kd, cap):
    """Our grouped GEMM (kernels/grouped_gemm.py, where cuBLASLt has none): moe_route_tiles'
    work list from the counts the route kernels wrote (tiles of 64 rows of the rows past a
    padded block of cap rows an expert: every row for cap 0; -1 past the last), then each of
    those rows' product within fp32's error of float64, every one written over a NaN-poisoned
    output and the block's rows and the rows past the layout untouched, at k steps of 32 and
    (k allowing) 64; the 35B-A3B's gate|up (1024 x 2048) and down (2048 x 512) among the shapes."""
    from ninfer.models.qwen3_5.cuda import moe_route
    r = rng(tokens + E + N + cap)
    pairs = tokens * K
    spec_ = np.zeros(8, np.uint64)
    ids, total, rows, first, _ = _route_on_device(g, r, tokens, E, K, spec_, cap)
    over = np.maximum(total - cap, 0)
    assert cap == 0 or ((over > 0).any() and (total < cap).any())
    used_rows = E * cap + int(over.sum())
    x = bf16_bits(r.standard_normal((used_rows, Kd)))
    w = bf16_bits(r.standard_normal((E, N, Kd)) / np.sqrt(Kd))
    xg = g.put(x)
    tc = moe_route.tile_cap(pairs, E)
    tiles = g.empty((3 * tc,), np.int32)
    g.run("moe_route_tiles", (1,), (-(-E // 32) * 32,), (tiles, rows, first, cap, tc),
          dict(E=E, BM=moe_route.GEMM_BM))
    t = g.get(tiles).reshape(3, tc)
    used = int(sum(-(-int(m) // moe_route.GEMM_BM) for m in over))
    f = E * cap + np.concatenate([[0], np.cumsum(over)[:-1]])
    assert np.array_equal(g.get(first), f)
    want = [(e, f[e] + j * 64, min(64, over[e] - j * 64)) for e in range(E)
            for j in range(-(-int(over[e]) // 64))]
    assert [tuple(int(v) for v in t[:, i]) for i in range(used)] == want
    assert (t[0, used:] == -1).all()
    dw = g.put(w)
    ref = _expert_products(x[E * cap:], w, over)
    # k steps of 32, and of 64 where Kd is whole steps of it (the route's grouped_gemm64)
    for bk in (32, 64) if Kd % 64 == 0 else (32,):
        y = g.empty((used_rows + 3, N), np.float32)
        g.run("grouped_gemm", (tc, N // moe_route.GEMM_BN), (moe_route.GEMM_THREADS,),
              (y, xg, dw, tiles, tc, N, Kd), {} if bk == moe_route.GEMM_BK else dict(BK=bk))
        got = g.get(y)
        assert np.isnan(got[:E * cap]).all() and np.isnan(got[used_rows:]).all(), bk
        assert np.isfinite(got[E * cap:used_rows]).all(), bk
        assert rel_err(got[E * cap:used_rows], ref) < TOL_F32, bk


@pytest.mark.parametrize("M,n,k,beta", [(1, 1281, 2048, 0.0), (3, 7, 256, 1.0),
                                        (8, 2048, 512, 1.0), (5, 300, 5120, 0.0)])
def test_gemv(g, M, n, k, beta):
    """The decode GEMV (kernels/gemv.py): every token's row within fp32's error of float64, over
    a poisoned output (beta 0) and a live one (beta 1), the unrolled and the tail loops."""
    from ninfer.models.qwen3_5.cuda.runner import GEMV_WARPS
    r = rng(M * n + k)
    x, w = bf16_bits(r.standard_normal((M, k))), bf16_bits(0.05 * r.standard_normal((n, k)))
    y0 = r.standard_normal((M, n)).astype(np.float32)
    y = g.put(y0) if beta else g.empty((M, n), np.float32)
    g.run("gemv", (-(-n // GEMV_WARPS),), (32 * GEMV_WARPS,),
          (y, g.put(x.view(np.uint32)), g.put(w.view(np.uint32)), n, k // 2, beta), dict(M=M))
    want = bits_to_f64(x) @ bits_to_f64(w).T + beta * y0
    assert rel_err(g.get(y), want) < TOL_F32


# ---- sampling -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,V", [(1, 1), (3, 1025), (2, 248320)])
def test_argmax_ties_lowest(g, n, V):
    r = rng(V)
    logits = r.standard_normal((n, V)).astype(np.float32)
    if V > 10:
        logits[0, 3] = logits[0, V - 2] = logits[0].max() + 1     # tie -> the lower id
    out = g.empty((n,), np.int32)
    g.run("argmax", (n,), (1024,), (out, g.put(logits), V))
    assert np.array_equal(g.get(out), np.argmax(logits, -1))
