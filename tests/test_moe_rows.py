"""The MoE prefill's routed-row layout (ninfer/models/qwen3_5/cuda/moe_rows.py), on the host.

The layout is checked by what the GPU path does with it: gather x rows by `src`, run one strided
batch over the padded block plus one product per overflow expert, read each pair's output through
`row_of_pair`. Emulated here in float64 with per-expert matrices, it must equal the direct
per-pair product, whatever cap the chooser or the test picks."""
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer.models.qwen3_5.cuda import moe_rows as mr
from ninfer.models.qwen3_5.cuda.kernel_set import qmma_name
from ninfer.models.qwen3_5.cuda.runner import grouped_rows


def _route(rng, n, E, K, skew=0.0):
    p = np.exp(skew * rng.standard_normal(E))
    p /= p.sum()
    return np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(n)]).reshape(-1)


def _emulate(lay, ids, x, W, K):
    """y[pair] through the layout: block products, overflow products, then the pair map."""
    E = W.shape[0]
    rows = np.full((lay.rows, W.shape[1]), np.nan)
    xg = x[lay.src]                                    # gather (padding rows read token 0)
    c = lay.cap
    for e in range(E):                                 # the strided batch: every expert, cap rows
        rows[e * c:(e + 1) * c] = xg[e * c:(e + 1) * c] @ W[e].T
    for e, r0, cnt in lay.overflow:
        rows[r0:r0 + cnt] = xg[r0:r0 + cnt] @ W[e].T
    return rows[lay.row_of_pair]


@pytest.mark.parametrize("n,E,K,skew,cap", [(1, 8, 2, 0.0, None), (37, 8, 2, 0.0, None),
                                            (200, 16, 4, 2.0, None), (64, 8, 8, 0.0, None),
                                            (50, 8, 2, 0.0, 0), (50, 8, 2, 0.0, 16),
                                            (300, 32, 4, 3.0, 16), (5, 64, 8, 0.0, None)])
def test_layout_reproduces_the_per_pair_products(n, E, K, skew, cap):
    rng = np.random.default_rng(n * 131 + E)
    ids = _route(rng, n, E, K, skew)
    H, N = 6, 5
    x = rng.standard_normal((n, H))
    W = rng.standard_normal((E, N, H))
    lay = mr.expert_rows(ids, K, E, grouped_rows(n, K, E), cap=cap)
    want = np.einsum("ph,pnh->pn", x[np.arange(n * K) // K], W[ids])
    got = _emulate(lay, ids, x, W, K)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    # every pair has its own row, inside its expert's block slot or its overflow range
    assert len(np.unique(lay.row_of_pair)) == n * K
    counts = np.bincount(ids, minlength=E)
    assert lay.rows == E * lay.cap + sum(max(0, int(c) - lay.cap) for c in counts)
    assert [e for e, _, _ in lay.overflow] == [e for e in range(E) if counts[e] > lay.cap]
    if cap is not None:
        assert lay.cap == cap


def test_chooser_prefers_one_batch_for_balanced_routing_and_overflow_for_a_hot_expert():
    rng = np.random.default_rng(7)
    E, K, n = 256, 8, 4096
    ids = _route(rng, n, E, K)
    lay = mr.expert_rows(ids, K, E, grouped_rows(n, K, E))
    counts = np.bincount(ids, minlength=E)
    assert lay.cap >= 16 and lay.rows <= 1.5 * n * K and len(lay.overflow) <= 8
    # one expert gets a tenth of the pairs: it overflows rather than padding every expert to it
    hot = ids.copy()
    hot[: n * K // 10] = 3
    counts = np.bincount(hot, minlength=E)
    lay = mr.expert_rows(hot, K, E, grouped_rows(n, K, E))
    assert 3 in [e for e, _, _ in lay.overflow] and lay.cap < counts[3]
    assert lay.rows <= grouped_rows(n, K, E)


def test_chooser_respects_the_row_budget_and_falls_back_to_per_expert_products():
    counts = np.array([40, 1, 1, 1])
    # launches expensive: the largest block the budget allows. 100 rows take a 16-row block
    # (64 padded + 24 overflow rows), not 32 (136); 60 rows not even that (88) -> no block
    assert mr.choose_cap(counts, max_rows=100, launch_rows=10**6) == 16
    assert mr.choose_cap(counts, max_rows=60, launch_rows=10**6) == 0
    # launches free: padding never pays
    assert mr.choose_cap(counts, max_rows=10**6, launch_rows=0) == 0
    # launches expensive, room enough: one batch covering the hot expert
    assert mr.choose_cap(counts, max_rows=10**6, launch_rows=10**6) == 48


def test_bad_router_ids_are_rejected():
    with pytest.raises(ValueError, match="outside"):
        mr.expert_rows(np.array([0, 9]), 2, 8, 100)
    with pytest.raises(ValueError, match="top-2"):
        mr.expert_rows(np.array([0, 1, 2]), 2, 8, 100)
    with pytest.raises(ValueError, match="exceed"):
        mr.expert_rows(np.array([0, 0, 0, 0]), 2, 8, 10, cap=16)


# ---- StepRunner.experts_grouped: the layout's offsets on the device side, both dtypes -------------

def _bf16(a):
    u = np.asarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)      # round to nearest even


def _f32_of(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


class _Mem:
    """Device memory as one byte array (base 1<<40) and pinned host buffers as byte arrays."""
    BASE = 1 << 40

    def __init__(self, nbytes):
        self.mem, self.used, self.host = np.zeros(nbytes, np.uint8), 0, {}

    def take(self, shape, dtype, what=""):
        from ninfer.core.cuda.arena import DeviceArray, _round_up
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        nbytes = _round_up(max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1))
        assert self.used + nbytes <= self.mem.size, what
        a = DeviceArray(self.BASE + self.used, shape, dtype)
        self.used += nbytes
        return a

    def bytes(self, ptr, n):
        for base, buf in self.host.items():
            if base <= ptr < base + buf.size:
                assert ptr - base + n <= buf.size, "host access past a pinned buffer"
                return buf[ptr - base: ptr - base + n]
        off = ptr - self.BASE
        assert 0 <= off and off + n <= self.used, "device access outside what was taken"
        return self.mem[off: off + n]

    def arr(self, a, dtype=None):
        dt = np.dtype(dtype or a.dtype)
        return self.bytes(a.ptr, a.nbytes).view(dt)

    def pinned(self, nbytes):
        mem, base = self, (1 << 30) * (len(self.host) + 1)
        self.host[base] = np.zeros(nbytes, np.uint8)

        class P:
            ptr = base

            def view(self, dtype, offset, count):
                return mem.bytes(base + offset, count * np.dtype(dtype).itemsize).view(dtype)
        return P()


def _grouped_rig(monkeypatch, f32, n, cfg_kw):
    from ninfer.models.qwen3_5.config import TextConfig
    from ninfer.models.qwen3_5.cuda import runner as R
    cfg = TextConfig(layer_types=("linear_attention", "full_attention"), num_hidden_layers=2,
                     **cfg_kw)
    mem = _Mem(64 << 20)
    gin = np.float32 if f32 else np.uint16
    ws = R.Workspace(mem, cfg, n, 8, 8, 64, f32=f32)
    K, E, H, I = cfg.num_experts_per_tok, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gu_w, dn_w = mem.take((E, 2 * I, H), gin), mem.take((E, H, I), gin)
    decoded = {}                # packed experts' codes address -> float64 [E, n, k] values

    def gemm(st, x, w, y, m, nn, k, beta=0.0, w_kn=False, batch=1, strides=(0, 0, 0), ldc=0):
        ldc = ldc or nn                     # y's row stride (CublasLt.gemm's ldc)
        ab = 4 if f32 else 2
        for i in range(batch):              # product i at element offsets i * strides (w, x, y)
            def operand(ptr, shape):
                raw = mem.bytes(ptr, int(np.prod(shape)) * ab).view(gin)
                return (raw if f32 else _f32_of(raw)).astype(np.float64).reshape(shape)
            X = operand(x + ab * i * strides[1], (m, k))
            W = operand(w + ab * i * strides[0], (nn, k))
            Y = mem.bytes(y + 4 * i * strides[2], 4 * ((m - 1) * ldc + nn)).view(np.float32)
            R = X @ W.T
            for r in range(m):
                Y[r * ldc: r * ldc + nn] = R[r]

    class Kernel:
        def __init__(self, name):
            self.name = name

        def launch(self, st, grid, block, args, smem=0):
            if self.name == "gather_rows":
                out, x, route, words = args        # rows of 32-bit words
                rows = grid[0]
                assert block == (R.GATHER_THREADS,) and grid[1] * 4 * block[0] >= words
                src = mem.arr(route, np.int32)[:rows]
                mem.arr(out, np.uint32)[: rows * words].reshape(rows, words)[:] = \
                    mem.arr(x, np.uint32).reshape(-1, words)[src]
            elif self.name == "qmma":
                # the grouped mode only (moe_rows.expert_groups), weights from `decoded`
                y, x, w, _, _, _, nn, k, ldy, *_, ids, topk, _, _, _ = \
                    [getattr(a, "ptr", a) for a in args]
                assert topk == -1 and grid[0] == -(-nn // 16)
                table = mem.bytes(ids, 12 * grid[1]).view(np.int32).reshape(-1, 3)
                for e, r0, cnt in table.tolist():
                    X = _f32_of(mem.bytes(x + 2 * k * r0, 2 * k * cnt).view(np.uint16))
                    Y = mem.bytes(y + 4 * ldy * r0, 4 * ldy * cnt).view(np.float32)
                    Y.reshape(cnt, ldy)[:, :nn] = X.reshape(cnt, k).astype(np.float64) @ \
                        decoded[w][e].T
            elif self.name == "silu_mul":
                out, gu, stride, off, inter = args
                rows = grid[0]
                g = mem.arr(gu).reshape(-1, stride)[:rows].astype(np.float64)
                a = g[:, off: off + inter] / (1 + np.exp(-g[:, off: off + inter])) * \
                    g[:, off + inter: off + 2 * inter]
                mem.arr(out)[: rows * inter] = (a.astype(np.float32) if f32 else
                                                _bf16(a)).reshape(-1)
            else:
                raise AssertionError(self.name)

    drv = SimpleNamespace(
        copy_dtoh_async=lambda dst, src, nb, st: mem.bytes(dst, nb).__setitem__(
            slice(None), mem.bytes(src, nb)),
        copy_htod_async=lambda dst, src, nb, st: mem.bytes(dst, nb).__setitem__(
            slice(None), mem.bytes(src, nb)))
    monkeypatch.setattr(R, "_d", drv)
    kernels = {"gather_rows": Kernel("gather_rows"), "silu_mul": Kernel("silu_mul"),
               qmma_name("fp8_block", False, 1): Kernel("qmma")}
    # (specs: what the kernel set holds, as KernelSet.specs: the runner takes silu_mul4 only
    # where the set has it)
    res = R.StepResources(cfg=cfg, ws=ws, weights={}, lt=SimpleNamespace(gemm=gemm),
                          kernels=SimpleNamespace(specs=dict.fromkeys(kernels), **kernels),
                          num_sms=1, b_cap=1, moe_gemv_tokens=1, n_cap=n,
                          route_host=mem.pinned((R.grouped_rows(n, K, E) + 2 * n * K) * 4),
                          media=None)
    runner = R.StepRunner(res, invariant=False, attn_tc_min_tokens=64)
    return runner, mem, ws, cfg, {"experts_gu": gu_w, "experts_down": dn_w}, decoded


@pytest.mark.parametrize("f32", [False, True], ids=["bf16", "f32"])
@pytest.mark.parametrize("cap", [None, 0, 16, 32])
def test_experts_grouped_offsets_match_per_pair_products(monkeypatch, f32, cap):
    """The runner's gather, strided batch, overflow GEMMs (byte offsets of xg / gu / gact / my by
    element size) and the pair -> row map, run over fake device memory with numpy kernels and
    GEMMs in float64: each pair's output row equals its expert's SwiGLU product. A skewed
    routing makes caps 16 / 32 overflow; cap 0 is one product per expert."""
    n = 40
    runner, mem, ws, cfg, lw, _ = _grouped_rig(monkeypatch, f32, n, dict(
        hidden_size=24, is_moe=True, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=10, shared_expert_intermediate_size=12, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=50))
    rng = np.random.default_rng(5)
    E, K, H, I = 8, 2, 24, 10
    ids = _route(rng, n, E, K, skew=2.0).astype(np.int32)
    counts = np.bincount(ids, minlength=E)
    assert counts.max() > 32                        # caps 16 and 32 overflow
    x = rng.standard_normal((n, H)).astype(np.float32)
    Wgu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) / 4
    Wdn = rng.standard_normal((E, H, I)).astype(np.float32) / 4
    enc = (lambda a: a) if f32 else _bf16
    dec = (lambda a: a.astype(np.float64)) if f32 else (lambda a: _f32_of(a).astype(np.float64))
    mem.arr(ws.x)[: n * H] = enc(x).reshape(-1)
    mem.arr(lw["experts_gu"])[:] = enc(Wgu).reshape(-1)
    mem.arr(lw["experts_down"])[:] = enc(Wdn).reshape(-1)
    mem.arr(ws.ids)[: n * K] = ids
    mem.arr(ws.my)[:] = np.nan
    runner.moe_cap = cap
    runner.experts_grouped(SimpleNamespace(synchronize=lambda: None), n, lw)
    got_cap, rows, n_over = runner.last_moe_layout
    if cap is not None:
        assert got_cap == cap and n_over == int(np.count_nonzero(counts > cap))
    R_ = ws.grouped_rows
    row_of_pair = mem.arr(ws.route, np.int32)[R_: R_ + n * K]
    my = mem.arr(ws.my).reshape(-1, H)
    xs, gu, dn = dec(enc(x)), dec(enc(Wgu)), dec(enc(Wdn))
    for p in range(n * K):
        e, t = ids[p], p // K
        g = gu[e] @ xs[t]
        act = g[:I] / (1 + np.exp(-g[:I])) * g[I:]
        act = act.astype(np.float32).astype(np.float64) if f32 else dec(_bf16(act))
        want = dn[e] @ act
        np.testing.assert_allclose(my[row_of_pair[p]], want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"pair {p} (expert {e}, row {row_of_pair[p]})")


def test_expert_groups_cut_each_experts_rows_in_eights():
    g = mr.expert_groups(((3, 0, 17), (0, 17, 1), (5, 18, 8)))
    assert g.dtype == np.int32 and [tuple(r) for r in g] == [
        (3, 0, 8), (3, 8, 8), (3, 16, 1), (0, 17, 1), (5, 18, 8)]
    assert mr.expert_groups(()).shape == (0, 3)
    assert [tuple(r) for r in mr.expert_groups(((1, 4, 5),), size=2)] == [(1, 4, 2), (1, 6, 2),
                                                                           (1, 8, 1)]


def test_packed_experts_prefill_reads_the_codes_in_groups(monkeypatch):
    """Packed experts the tensor-core GEMV takes: cap 0 (every expert's rows consecutive), the
    group table staged after the gathered rows' map, one grouped qmma launch per projection;
    each pair's output row equals its expert's SwiGLU product on the decoded weights."""
    from ninfer.models.qwen3_5.cuda import qweights as qw
    n, E, K, H, I = 40, 8, 2, 32, 16
    runner, mem, ws, cfg, _, decoded = _grouped_rig(monkeypatch, False, n, dict(
        hidden_size=H, is_moe=True, num_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=I, shared_expert_intermediate_size=16, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=50))
    rng = np.random.default_rng(7)
    lw = {}
    for name, (rows, k) in (("experts_gu", (2 * I, H)), ("experts_down", (H, I))):
        codes = mem.take((E, rows, k), np.uint8)
        scale = mem.take((E, 1, 1), np.float32)
        decoded[codes.ptr] = rng.standard_normal((E, rows, k)) / 4
        seg = SimpleNamespace(layout="fp8_block", asym=False, block=(128, 128), rows=rows,
                              row_bytes=k, w=codes, scale=scale, zero=None)
        lw[name] = qw.QMatrix((E, rows, k), (seg,))
    ids = _route(rng, n, E, K, skew=2.0).astype(np.int32)
    x = rng.standard_normal((n, H)).astype(np.float32)
    mem.arr(ws.x)[: n * H] = _bf16(x).reshape(-1)
    mem.arr(ws.ids)[: n * K] = ids
    mem.arr(ws.my)[:] = np.nan
    runner.moe_cap = 32                             # ignored: packed experts take cap 0
    runner.packed_grouped = True
    runner.experts_grouped(SimpleNamespace(synchronize=lambda: None), n, lw)
    counts = np.bincount(ids, minlength=E)
    assert runner.last_moe_layout == (0, n * K, int(np.count_nonzero(counts)))
    R_ = ws.grouped_rows
    row_of_pair = mem.arr(ws.route, np.int32)[R_: R_ + n * K]
    my = mem.arr(ws.my).reshape(-1, H)
    xs = _f32_of(_bf16(x)).astype(np.float64)
    gu, dn = decoded[lw["experts_gu"].segments[0].w.ptr], decoded[lw["experts_down"].segments[0].w.ptr]
    for p in range(n * K):
        e, t = ids[p], p // K
        g = gu[e] @ xs[t]
        act = _f32_of(_bf16(g[:I] / (1 + np.exp(-g[:I])) * g[I:])).astype(np.float64)
        np.testing.assert_allclose(my[row_of_pair[p]], dn[e] @ act, rtol=1e-5, atol=1e-5,
                                   err_msg=f"pair {p} (expert {e}, row {row_of_pair[p]})")
