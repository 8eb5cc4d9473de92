"""cuda/qweights.py without a GPU: which matrices the CUDA model holds packed and how their rows
split into segments, the bytes it plans for them, the host images' checks, and the launch
geometry it shares with kernels/quant_gemv.py."""
import importlib.util

import numpy as np
import pytest

from fixture_utils import fixture_dir

from ninfer.artifact import Artifact
from ninfer.convert import convert_checkpoint
from ninfer.convert.quantize import Quantize
from ninfer.errors import ArtifactError
from ninfer.models import model_config
from ninfer.models.qwen3_5.cuda import qweights as qw
from ninfer.models.qwen3_5.cuda import weights as W
from ninfer.models.qwen3_5.cuda.weight_load import quant_plans


@pytest.fixture(scope="module")
def int4_dense(tmp_path_factory):
    out = tmp_path_factory.mktemp("qw") / "i4.ninfer"
    convert_checkpoint(fixture_dir("dense"), out, progress=False, recipe=Quantize("int4"))
    return out


def test_segments_of_an_int4_conversion(int4_dense):
    with Artifact(int4_dense) as art:
        cfg = model_config(art).text
        plans = quant_plans(cfg, art)
        gdn = plans[(0, "w_in")]
        # qkv and z merge (same layout and block); in_proj_b / in_proj_a stay bf16, one GEMM
        assert [(s.layout, s.row0, s.rows, len(s.parts)) for s in gdn] == [
            ("int4_block", 0, cfg.linear_conv_dim + cfg.linear_value_dim, 2),
            ("bf16", cfg.linear_conv_dim + cfg.linear_value_dim, 2 * cfg.linear_num_value_heads, 2)]
        assert all(s.asym and s.block == (1, 128) for segs in plans.values() for s in segs
                   if s.layout != "bf16")
        assert ("", "lm_head") not in plans and ("", "embed") not in plans
        assert qw.formats(plans.values()) == {("int4_block", True, 1)}
        packed, bf16 = W.plan_bytes(cfg, qplans=plans), W.plan_bytes(cfg)
        assert packed < 0.7 * bf16
        # the prefill tile exists only when a call can exceed the GEMV's rows
        assert qw.slab_elements(plans.values(), qw.GEMV_MAX_ROWS) == 0
        assert qw.slab_elements(plans.values(), 128) > 0


def test_an_unquantized_artifact_has_no_packed_matrix(tmp_path):
    out = convert_checkpoint(fixture_dir("dense"), tmp_path / "bf16.ninfer", progress=False)
    with Artifact(out) as art:
        assert quant_plans(model_config(art).text, art) == {}


def test_slab_rows_are_whole_128_row_blocks():
    seg = qw.SegmentPlan(0, 40000, 5120, "int8_block", (1, 128))
    rows = qw.slab_rows(seg, qw.SLAB_ELEMENTS)
    assert rows % 128 == 0 and rows * 5120 <= qw.SLAB_ELEMENTS
    assert qw.slab_rows(qw.SegmentPlan(0, 100, 64, "fp8_block", (128, 128)), 1 << 20) == 100


def test_host_images_refuse_what_the_numpy_reader_refuses():
    class Fake:
        def __init__(self, data, scale, zero=None):
            from types import SimpleNamespace
            self.q = SimpleNamespace(data=data, scale=scale, zero=zero)

        def quantized(self, name):
            return self.q
    part = qw.SourcePart("w", 0, 1)
    nan_code = np.array([[1, 0x7F, 3]], np.uint8)
    with pytest.raises(ArtifactError, match="NaN code"):
        qw.codes_host(Fake(nan_code, None), part, "fp8_block")
    assert qw.codes_host(Fake(nan_code, None), part, "int8_block") is not None
    with pytest.raises(ArtifactError, match="non-finite scale"):
        qw.scale_host(Fake(None, np.array([[1.0, np.inf]], np.float32)), part)
    with pytest.raises(ArtifactError, match="zero point 16"):
        qw.zero_host(Fake(None, None, np.array([[3, 16]], np.uint8)), part)


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_launch_geometry_matches_the_kernels():
    from ninfer.core.cuda import numba_shim
    from ninfer.core.cuda.kernels import _import_kernel_module
    numba_shim.import_numba_cuda()
    k = _import_kernel_module("quant_gemv")
    assert (k.THREADS, k.WARPS, k.ROWS, k.DEQUANT_THREADS, k.BMS, k.MMA_WARPS) == \
        (qw.THREADS, qw.WARPS, qw.ROWS, qw.DEQUANT_THREADS, qw.BMS, qw.MMA_WARPS)
    aq = _import_kernel_module("act_quant")
    from ninfer.core.cuda.cublaslt import FP8_BLOCK
    assert (aq.WARPS, aq.GROUP) == (qw.ACT_QUANT_WARPS, FP8_BLOCK)
    for layout in k.LAYOUTS:
        for kk, bc in ((256, 128), (136, 128), (99, 64), (48, 12), (4096, 4096), (96, 128),
                       (4096, 64), (4096, 32), (160, 128), (4096, 384), (4096, 16), (100, 32),
                       (160, 32), (96, 64), (4096, 8), (4096, 256)):
            assert k.vector_ok(layout, kk, bc) == qw.vector_ok(layout, kk, bc)
            assert k.mma_ok(layout, kk, bc) == qw.mma_ok(layout, kk, bc), (layout, kk, bc)
            assert k.mma_split(layout, bc) == qw.mma_split(layout, bc), (layout, bc)


def test_runner_picks_the_packed_kernel_by_dtype_shape_and_rows(monkeypatch):
    """StepRunner.qlinear / _expert_gemv: a bf16 segment is a cuBLASLt GEMM over its columns;
    codes take the tensor-core GEMV (qmma) in a bf16 model where mma_ok, 8 rows of x per launch,
    the CUDA-core one (qgemv) in a float32 model or for other blocks, and more than 32 rows
    dequantize slabs into the tile and multiply through cuBLASLt. Each launch writes its
    segment's columns (y + 4 * row0) of its rows (y + 4 * n * b0)."""
    from types import SimpleNamespace
    from ninfer.models.qwen3_5.config import TextConfig
    from ninfer.models.qwen3_5.cuda import runner as R
    from ninfer.models.qwen3_5.cuda.kernel_set import spec
    launched = []

    class Kernels:
        def __getattr__(self, name):
            class K:
                def launch(self, st, grid, block, args, smem=0):
                    launched.append((name, grid, block,
                                     tuple(getattr(a, "ptr", a) for a in args)))
            K.spec = spec("qmma" if name.startswith("qmma") else
                          "dequant" if name.startswith("dequant") else "qgemv")
            return K()

    def gemm(st, x, w, y, m, n, k, beta=0.0, w_kn=False, batch=1, strides=(0, 0, 0), ldc=0):
        launched.append(("gemm", m, n, k, y, ldc))

    def arr(ptr, *shape):
        return SimpleNamespace(ptr=ptr, shape=shape)

    K = 4096
    segs = (qw.QSegment(qw.SegmentPlan(0, 64, K, qw.BF16), arr(1000)),
            qw.QSegment(qw.SegmentPlan(64, 256, K, "int4_block", (1, 128), True), arr(2000),
                        arr(3000, 1, 256, K // 128), arr(4000)),
            qw.QSegment(qw.SegmentPlan(320, 32, K, "int4_block", (1, 64), False), arr(5000),
                        arr(6000, 1, 32, K // 64)),
            qw.QSegment(qw.SegmentPlan(352, 16, K, "int4_block", (1, 96), False), arr(5500),
                        arr(6500, 1, 16, -(-K // 96))))
    w = qw.QMatrix((368, K), segs)
    N = 368

    def runner(gin):
        ws = SimpleNamespace(gin_bytes=gin, wq=SimpleNamespace(ptr=7000, shape=(1 << 20,)),
                             ids=SimpleNamespace(ptr=8000))
        res = R.StepResources(cfg=TextConfig(), ws=ws, weights={}, lt=SimpleNamespace(gemm=gemm),
                              kernels=Kernels(), num_sms=132, b_cap=8, moe_gemv_tokens=8, n_cap=64,
                              route_host=None, media=None)
        return R.StepRunner(res, invariant=False, attn_tc_min_tokens=64)

    y, x = 10 ** 6, 2 * 10 ** 6
    # bf16 model, 9 decode rows: the bf16 columns, then qmma for 8 + 1 rows, its two-blocks-per-
    # step variant for g64 likewise, and qgemv for g96 (no whole number of blocks per step)
    launched.clear()
    runner(2).qlinear(None, x, w, y, 9, N, K, 0.0)
    names = [c[0] for c in launched]
    assert names == ["gemm", "qmma_int4_block_z", "qmma_int4_block_z", "qmma_int4_block_s2",
                     "qmma_int4_block_s2", "qgemv_int4_block_8", "qgemv_int4_block_1"]
    assert launched[0] == ("gemm", 9, 64, K, y, N)
    q0, q1 = launched[1], launched[2]
    assert q0[1] == (256 // qw.MMA_ROWS, 1) and q0[2] == (32 * qw.MMA_WARPS,)
    # (y, x, codes, scale, zero, m, n, k, ldy, br, bc, sc_cols, beta, ids, topk, ...)
    assert q0[3][:12] == (y + 4 * 64, x, 2000, 3000, 4000, 8, 256, K, N, 1, 128, K // 128)
    assert q1[3][:2] == (y + 4 * 64 + 4 * N * 8, x + 2 * K * 8) and q1[3][5] == 1
    assert launched[3][3][0] == y + 4 * 320 and launched[3][3][10] == 64
    assert launched[5][3][0] == y + 4 * 352 and launched[5][3][7] == 8
    # float32 model: never the tensor-core GEMV
    launched.clear()
    runner(4).qlinear(None, x, w, y, 3, N, K, 0.0)
    assert [c[0] for c in launched] == ["gemm", "qgemv_int4_block_4_z", "qgemv_int4_block_4",
                                        "qgemv_int4_block_4"]
    # a prefill chunk of 40 rows: slabs dequantized, then cuBLASLt
    launched.clear()
    runner(2).qlinear(None, x, w, y, 40, N, K, 0.0)
    assert [c[0] for c in launched] == ["gemm", "dequant_int4_block_z", "gemm", "dequant_int4_block",
                                        "gemm", "dequant_int4_block", "gemm"]
    # fp8 [128, 128] segments with w8a8 (fp8_activations): 40 rows quantized once for both
    # fp8 segments, each a block-scaled fp8 GEMM on its columns; the bf16 segment stays a bf16
    # GEMM, an fp8 segment of other blocks and an expert stack are dequantized; decode rows
    # still take qmma
    fp8 = qw.QMatrix((N, K), (
        qw.QSegment(qw.SegmentPlan(0, 64, K, qw.BF16), arr(1000)),
        qw.QSegment(qw.SegmentPlan(64, 256, K, "fp8_block", (128, 128)), arr(2000),
                    arr(3000, 1, 2, K // 128)),
        qw.QSegment(qw.SegmentPlan(320, 32, K, "fp8_block", (1, 128)), arr(5000),
                    arr(6000, 1, 32, K // 128)),
        qw.QSegment(qw.SegmentPlan(352, 16, K, "fp8_block", (128, 128)), arr(5500),
                    arr(6500, 1, 1, K // 128))))

    def gemm_fp8(st, xq, xs, w, ws, y, m, n, k, beta=0.0, ldc=0):
        launched.append(("gemm_fp8", xq, xs, w, ws, y, m, n, k, ldc))

    r = runner(2)
    r.w8a8 = True
    r.res.lt.gemm_fp8 = gemm_fp8
    r.res.lt.fp8_plan_ok = lambda m, n, k, beta, align, ldc: n != 16     # one refused shape
    r.res.ws.xq, r.res.ws.xqs = SimpleNamespace(ptr=11000), SimpleNamespace(ptr=12000)
    launched.clear()
    r.qlinear(None, x, fp8, y, 40, N, K, 0.0)
    assert [c[0] for c in launched] == ["gemm", "act_quant_fp8", "gemm_fp8", "dequant_fp8_block",
                                        "gemm", "dequant_fp8_block", "gemm"]
    aq = launched[1]
    assert aq[1] == (K // (128 * qw.ACT_QUANT_WARPS), 40) and aq[3] == (x, 11000, 12000, 40, K, 40)
    assert launched[2][1:] == (11000, 12000, 2000, 3000, y + 4 * 64, 40, 256, K, N)
    # 43 rows: cuBLASLt's M is a multiple of 4, the last 3 rows take qmma as decode rows do
    launched.clear()
    r.qlinear(None, x, fp8, y, 43, N, K, 0.0)
    assert [c[0] for c in launched][1:4] == ["act_quant_fp8", "gemm_fp8", "qmma_fp8_block"]
    assert launched[1][3][3:] == (40, K, 40) and launched[2][6] == 40
    assert launched[3][3][:2] == (y + 4 * 64 + 4 * N * 40, x + 2 * K * 40) \
        and launched[3][3][5] == 3
    launched.clear()
    r.qlinear(None, x, fp8, y, 8, N, K, 0.0)
    assert "gemm_fp8" not in [c[0] for c in launched]
    # routed experts (decode): qmma in expert mode over the (token, slot) pairs
    ex = qw.QMatrix((8, 512, K), (qw.QSegment(qw.SegmentPlan(0, 512, K, "fp8_block", (128, 128),
                                                             experts=8), arr(9000),
                                              arr(9500, 8, 4, K // 128)),))
    launched.clear()
    runner(2)._expert_gemv(None, ex, x, y, 6, 512, K, 2, 0)
    (name, grid, block, args), = launched
    assert name == "qmma_fp8_block" and grid == (512 // qw.MMA_ROWS, 6)
    assert args[5] == 1 and args[13:] == (8000, 2, 0, 512 * K, 4 * (K // 128))
