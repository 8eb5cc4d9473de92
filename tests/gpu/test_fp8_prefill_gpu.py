"""fp8 weights' prefill on the fp8 tensor cores (W8A8, EngineOptions.fp8_activations): the input
quantization (kernels/act_quant.py) byte for byte against ninfer/ops/kv_quant.quantize per 128
columns, cuBLASLt's block-scaled e4m3 GEMM (cublaslt.gemm_fp8) against a float64 product of the
same codes and scales, and a trained reference model converted to fp8 on the GPU against the
numpy backend (exact weights, float32 activations)."""
import ml_dtypes
import numpy as np
import pytest

from gpu_harness import TOL_MODEL_BF16, Harness, bf16_bits, rel_err

from ninfer.core.cuda.cublaslt import FP8_BLOCK, CublasLt, fp8_scale_rows
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.cuda import qweights as qw
from ninfer.ops.kv_quant import quantize
from ninfer.options import EngineOptions

pytestmark = pytest.mark.gpu
FP8 = ml_dtypes.float8_e4m3fn
# The tensor cores multiply e4m3 codes exactly but sum a 128-column block's products in an
# accumulator narrower than fp32 (about 14 bits kept, DeepSeek-V3 report sec. 3.3.2) before the
# block is scaled and added in fp32: ~2^-14 relative per block
TOL_FP8_GEMM = 1e-3
# A whole model with its GEMM inputs in e4m3 (4 significant bits) instead of bf16 (8): the unit
# roundoff is 2^-4 against 2^-8, so the bf16 model's tolerance times 16
TOL_MODEL_W8A8 = 16 * TOL_MODEL_BF16


@pytest.fixture(scope="module")
def h():
    harness = Harness()
    lt = CublasLt(harness.empty((32 << 20,), np.uint8).ptr, 32 << 20)
    supported = lt.fp8_supported()
    lt.close()
    harness.reset()
    if not supported:
        harness.close()
        pytest.skip("this GPU's cuBLASLt has no block-scaled fp8 GEMM (Hopper, cuBLAS 12.9+)")
    yield harness
    harness.close()


def _blocks(a, br, bc):
    """a [R, C] -> (e4m3 codes, float32 scales [ceil(R / br), C / bc]), scale = amax / 448."""
    R, C = a.shape
    Rp = -(-R // br) * br
    p = np.zeros((Rp, C))
    p[:R] = a
    b = p.reshape(Rp // br, br, C // bc, bc)
    amax = np.abs(b).max(axis=(1, 3))
    s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    return np.clip(b / s[:, None, :, None], -448, 448).reshape(Rp, C)[:R].astype(FP8), s


@pytest.mark.parametrize("m,k", [(61, 4096), (512, 12288), (1, 128)])
def test_act_quant_equals_kv_quant_rule(h, m, k):
    rng = np.random.default_rng(m)
    x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-8, 8, (m, 1)))).astype(np.float32)
    x[0, :FP8_BLOCK] = 0.0                                     # an all-zero group: scale 1
    xb = bf16_bits(x)
    ld = fp8_scale_rows(m)
    codes = h.empty(((ld + 1) * k,), np.uint8)
    scale = h.empty((k // FP8_BLOCK * ld + 4,), np.float32)
    h.run("act_quant_fp8", (-(-k // (FP8_BLOCK * qw.ACT_QUANT_WARPS)), ld),
          (32 * qw.ACT_QUANT_WARPS,), (h.put(xb), codes, scale, m, k, ld))
    xv = (xb.astype(np.uint32) << 16).view(np.float32)          # the bf16 values, exactly
    want_q, want_s = quantize(xv.reshape(m, -1, FP8_BLOCK), "fp8")
    got_q, got_s = h.get(codes), h.get(scale)
    assert np.array_equal(got_q[:m * k], want_q.view(np.uint8).reshape(-1))
    assert np.array_equal(got_s[:k // FP8_BLOCK * ld].reshape(-1, ld)[:, :m], want_s.T)
    assert not got_q[m * k: ld * k].any()                      # padded rows: zero codes
    assert np.all(got_q[ld * k:] == 0xFF) and np.all(np.isnan(got_s[k // FP8_BLOCK * ld:]))
    h.reset()


@pytest.mark.parametrize("m,n,k,beta,ldc", [(60, 256, 512, 0.0, 0), (40, 384, 256, 1.0, 0),
                                            (48, 200, 384, 1.0, 640), (36, 384, 128, 0.0, 0),
                                            (512, 4160, 4096, 0.0, 0)])
def test_gemm_fp8_against_float64(h, m, n, k, beta, ldc):
    """Fresh random W and X with per-row magnitudes over decades, N not a multiple of 128 (a
    partial last scale block), K of 1..3 blocks (W's scale rows padded to 4 blocks, as
    qweights stores them), beta 1 onto the output, a column range of wider rows (the fused
    outputs' ldc): the columns past N untouched. M not a multiple of 4: refused."""
    rng = np.random.default_rng(n + m)
    wq, ws = _blocks(rng.standard_normal((n, k)) * rng.uniform(0.01, 1, (n, 1)), 128, 128)
    xq, xs = _blocks(rng.standard_normal((m, k)) * np.exp(rng.uniform(-4, 4, (m, 1))), 1, 128)
    ld = fp8_scale_rows(m)
    xs_t = np.ones((k // 128, ld), np.float32)
    xs_t[:, :m] = xs.T
    ref = (xq.astype(np.float64) * np.repeat(xs, 128, 1)) @ \
        (wq.astype(np.float64) * np.repeat(np.repeat(ws, 128, 0)[:n], 128, 1)).T
    ldc = ldc or n
    y0 = rng.standard_normal((m, ldc)).astype(np.float32)
    y = h.put(y0)
    lt = CublasLt(h.empty((32 << 20,), np.uint8).ptr, 32 << 20)
    try:
        ws4 = np.pad(ws, ((0, 0), (0, -ws.shape[1] % qw.FP8_SCALE_COLS)), constant_values=7.0)
        lt.gemm_fp8(h.stream, h.put(xq.view(np.uint8)).ptr, h.put(xs_t).ptr,
                    h.put(wq.view(np.uint8)).ptr, h.put(ws4).ptr, y.ptr, m, n, k, beta, ldc)
        out = h.get(y)
        assert not lt.fp8_plan_ok(m + 1, n, k, beta, 256, ldc)
    finally:
        lt.close()
    assert rel_err(out[:, :n], ref + beta * y0[:, :n]) < TOL_FP8_GEMM
    assert np.array_equal(out[:, n:], y0[:, n:])
    h.reset()


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory):
    """The trained dense reference model (real activations: outlier channels, norms) in fp8."""
    from ninfer import reference_models as rm
    from ninfer.artifact import Artifact
    from ninfer.convert import convert_checkpoint
    from ninfer.convert.quantize import Quantize
    tmp = tmp_path_factory.mktemp("w8a8")
    ckpt = rm.expand_to_checkpoint(rm.model_path("dense"), tmp / "dense")
    convert_checkpoint(ckpt, tmp / "dense-fp8.ninfer", progress=False, recipe=Quantize("fp8"))
    art = Artifact(tmp / "dense-fp8.ninfer")
    yield art
    art.close()


def test_w8a8_model_against_numpy(h, fp8_reference):
    """Prefill logits of the fp8 reference model with the activations on the fp8 tensor cores
    within TOL_MODEL_W8A8 of the numpy backend's (exact weights, float32), the W8A8 GEMMs
    actually run (the cuBLASLt plans say so), and the same model with fp8_activations=False
    (dequantized weights, bf16 inputs) within the bf16 tolerance."""
    from ninfer.models.qwen3_5 import load_model
    art = fp8_reference
    cpu = load_model(art, EngineOptions(backend="numpy"))
    opts = dict(backend="cuda", max_concurrency=1, max_context=512, prefill_chunk=256,
                page_size=16)
    w8, exact = (load_model(art, EngineOptions(**opts, fp8_activations=a)) for a in (None, False))
    scoring = load_model(art, EngineOptions(**opts, purpose="scoring"))
    try:
        # on by default, but not for scoring (every logit there comes from prefill)
        assert w8.w8a8 and not exact.w8a8 and not scoring.w8a8
        rng = np.random.default_rng(17)
        ids = rng.integers(3, 2000, 200).tolist()
        batch = ForwardBatch.single(ids, 0, np.arange(13, dtype=np.int32), 0)
        out = {}
        for name, model in (("numpy", cpu), ("w8a8", w8), ("exact", exact)):
            kv, st = model.new_kv_pool(16, 16), model.new_state_pool(1)
            out[name] = model.forward(batch, kv, st, all_logits=True)
            for pool in (kv, st):
                getattr(pool, "close", lambda: None)()       # (the numpy pools have none)
        assert any(p.fp8 for p in w8.lt._plans.values()), "no fp8 GEMM ran"
        assert not any(p.fp8 for p in exact.lt._plans.values())
        err_w8, err_exact = rel_err(out["w8a8"], out["numpy"]), rel_err(out["exact"], out["numpy"])
        assert err_exact < TOL_MODEL_BF16, err_exact
        assert err_w8 < TOL_MODEL_W8A8, (err_w8, err_exact)
    finally:
        for m in (w8, exact, scoring, cpu):
            m.close()
