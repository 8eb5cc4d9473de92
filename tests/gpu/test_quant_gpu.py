"""Packed quantized weights on the GPU (cuda/qweights.py, kernels/quant_gemv.py): the kernels at
layer-sized shapes against float64 decodes of the same bytes, and whole models converted with
--quantize (and the synthetic FP8 release) against the numpy backend on the same artifact:
float32 logits within TOL_MODEL_F32 and free-running greedy token for token; bfloat16 logits
within the fixtures' bf16 tolerance."""
import numpy as np
import pytest

from gpu_harness import (TOL_F32, TOL_FIXTURE_BF16, TOL_FIXTURE_BF16_MOE, TOL_MODEL_BF16,
                         TOL_MODEL_F32, Harness, bf16_bits, rel_err)

from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.cuda import qweights as qw
from ninfer.models.qwen3_5.cuda.kernel_set import dequant_name, qgemv_name, qmma_name, quant_specs
from ninfer.options import EngineOptions

pytestmark = pytest.mark.gpu
PAGE = 16
FORMATS = [("fp8_block", (128, 128), False), ("int8_block", (1, 128), False),
           ("int4_block", (1, 128), True), ("int4_block", (1, 64), False)]


@pytest.fixture(scope="module")
def h():
    harness = Harness()
    yield harness
    harness.close()


def _encoded(layout, block, asym, n, k, rng):
    import ml_dtypes
    from ninfer.convert.quantize import encode
    w = rng.standard_normal((1, n, k)).astype(np.float32)
    stored, scale, zero = encode(layout, w, block, asymmetric=asym)
    stored = np.ascontiguousarray(stored[0]).view(np.uint8)
    scale = scale[0].astype(np.float32)
    if layout == "fp8_block":
        q = stored.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elif layout == "int8_block":
        q = stored.view(np.int8).astype(np.float32)
    else:
        q = np.stack([stored & 15, stored >> 4], -1).reshape(n, -1)[:, :k].astype(np.float32)
    br, bc = block
    z = np.float32(8 if layout == "int4_block" else 0) if zero is None else \
        np.repeat(np.repeat(zero[0].astype(np.float32), br, 0), bc, 1)[:n, :k]
    s = np.repeat(np.repeat(scale, br, 0), bc, 1)[:n, :k]
    value32 = (q - z) * s                          # the kernels' float32 decode, exactly
    return stored, scale, None if zero is None else zero[0], value32


@pytest.mark.parametrize("layout,block,asym", FORMATS)
def test_qgemv_and_dequant_at_layer_shapes(h, layout, block, asym):
    rng = np.random.default_rng(7)
    n, k = 1030, 4096                      # partial last warp; 32 scale blocks per row
    stored, scale, zero, value = _encoded(layout, block, asym, n, k, rng)
    split = qw.mma_split(layout, block[1])
    ks = quant_specs({(layout, asym, split)})
    w, s = h.put(stored.reshape(-1)), h.put(scale)
    z = h.put(zero) if zero is not None else None
    for m in (1, 3, 8):
        x = rng.standard_normal((m, k)).astype(np.float32)
        xb = h.put(bf16_bits(x))
        ldy = n + 2
        y = h.empty((m + 1, ldy), np.float32)
        bm = next(b for b in qw.BMS if b >= m)
        name = qgemv_name(layout, bm, asym)
        h.cache.get(ks[name]).launch(
            h.stream, (-(-n // (qw.WARPS * qw.ROWS)), 1), (qw.THREADS,),
            (y, xb, xb, w, w, s, z.ptr if z is not None else 0, m, n, k, ldy, block[0], block[1],
             scale.shape[-1], 0.0, int(qw.vector_ok(layout, k, block[1])), 0, 0, 0, 0, 0))
        out = h.get(y)
        xv = (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        ref = xv @ value.astype(np.float64).T
        assert rel_err(out[:m, :n], ref) < TOL_F32, (layout, m)
        assert np.isnan(out[m:]).all() and np.isnan(out[:m, n:]).all()   # nothing else written
        if qw.mma_ok(layout, k, block[1]):
            # the tensor-core GEMV: weights exact in bf16, products summed in fp32
            y = h.empty((m + 1, ldy), np.float32)
            h.cache.get(ks[qmma_name(layout, asym, split)]).launch(
                h.stream, (-(-n // qw.MMA_ROWS), 1), (32 * qw.MMA_WARPS,),
                (y, xb, w, s, z.ptr if z is not None else 0, m, n, k, ldy, block[0], block[1],
                 scale.shape[-1], 0.0, 0, 0, 0, 0, 0))
            out = h.get(y)
            assert rel_err(out[:m, :n], ref) < TOL_F32, (layout, m, "qmma")
            assert np.isnan(out[m:]).all() and np.isnan(out[:m, n:]).all()
    rows, r0 = 300, 128
    for vec in (1, 0):                     # a thread per word, a thread per code
        tile = h.empty((rows * k,), np.uint16)
        units = stored.shape[-1] // 8 if vec else k
        h.cache.get(ks[dequant_name(layout, asym)]).launch(
            h.stream, (-(-units // qw.DEQUANT_THREADS), rows, 1), (qw.DEQUANT_THREADS,),
            (tile, tile, w, w, s, z.ptr if z is not None else 0, r0, rows, k, block[0], block[1],
             scale.shape[-1], 0, 0, 0, vec))
        assert np.array_equal(h.get(tile).reshape(rows, k), bf16_bits(value[r0:r0 + rows]))
    h.reset()


@pytest.mark.parametrize("layout,block,asym", FORMATS)
def test_qmma_expert_mode(h, layout, block, asym):
    """The tensor-core GEMV over (token, slot) pairs, each reading its expert's codes: a 35B-A3B
    gate|up (n = 2 x 512, k = 2048) with x per token, and its down (x per pair)."""
    rng = np.random.default_rng(11)
    E, topk, tokens = 5, 2, 3
    ids = np.array([4, 0, 2, 4, 1, 3], np.int32)
    pairs = tokens * topk
    for n, k, per_pair in ((1024, 2048, 0), (2048, 512, 1)):
        enc = [_encoded(layout, block, asym, n, k, rng) for _ in range(E)]
        stored = np.stack([e[0] for e in enc])
        scale = np.stack([e[1] for e in enc])
        w, s = h.put(stored.reshape(-1)), h.put(scale.reshape(-1))
        z = h.put(np.stack([e[2] for e in enc]).reshape(-1)) if asym else None
        x = rng.standard_normal((pairs if per_pair else tokens, k)).astype(np.float32)
        xb = h.put(bf16_bits(x))
        y = h.empty((pairs + 1, n), np.float32)
        split = qw.mma_split(layout, block[1])
        h.cache.get(quant_specs({(layout, asym, split)})[qmma_name(layout, asym, split)]).launch(
            h.stream, (-(-n // qw.MMA_ROWS), pairs), (32 * qw.MMA_WARPS,),
            (y, xb, w, s, z.ptr if z is not None else 0, 1, n, k, n, block[0], block[1],
             scale.shape[-1], 0.0, h.put(ids), topk, per_pair, stored[0].size, scale[0].size))
        out = h.get(y)
        xv = (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        ref = np.stack([enc[ids[q]][3].astype(np.float64) @ xv[q if per_pair else q // topk]
                        for q in range(pairs)])
        assert rel_err(out[:pairs], ref) < TOL_F32, (layout, n, k)
        assert np.isnan(out[pairs:]).all()
        h.reset()


@pytest.mark.parametrize("layout,block,asym", FORMATS)
def test_qmma_grouped_mode(h, layout, block, asym):
    """The MoE prefill's grouped tensor-core GEMV (moe_rows.expert_groups): groups of 1..8
    consecutive rows of one expert, an expert's rows over several groups, on the 35B-A3B
    expert shapes; rows no group names stay untouched."""
    from ninfer.models.qwen3_5.cuda.moe_rows import expert_groups
    rng = np.random.default_rng(12)
    E = 4
    counts = [19, 0, 1, 8]                          # expert 1 routed nothing
    ranges, r0 = [], 0
    for e, c in enumerate(counts):
        if c:
            ranges.append((e, r0, c))
        r0 += c
    rows = r0
    groups = expert_groups(tuple(ranges))
    assert [tuple(g) for g in groups] == [(0, 0, 8), (0, 8, 8), (0, 16, 3), (2, 19, 1),
                                          (3, 20, 8)]
    for n, k in ((1024, 2048), (2048, 512)):
        enc = [_encoded(layout, block, asym, n, k, rng) for _ in range(E)]
        stored = np.stack([e[0] for e in enc])
        scale = np.stack([e[1] for e in enc])
        w, s = h.put(stored.reshape(-1)), h.put(scale.reshape(-1))
        z = h.put(np.stack([e[2] for e in enc]).reshape(-1)) if asym else None
        x = rng.standard_normal((rows, k)).astype(np.float32)
        y = h.empty((rows + 1, n), np.float32)
        split = qw.mma_split(layout, block[1])
        h.cache.get(quant_specs({(layout, asym, split)})[qmma_name(layout, asym, split)]).launch(
            h.stream, (-(-n // qw.MMA_ROWS), len(groups)), (32 * qw.MMA_WARPS,),
            (y, h.put(bf16_bits(x)), w, s, z.ptr if z is not None else 0, 1, n, k, n, block[0],
             block[1], scale.shape[-1], 0.0, h.put(groups.reshape(-1)), -1, 0, stored[0].size,
             scale[0].size))
        out = h.get(y)
        xv = (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        expert = np.repeat(np.arange(E), counts)
        ref = np.stack([enc[expert[r]][3].astype(np.float64) @ xv[r] for r in range(rows)])
        assert rel_err(out[:rows], ref) < TOL_F32, (layout, n, k)
        assert np.isnan(out[rows:]).all()
        h.reset()


@pytest.mark.parametrize("layout,block,asym", [("fp8_block", (128, 128), False),
                                               ("int4_block", (1, 32), True)])
def test_packed_experts_prefill_in_a_whole_model(layout, block, asym):
    """A bf16 tiny MoE (every token to every expert: no routing flips) with packed experts of
    widths the tensor-core GEMV takes: its prefill on the grouped qmma path and on the
    dequantizing path, each within the bf16 model tolerance of the numpy backend on the same
    codes (the fixtures' experts, 24 wide, never take the grouped path)."""
    from tiny_model import PackedExpertsArtifact, tiny_config

    from ninfer.models.qwen3_5 import load_model
    art = PackedExpertsArtifact(tiny_config(moe=True), layout, block, asym, seed=4)
    cpu = load_model(art, EngineOptions(backend="numpy"))
    gpu = load_model(art, EngineOptions(backend="cuda", max_concurrency=2, max_context=256,
                                        prefill_chunk=128, page_size=PAGE))
    ids = np.random.default_rng(6).integers(3, 300, 70).tolist()
    table = np.arange(8, dtype=np.int32)

    def prefill(model):
        kv, st = model.new_kv_pool(8, PAGE), model.new_state_pool(1)
        try:
            return model.forward(ForwardBatch.single(ids, 0, table[: -(-len(ids) // PAGE)], 0),
                                 kv, st, all_logits=True)
        finally:
            for pool in (kv, st):
                if hasattr(pool, "close"):
                    pool.close()
    try:
        want = prefill(cpu)
        K = gpu.config.text.num_experts_per_tok
        for grouped in (True, False):
            gpu.runner.packed_grouped = grouped
            got = prefill(gpu)
            err = rel_err(got, want)
            assert np.isfinite(got).all() and err < TOL_MODEL_BF16, (layout, grouped, err)
            if grouped:
                assert gpu.runner.last_moe_layout == (0, len(ids) * K, K)
    finally:
        gpu.close()
        cpu.close()


def _quantized_fixture(tmp_path_factory, kind):
    from fixture_utils import fixture_dir
    from ninfer.convert import convert_checkpoint
    from ninfer.convert.quantize import Quantize
    out = tmp_path_factory.mktemp("ninfer_quant") / f"{kind}.ninfer"
    if kind == "fp8_release":
        convert_checkpoint(fixture_dir("fp8_dense"), out, progress=False)
        return out
    source, recipe = KINDS[kind]
    convert_checkpoint(fixture_dir(source), out, progress=False, recipe=Quantize(*recipe[:1],
                                                                                 **recipe[1]))
    return out


# kind -> (fixture, (format, Quantize options)); the tied one quantizes lm_head and so the
# embedding object it shares (the embedding is then decoded at load, lm_head runs packed)
KINDS = {"fp8_release": None, "fp8": ("dense", ("fp8", {})), "int8": ("dense", ("int8", {})),
         "int4": ("dense", ("int4", {})), "int4_sym": ("dense", ("int4", {"asymmetric": False})),
         "int8_head_tied": ("dense_tied", ("int8", {"quantize_lm_head": True})),
         "int4_head_int8": ("dense", ("int4", {"quantize_lm_head": "int8"})),
         "moe_fp8": ("moe", ("fp8", {})), "moe_int4": ("moe", ("int4", {}))}


@pytest.mark.parametrize("kind", list(KINDS))
def test_quantized_model_on_cuda_equals_numpy(tmp_path_factory, kind):
    """float32: prefill logits (T <= 32: the GEMVs; longer: the dequantized tiles) within
    TOL_MODEL_F32 of the numpy backend and 12 free-running greedy steps token for token (the
    decode graph's GEMVs); bfloat16: logits within the fixtures' bf16 tolerance."""
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5 import load_model
    art = Artifact(_quantized_fixture(tmp_path_factory, kind))
    cpu = load_model(art, EngineOptions(backend="numpy"))
    opts = dict(backend="cuda", max_concurrency=2, max_context=256, prefill_chunk=128,
                page_size=PAGE)
    models = [load_model(art, EngineOptions(dtype="float32", **opts)),
              load_model(art, EngineOptions(**opts))]
    try:
        assert models[0].qplans, "no packed weights: the test would not test them"
        rng = np.random.default_rng(3)
        table = np.arange(16, dtype=np.int32)
        bf16_tol = TOL_FIXTURE_BF16_MOE if cpu.config.is_moe else TOL_FIXTURE_BF16
        for gpu, tol in zip(models, (TOL_MODEL_F32, bf16_tol)):
            for T in (5, 31, 70):
                ids = rng.integers(3, 200, T).tolist()
                kv_g, st_g = gpu.new_kv_pool(16, PAGE), gpu.new_state_pool(1)
                kv_c, st_c = cpu.new_kv_pool(16, PAGE), cpu.new_state_pool(1)
                batch = ForwardBatch.single(ids, 0, table[: -(-T // PAGE)], 0)
                err = rel_err(gpu.forward(batch, kv_g, st_g, all_logits=True),
                              cpu.forward(batch, kv_c, st_c, all_logits=True))
                assert err < tol, f"{kind} f32={gpu.f32}: T={T} prefill logits {err:.2e}"
                if not gpu.f32 and T == 5 and not cpu.config.is_moe:
                    # bf16 decode steps (the graphs' GEMVs: on tensor cores) on numpy's tokens
                    # (dense only: in one MoE token a bf16 routing flip moves the logits by
                    # ~30%, as in transformers' own bf16; test_qmma_expert_mode covers experts)
                    for step in range(4):
                        tok = int(rng.integers(3, 200))
                        one = ForwardBatch.single([tok], T + step, table[:1])
                        err = rel_err(gpu.forward(one, kv_g, st_g), cpu.forward(one, kv_c, st_c))
                        assert err < tol, f"{kind}: bf16 decode step {step} logits {err:.2e}"
                kv_g.close()
                st_g.close()
        gpu = models[0]
        prompt = rng.integers(3, 200, 9).tolist()
        pages = table[:2]
        kv_g, st_g = gpu.new_kv_pool(16, PAGE), gpu.new_state_pool(1)
        kv_c, st_c = cpu.new_kv_pool(16, PAGE), cpu.new_state_pool(1)
        first = ForwardBatch.single(prompt, 0, pages)
        lg, lc = gpu.forward(first, kv_g, st_g), cpu.forward(first, kv_c, st_c)
        for step in range(12):
            assert rel_err(lg, lc) < TOL_MODEL_F32, f"{kind}: step {step}"
            tg, tc = int(np.argmax(lg[0])), int(np.argmax(lc[0]))
            assert tg == tc, f"{kind}: step {step}: cuda {tg} != numpy {tc}"
            pos = len(prompt) + step
            lg = gpu.forward(ForwardBatch.single([tg], pos, pages), kv_g, st_g)
            lc = cpu.forward(ForwardBatch.single([tc], pos, pages), kv_c, st_c)
        kv_g.close()
        st_g.close()
    finally:
        for m in models:
            m.close()
        cpu.close()
        art.close()
