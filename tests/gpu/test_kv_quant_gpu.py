"""Quantized KV (EngineOptions.kv_dtype fp8 / int8) on the GPU:

* the write kernel's codes and scales are kv_quant.quantize's bytes of the same float32 K/V (the
  float32 variant of the kernel, same inputs), bit for bit, at layer geometries, and it changes
  no other byte of the pages;
* paged attention and the tensor-core path's gather read them: against float64 attention over
  the dequantized pages at layer shapes (long contexts, split heads);
* whole models (the dense and MoE fixtures) in float32 against the numpy backend with the same
  kv_dtype: prefill logits at 5, 31 and 70 tokens (70: five 16-token pages), 12 greedy decode
  steps token for token (the decode graph), the pools' bytes; in bfloat16 within the fixtures'
  tolerance on both prefill attention paths;
* the Engine: pauses (Replay and Snapshot) and a context-cache hit give the tokens of an
  uninterrupted / cold run.

Tolerance of the float32 model with quantized KV, TOL_MODEL_KVQ_F32: the two backends' K/V differ
by ~1e-7 (summation order), which moves a code wherever a value lies that close to a rounding
boundary; one such code moves a fixture's logits by up to ~1e-4 (numpy backend, its K/V
perturbed by 3e-7 before quantizing: <= 1.0e-4 over both fixtures, both codes, 5-70 tokens;
perturbed by 3e-5, 100x more: <= 6.7e-4). Greedy steps compare tokens where numpy's top-2 margin
exceeds MARGIN; a step within it continues both backends on numpy's token.
"""
import math

import numpy as np
import pytest

from fixture_utils import convert_fixture
from gpu_harness import TOL_F32, TOL_FIXTURE_BF16, TOL_FIXTURE_BF16_MOE, rel_err
from oracles import page_tables, quantized_device_pages, quantized_host_layer

from ninfer import Engine
from ninfer.api import SamplingParams
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.cuda.kernel_set import kvq_spec, spec
from ninfer.models.qwen3_5.cuda.runner import combine_launch
from ninfer.ops.kv_quant import QuantizedPages, dequantize, quantize
from ninfer.options import EngineOptions

pytestmark = pytest.mark.gpu
PAGE = 16
KV_DTYPES = ["fp8", "int8"]
TOL_MODEL_KVQ_F32 = 2e-3
MARGIN = 0.05


@pytest.fixture
def g(gpu):
    yield gpu
    gpu.reset()


# ---- the write kernel ----------------------------------------------------------------------------

@pytest.mark.parametrize("kvq", KV_DTYPES)
@pytest.mark.parametrize("hd, rot, nh, nkv, ps", [(256, 64, 16, 4, 16), (128, 32, 8, 1, 4),
                                                  (20, 8, 2, 1, 3)])
def test_write_kernel_stores_numpys_bytes(g, kvq, hd, rot, nh, nkv, ps):
    """Two rows (3 new tokens after 5, 2 after 17) across page boundaries, an all-zero K head
    and V heads over 7 decades; (20, 8, 2, 1, 3): 60 code bytes a page, padded to 64."""
    r = np.random.default_rng(hd + nkv)
    lengths, ctxs = [3, 2], [5, 17]
    n = sum(lengths)
    qs = np.array([0, 3, 5], np.int32)
    token_row = np.array([0, 0, 0, 1, 1], np.int32)
    bt, p_cap, num_pages = page_tables(r, lengths, ctxs, ps)
    P = 2 * nh * hd + 2 * nkv * hd
    proj = r.standard_normal((n, P)).astype(np.float32)
    kv0 = 2 * nh * hd
    proj[1, kv0: kv0 + hd] = 0                                      # token 1, kv head 0: K = 0
    v = proj[:, kv0 + nkv * hd:]
    v[:] = np.sign(v) * 10.0 ** r.uniform(-7, 1, v.shape)
    qn, kn = (0.2 * r.standard_normal((2, hd))).astype(np.float32)
    pos = np.zeros((3, n + 2), np.int32)
    pos[:, :n] = r.integers(0, 4096, (3, n))
    geo = dict(hd=hd, rot=rot, nh=nh, nkv=nkv, sec_t=rot // 2, sec_h=0, sec_w=0,
               interleaved=False)
    shape = (num_pages, ps, nkv, hd)
    kf = g.empty(shape, np.float32, poison=0)
    vf = g.empty(shape, np.float32, poison=0)
    whole = quantized_device_pages(np.zeros(shape, np.uint8), np.zeros(shape[:3])).shape[1]
    kq = g.empty((num_pages, whole), np.uint8, poison=0xA5)
    vq = g.empty((num_pages, whole), np.uint8, poison=0xA5)
    args = (g.put(proj), P, g.put(qn), g.put(kn))
    meta = (g.put(pos), n + 2, g.put(token_row), g.put(qs), g.put(np.array(ctxs, np.int32)),
            g.put(bt), p_cap, ps, 1e6, 1e-6)
    block = ((hd + 31) // 32 * 32,)
    q_f, q_q = g.empty((n, nh, hd), np.float32), g.empty((n, nh, hd), np.float32)
    for sp, q, k_, v_ in ((spec("qk_norm_rope_kv", True, **geo), q_f, kf, vf),
                          (kvq_spec("qk_norm_rope_kv", kvq, **geo), q_q, kq, vq)):
        g.cache.get(sp).launch(g.stream, (n, nh + nkv), block, (q, *args, k_, v_, *meta))
    assert np.array_equal(g.get(q_q), g.get(q_f))                 # queries as before
    written = np.zeros((num_pages, ps), bool)
    for row in range(2):
        p = ctxs[row] + np.arange(lengths[row])
        written[bt[row, p // ps], p % ps] = True
    for dev, f in ((kq, kf), (vq, vf)):
        got = quantized_host_layer(g.get(dev), shape, kvq)
        codes, scale = quantize(g.get(f)[written], kvq)
        np.testing.assert_array_equal(got.codes[written].view(np.uint8), codes.view(np.uint8))
        np.testing.assert_array_equal(got.scale[written].view(np.uint32), scale.view(np.uint32))
        # every other byte keeps its poison: the other tokens' codes and scales, the padding
        owned = QuantizedPages(shape, kvq)
        owned.scale[:] = 0.0
        owned.codes.view(np.uint8)[written] = 1
        owned.scale.view(np.uint32)[written] = 0x01010101
        free = quantized_device_pages(owned.codes, owned.scale) == 0
        assert (g.get(dev)[free] == 0xA5).all()
    page, off = bt[0, 6 // ps], 6 % ps
    assert quantized_host_layer(g.get(kq), shape, kvq).scale[page, off, 0] == 1.0   # K = 0


# ---- attention over quantized pages --------------------------------------------------------------

def _quantized_pools(r, shape, kvq):
    k, v = QuantizedPages(shape, kvq), QuantizedPages(shape, kvq)
    ids = np.repeat(np.arange(shape[0]), shape[1]), np.tile(np.arange(shape[1]), shape[0])
    k[ids] = (2.0 * r.standard_normal((len(ids[0]),) + shape[2:])).astype(np.float32)
    v[ids] = (r.standard_normal((len(ids[0]),) + shape[2:]) *
              10.0 ** r.uniform(-2, 1, (len(ids[0]), shape[2], 1))).astype(np.float32)
    return k, v


def _attention_ref(q, K, V, bt, ctxs, qs, token_row, ps, G):
    n, nh, hd = q.shape
    out = np.zeros((n, nh, hd))
    for t in range(n):
        row = token_row[t]
        keys = np.arange(ctxs[row] + t - qs[row] + 1)
        pg, of = bt[row, keys // ps], keys % ps
        for h in range(nh):
            s = K[pg, of, h // G] @ q[t, h] / math.sqrt(hd)
            e = np.exp(s - s.max())
            out[t, h] = (e / e.sum()) @ V[pg, of, h // G]
    return out


@pytest.mark.parametrize("kvq", KV_DTYPES)
@pytest.mark.parametrize("hd, G, nkv, GS, lengths, ctxs, splits", [
    (256, 4, 4, 4, [1, 1, 1], [3000, 17, 0], 32),          # 9B decode rows, long and short
    (256, 16, 2, 8, [1, 2], [700, 40], 8),                 # 122B: a kv head's queries in 2 blocks
    (128, 2, 2, 2, [5, 1], [0, 129], 3),                   # a short prefill row and a decode row
])
def test_paged_attention_reads_quantized_pages(g, kvq, hd, G, nkv, GS, lengths, ctxs, splits):
    r = np.random.default_rng(hd * G + sum(ctxs))
    nh, ps = G * nkv, 16
    n = sum(lengths)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    token_row = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    bt, p_cap, num_pages = page_tables(r, lengths, ctxs, ps)
    kp, vp = _quantized_pools(r, (num_pages, ps, nkv, hd), kvq)
    q = r.standard_normal((n, nh, hd)).astype(np.float32)
    P = 2 * nh * hd + 5
    proj = r.standard_normal((n, P)).astype(np.float32)
    part = g.empty((n * splits, nh, hd), np.float32)
    ml = g.empty((n * splits, nh, 2), np.float32)
    out = g.empty((n, nh * hd), np.float32)
    sp = kvq_spec("paged_attention", kvq, hd=hd, G=G, nkv=nkv, **({"GS": GS} if GS != G else {}))
    g.cache.get(sp).launch(g.stream, (n, nkv * (G // GS), splits), (128,), (
        part, ml, g.put(q), g.put(quantized_device_pages(kp.codes, kp.scale)),
        g.put(quantized_device_pages(vp.codes, vp.scale)), g.put(token_row), g.put(qs),
        g.put(np.array(ctxs, np.int32)), g.put(bt), p_cap, ps, splits, 1 / math.sqrt(hd), 0))
    g.run("attn_combine", *combine_launch(n, nh, hd), (out, part, ml, g.put(proj), P, splits, 0),
          dict(hd=hd, nh=nh, f32=True))
    K = dequantize(kp.codes, kp.scale).astype(np.float64)
    V = dequantize(vp.codes, vp.scale).astype(np.float64)
    ref = _attention_ref(q.astype(np.float64), K, V, bt, ctxs, qs, token_row, ps, G)
    gate = proj[:, :2 * nh * hd].reshape(n, nh, 2 * hd)[:, :, hd:].astype(np.float64)
    assert rel_err(g.get(out).reshape(n, nh, hd), ref / (1 + np.exp(-gate))) < TOL_F32


@pytest.mark.parametrize("kvq", KV_DTYPES)
def test_kv_gather_decodes_to_bf16(g, kvq):
    """The tensor-core path's gather of one row (1000 keys, 9B heads) from quantized pages: each
    value is bf16(code * scale), rows past the keys zero up to the padded length."""
    import ml_dtypes
    r = np.random.default_rng(9)
    hd, nkv, ps, n_keys = 256, 4, 16, 1000
    n_pad, g_stride = 1000, 1008
    bt, p_cap, num_pages = page_tables(r, [n_keys], [0], ps)
    kp, vp = _quantized_pools(r, (num_pages, ps, nkv, hd), kvq)
    kc = g.empty((nkv, g_stride, hd), np.uint16)
    vc = g.empty((nkv, g_stride, hd), np.uint16)
    g.cache.get(kvq_spec("kv_gather", kvq, hd=hd, nkv=nkv)).launch(
        g.stream, ((n_pad + 7) // 8, nkv), (128,),
        (kc, vc, g.put(quantized_device_pages(kp.codes, kp.scale)),
         g.put(quantized_device_pages(vp.codes, vp.scale)), g.put(bt), 0, p_cap, ps, n_keys,
         n_pad, g_stride))
    keys = np.arange(n_keys)
    for got, qp in ((g.get(kc), kp), (g.get(vc), vp)):
        vals = dequantize(qp.codes, qp.scale)[bt[0, keys // ps], keys % ps]
        want = vals.transpose(1, 0, 2).astype(ml_dtypes.bfloat16).view(np.uint16)
        np.testing.assert_array_equal(got[:, :n_keys], want)
        assert (got[:, n_pad:] == 0xFFFF).all()                     # past n_pad: untouched


# ---- whole models ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["dense", "moe"])
def fixture_path(request, tmp_path_factory):
    return convert_fixture(request.param, tmp_path_factory.mktemp("ninfer_kvq"))


def _models(path, kvq, dtype):
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5 import load_model
    art = Artifact(path)
    cpu = load_model(art, EngineOptions(backend="numpy", kv_dtype=kvq))
    gpu = load_model(art, EngineOptions(backend="cuda", dtype=dtype, kv_dtype=kvq,
                                        max_concurrency=2, max_context=256, prefill_chunk=128,
                                        page_size=PAGE))
    return art, cpu, gpu


@pytest.mark.parametrize("kvq", KV_DTYPES)
def test_float32_model_with_quantized_kv_equals_numpy(fixture_path, kvq):
    art, cpu, gpu = _models(fixture_path, kvq, "float32")
    rng = np.random.default_rng(3)
    table = np.arange(16, dtype=np.int32)
    try:
        probe = gpu.new_kv_pool(1, PAGE)
        assert gpu.kv_dtype == kvq and probe.kv_dtype == kvq
        probe.close()
        for T in (5, 31, 70):
            ids = rng.integers(3, 200, T).tolist()
            kv_g, st_g = gpu.new_kv_pool(16, PAGE), gpu.new_state_pool(1)
            kv_c, st_c = cpu.new_kv_pool(16, PAGE), cpu.new_state_pool(1)
            batch = ForwardBatch.single(ids, 0, table[: -(-T // PAGE)], 0)
            err = rel_err(gpu.forward(batch, kv_g, st_g, all_logits=True),
                          cpu.forward(batch, kv_c, st_c, all_logits=True))
            assert err < TOL_MODEL_KVQ_F32, f"{kvq}: T={T} prefill logits {err:.2e}"
            # the pools hold the same bytes but where ~1e-7 moved a value across a boundary
            pages = list(range(-(-T // PAGE)))
            _same_bytes(kv_g.read_pages(pages), kv_c.read_pages(pages), T, PAGE, kvq, cpu.text)
            kv_g.close()
            st_g.close()
        prompt = rng.integers(3, 200, 9).tolist()
        kv_g, st_g = gpu.new_kv_pool(4, PAGE), gpu.new_state_pool(1)
        kv_c, st_c = cpu.new_kv_pool(4, PAGE), cpu.new_state_pool(1)
        first = ForwardBatch.single(prompt, 0, table[:2])
        lg, lc = gpu.forward(first, kv_g, st_g), cpu.forward(first, kv_c, st_c)
        for step in range(12):                          # decode graphs (B = 1) from step 1 on
            assert rel_err(lg, lc) < TOL_MODEL_KVQ_F32, f"{kvq}: step {step}"
            tg, tc = int(np.argmax(lg[0])), int(np.argmax(lc[0]))
            top2 = np.sort(lc[0])[-2:]
            assert tg == tc or top2[1] - top2[0] < MARGIN, f"{kvq}: step {step}: {tg} != {tc}"
            pos = len(prompt) + step
            lg = gpu.forward(ForwardBatch.single([tc], pos, table[:2]), kv_g, st_g)
            lc = cpu.forward(ForwardBatch.single([tc], pos, table[:2]), kv_c, st_c)
        kv_g.close()
        st_g.close()
    finally:
        gpu.close()
        cpu.close()
        art.close()


def _same_bytes(got, want, T, ps, kvq, text):
    """Host copies of quantized pages (both backends: QuantizedPages.raw bytes) over the T
    written tokens: scales within 1e-5, at least 99% of the codes equal, the others one code
    step apart."""
    shape = (len(got[0][0]), ps, text.num_key_value_heads, text.head_dim)
    tokens = np.arange(T)
    for g_raw, c_raw in zip(got[0] + got[1], want[0] + want[1]):
        assert g_raw.dtype == np.uint8 and g_raw.shape == c_raw.shape
        a, b = QuantizedPages(shape, kvq), QuantizedPages(shape, kvq)
        a.set_raw(range(shape[0]), g_raw)
        b.set_raw(range(shape[0]), c_raw)
        idx = tokens // ps, tokens % ps
        assert rel_err(a.scale[idx], b.scale[idx]) < 1e-5
        ca = a.codes[idx].astype(np.float32)
        cb = b.codes[idx].astype(np.float32)
        assert np.mean(ca == cb) >= 0.99
        if kvq == "int8":
            assert np.abs(ca - cb).max() <= 1
        else:                                # neighbouring e4m3 values: within 1/8 relative
            assert (np.abs(ca - cb) <= np.maximum(np.abs(cb), 2.0 ** -6) / 8 + 1e-12).all()


@pytest.mark.parametrize("kvq", ["fp8"])
def test_bfloat16_model_with_quantized_kv_both_attention_paths(fixture_path, kvq):
    """bf16 model: prefill logits against numpy's within the fixtures' bf16 tolerance, through
    the tensor-core path (70 >= 64 new tokens: kv_gather from quantized pages) and the CUDA-core
    kernel (31, and 70 again with the threshold moved past it); decode steps on numpy's tokens."""
    art, cpu, gpu = _models(fixture_path, kvq, None)
    tol = TOL_FIXTURE_BF16_MOE if cpu.config.is_moe else TOL_FIXTURE_BF16
    rng = np.random.default_rng(4)
    table = np.arange(16, dtype=np.int32)
    try:
        for T, tc_min in ((70, 64), (31, 64), (70, 10 ** 9)):
            gpu.attn_tc_min_tokens = tc_min
            ids = rng.integers(3, 200, T).tolist()
            kv_g, st_g = gpu.new_kv_pool(16, PAGE), gpu.new_state_pool(1)
            kv_c, st_c = cpu.new_kv_pool(16, PAGE), cpu.new_state_pool(1)
            batch = ForwardBatch.single(ids, 0, table[: -(-T // PAGE)], 0)
            err = rel_err(gpu.forward(batch, kv_g, st_g, all_logits=True),
                          cpu.forward(batch, kv_c, st_c, all_logits=True))
            assert err < tol, f"T={T} tc_min={tc_min}: {err:.2e}"
            if T == 31 and not cpu.config.is_moe:
                for step in range(4):                   # positions 31..34: pages 0..2
                    tok = int(rng.integers(3, 200))
                    one = ForwardBatch.single([tok], T + step, table[:3])
                    err = rel_err(gpu.forward(one, kv_g, st_g), cpu.forward(one, kv_c, st_c))
                    assert err < tol, f"decode step {step}: {err:.2e}"
            kv_g.close()
            st_g.close()
    finally:
        gpu.close()
        cpu.close()
        art.close()


# ---- the Engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return convert_fixture("dense", tmp_path_factory.mktemp("ninfer_kvq_engine"))


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 256, n).astype(np.int32) for n in (1, 13, 29, 40, 21, 9)]


def _params(i):
    return SamplingParams(max_tokens=10, ignore_eos=True, seed=200 + i, temperature=0.8,
                          top_p=0.95)


@pytest.mark.parametrize("kvq", KV_DTYPES)
def test_engine_pauses_with_quantized_kv_keep_tokens(dense, kvq):
    """6 seeded requests under 8 KV pages of 8 tokens pause and resume (Replay, then Snapshot:
    the pages' codes and scales to host and back) and give the tokens each gives alone;
    batch_invariant (float32) makes a row's logits independent of B and Replay exact."""
    opts = dict(backend="cuda", dtype="float32", batch_invariant=True, kv_dtype=kvq,
                max_context=56, page_size=8, prefill_chunk=8)
    prompts = _prompts()
    with Engine(dense, max_concurrency=1, **opts) as engine:
        alone = [engine.generate(p, _params(i)).token_ids for i, p in enumerate(prompts)]
    for snapshot_bytes in (0, 64 << 20):
        with Engine(dense, max_concurrency=4, num_kv_pages=8, host_snapshot_bytes=snapshot_bytes,
                    debug_checks=True, **opts) as engine:
            handles = [engine.submit(p, _params(i)) for i, p in enumerate(prompts)]
            got = [h.result(timeout=300).token_ids for h in handles]
            stats = engine.stats()
            assert engine.health == "ready"
        assert got == alone, snapshot_bytes
        assert stats["pauses"] > 0
        assert (stats["snapshot_resumes"] > 0) == (snapshot_bytes > 0)


@pytest.mark.parametrize("kvq", KV_DTYPES)
def test_engine_context_cache_hit_with_quantized_kv(dense, kvq):
    """Turn 2 of a chat binds turn 1's continuation (shared pages, a copy of the partly filled
    page: codes and scales) and gives the cold run's greedy tokens (float32)."""
    rng = np.random.default_rng(6)
    turn1 = rng.integers(3, 256, 29).astype(np.int32)
    params = SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0)

    def chat(**options):
        with Engine(dense, backend="cuda", dtype="float32", kv_dtype=kvq, max_concurrency=2,
                    max_context=256, prefill_chunk=16, page_size=8, debug_checks=True,
                    **options) as engine:
            r1 = engine.generate(turn1, params)
            turn2 = np.concatenate([turn1, np.asarray(r1.token_ids, np.int32),
                                    rng.integers(3, 256, 11).astype(np.int32)])
            r2 = engine.generate(turn2, params)
            assert engine.health == "ready"
            return r1, r2, engine.stats()

    state = rng.bit_generator.state
    c1, c2, _ = chat(prefix_cache=False)
    rng.bit_generator.state = state
    w1, w2, stats = chat()
    assert (w1.token_ids, w2.token_ids) == (c1.token_ids, c2.token_ids)
    # (the pipelined decode's step ahead ran the last sampled token: the continuation holds it;
    # test_context_cache_gpu.py tests both ways)
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    ran_last = int(CudaModel.chains_token_steps)
    assert w2.num_cached_tokens == 29 + 7 - 1 + ran_last and c2.num_cached_tokens == 0
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_device_bytes"] > 0
