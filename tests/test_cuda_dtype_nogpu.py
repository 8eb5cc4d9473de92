"""dtype="float32" on the CUDA backend, without a GPU: the option and the CLI flag, the kernel
variants (specs, PTX for sm_90 at real geometries, the simulator against float64), cuBLASLt's
types, the memory plan and the fp32 KV pools."""
import json
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from ninfer.core.cuda import kernels as K
from ninfer.errors import DeviceError, RequestError
from ninfer.options import EngineOptions
from ninfer.models.qwen3_5.config import TextConfig
from ninfer.models.qwen3_5.cuda.kernel_set import F32_VARIANTS, SIGS, geometry_specs, spec
from ninfer.options import EngineOptions

from cuda_shapes import SHAPES
from fake_cublaslt import fake_cublaslt

ROOT = pathlib.Path(__file__).resolve().parents[1]
LT = ("linear_attention",) * 3 + ("full_attention",)


def _cfg(shape):
    return TextConfig(layer_types=LT, num_hidden_layers=4, **SHAPES[shape])


# ---- the option and the flag -----------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", [("cuda", None), ("cuda", "bfloat16"),
                                            ("cuda", "float32"), ("numpy", None),
                                            ("numpy", "float32")])
def test_dtype_option_accepts(backend, dtype):
    assert EngineOptions.from_kwargs(backend=backend, dtype=dtype).dtype == dtype


@pytest.mark.parametrize("backend, dtype, words", [
    ("cuda", "float16", "dtype='float16': must be None, 'bfloat16' or 'float32'"),
    ("numpy", "fp32", "dtype='fp32'"),
    ("numpy", "bfloat16", "numpy backend computes in float32 only"),
])
def test_dtype_option_refuses_with_a_reason(backend, dtype, words):
    with pytest.raises(RequestError, match=words):
        EngineOptions.from_kwargs(backend=backend, dtype=dtype)


def _ninfer(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ninfer", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command, args, message", [
    ("run", ["--prompt", "x", "--dtype", "bfloat16"], "numpy backend computes in float32 only"),
    ("run", ["--prompt", "x", "--dtype", "float16"], "invalid choice: 'float16'"),
    ("serve", ["--dtype", "bfloat16"], "numpy backend computes in float32 only"),
])
def test_dtype_flag_bad_input_one_line_error(command, args, message):
    r = _ninfer(command, *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_run_flag_reaches_the_engine(monkeypatch):
    """`run --backend cuda --dtype float32` builds the Engine with dtype='float32'."""
    import ninfer.engine
    from ninfer import commands
    from ninfer.cli import build_parser
    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(path, **kwargs):
        seen.update(kwargs)
        raise Stop
    monkeypatch.setattr(ninfer.engine, "Engine", fake_engine)
    monkeypatch.setattr(commands, "_artifact_or_demo", lambda path: (path, False))
    args = build_parser().parse_args(["run", "m.ninfer", "--prompt", "x", "--backend", "cuda",
                                      "--dtype", "float32", "--max-context", "256"])
    with pytest.raises(Stop):
        args.handler(args)
    assert seen["dtype"] == "float32" and seen["backend"] == "cuda"
    for cmd in (["run", "--prompt", "x"], ["serve"]):
        assert build_parser().parse_args(cmd).dtype is None          # default: the backend's



def test_serve_flag_reaches_the_engine(monkeypatch):
    """`serve --backend cuda --dtype float32`: the workers' engine factory builds the Engine
    with dtype='float32'."""
    import ninfer.engine
    import ninfer.serve.launcher as launcher
    from ninfer import serve_command
    from ninfer.cli import build_parser
    seen = {}
    started = types.SimpleNamespace(startup_seconds={"total": 1.0, "tokenizer": 0.1,
                                                     "model": 0.8, "warm_up": 0.1},
                                    stats=lambda: {"startup_seconds": 1.0},
                                    frontend=None)       # (scoring-only: no tokenizer)

    def engine(path, **kw):
        seen.update(kw)
        return started
    monkeypatch.setattr(ninfer.engine, "Engine", engine)
    monkeypatch.setattr(serve_command, "_artifact_or_demo", lambda path: (path, False))
    monkeypatch.setattr(serve_command, "_check_can_listen", lambda host, port: None)
    monkeypatch.setattr(launcher, "serve", lambda factory, config, **kw: factory())
    args = build_parser().parse_args(["serve", "m.ninfer", "--backend", "cuda", "--dtype",
                                      "float32", "--max-context", "256"])
    assert args.handler(args) == 0
    assert seen["dtype"] == "float32" and seen["backend"] == "cuda"

# ---- kernel variants ---------------------------------------------------------------------------

def test_f32_specs_swap_every_bf16_pointer_and_drop_the_tensor_core_path():
    for shape in SHAPES:
        bf, f32 = geometry_specs(_cfg(shape)), geometry_specs(_cfg(shape), True)
        assert any(s.module == "attention_tc" for s in bf.values())
        assert not any(s.module == "attention_tc" for s in f32.values())
        assert "widen_bf16" in f32 and "widen_bf16" not in bf
        # the chunked delta rule: tensor cores (tf32) for bf16, the fp32 kernels for float32
        assert not any(s.module == "gdn_chunk_tc" for s in f32.values())
        for name in ("gdn_chunk_prep", "gdn_chunk_scan"):
            if name + "_tc" in bf:
                assert name not in bf and name in f32
        for name, s in f32.items():
            if name in F32_VARIANTS:
                assert dict(s.params)["f32"] is True
                assert "u16*" not in s.sig and "u32*" not in s.sig, name
                assert len(s.sig) == len(bf[name].sig)
                assert dict(s.params) == {**dict(bf[name].params), "f32": True}
            elif name != "widen_bf16" and not (name.startswith("gdn_chunk") and name not in bf):
                assert s == bf[name]                      # fp32 already: the same kernel
        for name in F32_VARIANTS & set(bf):
            assert "f32" not in dict(bf[name].params)    # bf16: the spec of before
    with pytest.raises(ValueError, match="no float32 variant"):
        spec("argmax", True)
    assert set(F32_VARIANTS) <= set(SIGS)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_storage_variant_compiles_to_ptx_for_sm90(shape):
    """Both dtypes of every kernel with an f32 variant (and the widening kernel) at the real
    geometry: PTX for sm_90 with one entry; fp32 variants store no 16-bit values."""
    try:
        K.compile_spec(spec("silu_mul"), (9, 0))
    except Exception as exc:   # noqa: BLE001 - no NVVM here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    cfg = _cfg(shape)
    bf, f32 = geometry_specs(cfg), geometry_specs(cfg, True)
    names = sorted((F32_VARIANTS & set(bf)) | {"widen_bf16"})
    for name in names:
        for variant, specs in (("bf16", bf), ("f32", f32)):
            if name not in specs:
                continue
            ptx = K.compile_spec(specs[name], (9, 0))
            assert ".target sm_90" in ptx and K.entry_name(ptx), (name, variant)
            if variant == "f32" and name != "widen_bf16":
                assert "st.global.u16" not in ptx and "st.global.b16" not in ptx, name
    ptx = K.compile_spec(bf["rmsnorm"], (9, 0))
    assert "st.global.u16" in ptx or "st.global.b16" in ptx     # the check above can fail


def test_storage_variants_on_the_simulator():
    """kernels/{norm,act,moe,attention,fill}.py in both variants on numba-cuda's simulator
    against float64 (tests/gpu/sim_storage.py); the 4-wide SwiGLU and gated norm among them."""
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_storage.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    err = json.loads(res.stdout.strip().splitlines()[-1])
    assert err.pop("random_bf16 f32 == bf16") is True       # the same random model in both
    assert err.pop("widen exact") is True
    assert err.pop("conv_silu_chunk == conv_silu") is True    # (the same products and sums)
    assert err.pop("fill spread") > 0.1
    for key, e in err.items():
        kernel, variant = key.split("/")
        # fp32 storage: fp32 arithmetic only (gpu_harness TOL_F32); bf16: rounded outputs
        # (TOL_BF16_OUT); an exact copy is exact in both
        tol = 0.0 if kernel == "embed_gather" else (1e-5 if variant == "f32" else 8e-3)
        assert e <= tol, (key, e)
        if variant == "bf16" and kernel in ("rmsnorm", "gated_rmsnorm4", "silu_mul",
                                            "silu_mul4", "paged_attention"):
            assert e > 1e-4, (key, e)        # bf16 rounding really happened: the variants differ
    assert len(err) == 17


# ---- cuBLASLt ----------------------------------------------------------------------------------

def _fake_lt(f32):
    return fake_cublaslt(f32=f32)


def test_cublaslt_grouped_plan_reads_its_shapes_from_the_device_arrays():
    """The grouped GEMM's plan (moe_route.py's experts): strict fp32 compute, W^T x in the same
    column-major view as plan() (A = W_g as k x n, B = X_g as k x m_g, D as n x m_g in fp32),
    every dimension an address of the device arrays it was given (m_g the row counts the
    layout kernels write), alpha and beta by device pointer, the heuristic's shape hints; the
    float32 handle refuses it."""
    from ninfer.core.cuda import cublaslt as C
    lt, calls = _fake_lt(False)
    lt.grouped_plan(96, 200, 40, rows_dev=0x100, n_dev=0x200, k_dev=0x300, avg_rows=16)
    desc = [a for n, a in calls if n == "cublasLtMatmulDescCreate"]
    assert len(desc) == 1 and desc[0][1:] == (C.CUBLAS_COMPUTE_32F, C.CUDA_R_32F)
    layouts = [(a[1], a[2], a[3].value, a[4].value, a[5].value)
               for n, a in calls if n == "cublasLtGroupedMatrixLayoutCreate"]
    assert layouts == [(C.CUDA_R_16BF, 40, 0x300, 0x200, 0x300),    # A: k x n, ld k
                       (C.CUDA_R_16BF, 40, 0x300, 0x100, 0x300),    # B: k x m_g, ld k
                       (C.CUDA_R_32F, 40, 0x200, 0x100, 0x200)]     # D: n x m_g, ld n
    attrs = {a[1]: a[2]._obj.value for n, a in calls if n == "cublasLtMatmulDescSetAttribute"}
    assert attrs == {C.DESC_TRANSA: C.CUBLAS_OP_T, C.DESC_TRANSB: C.CUBLAS_OP_N,
                     C.DESC_POINTER_MODE: C.POINTER_MODE_DEVICE}
    hints = {a[1]: a[2]._obj.value for n, a in calls
             if n == "cublasLtMatmulPreferenceSetAttribute" and a[1] != C.PREF_MAX_WORKSPACE_BYTES}
    assert hints == {C.PREF_GROUPED_AVG_ROWS: 96, C.PREF_GROUPED_AVG_COLS: 16,
                     C.PREF_GROUPED_AVG_K: 200}
    f32, _ = _fake_lt(True)
    with pytest.raises(DeviceError, match="grouped"):
        f32.grouped_plan(96, 200, 40, 0x100, 0x200, 0x300, 16)


@pytest.mark.parametrize("f32", [False, True])
def test_cublaslt_types_and_strict_fp32_compute(f32):
    from ninfer.core.cuda import cublaslt as C
    lt, calls = _fake_lt(f32)
    lt.plan(8, 16, 32)
    desc = [a for n, a in calls if n == "cublasLtMatmulDescCreate"]
    assert len(desc) == 1 and desc[0][1:] == (C.CUBLAS_COMPUTE_32F, C.CUDA_R_32F)
    assert C.CUBLAS_COMPUTE_32F == 68            # CUBLAS_COMPUTE_32F_FAST_TF32 is 77
    types = [a[1] for n, a in calls if n == "cublasLtMatrixLayoutCreate"]
    ab = C.CUDA_R_32F if f32 else C.CUDA_R_16BF
    assert types == [ab, ab, C.CUDA_R_32F]       # A (W), B (X), C/D
    attrs = [a[1] for n, a in calls if n == "cublasLtMatmulDescSetAttribute"]
    assert sorted(attrs) == [C.DESC_TRANSA, C.DESC_TRANSB]      # nothing that loosens fp32


def test_cublaslt_constructor_takes_the_dtype(monkeypatch):
    from ninfer.core.cuda import cublaslt as C
    monkeypatch.setattr(C, "load_library", lambda: _fake_lt(False)[0].lib)
    assert C.CublasLt(0, 1 << 20).ab_type == C.CUDA_R_16BF
    assert C.CublasLt(0, 1 << 20, f32=True).ab_type == C.CUDA_R_32F


# ---- memory plan -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_weight_plan_bytes_by_dtype(shape):
    from ninfer.models.qwen3_5.cuda import weights as W
    cfg = _cfg(shape)
    plans = [W.model_plan(cfg)] + [W.layer_plan(cfg, i) for i in range(cfg.num_hidden_layers)]
    for f32 in (False, True):
        for tied in (False, True):
            want = sum(-(-int(np.prod(sh)) * (4 if f32 or dt == W.F32 else 2) // 256) * 256
                       for p in plans for name, (sh, dt, _) in p.items()
                       if not (tied and name == "lm_head"))
            assert W.plan_bytes(cfg, tied, f32) == want
    assert W.plan_bytes(cfg, f32=True) > 1.9 * W.plan_bytes(cfg)


def _bare(cfg, f32, b_cap=4, n_cap=512, max_context=4096, page_size=16):
    from ninfer.models.qwen3_5.cuda.meta import MetaLayout
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    m = CudaModel.__new__(CudaModel)
    m.text, m.f32 = cfg, f32
    m.p_cap = (max_context + page_size - 1) // page_size + 1
    m.lg_cap, m.max_keys = max(b_cap, min(n_cap, 256)), m.p_cap * page_size
    m.eager_layout = MetaLayout(n_cap, max(b_cap, 8), m.p_cap)
    m.decode_layout = MetaLayout(b_cap, b_cap, m.p_cap)
    return m


class _CountingArena:
    def __init__(self):
        self.nbytes, self.taken = 0, []

    def take(self, shape, dtype, what):
        from ninfer.core.cuda.arena import DeviceArray, _round_up
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self.nbytes += _round_up(max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1))
        a = DeviceArray(1 << 40, shape, dtype)
        self.taken.append(a)
        return a


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("b_cap, n_cap, max_context", [(1, 512, 2048), (8, 4096, 32768)])
def test_float32_workspace_plan_covers_the_workspace(shape, b_cap, n_cap, max_context):
    from ninfer.models.qwen3_5.cuda_model import LT_WORKSPACE, workspace_bytes
    from ninfer.models.qwen3_5.cuda.runner import Workspace, part_rows_needed
    cfg = _cfg(shape)
    sizes = {}
    for f32 in (False, True):
        m = _bare(cfg, f32, b_cap, n_cap, max_context)
        part_rows = part_rows_needed(n_cap, cfg.num_key_value_heads, 132)
        arena = _CountingArena()
        ws = Workspace(arena, cfg, n_cap, m.lg_cap, part_rows, m.max_keys, f32=f32)
        arena.take((m.eager_layout.count + m.decode_layout.count,), np.int32, "metadata")
        arena.take((LT_WORKSPACE,), np.uint8, "cuBLASLt workspace")
        assert arena.nbytes <= workspace_bytes(
            cfg, f32=f32, n_cap=n_cap, lg_cap=m.lg_cap, part_rows=part_rows, max_keys=m.max_keys,
            meta_bytes=m.eager_layout.nbytes + m.decode_layout.nbytes)
        gin = np.float32 if f32 else np.uint16
        for name in ("x", "act", "xf") + (("xg", "gact") if cfg.is_moe else ()):
            assert getattr(ws, name).dtype == gin, name
        assert (ws.tc.l_cap == 0) == f32                 # no tensor-core buffers in float32
        if cfg.linear_layer_ids:     # the chunked delta rule: tensor cores (chunks of 64) for bf16
            from ninfer.models.qwen3_5.cuda import gdn_chunk as gc
            tc = not f32 and gc.tc_ok(cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            assert tc == (not f32 and "tiny" not in shape)      # every release geometry takes it
            assert ws.gdn_tc == tc and ws.gdn_cn == (
                gc.TC_CHUNK if tc else gc.chunk_size(cfg.linear_key_head_dim))
            assert ws.gdn_p.shape == (n_cap, cfg.linear_num_value_heads, ws.gdn_cn)
        sizes[f32] = workspace_bytes(
            cfg, f32=f32, n_cap=n_cap, lg_cap=m.lg_cap, part_rows=part_rows, max_keys=m.max_keys,
            meta_bytes=m.eager_layout.nbytes + m.decode_layout.nbytes)
    # fp32 GEMM inputs cost more, the tensor-core buffers (bf16 only) less
    assert sizes[True] != sizes[False]


def test_pool_reserve_counts_fp32_kv():
    from types import SimpleNamespace
    from ninfer.models.qwen3_5.memory_plan import max_state_slots, pool_bytes
    cfg = _cfg("27B")
    kv_bf16 = 2 * len(cfg.attention_layer_ids) * 100 * 16 * cfg.num_key_value_heads * cfg.head_dim * 2
    slots = max_state_slots(4)
    assert pool_bytes(cfg, 100, 16, slots, 4) - pool_bytes(cfg, 100, 16, slots, 2) == kv_bf16


def test_too_little_memory_names_the_float32_plan(monkeypatch):
    """The memory check uses the dtype's plan: free memory enough for bf16 and not for fp32 ->
    bf16 passes the check (and reaches the arena), fp32 raises DeviceError before allocating.
    (A KV pool large enough that fp32 KV outweighs the bf16-only tensor-core buffers.)"""
    from fake_plan_device import ArenaReached, install
    from ninfer.models.qwen3_5 import cuda_model as cm
    from ninfer.models.qwen3_5.config import ModelConfig
    cfg = TextConfig(layer_types=LT, num_hidden_layers=4, **SHAPES["tiny-moe"])
    memory = install(monkeypatch)
    config = ModelConfig("Qwen3_5ForCausalLM", cfg)
    needs = {}
    for dtype in ("bfloat16", "float32"):
        memory["free"] = 1 << 50
        with pytest.raises(ArenaReached) as exc:
            cm.CudaModel(config, EngineOptions(backend='cuda', dtype=dtype, max_context=8192, num_kv_pages=100000), random_seed=1)
        needs[dtype] = exc.value.args[0]
    assert needs["float32"] > needs["bfloat16"]
    memory["free"] = (needs["bfloat16"] + needs["float32"]) // 2 + cm.MEMORY_MARGIN
    with pytest.raises(ArenaReached):
        cm.CudaModel(config, EngineOptions(backend="cuda", dtype="bfloat16", max_context=8192, num_kv_pages=100000), random_seed=1)
    with pytest.raises(DeviceError, match="too little device memory.*all in float32"):
        cm.CudaModel(config, EngineOptions(backend="cuda", dtype="float32", max_context=8192, num_kv_pages=100000), random_seed=1)


# ---- fp32 KV pools -----------------------------------------------------------------------------

def test_float32_kv_pool_round_trips_fp32_values(monkeypatch):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_cuda_nogpu import _FakeDevice, _pool_config, _pool_dev
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool
    from ninfer.models.qwen3_5.state import KVPool
    dev, cfg, r = _FakeDevice(monkeypatch, 64 << 20), _pool_config(), np.random.default_rng(3)
    dev.f32 = True
    kv = DeviceKVPool(_pool_dev(dev), cfg, 5, 4)
    assert all(a.dtype == np.float32 for a in kv.k + kv.v)
    ref = KVPool.allocate(cfg, 5, 4)
    data = tuple([r.standard_normal((2,) + k.shape[1:]).astype(np.float32) for k in ref.k]
                 for _ in range(2))
    for pool in (kv, ref):
        pool.write_pages([4, 1], data)
    for got, want in zip(kv.read_pages([0, 1, 4]), ref.read_pages([0, 1, 4])):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))     # no bf16 rounding


def test_numpy_loader_refuses_bfloat16_without_validated_options():
    """load_model with options that skipped EngineOptions.validate still refuses numpy + bf16
    (it would compute in float32 and say nothing); no artifact is touched before the refusal."""
    from types import SimpleNamespace
    from ninfer.models.qwen3_5 import load_model
    with pytest.raises(RequestError, match="numpy backend computes in float32 only"):
        load_model(object(), SimpleNamespace(backend="numpy", dtype="bfloat16"))


@pytest.mark.skipif(os.environ.get("NINFER_SIM_MODEL") != "1",
                    reason="minutes on the simulator: set NINFER_SIM_MODEL=1")
@pytest.mark.parametrize("kind", ["dense", "moe", "dense-split"])
def test_whole_model_on_the_simulator_matches_numpy(kind):
    """CudaModel's whole launch sequence (tests/gpu/sim_model.py: kernels on the simulator,
    numpy GEMMs, fake device memory) in both dtypes against the numpy backend: float32 within
    1e-5 (measured 6e-7) and the same greedy token; bfloat16 within its model tolerance. The MoE
    prefill of 3 tokens takes the grouped path, its decode the GEMVs: in bfloat16 routed on the
    device (moe_route.py: the layout kernels, a padded block of 2 rows an expert on the
    strided-batched GEMM and our grouped GEMM over the tiles of the rows past it), in float32 on
    the host (strided-batched GEMMs).
    dense-split: paged attention with a kv head's query heads in two blocks (GS < G)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_model.py"),
                          kind, "3", "1"], env=env, capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    f, b = out["float32"], out["bfloat16"]
    assert f["prefill"] < 1e-5 and max(f["steps"]) < 1e-5, f
    assert f["tokens_cuda"] == f["tokens_numpy"] and f["kv_dtype"] == "float32", f
    assert 1e-4 < b["prefill"] < 3e-2 and b["kv_dtype"] == "uint16", b     # bf16 really rounds
    assert f["kv_round_trip"] and b["kv_round_trip"]
    assert not f["moe_device_route"] and b["moe_device_route"] == (kind == "moe")
    # (with our grouped GEMM: the simulated cuBLASLt has none, as cuBLAS 13.1's; kernels/
    # grouped_gemm.py and moe_route_tiles on the simulator)
    assert b["moe_own_gemm"] == (kind == "moe")


def test_widening_upload_in_pieces(monkeypatch):
    """weight_load.upload_widened: a weight larger than the scratch (the cuBLASLt workspace) goes up in
    pieces, each widened into its place; the fp32 result equals the bf16 values exactly."""
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / "tests"))
    from test_cuda_nogpu import _FakeDevice
    from ninfer.models.qwen3_5.cuda.weight_load import WeightLoader, upload_widened
    dev = _FakeDevice(monkeypatch, 1 << 20)
    scratch = dev.arena.take((64,), np.uint8, "scratch")
    dst = dev.arena.take((7, 15), np.float32, "weight")  # 105 values: 4 pieces, the last short
    pieces = []

    def widen(stream, grid, block, args):
        out, bits, n = args
        src = dev._dev(getattr(bits, "ptr", bits), 2 * n).view(np.uint16)
        dev._dev(out, 4 * n)[:] = (src.astype(np.uint32) << 16).view(np.float32).view(np.uint8)
        pieces.append(n)
    kernels = SimpleNamespace(widen_bf16=SimpleNamespace(launch=widen))
    # a 64-byte scratch: 32 bf16 values per piece
    loader = WeightLoader(dev.arena, kernels, dev.stream, True, scratch, 64)
    r = np.random.default_rng(0)
    bits = (r.standard_normal((7, 15)).astype(np.float32).view(np.uint32) >> 16
                       ).astype(np.uint16)
    upload_widened(loader, dst, bits, dev._pinned(64))
    got = dev._dev(dst.ptr, dst.nbytes).view(np.float32).reshape(7, 15)
    assert pieces == [32, 32, 32, 9]
    assert np.array_equal(got, (bits.astype(np.uint32) << 16).view(np.float32))


_SIM_SLOW = pytest.mark.skipif(os.environ.get("NINFER_SIM_MODEL") != "1",
                               reason="minutes on the simulator: set NINFER_SIM_MODEL=1")


def _sim_script(script: str, *args) -> dict:
    """The JSON a tests/gpu/sim_*.py script prints last (kernels on the simulator)."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu" / script),
                          *args], env=env, capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _sim_mtp(kind: str, part: str) -> dict:
    return _sim_script("sim_mtp.py", kind, part)


def test_dflash_steps_on_the_simulator_match_the_numpy_drafter():
    """CudaDFlashDrafter (issue 30: the feed's fc, norm and context K/V into the pool's extra
    layers; the block pass over context and block with the plain norms, full-head RoPE, the
    non-causal paged attention and the ungated merge; the target's lm_head and argmax) on the
    simulator (tests/gpu/sim_dflash.py: two rows, one fed in two calls) against DFlashDrafter,
    a drafter of its own KV geometry (head_dim 8 and 1 KV head against the target's 16 and 2:
    its pool layers of their own page shape): float32 hidden within 1e-5 (measured 1.8e-7 at
    the target's geometry) and the same drafts; bf16 within its rounding (measured 2.6e-3)."""
    out = _sim_script("sim_dflash.py", "step", "own")
    f, b = out["float32"], out["bfloat16"]
    assert f["hidden"] < 1e-5 and f["ids_equal"] and f["shape"] == [2, 4, 32], f
    assert 1e-4 < b["hidden"] < 3e-2 and b["ids_agree"] >= 0.75, b     # bf16 really rounds
    assert f["kv_layers"] == f["target_kv_layers"] + 2                  # the drafter's, last


@_SIM_SLOW
def test_dflash_verify_features_on_the_simulator():
    """CudaModel.verify_forward with the drafter's hidden_layers (StepRunner.run's capture into
    the feature rows) on the simulator: features and logits as the numpy model's; and a plain
    decode step's features (launch_tokens(keep_hidden=True, hidden_layers=...))."""
    out = _sim_script("sim_dflash.py", "verify")
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 3e-2)):
        v = out[dtype]
        assert v["verify_logits"] < tol and v["verify_features"] < tol, (dtype, v)
        assert v["step_features"] < tol, (dtype, v)     # a plain step's (keep_hidden=True)
        assert v["features_shape"] == [4, 3 * 32], v


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=_SIM_SLOW)])
def test_mtp_step_on_the_simulator_matches_the_numpy_drafter(kind):
    """CudaModel.mtp_forward (issue 25: the MTP head's step on the device: the fc prologue's two
    norms, the fc GEMM, its full-attention layer on the KV pool's extra last layer, its MLP, the
    final norm, the shared lm_head) on the simulator (tests/gpu/sim_mtp.py) against
    MtpDrafter.forward, a fresh row and then a continuation that attends to its KV: float32
    within 1e-5 (measured 2e-7) and the same argmax, bfloat16 within its rounding (3.5e-3).
    And CudaModel.mtp_chain (3 draft steps of 2 rows in one call, each step's argmaxes fed to
    the next on the device): the drafts and drafter KV of mtp.draft_greedy step by step over
    the same model, bit for bit in both dtypes, and float32 the numpy drafter's drafts; the
    feed's mtp_argmax(last_only=True) brings down the rows' last MTP hidden states alone."""
    out = _sim_mtp(kind, "step")
    f, b = out["float32"], out["bfloat16"]
    assert max(f["logits"] + f["hidden"]) < 1e-5 and all(f["argmax_equal"]), f
    assert 1e-4 < max(b["logits"] + b["hidden"]) < 3e-2, b           # bf16 really rounds
    assert f["kv_layers"] == f["model_kv_layers"] + 1                # the drafter's, last
    for res in (f, b):
        assert res["chain_shape"] == [2, 3], res
        assert res["chain_equals_stepwise"] and res["chain_kv_stepwise"], res
    assert f["chain_equals_numpy"] and f["feed_last_rows"] is True, f


@_SIM_SLOW
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_verify_on_the_simulator_keeps_the_state_after_every_token(kind):
    """CudaModel.verify_forward (the target over a row's token and 3 drafts with the snapshot
    kernels) on the simulator: every token's logits and final-normed hidden (the drafter's feed)
    as the numpy model's, snapshot slot 2 + i the
    numpy State after the first i + 1 tokens, the row's slot after all, slot 1 untouched."""
    out = _sim_mtp(kind, "verify")
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 3e-2)):
        v = out[dtype]
        assert v["verify_logits"] < tol and v["verify_hidden"] < tol, (dtype, v)
        assert max(v["verify_states"]) < tol, (dtype, v)
        assert v["verify_own"] < tol and v["verify_untouched"], (dtype, v)


@_SIM_SLOW
def test_speculative_units_on_the_simulator_equal_the_numpy_programs():
    """A Program's speculative units on the CUDA model (tests/gpu/sim_speculative.py: the tiny
    model with a random MTP head, float32, 2 rows greedy and seeded, k = 2, a prefill unit and
    a verify unit: over an hour on a loaded 2-core machine) give the numpy Program's tokens;
    every rejected draft undone by a State snapshot slot (no recompute), the numpy Program's by
    recompute."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore",
                          str(ROOT / "tests/gpu/sim_speculative.py"), "2"], env=env,
                         capture_output=True, text=True, timeout=7200)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["tokens_cuda"] == out["tokens_numpy"], out
    got, want = out["stats_cuda"], out["stats_numpy"]
    assert got["spec_verify_rows"] == want["spec_verify_rows"] == 2, out
    assert got["spec_recompute_rows"] == 0 and want["spec_snapshot_selects"] == 0, out
    assert got["spec_snapshot_selects"] == want["spec_recompute_rows"] > 0, out
