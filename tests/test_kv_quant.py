"""Quantized KV cache on the numpy backend (EngineOptions.kv_dtype fp8 / int8, ops/kv_quant.py):
the per-token, per-head encoding against float64, paged attention reading quantized pages against
a float64 oracle, the pool's bytes and raw page copies, and the Engine: generation works, and a
seeded request gives the same tokens alone, batched, and through pauses (Replay and Snapshot)."""
import ml_dtypes
import numpy as np
import pytest
from fixture_utils import convert_fixture

from ninfer import Engine, SamplingParams
from ninfer import ops
from ninfer.errors import RequestError
from ninfer.models.qwen3_5.config import TextConfig
from ninfer.models.qwen3_5.state import KVPool
from ninfer.ops.kv_quant import QuantizedPages, dequantize, quantize
from ninfer.options import EngineOptions

pytestmark = pytest.mark.timeout(300)

INT8_STEP = 0.5 * (1 + 1e-6)    # |error| <= half a step (scale = amax / 127), float32 rounding
FP8_REL = 2.0 ** -4             # e4m3: 3 mantissa bits, half an ulp relative (normal range)
FP8_SUB = 2.0 ** -10            # ... absolute, in units of the scale, for subnormal codes
ORACLE_TOL = 2e-5               # float32 attention over dequantized KV vs its float64 oracle


def _values(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., :1] *= 30.0          # an outlier channel (keys have them)
    return x


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 3, 5), (33, 2, 64), (4, 1, 256)])
def test_quantize_round_trip_against_float64(kv_dtype, shape):
    rng = np.random.default_rng(sum(shape))
    x = _values(rng, shape)
    x[0, 0] = 0.0                                  # an all-zero token head: scale 1, codes 0
    codes, scale = quantize(x, kv_dtype)
    assert codes.dtype == (np.int8 if kv_dtype == "int8" else ml_dtypes.float8_e4m3fn)
    assert codes.shape == x.shape and scale.shape == shape[:-1] and scale.dtype == np.float32
    amax = np.abs(x.astype(np.float64)).max(-1)
    top = 127.0 if kv_dtype == "int8" else 448.0
    want_scale = np.where(amax > 0, amax / top, 1.0)
    assert np.allclose(scale, want_scale, rtol=1e-6, atol=0)
    assert scale[0, 0] == 1.0 and not codes[0, 0].astype(np.float32).any()
    got = codes.astype(np.float64) * scale.astype(np.float64)[..., None]
    assert np.array_equal(dequantize(codes, scale), got.astype(np.float32))
    err = np.abs(got - x)
    s = scale.astype(np.float64)[..., None]
    if kv_dtype == "int8":
        assert np.all(err <= INT8_STEP * s)
    else:
        assert np.all(err <= np.abs(x) * FP8_REL + s * FP8_SUB + 1e-12)
    # amax is representable exactly (up to float32 rounding of the scale): nothing saturates
    assert np.all(np.abs(got).max(-1) <= amax * (1 + 1e-6) + 1e-30)


def _attention64(q, keys, vals, ctx, scale):
    """float64 causal attention of one row: q [n, Hq, d], keys/vals [L, Hkv, d]."""
    n, Hq, d = q.shape
    L, Hkv, _ = keys.shape
    out = np.zeros((n, Hq, d))
    for h in range(Hq):
        kh = h // (Hq // Hkv)
        for i in range(n):
            s = keys[: ctx + i + 1, kh] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ vals[: ctx + i + 1, kh] / p.sum()
    return out


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_paged_attention_reads_quantized_pages(kv_dtype):
    """Two rows (a prefill continuing a context, one decode token) over scattered pages: the
    float32 kernel on quantized pages equals float64 attention over the dequantized K/V, and stays
    within the quantization's reach of attention over the original K/V."""
    rng = np.random.default_rng(11)
    P, Hkv, Hq, d = 4, 2, 4, 16
    kp, vp = QuantizedPages((12, P, Hkv, d), kv_dtype), QuantizedPages((12, P, Hkv, d), kv_dtype)
    tables = np.array([[7, 2, 9, 0], [5, 11, 3, 0]], np.int32)
    lens = (10, 6)                                 # tokens already in the pool per row
    new = (3, 1)
    full_k = [_values(rng, (lens[r] + new[r], Hkv, d)) for r in range(2)]
    full_v = [rng.standard_normal((lens[r] + new[r], Hkv, d)).astype(np.float32) for r in range(2)]

    def where(r, positions):
        positions = np.asarray(positions)
        return tables[r, positions // P], positions % P
    for r in range(2):                             # the context, written token by token
        for t in range(lens[r]):
            pg, off = where(r, [t])
            ops.write_paged_kv(kp, vp, full_k[r][t:t + 1], full_v[r][t:t + 1], pg, off)
    q = rng.standard_normal((sum(new), Hq, d)).astype(np.float32)
    pages = np.concatenate([where(r, np.arange(lens[r], lens[r] + new[r]))[0] for r in range(2)])
    offs = np.concatenate([where(r, np.arange(lens[r], lens[r] + new[r]))[1] for r in range(2)])
    ops.write_paged_kv(kp, vp, np.concatenate([full_k[r][lens[r]:] for r in range(2)]),
                       np.concatenate([full_v[r][lens[r]:] for r in range(2)]), pages, offs)
    qs = np.array([0, new[0], sum(new)], np.int32)
    got = ops.paged_attention(q, kp, vp, tables, np.array(lens, np.int32), qs, 0.25)
    for r in range(2):
        pg, off = where(r, np.arange(lens[r] + new[r]))
        deq_k = dequantize(kp.codes[pg, off], kp.scale[pg, off]).astype(np.float64)
        deq_v = dequantize(vp.codes[pg, off], vp.scale[pg, off]).astype(np.float64)
        want = _attention64(q[qs[r]:qs[r + 1]].astype(np.float64), deq_k, deq_v, lens[r], 0.25)
        assert np.allclose(got[qs[r]:qs[r + 1]], want, rtol=ORACLE_TOL, atol=ORACLE_TOL)
        exact = _attention64(q[qs[r]:qs[r + 1]].astype(np.float64), full_k[r].astype(np.float64),
                             full_v[r].astype(np.float64), lens[r], 0.25)
        reach = 0.02 if kv_dtype == "int8" else 0.2      # of the largest |output|
        assert np.abs(got[qs[r]:qs[r + 1]] - exact).max() <= reach * np.abs(exact).max()


def test_pool_bytes_and_raw_page_copies():
    cfg = TextConfig(num_key_value_heads=2, head_dim=64,
                     layer_types=("linear_attention", "full_attention") * 2)
    full = KVPool.allocate(cfg, 8, 4)
    bf16 = KVPool.allocate(cfg, 8, 4, dtype=ml_dtypes.bfloat16)
    rng = np.random.default_rng(2)
    for kv_dtype in ("int8", "fp8"):
        pool = KVPool.allocate(cfg, 8, 4, kv_dtype=kv_dtype)
        # one byte per element plus a float32 scale per token and head: (64 + 4) / 128 of bf16
        assert pool.nbytes * 128 == bf16.nbytes * 68 and pool.nbytes * 256 == full.nbytes * 68
        for a in pool.k + pool.v:
            a[np.array([1, 1, 6]), np.array([0, 3, 2])] = _values(rng, (3, 2, 64))
        image = pool.read_pages([1, 6])
        assert all(x.dtype == np.uint8 for part in image for x in part)
        before = [a[np.array([1, 6])] for a in pool.k + pool.v]
        other = KVPool.allocate(cfg, 8, 4, kv_dtype=kv_dtype)
        other.write_pages([4, 0], image)            # a resume into other pages
        assert all(np.array_equal(a[np.array([4, 0])], b)
                   for a, b in zip(other.k + other.v, before))
        pool.copy_pages([6], [3])                   # the context cache's copy-on-write
        assert all(np.array_equal(a[np.array([3])], a[np.array([6])]) for a in pool.k + pool.v)
        joined = np.zeros_like(pool.k[0])           # the MTP drafter's join_kv_pool
        assert isinstance(joined, QuantizedPages) and joined.kv_dtype == kv_dtype


def test_kv_dtype_option_errors():
    with pytest.raises(RequestError, match="kv_dtype"):
        EngineOptions(kv_dtype="fp16").validate()
    for backend in ("numpy", "cuda"):        # both backends store quantized KV
        for kv_dtype in ("fp8", "int8"):
            EngineOptions(backend=backend, kv_dtype=kv_dtype).validate()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return convert_fixture("dense", tmp_path_factory.mktemp("kv_quant"))


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 256, n).astype(np.int32) for n in (1, 13, 29, 40, 21, 9)]


def _params(i):
    return SamplingParams(max_tokens=10, ignore_eos=True, seed=200 + i, temperature=0.8,
                          top_p=0.95)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_engine_generates_and_pauses_keep_outputs(dense, kv_dtype):
    prompts = _prompts()
    with Engine(dense, max_concurrency=1, kv_dtype=kv_dtype) as engine:
        assert engine.model.new_kv_pool(2, 4).k[0].kv_dtype == kv_dtype
        alone = [engine.generate(p, _params(i)).token_ids for i, p in enumerate(prompts)]
    for snapshot_bytes in (0, 64 << 20):                # Replay, then Snapshot (host pages)
        with Engine(dense, max_concurrency=4, max_context=56, page_size=8, num_kv_pages=8,
                    prefill_chunk=8, host_snapshot_bytes=snapshot_bytes,
                    kv_dtype=kv_dtype) as engine:
            handles = [engine.submit(p, _params(i)) for i, p in enumerate(prompts)]
            got = [h.result(timeout=120).token_ids for h in handles]
            stats = engine.stats()
        assert got == alone
        assert stats["pauses"] > 0
        assert (stats["snapshot_resumes"] > 0) == (snapshot_bytes > 0)


def test_speculative_decoding_with_quantized_kv():
    """The MTP drafter's layer joins a quantized pool (np.zeros_like of a QuantizedPages) and the
    tokens equal plain greedy decoding with the same kv_dtype."""
    from ninfer.demo import ensure_reference_artifact
    ref = ensure_reference_artifact("dense")
    prompts = ["import os\n\ndef main():\n", "class Parser:\n    def __init__(self"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    out = {}
    for spec in (None, "mtp"):
        with Engine(ref, max_concurrency=2, kv_dtype="int8", speculative=spec) as engine:
            hs = [engine.submit(p, params, enable_thinking=False) for p in prompts]
            out[spec] = [h.result(timeout=300).token_ids for h in hs]
            if spec:
                assert engine.stats()["spec_accepted_tokens"] > 0
    assert out["mtp"] == out[None]
