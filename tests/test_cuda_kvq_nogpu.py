"""kv_dtype fp8 / int8 on the CUDA backend, without a GPU: the kernel variants' specs and PTX for
sm_90 at a release geometry (ptxas: registers, no spills), the variants on numba-cuda's CPU
simulator (tests/gpu/sim_kv_quant.py: the stored bytes equal kv_quant.quantize's, attention
against float64 over the dequantized pages), the device pool's host copies against the numpy
pool's bytes, and the memory plan (tokens per GiB)."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ninfer.core.cuda import kernels as K
from ninfer.models.qwen3_5.config import TextConfig
from ninfer.models.qwen3_5.cuda.kernel_set import KVQ_VARIANTS, SIGS, geometry_specs, kvq_spec
from sim_run import run_sim
from ninfer.models.qwen3_5.memory_plan import (kv_page_bytes, max_state_slots, plan_device_pools,
                                               pool_bytes, quantized_page_bytes)
from ninfer.models.qwen3_5.releases import release_config
from ninfer.options import EngineOptions

from cuda_shapes import SHAPES

ROOT = pathlib.Path(__file__).resolve().parents[1]
LT = ("linear_attention",) * 3 + ("full_attention",)


def _cfg(shape):
    return TextConfig(layer_types=LT, num_hidden_layers=4, **SHAPES[shape])


# ---- specs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("f32", [False, True])
@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_kvq_specs_replace_the_pool_kernels_only(kv_dtype, f32):
    for shape in SHAPES:
        base = geometry_specs(_cfg(shape), f32)
        got = geometry_specs(_cfg(shape), f32, kv_dtype=kv_dtype)
        # the tensor-core decode attention reads bf16 pairs: quantized pools take paged_attention
        assert set(got) == set(base) - {"paged_attention_mma"}
        for name, sp in got.items():
            if name not in KVQ_VARIANTS:
                assert sp == base[name], name
                continue
            params = dict(base[name].params)
            params.pop("f32", None)
            assert dict(sp.params) == {**params, "kvq": kv_dtype}       # one variant, both dtypes
            at, kind = KVQ_VARIANTS[name]
            bf16_sig = SIGS[name][2]
            assert len(sp.sig) == len(bf16_sig)                         # the same arguments
            for i, (t, b) in enumerate(zip(sp.sig, bf16_sig)):
                assert t == (kind if i in at else b), (name, i)
                if i in at:
                    assert b in ("u16*", "u32*")                        # they were the pools
    with pytest.raises(ValueError, match="no quantized-KV variant"):
        kvq_spec("rmsnorm", "fp8")


def test_options_accept_quantized_kv_on_cuda():
    for kv_dtype in ("fp8", "int8"):
        EngineOptions(backend="cuda", kv_dtype=kv_dtype, dtype="float32").validate()
        EngineOptions(backend="cuda", kv_dtype=kv_dtype).validate()


def _ptxas_info(ptx: str, tmp_path, name: str):
    """(registers, spill bytes) from ptxas -v, or None without ptxas."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    src = tmp_path / f"{name}.ptx"
    src.write_text(ptx)
    res = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", str(src) + ".cubin"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", res.stderr))
    return regs, spills


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_kvq_variants_compile_to_ptx_for_sm90(kv_dtype, tmp_path):
    """The three variants at the 9B geometry (head_dim 256, 4 kv heads, G = 4): PTX for sm_90,
    IEEE division in the scale (as numpy's), no flush-to-zero on the codec's arithmetic, and
    through ptxas (when present) no spills and paged attention within 128 registers (measured
    128; the bf16 kernel 123: four 128-thread blocks per SM either way)."""
    try:
        K.compile_spec(geometry_specs(_cfg("tiny-moe"))["silu_mul"], (9, 0))
    except Exception as exc:   # noqa: BLE001 - no NVVM here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    specs = geometry_specs(release_config("9b"), kv_dtype=kv_dtype)
    for name in KVQ_VARIANTS:
        ptx = K.compile_spec(specs[name], (9, 0))
        assert ".target sm_90" in ptx and K.entry_name(ptx), name
        assert not re.search(r"\bmul\.ftz\.f32|\bdiv\.(approx|full)", ptx), name
        if name == "qk_norm_rope_kv":
            assert "div.rn.f32" in ptx and "cvt.rni" in ptx
        info = _ptxas_info(ptx, tmp_path, name)
        if info is not None:
            regs, spills = info
            assert spills == 0, (name, info)
            if name == "paged_attention":
                assert regs <= 128, regs


# ---- the kernels on the simulator --------------------------------------------------------------

def test_kvq_kernels_on_the_simulator():
    """tests/gpu/sim_kv_quant.py: the codec bit for bit (crafted ties, subnormals, clip, signed
    zeros; all 256 codes decoded), the write kernel's codes and scales equal kv_quant.quantize of
    the float32 variant's K/V on fresh random inputs (all-zero heads, page boundaries, padded
    pages) and no byte outside the written tokens changes, paged attention (both kv head
    splits) against float64 over the dequantized pages with poisoned outputs, kv_gather's bf16
    rows exact."""
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    out = run_sim("sim_kv_quant.py", np.random.default_rng().integers(1 << 30))
    assert len(out) == 11, out
    for key, v in out.items():
        kind = key.split("/")[0]
        if kind in ("codec", "gather"):
            assert v == 0, (key, v)
        elif kind == "write":
            assert v == [0, 0], (key, v)
        else:
            assert v < 1e-5, (key, v)              # fp32 arithmetic (gpu_harness TOL_F32)


# ---- device pools ------------------------------------------------------------------------------

def _fake_pool_device(monkeypatch, kv_dtype):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_cuda_nogpu import _FakeDevice
    from ninfer.core.cuda import driver as d
    from ninfer.models.qwen3_5.cuda.device_pools import HostStaging, PoolDevice
    dev = _FakeDevice(monkeypatch, 64 << 20)

    def dtod(dst, src, n, stream):
        dev._dev(dst, n)[:] = dev._dev(src, n).copy()
    monkeypatch.setattr(d, "copy_dtod_async", dtod)
    return dev, PoolDevice(dev.arena, dev.stream, dev._current, dev._forget_graphs_of,
                           HostStaging(), False, kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("page_size, nkv, hd", [(4, 2, 64), (3, 1, 6)])
def test_quantized_pool_moves_the_numpy_pools_bytes(monkeypatch, kv_dtype, page_size, nkv, hd):
    """DeviceKVPool(kv_dtype): page rows of the planned size; write_pages / read_pages take and
    give the numpy pool's host bytes (QuantizedPages.raw), copy_pages copies them, on a fake
    device memory; (3, 1, 6): 18 code bytes a page, padded to 20 on the device only."""
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool
    from ninfer.models.qwen3_5.state import KVPool
    cfg = TextConfig(layer_types=LT + LT[-1:], num_hidden_layers=5, num_key_value_heads=nkv,
                     head_dim=hd)
    dev, pool_dev = _fake_pool_device(monkeypatch, kv_dtype)
    r = np.random.default_rng(7)
    kv = DeviceKVPool(pool_dev, cfg, 6, page_size)
    ref = KVPool.allocate(cfg, 6, page_size, kv_dtype=kv_dtype)
    whole = quantized_page_bytes(page_size, nkv, hd)[1]
    assert all(a.dtype == np.uint8 and a.shape == (6, whole) for a in kv.k + kv.v)
    assert sum(a.nbytes for a in kv.k + kv.v) == kv_page_bytes(cfg, page_size, 1, kv_dtype) * 6
    for layer in ref.k + ref.v:                       # fresh tokens in every slot of every page
        layer[np.repeat(np.arange(6), page_size), np.tile(np.arange(page_size), 6)] = \
            (r.standard_normal((6 * page_size, nkv, hd)) * 10.0 ** r.uniform(-3, 3)).astype(
                np.float32)
    image = ref.read_pages(range(6))
    kv.write_pages(list(range(6)), image)
    for got, want in zip(kv.read_pages([5, 0, 2]), ref.read_pages([5, 0, 2])):
        assert all(g.dtype == np.uint8 and np.array_equal(g, w) for g, w in zip(got, want))
    kv.copy_pages([1, 4], [3, 0])
    ref.copy_pages([1, 4], [3, 0])
    for got, want in zip(kv.read_pages(range(6)), ref.read_pages(range(6))):
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="KV pages image"):
        kv.write_pages([0], ([a[:, :-1] for a in image[0][:1]] * 2, image[1][:1] * 2))


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_a_drafters_layers_of_their_own_geometry_page_with_the_models(monkeypatch, kv_dtype):
    """DeviceKVPool(extra=((kv heads, head_dim), ...)): a drafter's KV layers (a DFlash
    drafter's may have another geometry than the target's: z-lab's Qwen3-style drafters) are
    arrays of their own page shape after the model's, their bytes those the memory plan counts
    (kv_page_bytes(extra=)), and page copies, writes and reads carry every layer as a numpy
    pool of those layers does."""
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool
    from ninfer.ops.kv_quant import QuantizedPages
    from ninfer.models.qwen3_5.state import KVPool
    page, extra = 4, ((1, 8), (3, 4))
    cfg = TextConfig(layer_types=LT + LT[-1:], num_hidden_layers=5, num_key_value_heads=2,
                     head_dim=16)
    _, pool_dev = _fake_pool_device(monkeypatch, kv_dtype)
    kv = DeviceKVPool(pool_dev, cfg, 6, page, extra=extra)
    shapes = [(6, page, 2, 16)] * 2 + [(6, page) + e for e in extra]
    assert len(kv.k) == len(kv.v) == 4
    itemsize = 1 if kv_dtype else 2
    assert sum(a.nbytes for a in kv.k + kv.v) == \
        kv_page_bytes(cfg, page, itemsize, kv_dtype, extra) * 6
    assert kv_page_bytes(cfg, page, itemsize, kv_dtype, extra) > kv_page_bytes(cfg, page,
                                                                               itemsize, kv_dtype)
    if kv_dtype is None:
        assert [a.shape for a in kv.k] == shapes
        ref = KVPool(page, [np.zeros(s, np.float32) for s in shapes],
                     [np.zeros(s, np.float32) for s in shapes])
    else:
        ref = KVPool(page, [QuantizedPages(s, kv_dtype) for s in shapes],
                     [QuantizedPages(s, kv_dtype) for s in shapes])
    r = np.random.default_rng(11)
    for layer, shp in zip(ref.k + ref.v, shapes * 2):
        vals = r.standard_normal((6 * page,) + shp[2:]).astype(np.float32)
        if kv_dtype is None:                  # bf16 values: the pool stores them exactly
            vals = ((vals.view(np.uint32) >> 16) << 16).view(np.float32)
        layer[np.repeat(np.arange(6), page), np.tile(np.arange(page), 6)] = vals
    kv.write_pages(list(range(6)), ref.read_pages(range(6)))
    kv.copy_pages([1, 4], [3, 0])
    ref.copy_pages([1, 4], [3, 0])
    for got, want in zip(kv.read_pages([0, 3, 5]), ref.read_pages([0, 3, 5])):
        assert len(got) == len(want) == 4
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


# ---- memory plan -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["0.8b", "9b", "27b", "35b-a3b"])
def test_quantized_kv_pages_cost_their_bytes(name):
    """A quantized page: (head_dim + 4) bytes per token and kv head and layer, K and V (codes and
    a float32 scale), against 2 * head_dim for bf16: 1.97x the tokens per GiB at head_dim 256."""
    cfg = release_config(name)
    n, nkv, hd = len(cfg.attention_layer_ids), cfg.num_key_value_heads, cfg.head_dim
    for kv_dtype in ("fp8", "int8"):
        assert kv_page_bytes(cfg, 16, 1, kv_dtype) == 2 * n * 16 * nkv * (hd + 4)
        per_gib = (1 << 30) // kv_page_bytes(cfg, 16, 1, kv_dtype) * 16
        bf16 = (1 << 30) // kv_page_bytes(cfg, 16, 2) * 16
        assert 1.9 < per_gib / bf16 < 2.0
    slots = max_state_slots(8)
    assert pool_bytes(cfg, 100, 16, slots, 2, kv_dtype="fp8") - pool_bytes(cfg, 0, 16, slots, 2) \
        == 100 * kv_page_bytes(cfg, 16, 1, "fp8")
    assert quantized_page_bytes(3, 1, 6) == (20, 32)       # 18 codes padded to 4 bytes
    assert quantized_page_bytes(16, 4, 256) == (16384, 16640)


def test_device_plan_holds_about_twice_the_pages():
    """plan_device_pools in the same free memory: quantized KV holds ~1.97x the bf16 pages (9B,
    B = 8 at 32K: the issue's target shape) and its pool_bytes fit the same budget."""
    cfg = release_config("9b")
    options = EngineOptions(max_concurrency=8, max_context=262144, page_size=16)
    free, fixed, margin = 40 << 30, 20 << 30, 512 << 20
    plans = {kv: plan_device_pools(cfg, options, fixed_bytes=fixed, free_bytes=free,
                                   kv_itemsize=2, margin_bytes=margin, region_slack_bytes=64 << 10,
                                   kv_dtype=kv)
             for kv in (None, "fp8", "int8")}
    base = plans[None].num_kv_pages
    for kv in ("fp8", "int8"):
        assert 1.95 < plans[kv].num_kv_pages / base < 1.98
        assert fixed + plans[kv].pool_bytes + margin <= free
        assert fixed + plans[kv].pool_bytes + margin + kv_page_bytes(cfg, 16, 1, kv) > free


def test_cuda_model_plans_quantized_pools(monkeypatch):
    """CudaModel's load-time plan with kv_dtype: the same free memory holds the pages' byte
    ratio more KV pages (tiny MoE shape, head_dim 32: 1.78x bf16's, 3.56x float32's), and the
    kernel set holds the kvq variants."""
    from fake_plan_device import ArenaReached, install, record_kernel_specs
    from ninfer.models.qwen3_5 import cuda_model as cm
    from ninfer.models.qwen3_5.config import ModelConfig
    cfg = TextConfig(layer_types=LT, num_hidden_layers=4, **SHAPES["tiny-moe"])
    # every plan below max_concurrency * max_context pages (the cap) and above one sequence
    memory = install(monkeypatch)
    seen = record_kernel_specs(monkeypatch)
    config = ModelConfig("Qwen3_5ForCausalLM", cfg)
    for dtype, memory["free"] in (("bfloat16", 2 << 30), ("float32", 3 << 29)):
        pages = {}
        for kv in ("bfloat16", "fp8", "int8"):
            m = cm.CudaModel.__new__(cm.CudaModel)
            with pytest.raises(ArenaReached):
                cm.CudaModel.__init__(m, config, EngineOptions(
                    backend="cuda", dtype=dtype, kv_dtype=kv, max_context=1 << 20,
                    max_concurrency=8), random_seed=1)
            pages[kv] = m.memory_plan.num_kv_pages
            kvq = {n: dict(seen["specs"][n].params).get("kvq") for n in KVQ_VARIANTS
                   if n in seen["specs"]}
            assert set(kvq.values()) == {None if kv == "bfloat16" else kv}, kvq
        itemsize = 4 if dtype == "float32" else 2
        want = cfg.head_dim * itemsize / (cfg.head_dim + 4)       # 1.78x / 3.56x at head_dim 32
        for kv in ("fp8", "int8"):
            assert want * 0.97 < pages[kv] / pages["bfloat16"] < want * 1.01, (dtype, pages)


@pytest.mark.skipif(os.environ.get("NINFER_SIM_MODEL") != "1",
                    reason="minutes on the simulator: set NINFER_SIM_MODEL=1")
@pytest.mark.parametrize("kind, kv_dtype", [("dense", "fp8"), ("moe", "int8")])
def test_whole_model_on_the_simulator_with_quantized_kv(kind, kv_dtype):
    """CudaModel's launch sequence with quantized pools (tests/gpu/sim_model.py) against the
    numpy backend with the same kv_dtype: float32 within the GPU test's TOL_MODEL_KVQ_F32 and
    the same greedy tokens, the pool's host bytes round-trip."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_model.py"),
                          kind, "5", "2", kv_dtype], env=env, capture_output=True, text=True,
                         timeout=3000)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    f, b = out["float32"], out["bfloat16"]
    assert f["prefill"] < 2e-3 and max(f["steps"]) < 2e-3, f
    assert f["tokens_cuda"] == f["tokens_numpy"] and f["kv_dtype"] == "uint8", f
    assert b["prefill"] < 3e-2 and b["kv_dtype"] == "uint8", b
    assert f["kv_round_trip"] and b["kv_round_trip"]
