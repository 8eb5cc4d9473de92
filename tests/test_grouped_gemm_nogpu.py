"""The device-routed MoE prefill's own grouped GEMM (kernels/grouped_gemm.py) and its work list
(kernels/moe.py moe_route_tiles) without a GPU: on numba-cuda's CPU simulator against numpy
(tests/gpu/sim_grouped_gemm.py), and its PTX for sm_90 (mma.sync bf16, no local memory)."""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL_F32 = 1e-5          # fp32 accumulation of bf16 products against float64 (gpu_harness.py)
TOL_BF16 = 2 ** -8 + 1e-6   # one bf16 rounding (its unit roundoff, relative) + fp32 math


def test_grouped_gemm_on_the_simulator():
    """Experts with 0, 1, 64 (one whole tile), 65 and 3 rows, two column blocks, two k steps:
    the work list exactly numpy's (tiles of 64 rows, experts in order, -1 past the last), every
    routed row's products within float32's error of float64 over the same bf16 operands, over a
    NaN-poisoned output whose rows past the layout stay untouched. Behind a padded block of 16
    rows an expert (cap16: experts short of it, at it, 1, 64 and 65 rows past it): the tiles
    cover the overflow rows alone, the block's rows untouched. At k steps of 64 (bk64) as at 32. routed_silu_mul within one bf16
    rounding of float64, the rows of src -1 untouched."""
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=f"{ROOT}:{ROOT / 'tests/gpu'}")
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_grouped_gemm.py")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    outs = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(outs) == {"small", "cap16", "bk64", "silu"}, outs
    silu = outs.pop("silu")          # the SwiGLU between the products, rows no pair took skipped
    assert silu["rows_past_untouched"] and silu["rel"] < TOL_BF16, silu
    for out in outs.values():
        assert out["tiles_exact"] and out["finite"] and out["rows_past_untouched"], out
        assert out["rel"] < TOL_F32, out


def test_grouped_gemm_compiles_to_tensor_core_ptx():
    """At the 35B-A3B's projections (gate|up: n 1024, k 2048; down: n 2048, k 512 share one
    kernel): bf16 mma.sync, 16-byte loads, shared memory for two padded tiles, no local memory
    (the accumulators and the next step's pieces in registers)."""
    pytest.importorskip("numba.cuda")
    from numba.core.errors import TypingError
    from ninfer.core.cuda import kernels as K
    from ninfer.models.qwen3_5.cuda.kernel_set import spec
    try:
        ptx = K.compile_spec(spec("grouped_gemm"), (9, 0))
        ptx64 = K.compile_spec(spec("grouped_gemm", BK=64), (9, 0))    # (k steps of 64)
        tiles = K.compile_spec(spec("moe_route_tiles", E=256, BM=64), (9, 0))
        silu = K.compile_spec(spec("routed_silu_mul"), (9, 0))
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        if isinstance(exc, TypingError):
            raise                  # (a kernel numba cannot type is a failure, not a skip)
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    from kernels import grouped_gemm as gg
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.global.nc.v4.u32" in ptx
    decl = lambda text, space: [int(x) for x in re.findall(   # noqa: E731
        rf"\.{space}\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]", text)]
    assert sum(decl(ptx, "shared")) == 4 * (gg.BM + gg.BN) * gg.SW
    assert sum(decl(ptx64, "shared")) == 4 * (gg.BM + gg.BN) * (64 // 2 + 4)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx64
    # the accumulators and the next step's pieces in registers
    assert all(sum(decl(text, "local")) == 0 for text in (ptx, ptx64, tiles, silu))
    assert gg.fits(1024, 2048) and gg.fits(2048, 512)
    assert not gg.fits(1000, 2048) and not gg.fits(1024, 2040)


def test_host_constants_match_the_kernel():
    """cuda/moe_route.py launches the kernel with its tile, threads and fit rule (the host does
    not import numba)."""
    pytest.importorskip("numba.cuda")
    from ninfer.core.cuda import numba_shim
    from ninfer.core.cuda.kernels import _import_kernel_module
    from ninfer.models.qwen3_5.cuda import moe_route
    numba_shim.import_numba_cuda()
    gg = _import_kernel_module("grouped_gemm")
    assert (moe_route.GEMM_BM, moe_route.GEMM_BN, moe_route.GEMM_BK, moe_route.GEMM_THREADS) \
        == (gg.BM, gg.BN, gg.BK, gg.THREADS)
    assert moe_route.SILU_THREADS == gg.SILU_THREADS
    # the wide k step where k is whole steps of it, else BK (own_gemm_fits' granule)
    assert moe_route.GEMM_BK_WIDE % gg.BK == 0
    assert [moe_route.gemm_kernel(k) for k in (2048, 512, 96, 32)] \
        == ["grouped_gemm64", "grouped_gemm64", "grouped_gemm", "grouped_gemm"]
    for n, k in ((1024, 2048), (2048, 512), (1000, 2048), (1024, 2040), (64, 32), (0, 32)):
        assert moe_route.own_gemm_fits(n, k) == gg.fits(n, k), (n, k)
    # the work list's bound: ceil(pairs / BM) + E entries hold any routing's tiles
    r = np.random.default_rng(0)
    for _ in range(200):
        E = int(r.integers(1, 300))
        rows = r.multinomial(int(r.integers(0, 5000)), np.ones(E) / E)
        assert int(sum(-(-int(m) // gg.BM) for m in rows)) <= moe_route.tile_cap(rows.sum(), E)


def test_device_cap_is_the_mean_and_a_margin_within_the_rows():
    """moe_route.device_cap: the mean rows an expert and a margin (itself up to CAP_MARGIN_ROWS),
    rounded up to whole CAP_ALIGN rows; never so large that the block and every pair (the most
    the overflow can take) pass the workspace's grouped_rows; 0 for no pairs."""
    from ninfer.models.qwen3_5.cuda import moe_route
    from ninfer.models.qwen3_5.cuda.moe_rows import CAP_ALIGN
    from ninfer.models.qwen3_5.cuda.runner import grouped_rows
    E, K = 256, 8
    # the 35B-A3B's best blocks measured (H100): T 64 -> 16, 512 -> 32, 1024 -> 64, 2048 -> 96,
    # 4096 -> 160 (the workspace of a 4096-token chunk holds 144), 8192 -> 272 (its bound)
    R = grouped_rows(8192, K, E)
    assert [moe_route.device_cap(t * K, E, R) for t in (64, 512, 1024, 2048, 4096, 8192)] \
        == [16, 32, 64, 96, 160, 272]
    assert moe_route.device_cap(4096 * K, E, grouped_rows(4096, K, E)) == 144
    assert moe_route.device_cap(0, E, R) == 0
    r = np.random.default_rng(0)
    for _ in range(300):
        E = int(r.integers(1, 600))
        K = int(r.integers(1, min(E, 16) + 1))
        n_cap = int(r.integers(1, 9000))
        n = int(r.integers(1, n_cap + 1))
        cap = moe_route.device_cap(n * K, E, grouped_rows(n_cap, K, E))
        assert cap % CAP_ALIGN == 0 and cap >= n * K / E          # at least the mean
        assert E * cap + n * K <= grouped_rows(n_cap, K, E)


def test_routed_prefill_launches_our_gemm_where_cublaslt_has_none():
    """StepRunner.experts_routed with the route bound to our GEMM (DeviceRoute.own): the layout
    kernels for the block size device_cap picks from the pairs (the rows past the block
    gathered and activated too: E*cap + pairs), the overflow's work list from the counts the
    scan wrote, then for gate|up and down a strided-batched cuBLASLt GEMM over the padded block
    (E experts of cap rows, each reading its expert where it was loaded) and our grouped GEMM
    over every tile entry and the projections' column blocks, SiLU-mul between; no grouped
    cuBLASLt call. A forced block of 0 (moe_cap) leaves it all to ours."""
    from types import SimpleNamespace
    from ninfer.models.qwen3_5.config import TextConfig
    from ninfer.models.qwen3_5.cuda import moe_route
    from ninfer.models.qwen3_5.cuda.runner import StepResources, StepRunner, grouped_rows
    cfg = TextConfig(hidden_size=2048, num_hidden_layers=1, layer_types=("linear_attention",),
                     is_moe=True, num_experts=256, num_experts_per_tok=8,
                     moe_intermediate_size=512, shared_expert_intermediate_size=512)
    buf = lambda name: SimpleNamespace(name=name, ptr=hash(name) & 0xFFFFFF0)   # noqa: E731
    route = SimpleNamespace(own=True, enabled=True, counts=buf("counts"), rows=buf("rows"),
                            first=buf("first"), ptrs=buf("ptrs"), spec=buf("spec"),
                            tiles=buf("tiles"))
    R = grouped_rows(512, 8, 256)
    ws = SimpleNamespace(route_dev=route, ids=buf("ids"), route=buf("route"), xg=buf("xg"),
                         x=buf("x"), gu=buf("gu"), gact=buf("gact"), my=buf("my"),
                         gin_bytes=2, grouped_rows=R)

    class Names:
        def __getattr__(self, name):
            return name
    calls = []

    class Lt:
        def gemm(self, st, x, w, y, m, n, k, beta, w_kn, batch, strides, ldc):
            calls.append(("lt.gemm", (x, w, y, m, n, k, batch, strides)))

        def __getattr__(self, name):
            raise AssertionError(f"cuBLASLt called: {name}")

    r = StepRunner(StepResources(cfg=cfg, ws=ws, weights={}, lt=Lt(), kernels=Names(),
                                 num_sms=1, b_cap=1, moe_gemv_tokens=1, n_cap=512,
                                 route_host=None, media=None),
                   invariant=False, attn_tc_min_tokens=64)
    r.launch = lambda st, name, grid, block, args, smem=0: calls.append((name, grid, block, args))
    lw = {"experts_gu": buf("w_gu"), "experts_down": buf("w_dn")}
    n = 300
    pairs = n * 8
    cap = moe_route.device_cap(pairs, 256, R)
    assert cap == 32                                # mean 10 rows an expert
    r.experts_routed(None, n, lw)
    names = [c[0] for c in calls]
    assert names == ["moe_route_count", "moe_route_scan", "moe_route_place", "gather_rows",
                     "moe_route_tiles", "lt.gemm", "grouped_gemm64", "routed_silu_mul",
                     "lt.gemm", "grouped_gemm64"]       # (k 2048 and 512: steps of 64)
    rows = 256 * cap + pairs
    assert calls[1][3][-2:] == (cap, pairs) and calls[2][3][-2:] == (cap, pairs)
    assert calls[3][1][0] == rows and calls[7][1][0] == rows
    assert calls[7][3] == (ws.gact, ws.gu, ws.route, 512)     # rows no pair took: skipped
    tc = moe_route.tile_cap(pairs, 256)
    tiles = calls[4]
    assert tiles[3] == (route.tiles, route.rows, route.first, cap, tc) and tiles[2] == (256,)
    assert calls[5][1] == (ws.xg.ptr, lw["experts_gu"].ptr, ws.gu.ptr, cap, 1024, 2048, 256,
                           (1024 * 2048, cap * 2048, cap * 1024))
    assert calls[8][1] == (ws.gact.ptr, lw["experts_down"].ptr, ws.my.ptr, cap, 2048, 512, 256,
                           (2048 * 512, cap * 512, cap * 2048))
    gu, dn = calls[6], calls[9]
    assert gu[1] == (tc, 1024 // moe_route.GEMM_BN) and dn[1] == (tc, 2048 // moe_route.GEMM_BN)
    assert gu[2] == dn[2] == (moe_route.GEMM_THREADS,)
    assert gu[3] == (ws.gu, ws.xg, lw["experts_gu"], route.tiles, tc, 1024, 2048)
    assert dn[3] == (ws.my, ws.gact, lw["experts_down"], route.tiles, tc, 2048, 512)
    calls.clear()
    r.moe_cap = 0
    r.experts_routed(None, n, lw)
    assert [c[0] for c in calls] == ["moe_route_count", "moe_route_scan", "moe_route_place",
                                     "gather_rows", "moe_route_tiles", "grouped_gemm64",
                                     "routed_silu_mul", "grouped_gemm64"]
    assert calls[3][1][0] == pairs and calls[4][3][3] == 0


def test_route_binds_our_gemm_where_cublaslt_has_none(monkeypatch):
    """DeviceRoute.bind: with no grouped GEMM in cuBLASLt the route is enabled on ours where the
    experts' projections fit it (the 35B-A3B's), uploading only the scan's row-address spec (no
    address tables, no plans); not where a projection is no whole 64-column block, nor for
    packed experts."""
    from types import SimpleNamespace
    from ninfer.core.cuda import driver as d
    from ninfer.models.qwen3_5.config import TextConfig
    from ninfer.models.qwen3_5.cuda import moe_route
    uploads = []
    monkeypatch.setattr(d, "upload", lambda ptr, a, st: uploads.append(ptr))
    counter = iter(range(1 << 12, 1 << 30, 1 << 12))

    def take(shape, dtype, region):
        return SimpleNamespace(ptr=next(counter), shape=shape, at=lambda *i: 0)

    class Lt:
        def has_grouped_gemm(self):
            return False

        def grouped_plan(self, *a):
            raise AssertionError("no cuBLASLt plan for our GEMM")

    ws = SimpleNamespace(gin_bytes=2, xg=take(1, 0, 0), gu=take(1, 0, 0), gact=take(1, 0, 0),
                         my=take(1, 0, 0))
    dense = [{"experts_gu": take(1, 0, 0), "experts_down": take(1, 0, 0)} for _ in range(3)]

    def route(inter):
        cfg = TextConfig(hidden_size=2048, num_hidden_layers=3, is_moe=True, num_experts=256,
                         num_experts_per_tok=8, moe_intermediate_size=inter)
        return moe_route.DeviceRoute(take, cfg, 512, 3, "test")
    rt = route(512)
    assert rt.tiles.shape == (3 * moe_route.tile_cap(512 * 8, 256),)
    assert rt.bind(None, Lt(), ws, dense) and rt.enabled and rt.own
    assert uploads == [rt.spec.ptr]
    odd = route(40)                                   # gate|up 80 columns: not whole blocks
    assert not odd.bind(None, Lt(), ws, dense) and not odd.enabled and not odd.own
    packed = [{"experts_gu": object(), "experts_down": object()}]
    assert not route(512).bind(None, Lt(), ws, packed)
