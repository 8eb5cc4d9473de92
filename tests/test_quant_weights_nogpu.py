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
        assert qw.formats(plans.values()) == {("int4_block", True)}
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
    for layout in k.LAYOUTS:
        for kk, bc in ((256, 128), (136, 128), (99, 64), (48, 12), (4096, 4096), (96, 128),
                       (4096, 64), (4096, 32), (160, 128)):
            assert k.vector_ok(layout, kk, bc) == qw.vector_ok(layout, kk, bc)
            assert k.mma_ok(layout, kk, bc) == qw.mma_ok(layout, kk, bc)
