"""The CUDA layer's parts that run without a GPU (CI): cache keys, argument packing, metadata
packing, plan checks, and the DeviceError a GPU-less machine must raise."""
import ctypes
import importlib.util
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest

from ninfer.core.cuda import kernels as K
from ninfer.core.cuda.cublaslt import alignment
from ninfer.errors import DeviceError
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.config import ModelConfig, TextConfig
from ninfer.models.qwen3_5.cuda.kernel_set import (MODULES, SIGS, check_geometry,
                                                   declared_signatures, dflash_specs,
                                                   geometry_specs, mtp_specs,
                                                   spec, speculation_specs, vision_specs)
from ninfer.models.qwen3_5.cuda.meta import MetaLayout
from ninfer.models.qwen3_5.fakes import TensorArtifact
from ninfer.options import EngineOptions

from cuda_shapes import SHAPES


def _gpu_present() -> bool:
    try:
        from ninfer.core.cuda import driver as d
        d.Device(0).close()
        return True
    except Exception:   # noqa: BLE001
        return False


def _pool_dev(fake):
    """The PoolDevice of a fake model (its arena, stream, bind, graph forgetting, f32)."""
    from ninfer.models.qwen3_5.cuda.device_pools import HostStaging, PoolDevice
    return PoolDevice(fake.arena, fake.stream, fake._current, fake._forget_graphs_of,
                      HostStaging(), bool(getattr(fake, "f32", False)))


def test_cache_key_depends_on_source_params_signature_arch_version():
    s = spec("conv_silu", K=4, dk=128, dv=128, nk=16, nv=48)
    base = K.cache_key(s, (9, 0), source="src", version="0.30.4")
    assert base == K.cache_key(s, (9, 0), source="src", version="0.30.4")
    variants = [K.cache_key(s, (9, 0), source="src2", version="0.30.4"),
                K.cache_key(spec("conv_silu", K=4, dk=128, dv=128, nk=16, nv=32), (9, 0),
                            source="src", version="0.30.4"),
                K.cache_key(K.KernelSpec.of("conv", "conv_silu", ("f32*",) * 9, K=4, dk=128,
                                            dv=128, nk=16, nv=48), (9, 0), source="src",
                            version="0.30.4"),
                K.cache_key(s, (8, 0), source="src", version="0.30.4"),
                K.cache_key(s, (9, 0), source="src", version="0.31.0")]
    assert len({base, *variants}) == 6


def test_cache_key_names_the_toolchain_and_compile_options(monkeypatch):
    tid = K._toolchain_id()
    assert "numba-cuda=" in tid and ";numba=" in tid and "opt" in tid and "lineinfo" in tid
    s = spec("silu_mul")
    base = K.cache_key(s, (9, 0), source="src")
    monkeypatch.setattr(K, "COMPILE_OPTIONS", dict(K.COMPILE_OPTIONS, lineinfo=True))
    assert K.cache_key(s, (9, 0), source="src") != base


def test_cache_key_reads_the_kernel_sources():
    s = spec("rmsnorm")
    assert K.cache_key(s, (9, 0)) == K.cache_key(s, (9, 0))
    assert "rmsnorm_kernel" in K.source_text("norm")
    with pytest.raises(DeviceError, match="not found"):
        K.source_text("no_such_kernel_module")


def test_spec_rejects_unknown_argument_type():
    with pytest.raises(ValueError, match="unknown argument type"):
        K.KernelSpec.of("norm", "rmsnorm", ("f16*",))


def test_pack_args_layout():
    sig = ("f32*", "i32", "f32", "i64", "u32")
    keep, addr = K.pack_args(sig, (0x1234_5678_9ABC, -7, 1.5, 2**40, 3))
    ptrs = (ctypes.c_void_p * len(sig)).from_address(addr)
    raw = [ctypes.string_at(p, n) for p, n in zip(ptrs, (8, 4, 4, 8, 4))]
    assert struct.unpack("<Q", raw[0])[0] == 0x1234_5678_9ABC
    assert struct.unpack("<i", raw[1])[0] == -7
    assert struct.unpack("<f", raw[2])[0] == 1.5
    assert struct.unpack("<q", raw[3])[0] == 2**40
    assert struct.unpack("<I", raw[4])[0] == 3


def test_pack_args_checks_count_and_pointers():
    with pytest.raises(ValueError, match="expects 2 arguments"):
        K.pack_args(("f32*", "i32"), (1,))
    with pytest.raises(ValueError, match="device address"):
        K.pack_args(("f32*",), (1.5,))

    class Arr:
        ptr = 4096
    keep, addr = K.pack_args(("u16*",), (Arr(),))
    assert keep[0][0].value == 4096


def test_entry_name_parsing():
    ptx = ".version 9.0\n.target sm_90\n.visible .entry _ZN3fooE(\n.param .u64 a\n)\n{ ret; }"
    assert K.entry_name(ptx) == "_ZN3fooE"
    with pytest.raises(DeviceError, match="one kernel entry"):
        K.entry_name(ptx + "\n.visible .entry _ZN3barE(\n)")


def test_every_signature_names_known_types():
    for name, (module, factory, sig) in SIGS.items():
        assert (pathlib.Path(K.KERNELS_DIR) / f"{module}.py").exists(), name
        for t in sig:
            assert t in K.ARG_TYPES, (name, t)


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_signatures_read_from_the_text_are_the_kernels_own(monkeypatch):
    """kernel_set reads each module's SIGNATURES without importing it: the parse is the table the
    module itself holds, no kernel module is left out, and each kernel takes as many arguments as
    its signature lists (every spec of a dense and a MoE geometry, bf16 and fp32)."""
    import inspect
    from ninfer.core.cuda import numba_shim
    from ninfer.models.qwen3_5.config import FULL_ATTENTION, LINEAR_ATTENTION
    numba_shim.import_numba_cuda()
    declaring = {f.stem for f in pathlib.Path(K.KERNELS_DIR).glob("*.py")
                 if "\nSIGNATURES = {" in f.read_text()}
    assert declaring == set(MODULES)
    for module in MODULES:
        assert declared_signatures(module) == K._import_kernel_module(module).SIGNATURES, module
    types = tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(8))
    dense = TextConfig(num_hidden_layers=8, layer_types=types)
    moe = TextConfig(hidden_size=2048, num_hidden_layers=8, layer_types=types, is_moe=True,
                     num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, num_attention_heads=16,
                     num_key_value_heads=2)
    quant = {(lay, asym) for lay in ("fp8_block", "int8_block", "int4_block")
             for asym in (False, True)}
    specs = [s for cfg in (dense, moe) for f32 in (False, True)
             for s in geometry_specs(cfg, f32, quant).values()]
    specs += [s for f32 in (False, True) for s in vision_specs(f32).values()]
    specs += list(speculation_specs(dense).values())
    specs += [s for f32 in (False, True) for s in mtp_specs(f32).values()]
    from ninfer.models.qwen3_5.config import DFlashConfig
    drafter = DFlashConfig(dense.hidden_size, 2, dense.num_attention_heads,
                           dense.num_key_value_heads, dense.head_dim, 3 * dense.hidden_size,
                           1e-6, 1e6, (1, 3, 5), 16, 0)
    specs += [s for f32 in (False, True) for s in dflash_specs(drafter, f32).values()]
    specs += list(dflash_specs(drafter, kv_dtype="fp8").values())
    # the tensor-core delta rule (a bf16 model's prep and the scan's two passes)
    from ninfer.models.qwen3_5.cuda.kernel_set import gdn_chunk_specs
    specs += list(gdn_chunk_specs(128, 128, 16, 32, tc=True).values())
    assert {s.factory for s in specs} == set(SIGS)
    for s in specs:
        fn = getattr(K._import_kernel_module(s.module), s.factory)(**dict(s.params))
        assert len(inspect.signature(fn).parameters) == len(s.sig), s.factory


def test_geometry_checks_name_the_dimension():
    bad = TextConfig(layer_types=("linear_attention",), num_hidden_layers=1, linear_key_head_dim=6)
    with pytest.raises(DeviceError, match="linear_key_head_dim"):
        check_geometry(bad)
    ok = TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), num_hidden_layers=4)
    assert "gdn_recurrent" in geometry_specs(ok) and "router_topk" not in geometry_specs(ok)


def test_cublaslt_alignment():
    assert alignment(0, 256 * 7) == 256
    assert alignment(256, 64 + 256) == 64
    assert alignment(2) == 2


def test_meta_layout_pack():
    lay = MetaLayout(n_cap=8, b_cap=3, p_cap=4)
    batch = ForwardBatch(token_ids=np.array([5, 6, 7, 9], np.int32),
                         positions=ForwardBatch.text_positions([2, 0], [3, 1]),
                         query_start=np.array([0, 3, 4], np.int32),
                         context_lens=np.array([2, 0], np.int32),
                         block_tables=np.array([[3, 1], [0, -1]], np.int32),
                         state_slots=np.array([1, 0], np.int32))
    host = np.full(lay.count, 99, np.int32)
    lay.pack(host, batch, np.array([2, 3], np.int32))
    o = lay.offsets
    assert host[o["token_ids"]: o["token_ids"] + 4].tolist() == [5, 6, 7, 9]
    assert host[o["token_row"]: o["token_row"] + 4].tolist() == [0, 0, 0, 1]
    assert host[o["positions"] + 8: o["positions"] + 12].tolist() == [2, 3, 4, 0]   # axis h
    assert host[o["out_rows"]: o["out_rows"] + 2].tolist() == [2, 3]
    assert host[o["query_start"]: o["query_start"] + 3].tolist() == [0, 3, 4]
    bt = host[o["block_tables"]: o["block_tables"] + 2 * 4].reshape(2, 4)
    assert bt.tolist() == [[3, 1, -1, -1], [0, -1, -1, -1]]
    assert lay.used_bytes(2) == (o["block_tables"] + 8) * 4
    # a call past the layout's capacities is refused, not written into the next field
    nine = ForwardBatch.single(np.arange(9, dtype=np.int32), 0, [0, 1])
    with pytest.raises(ValueError, match="9 tokens / 1 rows exceed the layout's 8 / 3"):
        lay.pack(host, nine, np.array([8], np.int32))


@pytest.mark.skipif(_gpu_present(), reason="checks the GPU-less error path")
def test_cuda_backend_without_gpu_raises_device_error():
    from ninfer.models.qwen3_5 import load_model

    class Fake(TensorArtifact):
        def tensor(self, name):
            raise AssertionError("weights must not be read before the device check")
    cfg = ModelConfig("Qwen3_5ForCausalLM", TextConfig(
        layer_types=("linear_attention",) * 3 + ("full_attention",), num_hidden_layers=4))
    with pytest.raises(DeviceError, match="backend 'cuda'"):
        load_model(Fake(cfg, {}), EngineOptions(backend="cuda"))


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_compiles_a_kernel_to_ptx_without_a_gpu(tmp_path):
    try:
        ptx = K.compile_spec(spec("silu_mul"), (9, 0))
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    assert ".target sm_90" in ptx
    assert K.entry_name(ptx)
    cache = K.KernelCache((9, 0), tmp_path)
    assert cache.ptx(spec("silu_mul")) and cache.compiled == 1
    assert cache.ptx(spec("silu_mul")) and cache.compiled == 1      # second call: disk hit


def _decode_batch(B=3, P=5, ps=4):
    ctx = np.array([0, 5, 13][:B], np.int32)
    tables = np.arange(B * P, dtype=np.int32).reshape(B, P)[:, ::-1].copy()
    return ForwardBatch(token_ids=np.array([7, 8, 9][:B], np.int32),
                        positions=ForwardBatch.text_positions(ctx, [1] * B),
                        query_start=np.arange(B + 1, dtype=np.int32), context_lens=ctx,
                        block_tables=tables, state_slots=np.array([2, 0, 1][:B], np.int32))


def test_pack_decode_equals_generic_pack():
    lay = MetaLayout(n_cap=8, b_cap=8, p_cap=7)
    b = _decode_batch()
    a, c = np.full(lay.count, 55, np.int32), np.full(lay.count, 55, np.int32)
    lay.pack(a, b, np.arange(3, dtype=np.int32))
    nbytes = lay.pack_decode(c, b)
    used = nbytes // 4
    assert nbytes == lay.used_bytes(3)
    # the generic pack leaves unused slots alone, the fast one zeroes them: compare used fields
    o = lay.offsets
    for f, size in (("token_ids", 3), ("token_row", 3), ("out_rows", 3), ("query_start", 4),
                    ("context_lens", 3), ("state_slots", 3)):
        assert a[o[f]: o[f] + size].tolist() == c[o[f]: o[f] + size].tolist(), f
    for axis in range(3):
        s = o["positions"] + axis * 8
        assert a[s: s + 3].tolist() == c[s: s + 3].tolist()
    assert np.array_equal(a[o["block_tables"]: used], c[o["block_tables"]: used])


def test_check_decode_rejects_bad_rows():
    from ninfer.models.qwen3_5.cuda_model import CudaModel

    class KV:
        page_size, num_pages = 4, 15

    class ST:
        num_slots = 3
    m = CudaModel.__new__(CudaModel)
    m.text = TextConfig(vocab_size=10, layer_types=("linear_attention",) * 3 + ("full_attention",),
                        num_hidden_layers=4)
    m.p_cap, m.n_cap, m.eager_layout = 7, 8, MetaLayout(8, 8, 7)
    _decode_batch().check(m.batch_limits(KV(), ST()))
    b = _decode_batch()
    bad = [ForwardBatch(**{**{f: getattr(b, f) for f in b.__slots__}, "token_ids": np.array([7, 8, 10], np.int32)}),
           ForwardBatch(**{**{f: getattr(b, f) for f in b.__slots__}, "state_slots": np.array([1, 1, 0], np.int32)}),
           ForwardBatch(**{**{f: getattr(b, f) for f in b.__slots__}, "context_lens": np.array([0, 5, 40], np.int32)})]
    t = b.block_tables.copy()
    t[2, 3] = -1
    bad.append(ForwardBatch(**{**{f: getattr(b, f) for f in b.__slots__}, "block_tables": t}))
    for msg, bb in zip(("token id", "state slots", "needs", "does not cover"), bad):
        with pytest.raises(ValueError, match=msg):
            bb.check(m.batch_limits(KV(), ST()))


def test_runner_launches_by_attribute_and_profiles_under_the_kernel_names(monkeypatch):
    """StepRunner takes its kernels from StepResources by attribute; a dry run launches nothing;
    the profile keys launches by the kernel set's names (the spec's factory), as before."""
    from types import SimpleNamespace
    from ninfer.models.qwen3_5.cuda import runner as R
    launched = []

    class Kernel:
        def __init__(self, name):
            self.spec = spec(name)

        def launch(self, st, grid, block, args, smem=0):
            launched.append((self.spec.factory, grid, block))

    class Event:
        def __init__(self, *a, **k):
            pass

        def record(self, st):
            pass

        def elapsed_ms(self, other):
            return 0.5

        def destroy(self):
            pass
    monkeypatch.setattr(R._d, "Event", Event)
    ptr = SimpleNamespace(ptr=0)
    ws = SimpleNamespace(xf=ptr, h=ptr, logits=ptr, tokens=ptr)
    lt = SimpleNamespace(gemm=lambda *a: launched.append(("gemm",)))
    res = R.StepResources(cfg=TextConfig(), ws=ws, weights={"norm": 0, "lm_head": ptr}, lt=lt,
                          kernels=SimpleNamespace(rmsnorm=Kernel("rmsnorm"),
                                                  argmax=Kernel("argmax")),
                          num_sms=132, b_cap=1, moe_gemv_tokens=1, n_cap=4, route_host=None, media=None)
    r = R.StepRunner(res, invariant=False, attn_tc_min_tokens=64)
    meta = SimpleNamespace(out_rows=0)
    r.profile = []
    r.head(None, meta, 2)
    assert launched == [("rmsnorm", (2,), (1024,)), ("gemm",), ("argmax", (2,), (1024,))]
    assert r.profile_summary() == {"rmsnorm": 0.5, "gemm": 0.5, "argmax": 0.5}
    launched.clear()
    r.dry = True
    r.launch(None, res.kernels.rmsnorm, (1,), (32,), ())
    assert launched == []


# ---- tensor-core prefill attention: row split, query blocks, the kernels on the simulator -------

def test_split_rows_between_the_two_attention_paths():
    from ninfer.models.qwen3_5.cuda.runner import split_rows
    # rows (query_start, tokens, context): 9 | 64 | 63 | 1 | 70, threshold 64
    rows = [(0, 9, 0), (9, 64, 0), (73, 63, 5), (136, 1, 40), (137, 70, 100)]
    big, runs = split_rows(rows, 207, 64, 1024)
    assert big == [1, 4] and runs == [(0, 9), (73, 137)]
    assert split_rows(rows, 207, 10 ** 9, 1024) == ([], [(0, 207)])      # decode / path off
    assert split_rows([], 4, 64, 1024) == ([], [(0, 4)])                 # graphs: no row info
    assert split_rows(rows, 207, 1, 1024) == ([0, 1, 2, 3, 4], [])
    # a row whose keys exceed the buffers stays on the CUDA-core kernel
    assert split_rows(rows, 207, 64, 160) == ([1], [(0, 9), (73, 207)])


@pytest.mark.parametrize("n,ctx,G,s_cap", [(4096, 0, 6, 1 << 26), (16384, 0, 6, 1 << 26),
                                           (100, 3000, 4, 4 * 3104), (7, 1, 1, 16)])
def test_query_blocks_fit_the_s_buffer(n, ctx, G, s_cap):
    from ninfer.models.qwen3_5.cuda.attention_tc import QB_MAX, pad8, query_block
    qb = query_block(n, ctx, G, s_cap)
    assert 1 <= qb <= min(n, QB_MAX)
    for t0 in range(0, n, qb):
        t1 = min(n, t0 + qb)
        assert (t1 - t0) * G * pad8(ctx + t1) <= s_cap
    # the largest block that fits: one more token would not
    assert qb in (n, QB_MAX) or (qb + 1) * G * pad8(ctx + n) > s_cap


def test_tensor_core_attention_kernels_on_the_simulator():
    """kernels/attention_tc.py + attend_row's blocking on numba-cuda's CPU simulator against the
    float64 oracle (two rows, ctx > 0 across pages, padded head rows, several query blocks),
    with either softmax kernel."""
    import os
    import subprocess
    import sys
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(root))
    res = subprocess.run([sys.executable, "-W", "ignore", str(root / "tests/gpu/sim_attention_tc.py")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    errs = [float(e) for e in res.stdout.strip().splitlines()[-1].split()]
    # bf16 q, P and output roundings (the GPU op test's TOL_BF16_OUT); the softmax with the
    # row in registers (causal_softmax_reg), then the two-pass one (causal_softmax); then the
    # first alone over rows of 1,032 keys (bf16 P: ~2e-3)
    assert len(errs) == 3 and max(errs) < 8e-3, errs


# ---- review: batch checks agree with the numpy model, geometry limits, cache races, close -------

def _bare_models(layer_types, vocab=10):
    """A CudaModel and a NumpyModel without weights: only their batch checks are called."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from ninfer.models.qwen3_5.model import NumpyModel
    cfg = TextConfig(vocab_size=vocab, layer_types=layer_types, num_hidden_layers=len(layer_types))
    cm, nm = CudaModel.__new__(CudaModel), NumpyModel.__new__(NumpyModel)
    cm.text = nm.text = cfg
    cm.p_cap, cm.n_cap, cm.b_cap = 7, 16, 4
    cm.eager_layout = MetaLayout(16, 8, 7)
    return cm, nm


class _KV:
    page_size, num_pages = 4, 15


class _ST:
    num_slots = 3


def _with(b, **fields):
    return ForwardBatch(**{**{f: getattr(b, f) for f in b.__slots__}, **fields})


def _numpy_error(nm, batch):
    try:
        nm._plan(batch, _KV(), _ST())
    except ValueError as exc:
        return str(exc)
    return None


def test_eager_check_rejects_what_the_numpy_model_rejects():
    hybrid = ("linear_attention",) * 3 + ("full_attention",)
    cm, nm = _bare_models(hybrid)
    ok = _decode_batch()
    prefill = ForwardBatch.single([1, 2, 3, 4, 5], 2, [3, 4], state_slot=1)
    prefill.check(cm.batch_limits(_KV(), _ST()))
    shared = ok.block_tables.copy()
    shared[1, 1] = shared[0, 0]          # rows 0 (pos 0) and 1 (pos 5) write page slot (p, 0)/(p, 1)
    same_slot = shared.copy()
    same_slot[2, 3] = shared[0, 0]       # row 2 (pos 13 -> page 3, offset 1) collides with row 1
    bad = [_with(ok, block_tables=same_slot),
           _with(prefill, query_start=np.array([0, 4], np.int32)),
           _with(prefill, positions=prefill.positions[:, :4])]
    _with(ok, block_tables=shared).check(cm.batch_limits(_KV(), _ST()))   # same page, distinct slots: fine
    for batch in bad:
        want = _numpy_error(nm, batch)
        assert want is not None
        with pytest.raises(ValueError) as got:
            batch.check(cm.batch_limits(_KV(), _ST()))
        assert str(got.value) == want


def test_decode_check_rejects_two_rows_writing_one_kv_slot():
    cm, nm = _bare_models(("linear_attention",) * 3 + ("full_attention",))
    ok = _decode_batch()
    t = ok.block_tables.copy()
    t[2, 3] = t[1, 1]                    # row 2 writes (page, 1) at pos 13; row 1 at pos 5
    bad = _with(ok, block_tables=t)
    want = _numpy_error(nm, bad)
    assert want == "ForwardBatch: two new tokens would write the same KV page slot"
    with pytest.raises(ValueError, match="same KV page slot"):
        bad.check(cm.batch_limits(_KV(), _ST()))


def test_check_of_a_pure_gdn_model_matches_the_numpy_model():
    cm, nm = _bare_models(("linear_attention",) * 2)
    good = ForwardBatch.single([1, 2, 3], 0, [], state_slot=0)
    good.check(cm.batch_limits(_KV(), _ST()))
    for batch in (_with(good, query_start=np.array([0, 2], np.int32)),
                  _with(good, positions=good.positions[:, :2]),
                  _with(good, query_start=np.array([1, 3], np.int32))):
        want = _numpy_error(nm, batch)
        assert want is not None
        with pytest.raises(ValueError) as got:
            batch.check(cm.batch_limits(_KV(), _ST()))
        assert str(got.value) == want


@pytest.mark.parametrize("fields, words", [
    (dict(head_dim=1026), "an even head_dim <= 1024"),
    (dict(is_moe=True, num_experts=8192, num_experts_per_tok=512, hidden_size=64,
          moe_intermediate_size=64, shared_expert_intermediate_size=64), "num_experts <= 4096")])
def test_geometry_refuses_what_overflows_a_kernels_shared_memory(fields, words):
    cfg = TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",),
                     num_hidden_layers=4, **fields)
    with pytest.raises(DeviceError, match=words):
        check_geometry(cfg)


def test_real_geometries_pass_the_checks():
    # 27B (24/4 heads of 256), 35B-A3B (16/2 of 256, 256 experts top 8), 9B (16/4); 122B-A10B
    # and 397B-A17B (32/2: paged attention in blocks of 8 of a group's 16 heads)
    for f in (dict(num_attention_heads=24, num_key_value_heads=4, head_dim=256),
              dict(num_attention_heads=32, num_key_value_heads=2, head_dim=256),
              dict(num_attention_heads=16, num_key_value_heads=2, head_dim=256, is_moe=True,
                   num_experts=256,
                   num_experts_per_tok=8, hidden_size=2048, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512),
              dict(num_attention_heads=16, num_key_value_heads=4, head_dim=256)):
        check_geometry(TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",),
                                  num_hidden_layers=4, **f))


_FAKE_PTX = ".version 8.0\n.target sm_90\n.visible .entry fake_kernel(\n)\n{ ret; }\n"


def test_two_caches_writing_one_entry_at_once_both_succeed(tmp_path, monkeypatch):
    import threading
    monkeypatch.setattr(K, "compile_spec", lambda spec, cc: _FAKE_PTX)
    real_replace = K.os.replace
    both_written = threading.Barrier(2, timeout=10)

    def replace_after_both_wrote(src, dst):
        both_written.wait()
        real_replace(src, dst)
    monkeypatch.setattr(K.os, "replace", replace_after_both_wrote)
    errors, results = [], []

    def load():
        try:
            results.append(K.KernelCache((9, 0), tmp_path).ptx(spec("silu_mul")))
        except Exception as exc:   # noqa: BLE001 - collected for the assertion
            errors.append(exc)
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [_FAKE_PTX, _FAKE_PTX]
    assert [p.name for p in tmp_path.iterdir()] == [K.cache_key(spec("silu_mul"), (9, 0)) + ".ptx"]


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_precompile_compiles_the_missing_kernels_in_other_processes(tmp_path):
    """A cold start compiles the set's kernels side by side in compile_worker processes; one that
    fails is named; what compiled is cached for the next start; another arch shares nothing."""
    good = [spec("silu_mul"), spec("rmsnorm")]
    bad = K.KernelSpec.of("norm", "no_such_factory", ("f32*",))
    cache = K.KernelCache((9, 0), tmp_path)
    assert cache.missing(good + good) == good                     # each once, in order
    job = cache.start_precompile(good + [bad], workers=2)
    with pytest.raises(DeviceError, match="1 kernel.*norm.no_such_factory"):
        job.wait()
    for sp in good:
        ptx = (tmp_path / f"{K.cache_key(sp, (9, 0))}.ptx").read_text()
        assert ".target sm_90" in ptx and K.entry_name(ptx) and ptx.rstrip().endswith("}")
    assert cache.missing(good) == [] and cache.start_precompile(good).wait() == 0
    assert cache.ptx(good[0]) and cache.compiled == 0              # a disk hit, not a compile
    assert K.KernelCache((8, 0), tmp_path).missing(good) == good   # sm_80 never loads sm_90's


def test_precompile_here_counts_and_skips_what_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(K, "compile_spec", lambda spec, cc: _FAKE_PTX)
    cache = K.KernelCache((9, 0), tmp_path)
    cache.ptx(spec("silu_mul"))
    job = cache.start_precompile([spec("silu_mul"), spec("rmsnorm"), spec("argmax")], workers=0)
    assert job.wait() == 2 and cache.compiled == 3 and cache.missing([spec("argmax")]) == []


def test_kernel_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("NINFER_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    assert K.default_cache_dir() == tmp_path / "kernels"         # beside the demo model
    monkeypatch.setenv("NINFER_KERNEL_CACHE", str(tmp_path / "k"))
    assert K.default_cache_dir() == tmp_path / "k"
    monkeypatch.delenv("NINFER_KERNEL_CACHE")
    monkeypatch.delenv("NINFER_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert K.default_cache_dir() == tmp_path / ".cache" / "ninfer" / "kernels"


def test_a_corrupt_cache_entry_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setattr(K, "compile_spec", lambda spec, cc: _FAKE_PTX)
    cache = K.KernelCache((9, 0), tmp_path)
    path = tmp_path / (K.cache_key(spec("silu_mul"), (9, 0)) + ".ptx")
    path.write_text(_FAKE_PTX[:20])          # a truncated file (a crash mid-write, a full disk)
    assert cache.ptx(spec("silu_mul")) == _FAKE_PTX and cache.compiled == 1
    assert path.read_text() == _FAKE_PTX


class _FakeDriver:
    """cuda-python's driver module, as far as Device and module unloading use it: every call
    is recorded; `fail` names the calls that return an error."""

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 1
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 2
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 3

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)
        self.values = dict(cuInit=(), cuDeviceGetCount=(1,), cuDeviceGet=(0,),
                           cuDevicePrimaryCtxRetain=("ctx",), cuDeviceGetAttribute=(9,),
                           cuDeviceGetName=(b"Fake GPU\0",),
                           cuStreamCreateWithPriority=("stream",),
                           cuCtxGetStreamPriorityRange=(0, -5),
                           cuGetErrorName=(b"CUDA_ERROR_FAKE",))

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            if name in self.fail:
                return (700,)
            return (0,) + self.values.get(name, ())
        return call


def test_device_releases_the_primary_context_when_opening_fails(monkeypatch):
    from ninfer.core.cuda import driver as d
    fake = _FakeDriver(fail={"cuStreamCreateWithPriority"})
    monkeypatch.setattr(d, "_drv", fake)
    with pytest.raises(DeviceError, match="cuStreamCreateWithPriority failed: CUDA_ERROR_FAKE"):
        d.Device(0)
    names = [c[0] for c in fake.calls]
    assert names.count("cuDevicePrimaryCtxRetain") == names.count("cuDevicePrimaryCtxRelease") == 1


def test_kernel_cache_close_unloads_its_modules(monkeypatch):
    from ninfer.core.cuda import driver as d
    fake = _FakeDriver()
    monkeypatch.setattr(d, "_drv", fake)
    cache = K.KernelCache((9, 0), "unused")
    for i, name in enumerate(("silu_mul", "rmsnorm")):
        cache._loaded[spec(name)] = K.Kernel(f"module{i}", f"fn{i}", spec(name), name)
    cache.close()
    cache.close()
    assert sorted(c[1][0] for c in fake.calls if c[0] == "cuModuleUnload") == ["module0", "module1"]


class _FakeLt:
    def __init__(self):
        self.destroyed = []

    def __getattr__(self, name):
        if not name.endswith("Destroy"):
            raise AttributeError(name)
        return lambda obj: self.destroyed.append((name, obj)) or 0


def test_cublaslt_close_destroys_plans_preferences_and_handle():
    from ninfer.core.cuda.cublaslt import CublasLt, Plan
    lt = CublasLt.__new__(CublasLt)
    lt.lib, lt.handle = _FakeLt(), "handle"
    p = Plan()
    p.desc, p.layouts = "desc", ("a", "b", "c")
    lt._plans, lt._prefs = {(1, 2, 3): p}, {256: "pref256", 16: "pref16"}
    lt.close()
    lt.close()
    assert sorted(lt.lib.destroyed) == sorted(
        [("cublasLtMatrixLayoutDestroy", x) for x in "abc"] +
        [("cublasLtMatmulDescDestroy", "desc"), ("cublasLtMatmulPreferenceDestroy", "pref256"),
         ("cublasLtMatmulPreferenceDestroy", "pref16"), ("cublasLtDestroy", "handle")])


def test_cublaslt_sm_count_is_set_on_every_plan():
    """CublasLt(sm_count=N) sets SM_COUNT_TARGET = N on each plan's descriptor (the vision
    tower's GEMMs beside the decode steps); without it the attribute is never set."""
    from fake_cublaslt import fake_cublaslt
    from ninfer.core.cuda import cublaslt as L
    for sm_count, want in ((0, []), (96, [96])):
        lt, calls = fake_cublaslt(sm_count=sm_count)
        for shape in ((64, 128, 32), (8, 16, 32)):
            lt.plan(*shape)
        got = [args[2]._obj.value for name, args in calls
               if name == "cublasLtMatmulDescSetAttribute" and args[1] == L.DESC_SM_COUNT_TARGET]
        assert got == want * 2, (sm_count, got)


def test_cublaslt_products_past_8_rows_share_their_power_of_twos_algorithm():
    """A plan of M > SHARED_ALGO_FROM rows takes the algorithm the heuristic picks for
    algo_rows(M) (the next power of two; asked once per such shape, over layouts of that many
    rows) where cublasLtMatmulAlgoCheck accepts it for the exact layouts, else the exact shape's
    own (a new kernel's first launch costs milliseconds: an MTP catch-up feed has a new length
    most times). M <= 8 (decode), batched and fp8 plans keep their own; the exact layouts are
    always the plan's."""
    from fake_cublaslt import fake_cublaslt
    from ninfer.core.cuda import cublaslt as L
    assert L.SHARED_ALGO_FROM == L.PIN_M == 8        # (decode-sized products keep their own)
    assert [L.algo_rows(m) for m in (1, 8, 9, 20, 64, 65, 128, 129, 337, 512, 4097)] == \
        [1, 8, 16, 32, 64, 128, 128, 256, 512, 512, 8192]
    # (warm_up's row counts: one product in each shared algorithm's range up to n)
    assert [L.shared_algo_rows(n) for n in (8, 9, 64, 65, 129, 400)] == \
        [[], [9], [16, 32, 64], [16, 32, 64, 65], [16, 32, 64, 128, 129],
         [16, 32, 64, 128, 256, 400]]
    assert L.shared_algo_rows(4096) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]

    def counts(calls, n=16):
        return (sum(c[0] == "cublasLtMatmulAlgoGetHeuristic" for c in calls),
                sum(c[0] == "cublasLtMatmulAlgoCheck" for c in calls),
                [c[1][3] for c in calls if c[0] == "cublasLtMatrixLayoutCreate"
                 and c[1][2] == 32 and c[1][3] != n])     # X's layouts (K = 32 rows): their M
    lt, calls = fake_cublaslt()
    shapes = [(337, 16, 32), (400, 16, 32), (512, 16, 32), (64, 16, 32), (8, 16, 32), (9, 24, 32),
              (300, 24, 32)]
    for shape in shapes:
        calls.clear()
        p = lt.plan(*shape)
        assert (p.m, p.n, p.k) == shape
        got = counts(calls, shape[1])
        want = {(337, 16, 32): (1, 1, [337, 512]),     # the 512-row heuristic, checked at 337
                (400, 16, 32): (0, 1, [400]),          # shared: checked only
                (512, 16, 32): (1, 0, [512]),          # a power of two is its own
                (64, 16, 32): (1, 0, [64]),
                (8, 16, 32): (1, 0, [8]),               # decode-sized: its own
                (9, 24, 32): (1, 1, [9, 16]),
                (300, 24, 32): (1, 1, [300, 512])}[shape]     # another N: its own shared one
        assert got == want, (shape, got)
    assert len(lt._shared_algos) == 3
    for batched in (dict(batch=2, strides=(0, 300 * 32, 300 * 16)), dict(fp8=True)):
        calls.clear()
        lt.plan(300, 128, 128, **batched)
        assert counts(calls)[:2] == (1, 0), batched
    lt.share_algos = False                          # (bench_decode --own-algos: the A/B)
    calls.clear()
    own = lt.plan(337, 16, 32)
    assert counts(calls) == (1, 0, [337]) and lt.plan(337, 16, 32) is own
    lt.share_algos = True
    assert lt.plan(337, 16, 32) is not own          # (each setting keeps its own plans)

    class Refusing:                                 # cuBLASLt: the shared algorithm cannot run it
        def __init__(self, lib):
            self.lib = lib

        def __getattr__(self, name):
            f = getattr(self.lib, name)
            return (lambda *a: (f(*a), 15)[1]) if name == "cublasLtMatmulAlgoCheck" else f
    lt, calls = fake_cublaslt()
    lt.lib = Refusing(lt.lib)
    lt.plan(337, 16, 32)
    assert counts(calls) == (2, 1, [337, 512])      # the shared one refused: the exact one's
    lt.plan(400, 16, 32)
    assert counts(calls)[:2] == (3, 2)


def test_model_close_releases_everything_even_after_a_kernel_fault():
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from ninfer.models.qwen3_5.cuda.thread_context import ThreadContext
    from ninfer.models.qwen3_5.cuda.decode_graphs import DecodeGraphs
    released = []

    class Part:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def _do(self):
            released.append(self.name)
            if self.fails:
                raise DeviceError(f"{self.name} failed: CUDA_ERROR_ILLEGAL_ADDRESS")
        close = destroy = free = synchronize = make_current = _do
    m = CudaModel.__new__(CudaModel)
    m.device, m.stream = Part("context"), Part("stream sync", fails=True)
    m._bind_context = ThreadContext(m.device)
    m.graphs = DecodeGraphs(None, None, None)
    m.graphs._graphs = {(1, 0, 0): (Part("graph 1"), None, None),
                        (2, 0, 0): (Part("graph 2"), None, None)}
    m.lt, m.kernels = Part("cuBLASLt"), Part("modules", fails=True)
    m.sampler = m.ids_host = m.media_rows = None
    m.step_events = ()
    m.staging, m.out_host, m.route_host = Part("staging"), Part("out_host"), Part("route_host")
    m.pool_staging = Part("pool staging")
    m.arena = Part("arena")
    with pytest.raises(DeviceError, match="stream sync failed"):
        m.close()
    assert released == ["context", "stream sync", "graph 1", "graph 2", "cuBLASLt", "modules",
                        "staging", "out_host", "route_host", "pool staging", "arena", "context"]
    m.close()                                # idempotent: nothing left, nothing raised
    assert m.device is m.arena is m.lt is m.kernels is None and len(released) == 12


class _ArenaModel:
    """What the device pools use of the model: an arena (on a fake allocation) and a stream."""

    def __init__(self, monkeypatch, nbytes):
        from ninfer.core.cuda import driver as d
        from ninfer.core.cuda.arena import Arena
        monkeypatch.setattr(d, "mem_alloc", lambda n: 1 << 40)
        monkeypatch.setattr(d, "memset_d8_async", lambda *a: None)
        self.arena, self.stream = Arena(nbytes), None

    def _current(self):
        pass

    def _forget_graphs_of(self, pool):
        pass


def _pool_config():
    return TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",) * 2,
                      num_hidden_layers=5, num_key_value_heads=2, head_dim=64)


def test_dropped_pools_return_their_arena_regions(monkeypatch):
    import gc
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool, DeviceStatePool
    m = _ArenaModel(monkeypatch, 64 << 20)
    free = m.arena.free_bytes
    for _ in range(20):          # scoring: temporary pools per call, never closed
        kv, st = DeviceKVPool(_pool_dev(m), _pool_config(), 64, 16), DeviceStatePool(_pool_dev(m), _pool_config(), 1)
        assert m.arena.free_bytes < free
        del kv, st
        gc.collect()
    assert m.arena.free_bytes == free
    kv = DeviceKVPool(_pool_dev(m), _pool_config(), 64, 16)
    kv.close()                   # closed, then dropped: each region returned once
    del kv
    gc.collect()
    assert m.arena.free_bytes == free and m.arena._free == [(0, m.arena.capacity)]


def test_a_pool_that_does_not_fit_takes_nothing(monkeypatch):
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool
    m = _ArenaModel(monkeypatch, 7 << 17)
    free = m.arena.free_bytes
    # 4 arrays of 64 pages x 16 x 2 x 64 bf16 = 256 KiB each: the fourth does not fit
    with pytest.raises(DeviceError, match="KV pool"):
        DeviceKVPool(_pool_dev(m), _pool_config(), 64, 16)
    assert m.arena.free_bytes == free


class _CountingArena:
    def __init__(self):
        self.nbytes = 0

    def take(self, shape, dtype, what):
        from ninfer.core.cuda.arena import DeviceArray, _round_up
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self.nbytes += _round_up(max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1))
        return DeviceArray(1 << 40, shape, dtype)




@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("b_cap, prefill_chunk, max_context", [(1, 512, 2048), (8, 512, 32768),
                                                               (4, 4096, 16384), (64, 16, 512)])
@pytest.mark.parametrize("mtp", [False, True], ids=["", "mtp"])
def test_workspace_plan_covers_what_the_workspace_takes(shape, b_cap, prefill_chunk, max_context,
                                                        mtp):
    from ninfer.models.qwen3_5.cuda_model import LT_WORKSPACE, CudaModel, workspace_bytes
    from ninfer.models.qwen3_5.cuda.runner import Workspace, part_rows_needed
    cfg = TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",),
                     num_hidden_layers=4, **SHAPES[shape])
    m = CudaModel.__new__(CudaModel)
    m.text, page_size, num_sms = cfg, 16, 132
    n_cap = max(prefill_chunk, b_cap)
    m.p_cap = (max_context + page_size - 1) // page_size + 1
    m.lg_cap, m.max_keys = max(b_cap, min(n_cap, 256)), m.p_cap * page_size
    m.eager_layout = MetaLayout(n_cap, max(b_cap, 8), m.p_cap)
    m.decode_layout = MetaLayout(b_cap, b_cap, m.p_cap)
    part_rows = part_rows_needed(n_cap, cfg.num_key_value_heads, num_sms)
    arena = _CountingArena()
    Workspace(arena, cfg, n_cap, m.lg_cap, part_rows, m.max_keys, mtp=mtp)
    arena.take((m.eager_layout.count + m.decode_layout.count,), np.int32, "metadata")
    arena.take((LT_WORKSPACE,), np.uint8, "cuBLASLt workspace")
    assert arena.nbytes <= workspace_bytes(
        cfg, f32=False, n_cap=n_cap, lg_cap=m.lg_cap, part_rows=part_rows, max_keys=m.max_keys,
        meta_bytes=m.eager_layout.nbytes + m.decode_layout.nbytes, mtp=mtp)


def test_pack_args_refuses_integers_that_would_wrap():
    for t, bad in (("i32", 2**31), ("i32", -2**31 - 1), ("u32", -1), ("u32", 2**32), ("i64", 2**63)):
        with pytest.raises(ValueError, match=f"type {t} out of range"):
            K.pack_args((t,), (bad,))
    keep, _ = K.pack_args(("i32", "u32", "i64"), (np.int32(-2**31), 2**32 - 1, -2**63))
    assert [v.value for v in keep[0]] == [-2**31, 2**32 - 1, -2**63]


def test_closing_a_pool_destroys_the_graphs_captured_over_it(monkeypatch):
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from ninfer.models.qwen3_5.cuda.decode_graphs import DecodeGraphs
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool, DeviceStatePool, HostStaging
    fake = _ArenaModel(monkeypatch, 64 << 20)
    m = CudaModel.__new__(CudaModel)
    m.arena, m.stream, m._bind_context = fake.arena, None, lambda: None
    m.graphs = DecodeGraphs(None, None, None)
    m.pool_staging, m.f32 = HostStaging(), False
    destroyed = []

    class G:
        def __init__(self, name):
            self.name = name

        def destroy(self):
            destroyed.append(self.name)
    # the model's own wiring: its pools' on_close is the graphs' forget (no model reference)
    kv1, kv2 = DeviceKVPool(m._pool_device(), _pool_config(), 8, 16), DeviceKVPool(m._pool_device(), _pool_config(), 8, 16)
    st = DeviceStatePool(m._pool_device(), _pool_config(), 2)
    m.graphs._graphs = {(1, id(kv1), id(st)): (G("kv1 B=1"), kv1, st),
                 (2, id(kv1), id(st)): (G("kv1 B=2"), kv1, st),
                 (1, id(kv2), id(st)): (G("kv2 B=1"), kv2, st)}
    kv1.close()                  # a replay over kv1's returned pages would corrupt their next owner
    assert sorted(destroyed) == ["kv1 B=1", "kv1 B=2"] and list(m.graphs._graphs) == [(1, id(kv2), id(st))]
    st.close()
    assert sorted(destroyed) == ["kv1 B=1", "kv1 B=2", "kv2 B=1"] and len(m.graphs) == 0




def test_cuda_weight_reader_refuses_what_the_numpy_reader_refuses():
    from ninfer.errors import ArtifactError
    from ninfer.models.qwen3_5.cuda import weights as wplan
    from ninfer.models.qwen3_5.load import ParamReader, text_param_shapes
    cfg = TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), num_hidden_layers=4,
                     hidden_size=8, is_moe=True, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=6, shared_expert_intermediate_size=4)
    expected = text_param_shapes(cfg)
    model_cfg = ModelConfig("Qwen3_5MoeForCausalLM", cfg)

    def _Artifact(tensors):
        return TensorArtifact(model_cfg, tensors)
    plan = wplan.layer_plan(cfg, 0)
    name = "text.layers.0.mlp.experts.gate_up_proj"
    shape, dt, sources = plan["experts_gu"]
    r = np.random.default_rng(0)
    good = r.standard_normal(expected[name]).astype(np.float32)
    assert wplan.read_host(_Artifact({name: good}), shape, dt, sources, expected).shape == shape
    transposed = np.ascontiguousarray(good.transpose(0, 2, 1))      # same size, other layout
    nan = np.where(np.arange(good.size).reshape(good.shape) == 5, np.nan, good)
    for arr, words in ((transposed, "shape"), (nan, "non-finite")):
        with pytest.raises(ArtifactError, match=f"{name}.*{words}") as got:
            wplan.read_host(_Artifact({name: arr}), shape, dt, sources, expected)
        with pytest.raises(ArtifactError, match=f"{name}.*{words}") as np_got:
            ParamReader(_Artifact({name: arr}))(name, expected[name])
        if words == "shape":
            assert str(got.value) == str(np_got.value)
    # finite in float32 but past bfloat16's range: inf once stored on the device
    with pytest.raises(ArtifactError, match="non-finite values \\(in bfloat16\\)"):
        wplan.read_host(_Artifact({name: np.full(good.shape, 3.4e38, np.float32)}), shape, dt,
                        sources, expected)


def test_attention_biases_are_refused_not_ignored():
    cfg = TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), num_hidden_layers=4,
                     attention_bias=True)
    with pytest.raises(DeviceError, match="attention_bias"):
        check_geometry(cfg)


class _FakeDevice:
    """Device memory as one byte array behind the driver layer's copy functions, pinned buffers
    as numpy arrays: the pools' host copies run unchanged on it."""
    BASE = 1 << 40

    def __init__(self, monkeypatch, nbytes):
        from types import SimpleNamespace
        from ninfer.core.cuda import driver as d
        from ninfer.core.cuda.arena import Arena
        self.mem, self.host, self.next_host = np.zeros(nbytes, np.uint8), {}, 1 << 20
        for name, fn in (("mem_alloc", lambda n: self.BASE), ("memset_d8_async", self._memset),
                         ("copy_dtoh_async", self._dtoh), ("copy_htod_async", self._htod),
                         ("copy2d_dtod_async", self._dtod2d), ("PinnedBuffer", self._pinned)):
            monkeypatch.setattr(d, name, fn)
        self.arena, self.stream = Arena(nbytes), SimpleNamespace(synchronize=lambda: None)
        self.pinned_allocs = 0

    def _current(self):
        pass

    def _forget_graphs_of(self, pool):
        pass

    def _pinned(self, nbytes):
        from types import SimpleNamespace
        self.pinned_allocs += 1
        buf = SimpleNamespace(ptr=self.next_host, nbytes=nbytes, array=np.zeros(nbytes, np.uint8))
        self.next_host += nbytes + 4096
        self.host[buf.ptr] = buf.array
        buf.free = lambda: self.host.pop(buf.ptr)
        return buf

    def _host(self, ptr, n):
        base = max(b for b in self.host if b <= ptr)
        assert ptr - base + n <= self.host[base].size, "copy past a pinned buffer"
        return self.host[base][ptr - base: ptr - base + n]

    def _dev(self, ptr, n):
        assert self.BASE <= ptr and ptr - self.BASE + n <= self.mem.size, "copy past the arena"
        return self.mem[ptr - self.BASE: ptr - self.BASE + n]

    def _memset(self, dst, value, n, stream):
        self._dev(dst, n)[:] = value

    def _dtoh(self, dst, src, n, stream):
        self._host(dst, n)[:] = self._dev(src, n)

    def _htod(self, dst, src, n, stream):
        self._dev(dst, n)[:] = self._host(src, n)

    def _dtod2d(self, dst, dst_pitch, src, src_pitch, width, height, stream):
        for i in range(height):
            self._dev(dst + i * dst_pitch, width)[:] = self._dev(src + i * src_pitch, width).copy()


def _bf16_exact(r, shape):
    import ml_dtypes
    return r.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_pool_host_copies_round_trip_like_the_numpy_pools(monkeypatch):
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool, DeviceStatePool
    from ninfer.models.qwen3_5.state import KVPool, StatePool
    dev, cfg, r = _FakeDevice(monkeypatch, 64 << 20), _pool_config(), np.random.default_rng(5)
    kv, st = DeviceKVPool(_pool_dev(dev), cfg, 7, 4), DeviceStatePool(_pool_dev(dev), cfg, 3)
    ref_kv, ref_st = KVPool.allocate(cfg, 7, 4), StatePool.allocate(cfg, 3)
    pages = [5, 1, 3]
    data = tuple([_bf16_exact(r, (3,) + k.shape[1:]) for k in ref_kv.k] for _ in range(2))
    image = ([r.standard_normal(c.shape[1:]) for c in ref_st.conv],
             [r.standard_normal(s.shape[1:]) for s in ref_st.recurrent])
    for pool_kv, pool_st in ((kv, st), (ref_kv, ref_st)):
        pool_kv.write_pages(pages, data)
        pool_st.write(1, image)
        pool_st.write(2, image)
        pool_st.zero(2)
    allocs = dev.pinned_allocs
    for got, want in zip(kv.read_pages([0, 1, 3, 5, 6]), ref_kv.read_pages([0, 1, 3, 5, 6])):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert dev.pinned_allocs == allocs + 1          # one staging buffer for every page and layer
    for slot in range(3):
        for got, want in zip(st.read(slot), ref_st.read(slot)):
            assert all(np.array_equal(a, np.asarray(b, np.float32)) for a, b in zip(got, want))
    assert kv.read_pages([])[0][0].shape == (0,) + ref_kv.k[0].shape[1:]


def test_pool_host_copies_move_runs_of_pages_in_one_copy(monkeypatch):
    """Consecutive pages (a prefill chunk takes its pages together) go in one copy per run and
    array, each way and device to device; the bytes are the numpy pool's, in the order asked,
    for runs, single pages and repeats; a copy whose sources and destinations share pages is
    refused before anything moves, as numpy's is."""
    from ninfer.core.cuda import driver as d
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool, _runs
    from ninfer.models.qwen3_5.state import KVPool
    assert _runs([4, 5, 6, 9, 10, 2, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1), (2, 6, 1)]
    assert _runs([1, 2, 3], [7, 8, 0]) == [(1, 7, 2), (3, 0, 1)]
    dev, cfg, r = _FakeDevice(monkeypatch, 64 << 20), _pool_config(), np.random.default_rng(8)
    copies = []
    for name in ("copy_dtoh_async", "copy_htod_async"):
        monkeypatch.setattr(d, name, (lambda f: lambda *a: (copies.append(a[2]), f(*a)))(
            getattr(d, name)))
    monkeypatch.setattr(d, "copy_dtod_async", lambda dst, src, n, stream: (
        copies.append(n), dev._dev(dst, n).__setitem__(slice(None), dev._dev(src, n).copy())))
    kv, ref = DeviceKVPool(_pool_dev(dev), cfg, 12, 4), KVPool.allocate(cfg, 12, 4)
    arrays = 2 * len(ref.k)
    pages = [2, 3, 4, 5, 9, 10, 0]
    data = tuple([_bf16_exact(r, (7,) + k.shape[1:]) for k in ref.k] for _ in range(2))
    copies.clear()
    kv.write_pages(pages, data)
    ref.write_pages(pages, data)
    assert len(copies) == 3 * arrays                   # runs 2-5, 9-10, 0
    copies.clear()
    for got, want in zip(kv.read_pages([9, 10, 11, 3, 3]), ref.read_pages([9, 10, 11, 3, 3])):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert len(copies) == 3 * arrays                   # 9-11, 3, 3
    copies.clear()
    kv.copy_pages([2, 3, 4], [6, 7, 8])                # disjoint runs: one copy per array
    ref.copy_pages([2, 3, 4], [6, 7, 8])
    assert len(copies) == arrays
    for pool in (kv, ref):
        with pytest.raises(ValueError, match="overlap"):
            pool.copy_pages([4, 5], [5, 6])
    for got, want in zip(kv.read_pages(range(12)), ref.read_pages(range(12))):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_async_host_copies_run_on_the_copy_stream_after_the_model_stream(monkeypatch):
    """start_read_pages / start_read with a copy stream (CudaModel.async_host_copies): an event
    recorded on the model's stream, the copy stream waiting on it, the copies on the copy stream,
    an event after them; done() asks that event, result() waits on it and gives read_pages'
    bytes (a bf16 pool's as bf16 bits) and the pinned buffer back for the next read. Writes
    (write_pages, write: an install from the host tier, a resume) wait for nothing: their
    buffers go back to the pool once an event after their copies has passed."""
    from types import SimpleNamespace
    from ninfer.core.cuda import driver as d
    from ninfer.models.qwen3_5.cuda.device_pools import (DeviceKVPool, DeviceStatePool,
                                                        HostStaging, PinnedPool, PoolDevice)
    from ninfer.models.qwen3_5.state import KVPool, StatePool
    dev, cfg, r = _FakeDevice(monkeypatch, 64 << 20), _pool_config(), np.random.default_rng(9)
    log, ready = [], [False]

    class Event:
        def __init__(self, timing=True):
            self.name = f"e{len([x for x in log if x.startswith('new')])}"
            log.append("new " + self.name)

        def record(self, stream):
            log.append(f"record {self.name} on {stream.name}")

        def query(self):
            return ready[0]

        def synchronize(self):
            log.append(f"wait {self.name}")

        def destroy(self):
            pass
    monkeypatch.setattr(d, "Event", Event)
    dtoh = d.copy_dtoh_async
    monkeypatch.setattr(d, "copy_dtoh_async", lambda dst, src, n, stream: (
        log.append(f"copy on {stream.name}"), dtoh(dst, src, n, stream)))
    main = SimpleNamespace(name="main", synchronize=lambda: None)
    copy = SimpleNamespace(name="copy", synchronize=lambda: None,
                           wait=lambda e: log.append(f"copy waits {e.name}"))
    pinned = PinnedPool()
    pdev = PoolDevice(dev.arena, main, dev._current, dev._forget_graphs_of, HostStaging(),
                      copy_stream=copy, pinned=pinned)
    kv, st = DeviceKVPool(pdev, cfg, 6, 4), DeviceStatePool(pdev, cfg, 2)
    ref_kv, ref_st = KVPool.allocate(cfg, 6, 4), StatePool.allocate(cfg, 2)
    data = tuple([_bf16_exact(r, (6,) + k.shape[1:]) for k in ref_kv.k] for _ in range(2))
    image = ([r.standard_normal(c.shape[1:]) for c in ref_st.conv],
             [r.standard_normal(s.shape[1:]) for s in ref_st.recurrent])
    for pool_kv, pool_st in ((kv, st), (ref_kv, ref_st)):
        pool_kv.write_pages(range(6), data)
        pool_st.write(1, image)
    assert kv.reads_async and st.reads_async
    log.clear()
    read = kv.start_read_pages([4, 5, 0])
    copies = 2 * len(kv.k) * 2                      # runs 4-5 and 0, per array
    assert log == ["new e0", "record e0 on main", "copy waits e0"] + ["copy on copy"] * copies \
        + ["new e1", "record e1 on copy"]
    assert not read.done()
    ready[0] = True
    assert read.done()
    got, want = read.result(), ref_kv.read_pages([4, 5, 0])
    assert log[-1] == "wait e1"
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert g.dtype == np.uint16 and np.array_equal((g.astype(np.uint32) << 16).view(np.float32), w)
    assert read.result() is got                        # once
    tier = kv._tier                                    # the pool's pinned host tier: one chunk
    assert got.rows == [0, 1, 2] and tier.num_rows == tier.rows_per_chunk >= 3
    state = st.start_read(1).result()
    for g, w in zip(state[0] + state[1], ref_st.read(1)[0] + ref_st.read(1)[1]):
        assert np.array_equal(g, np.asarray(w, np.float32))

    def no_sync():
        raise AssertionError("an asynchronous pool write waited for its stream")
    main.synchronize = no_sync
    ready[0] = False
    kv.write_pages([1, 2, 3], got)                     # from the tier's rows, as they are
    assert log[-2:] == [f"new {got.in_use.name}", f"record {got.in_use.name} on main"]
    pending = len(pinned._pending)
    st.write(0, image)                                 # (plain arrays: a pinned buffer)
    assert log[-1].startswith("record") and log[-1].endswith("on main")
    assert len(pinned._pending) == pending + 1
    got.release()                                      # its rows wait for the write's event
    allocs = dev.pinned_allocs
    again = kv.start_read_pages([2, 3])
    assert again.image.rows == [3, 4] and tier.num_free == tier.rows_per_chunk - 5
    ready[0] = True
    again.result().release()
    assert kv.start_read_pages([0, 4, 5]).result().rows == [0, 1, 2]    # reused: no new chunk
    assert dev.pinned_allocs == allocs
    main.synchronize = lambda: None
    for g, w in zip(kv.read_pages([1, 2, 3])[0], want[0]):
        assert np.array_equal(g, w)
    for g, w in zip(st.read(0)[0], ref_st.read(1)[0]):
        assert np.array_equal(g, np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="host tier"):
        st.write(1, kv.start_read_pages([0]).result())
    kv.close()
    st.close()
    assert not tier._chunks


def test_synchronous_start_read_pages_keeps_the_pools_bf16_bits(monkeypatch):
    """Without a copy stream start_read_pages copies at once, and like the asynchronous read
    keeps a bf16 pool's bits (the host tier's checkpoints: half the bytes of read_pages'
    float32, written back by write_pages as they are)."""
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool
    from ninfer.models.qwen3_5.state import KVPool
    dev, cfg, r = _FakeDevice(monkeypatch, 64 << 20), _pool_config(), np.random.default_rng(12)
    kv, ref = DeviceKVPool(_pool_dev(dev), cfg, 6, 4), KVPool.allocate(cfg, 6, 4)
    data = tuple([_bf16_exact(r, (6,) + k.shape[1:]) for k in ref.k] for _ in range(2))
    kv.write_pages(range(6), data)
    ref.write_pages(range(6), data)
    assert not kv.reads_async
    read = kv.start_read_pages([5, 1, 2])
    assert read.done()
    got, want = read.result(), ref.read_pages([5, 1, 2])
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert g.dtype == np.uint16 and g.nbytes * 2 == w.nbytes
        assert np.array_equal((g.astype(np.uint32) << 16).view(np.float32), w)
    kv.write_pages([0, 3, 4], got)
    for g, w in zip(kv.read_pages([0, 3, 4])[0], want[0]):
        assert np.array_equal(g, w)


def test_pool_host_copies_refuse_indices_and_images_outside_the_pool(monkeypatch):
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool, DeviceStatePool
    from ninfer.models.qwen3_5.state import KVPool, StatePool
    dev, cfg = _FakeDevice(monkeypatch, 64 << 20), _pool_config()
    kv, st = DeviceKVPool(_pool_dev(dev), cfg, 6, 4), DeviceStatePool(_pool_dev(dev), cfg, 3)
    ref_kv, ref_st = KVPool.allocate(cfg, 6, 4), StatePool.allocate(cfg, 3)
    pages = ref_kv.read_pages([1, 5])
    before = dev.mem.copy()
    for pool, ref, call in ((kv, ref_kv, lambda p: p.read_pages([2, 6])),
                            (kv, ref_kv, lambda p: p.write_pages([6, 1], pages)),
                            (st, ref_st, lambda p: p.read(3)), (st, ref_st, lambda p: p.zero(3)),
                            (st, ref_st, lambda p: p.write(3, ref_st.read(0)))):
        with pytest.raises(IndexError):
            call(ref)                                  # the numpy pool refuses it too
        with pytest.raises(IndexError, match="out of range"):
            call(pool)
    short = ([pages[0][0][:1]] + pages[0][1:], pages[1])          # one page's data for two pages
    with pytest.raises(ValueError, match="expected"):
        kv.write_pages([1, 5], short)
    image = ref_st.read(0)
    with pytest.raises(ValueError, match="layer arrays"):
        st.write(0, (image[0][:-1], image[1]))
    assert np.array_equal(dev.mem, before)            # nothing reached the device


def test_graph_whose_instantiation_fails_is_destroyed(monkeypatch):
    from ninfer.core.cuda import driver as d
    from ninfer.core.cuda.graph import Graph

    class Drv(_FakeDriver):
        class CUstreamCaptureMode:
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 2
    fake = Drv(fail={"cuGraphInstantiate"})
    fake.values["cuStreamEndCapture"] = ("graph",)
    monkeypatch.setattr(d, "_drv", fake)

    class Stream:
        handle = "stream"
    with pytest.raises(DeviceError, match="cuGraphInstantiate"):
        Graph(Stream(), lambda st: None)
    assert ("cuGraphDestroy", ("graph",)) in fake.calls


def test_a_call_larger_than_the_kernel_grid_is_refused_at_load():
    from ninfer.models.qwen3_5.cuda_model import MAX_TOKENS_PER_CALL, check_capacity
    check_capacity(MAX_TOKENS_PER_CALL)
    with pytest.raises(DeviceError, match="prefill_chunk 65536"):
        check_capacity(MAX_TOKENS_PER_CALL + 1)


def test_call_capacities_cover_a_decode_graph_and_the_logits_rows():
    from ninfer.models.qwen3_5.cuda_model import call_capacities
    opts = EngineOptions(backend="cuda", max_concurrency=8, max_context=4096, prefill_chunk=512,
                         page_size=16)
    assert call_capacities(opts) == (8, 512, 257, 256)
    assert call_capacities(opts, max_tokens=4096) == (8, 4096, 257, 256)
    # fewer tokens per call than decode rows: the graph of B = 8 still fits the workspace
    assert call_capacities(opts, max_tokens=4)[:2] == (8, 8)
    # decode rows riding on a chunk (Model.mixed_batches): a call holds b_cap tokens more
    assert call_capacities(opts, mixed=True)[:2] == (8, 520)
    small = EngineOptions(backend="cuda", max_concurrency=2, max_context=256, prefill_chunk=4)
    b, n, p, lg = call_capacities(small)
    assert (b, n) == (2, 4) and lg >= b and p * small.page_size >= small.max_context + 1
    # speculative: a verify of every row's token and k drafts is one call, all its logits
    # (either drafter: a DFlash verify of 4 rows x 5 tokens at prefill_chunk 8 once failed)
    for drafter in ("mtp", "dflash"):
        spec = EngineOptions(backend="cuda", max_concurrency=8, max_context=4096,
                             prefill_chunk=16, speculative=drafter, num_draft_tokens=3)
        assert call_capacities(spec)[1] == call_capacities(spec)[3] == 32, drafter
    assert call_capacities(EngineOptions(backend="cuda", max_concurrency=8, prefill_chunk=512,
                                         speculative="mtp"))[1::2] == (512, 256)


def test_cublaslt_plan_that_finds_no_algorithm_destroys_its_descriptors():
    from ninfer.core.cuda.cublaslt import CublasLt
    made, destroyed = [], []

    class Lib:
        def __getattr__(self, name):
            def call(*args):
                if name.endswith("Create"):
                    args[0]._obj.value = 0x1000 + len(made)      # the handle written through byref
                    made.append(args[0]._obj.value)
                elif name.endswith("Destroy"):
                    destroyed.append(args[0].value)
                return 0                                          # the heuristic finds nothing
            return call
    lt = CublasLt.__new__(CublasLt)
    lt.lib, lt.handle, lt.workspace_bytes, lt._prefs, lt._plans = Lib(), "handle", 1 << 20, {}, {}
    with pytest.raises(DeviceError, match="no algorithm"):
        lt.plan(8, 16, 32)
    pref = lt._prefs[256].value
    assert sorted(destroyed) == sorted(v for v in made if v != pref) and len(destroyed) == 4
    assert lt._plans == {}


def test_negative_context_is_refused_on_both_paths():
    cm, _ = _bare_models(("linear_attention",) * 3 + ("full_attention",))
    ok = _decode_batch()
    bad = _with(ok, context_lens=np.array([0, -1, 13], np.int32))
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        bad.check(cm.batch_limits(_KV(), _ST()))
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        bad.check(cm.batch_limits(_KV(), _ST()))


def test_host_staging_keeps_one_buffer_and_frees_oversized_ones(monkeypatch):
    """The pools' host copies reuse one pinned buffer (grown to the largest copy up to
    keep_bytes); a larger copy gets a buffer of its own, freed when given back."""
    from ninfer.models.qwen3_5.cuda import device_pools
    live = []

    class Pinned:
        def __init__(self, nbytes):
            self.nbytes, self.is_freed = nbytes, False
            live.append(self)

        def free(self):
            self.is_freed = True
    monkeypatch.setattr(device_pools._d, "PinnedBuffer", Pinned)
    staging = device_pools.HostStaging(keep_bytes=100)
    a = staging.take(40)
    staging.give(a)
    assert staging.take(40) is a and staging.take(10) is a and not a.is_freed
    b = staging.take(80)                    # grows: the old one is freed
    assert b is not a and a.is_freed and b.nbytes == 80
    staging.give(b)
    big = staging.take(101)                 # past keep_bytes: its own, freed on give
    staging.give(big)
    assert big.is_freed and not b.is_freed and staging.take(50) is b
    staging.free()
    assert b.is_freed and len(live) == 3


@pytest.mark.parametrize("shape", ["27B", "35B-A3B", "tiny-moe"])
def test_the_cuda_weight_plan_holds_exactly_the_numpy_drafters_tensors(shape):
    """cuda/weights.mtp_plan (the MTP head on the device, issue 25) reads the tensors the numpy
    drafter reads (mtp_param_shapes), each once and whole; plan_bytes counts them with mtp=True."""
    from ninfer.models.qwen3_5.config import TextConfig
    from ninfer.models.qwen3_5.cuda import weights as wplan
    from ninfer.models.qwen3_5.mtp import mtp_param_shapes
    cfg = TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",),
                     num_hidden_layers=4, mtp_num_hidden_layers=1, **SHAPES[shape])
    plan, want = wplan.mtp_plan(cfg), mtp_param_shapes(cfg)
    read = [src for _, _, sources in plan.values() for src, _ in sources]
    assert sorted(read) == sorted(want)
    for name, (shp, dt, sources) in plan.items():
        assert int(np.prod(shp)) == sum(int(np.prod(want[s])) for s, _ in sources), name
        assert dt == (wplan.F32 if len(shp) == 1 else wplan.BF16), name
    extra = sum((int(np.prod(s)) * wplan.element_bytes(dt) + 255) // 256 * 256
                for s, dt, _ in plan.values())
    assert wplan.plan_bytes(cfg, mtp=True) == wplan.plan_bytes(cfg) + extra
    assert plan["fc"][0] == (cfg.hidden_size, 2 * cfg.hidden_size)
    # the int8 draft head (EngineOptions.draft_head; widths of whole 128-column groups):
    # codes [rows, H] and a float32 scale per row and group, each region rounded as the arena
    # rounds it
    from ninfer.models.qwen3_5.cuda import qweights as qw
    from ninfer.core.cuda.arena import _round_up
    from ninfer.models.qwen3_5.model import int8_head_ok
    rows, H = 1000, cfg.hidden_size
    if not int8_head_ok(H):
        return
    seg = qw.int8_head_plan(rows, H)
    assert seg.scale_shape == (1, rows, H // 128) and seg.row_bytes == H
    assert qw.mma_ok(seg.layout, H, seg.block[1]) and qw.mma_split(seg.layout, seg.block[1]) == 1
    assert wplan.plan_bytes(cfg, mtp=True, int8_head_rows=rows) == \
        wplan.plan_bytes(cfg, mtp=True) + _round_up(rows * H) + _round_up(4 * rows * H // 128)


def test_a_verify_runs_through_its_graph_only_where_the_graph_is_the_eager_call(monkeypatch):
    """CudaModel._verify_graph_launch: a verify whose rows all have the same token count (fewer
    than the tensor-core attention's minimum), with snapshots, no media and every token's
    logits within one call's rows takes the verify graph of its (tokens, rows), captured once
    (a dry run, then the capture: runner.run over the eager metadata with every token as an
    output row and the snapshot bases, then the final norm of every token); anything else
    launches nothing (the caller runs it eager)."""
    from types import SimpleNamespace

    from ninfer.models.qwen3_5.cuda import decode_graphs as dg
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    calls, launched = [], []

    class Runner:
        dry = False
        attn_tc_min_tokens = 64
        res = SimpleNamespace(moe_gemv_tokens=16)

        def run(self, st, meta, n, b, n_out, kv, state, snap=None, capture=None):
            calls.append(("run", self.dry, meta, n, b, n_out, kv, state, snap))

        def final_hidden(self, st, n):
            calls.append(("final_hidden", self.dry, n))

    class FakeGraph:
        def __init__(self, stream, fn):
            fn(stream)                          # the capture records what fn launches
            self.key = len(launched)

        def launch(self):
            launched.append(self)
    monkeypatch.setattr(dg, "Graph", FakeGraph)
    m = CudaModel.__new__(CudaModel)
    m.options = SimpleNamespace(graphs=True)
    m.lg_cap, m.runner, m.eager_layout, m.eager_meta = 16, Runner(), "layout", "meta"
    m.graphs = dg.DecodeGraphs("stream", m.runner, "decode meta")
    uploads = []
    m._upload_meta = lambda lay, meta, off, batch, out_rows: uploads.append((lay, meta,
                                                                            out_rows.tolist()))

    def batch(lens):
        qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        return SimpleNamespace(num_tokens=int(qs[-1]), num_rows=len(lens), query_start=qs)
    kv, st, snap = "kv", "state", 0xABC
    every = np.arange(8, dtype=np.int32)
    m.lt = SimpleNamespace(plan_seconds=0.25)       # (the GEMM plans' share of one_off_seconds)
    assert m.one_off_seconds == 0.25
    assert m._verify_graph_launch(batch([4, 4]), kv, st, every, snap, None)
    assert calls == [("run", True, "meta", 8, 2, 8, kv, st, snap), ("final_hidden", True, 8),
                     ("run", False, "meta", 8, 2, 8, kv, st, snap), ("final_hidden", False, 8)]
    assert uploads == [("layout", "meta", every.tolist())] and len(launched) == 1
    captured = m.one_off_seconds                    # the capture's time counts as one-off work
    assert captured > 0.25 and m.graphs.capture_seconds == pytest.approx(captured - 0.25)
    calls.clear()
    assert m._verify_graph_launch(batch([4, 4]), kv, st, every, snap, None)
    assert calls == [] and len(launched) == 2 and launched[0] is launched[1]   # captured once
    assert m.one_off_seconds == captured            # a replay is no one-off work
    assert len(m.graphs) == 1
    refused = [(batch([4, 3]), np.arange(7, dtype=np.int32), snap, None),       # uneven rows
               (batch([4, 4]), every, None, None),                              # no snapshots
               (batch([4, 4]), every, snap, ("media",)),                        # media rows
               (batch([4, 4]), np.array([3, 7], np.int32), snap, None),          # picks only
               (batch([9, 9]), np.arange(18, dtype=np.int32), snap, None)]       # > logits rows
    for b, out, sn, media in refused:
        assert not m._verify_graph_launch(b, kv, st, out, sn, media)
    m.lg_cap = m.runner.res.moe_gemv_tokens = 64             # rows for the tensor cores
    assert not m._verify_graph_launch(batch([64]), kv, st, np.arange(64, dtype=np.int32), snap,
                                      None)
    m.lg_cap, m.runner.res.moe_gemv_tokens = 16, 4            # an MoE step past the GEMVs
    assert not m._verify_graph_launch(batch([4, 4]), kv, st, every, snap, None)
    m.runner.res.moe_gemv_tokens, m.options.graphs = 16, False
    assert not m._verify_graph_launch(batch([4, 4]), kv, st, every, snap, None)
    assert len(launched) == 2 and len(uploads) == 2 and len(m.graphs) == 1


def test_warm_up_captures_every_verify_graph_a_unit_can_launch(monkeypatch):
    """CudaModel.warm_up captures, besides the decode graphs, the verify graph of every
    (B x (k + 1) tokens, B rows) with B = 1 .. its batch cap and k = 1 .. num_draft_tokens
    that _verify_graph_launch would take (verify_shapes: within the logits rows and the MoE
    GEMV tokens), with the DFlash features' hook where a DFlash drafter is loaded, the MTP
    drafter's chain of every (B, steps) and the DFlash block pass of every B; a model without a
    drafter captures none. So no speculative unit pays a capture while serving."""
    from types import SimpleNamespace

    from ninfer.models.qwen3_5.cuda_model import CudaModel

    def model(speculative, dflash=None, k=3, lg_cap=64, moe=64, chain_steps=0, mtp=False,
              n_cap=64, chunk=512):
        m = CudaModel.__new__(CudaModel)
        m.options = SimpleNamespace(graphs=True, num_draft_tokens=k, prefill_chunk=chunk)
        m.speculative, m.dflash, m.lg_cap, m.b_cap, m.n_cap, m.p_cap = \
            speculative, dflash, lg_cap, 4, n_cap, 400
        m.chain_steps, m.mtp, m.text = chain_steps, mtp, SimpleNamespace(hidden_size=8)
        m.runner = SimpleNamespace(attn_tc_min_tokens=64,
                                   res=SimpleNamespace(moe_gemv_tokens=moe))
        m.eager_meta, m.ws = "meta", SimpleNamespace(snap=SimpleNamespace(ptr=0xABC))
        calls = []

        class Graphs:
            def get(self, B, kv, st):
                calls.append(("decode", B))

            def verify(self, n, B, kv, st, meta, snap, capture):
                calls.append(("verify", n, B, meta, snap, capture))

            def chain(self, B, steps, kv, launches):
                calls.append(("chain", B, steps, launches))

            def block(self, B, kv, run):
                calls.append(("block", B))

            def __len__(self):
                return len(calls)
        m.graphs = Graphs()
        m._current = lambda: None
        m.decode_greedy = lambda batch, kv, st: calls.append(("prefill", batch.num_tokens))
        m.sample = lambda *a: None
        m.mtp_argmax = lambda batch, h, kv, last_only: calls.append(
            ("mtp", batch.num_tokens, h.shape, last_only))
        m.hidden_width = 24
        m.dflash_feed = lambda batch, f, kv: calls.append(("dflash feed", batch.num_tokens,
                                                            f.shape))
        return m, calls
    kv = SimpleNamespace(num_pages=100, page_size=4)
    st = SimpleNamespace(num_slots=100)
    m, calls = model(True)
    assert m.verify_shapes(4) == [(b * (k + 1), b) for b in range(1, 5) for k in (1, 2, 3)]
    m.warm_up(kv, st)
    assert [c for c in calls if c[0] == "decode"] == [("decode", B) for B in range(1, 5)]
    assert [c[1:] for c in calls if c[0] == "verify"] == \
        [(n, b, "meta", 0xABC, None) for n, b in m.verify_shapes(4)]
    assert set(m.warm_up_phases) == {"graphs", "speculative_graphs"}
    assert [c for c in calls if c[0] == "chain"] == []
    # the MTP drafter's chains (mtp_chain): every B and every step count after d_1
    m, calls = model(True, chain_steps=2)
    m.warm_up(kv, st)
    assert [c[1:3] for c in calls if c[0] == "chain"] == [(B, s) for B in range(1, 5)
                                                          for s in (1, 2)]
    assert all(c[3] == m._chain_launches for c in calls if c[0] == "chain")
    hook = object()
    m, calls = model(True, dflash=SimpleNamespace(capture=hook,
                                                  cfg=SimpleNamespace(block_size=3)), k=2)
    m.warm_up(kv, st)
    assert [c[1:3] + c[5:] for c in calls if c[0] == "verify"] == \
        [(b * (k + 1), b, hook) for b in range(1, 5) for k in (1, 2)]
    assert [c for c in calls if c[0] == "block"] == [("block", B) for B in range(1, 5)]
    # a verify past the logits rows or the MoE GEMVs runs eager: no graph to capture
    m, _ = model(True, lg_cap=8)
    assert m.verify_shapes(4) == [(n, b) for n, b in model(True)[0].verify_shapes(4) if n <= 8]
    m, _ = model(True, moe=6)
    assert max(n for n, _ in m.verify_shapes(4)) == 6
    m, calls = model(False)
    assert m.verify_shapes(4) == []
    m.warm_up(kv, st)
    assert [c for c in calls if c[0] == "verify"] == []
    # the row counts whose GEMM algorithms longer calls share (cublaslt.shared_algo_rows): the
    # prefill's up to its chunk, the MTP feed's up to a call's tokens (here 100 pages of 4)
    assert [c for c in calls if c[0] in ("prefill", "mtp")][4:] == \
        [("prefill", 64), ("prefill", 16), ("prefill", 32)]     # (B = 1..4 first; n_cap 64)
    every = (16, 32, 64, 128, 256, 400)
    for mtp, chunk, want_prefill in ((False, 512, [400, 16, 32, 64, 128, 256]),
                                     (True, 64, [400, 16, 32, 64])):
        m, calls = model(False, mtp=mtp, n_cap=1000, chunk=chunk)
        m.warm_up(kv, st)
        assert [c[1] for c in calls if c[0] == "prefill"][4:] == want_prefill
        assert [c[1:] for c in calls if c[0] == "mtp"] == \
            ([(r, (r, 8), True) for r in every] if mtp else [])
        assert [c for c in calls if c[0] == "dflash feed"] == []
    m, calls = model(True, dflash=SimpleNamespace(capture=hook, cfg=SimpleNamespace(block_size=3)),
                     n_cap=1000)
    m.warm_up(kv, st)
    assert [c[1:] for c in calls if c[0] == "dflash feed"] == [(r, (r, 24)) for r in every]
    # a row shorter than a call (p_cap - 1 pages: 16 tokens here): the calls of 32 and 64
    # tokens span rows of 16 on their own pages and slots, as a catch-up feed of B rows does
    m, calls = model(False, mtp=True, n_cap=1000)
    m.p_cap = 5
    seen = []
    m.mtp_argmax = lambda batch, h, kv, last_only: seen.append(batch)
    m.warm_up(kv, st)
    assert [b.num_tokens for b in seen] == [16, 32, 64]
    for b in seen:
        b.validate(kv.page_size)
        assert np.all(np.diff(b.query_start) == 16) and np.all(b.context_lens == 0)
        assert sorted(b.block_tables.ravel()) == list(range(b.block_tables.size))
        assert list(b.state_slots) == list(range(b.num_rows))


def test_a_token_step_keeps_its_rows_hidden_states(monkeypatch):
    """launch_tokens(keep_hidden=True) (CudaModel._queue_step_hidden): the step's B rows of
    ws.xf (the head's final-normed hidden of each row's last token) are copied into the pinned
    buffer of its turn, so two steps in flight keep theirs apart; TokenStep reads them at
    collect (bf16 or float32, as stored), hidden() collects first; a model
    without a drafter refuses, as a step launched without keep_hidden does. (A DFlash model's
    steps copy its feature rows the same way: test_dflash_gpu.py.)"""
    from types import SimpleNamespace

    from ninfer.models.qwen3_5.cuda.token_step import TokenStep
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    dev, r = _FakeDevice(monkeypatch, 1 << 20), np.random.default_rng(6)
    m = CudaModel.__new__(CudaModel)
    H, lg = 8, 4
    m.text, m.lg_cap, m.stream = SimpleNamespace(hidden_size=H), lg, dev.stream
    for f32 in (False, True):
        gin = 4 if f32 else 2
        xf = dev.arena.take((lg, H), np.float32 if f32 else np.uint16, "xf")
        m.f32, m.ws, m.step_hidden = f32, SimpleNamespace(xf=xf, gin_bytes=gin), True
        buf = dev._pinned(2 * lg * H * gin)
        buf.view = lambda dt, off=0, count=None, a=buf.array: \
            a[off: off + count * np.dtype(dt).itemsize].view(dt)
        m.step_hidden_host = buf
        values = [_bf16_exact(r, (lg, H)) for _ in range(2)]
        readers = []
        for turn in (0, 1):                 # two steps in flight, one per turn
            stored = values[turn] if f32 else \
                (values[turn].view(np.uint32) >> 16).astype(np.uint16)
            dev._dev(xf.ptr, xf.nbytes)[:] = stored.view(np.uint8).reshape(-1)
            readers.append(m._queue_step_hidden(turn, 3, xf, H))
        dev._dev(xf.ptr, xf.nbytes)[:] = 0xFF     # the workspace moved on: the copies were taken
        steps = [TokenStep(np.arange(3, dtype=np.int32), SimpleNamespace(synchronize=lambda: None),
                           lambda step: None, rd) for rd in readers]
        assert np.array_equal(steps[1].hidden(), values[1][:3])
        assert steps[1].hidden().dtype == (np.float32 if f32 else ml_dtypes.bfloat16)
        assert np.array_equal(steps[0].collect(), np.arange(3))
        assert np.array_equal(steps[0].hidden(), values[0][:3])
    with pytest.raises(RuntimeError, match="without keep_hidden"):
        TokenStep(np.zeros(1, np.int32), SimpleNamespace(synchronize=lambda: None),
                  lambda step: None).hidden()
    m.step_hidden = False
    with pytest.raises(RuntimeError, match="loaded without a drafter"):
        m._queue_step_hidden(0, 1, xf, H)


def test_hidden_rows_go_up_as_the_device_stores_them(monkeypatch):
    """CudaModel._put_hidden and drafter.host_rows: a bf16 model's own rows (TokenStep.hidden,
    bfloat16) go up as they are, float32 rows are rounded to bf16 on the way (the same bits for
    bf16-exact values), a float32 model's as float32; host_rows keeps bfloat16 rows and makes
    anything else float32 (the catch-up feed's thousands of queued rows are never widened and
    narrowed again on the host)."""
    from ninfer.models.qwen3_5.cuda.drafter import host_rows
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    dev, r = _FakeDevice(monkeypatch, 1 << 20), np.random.default_rng(8)
    n, H = 5, 8
    m = CudaModel.__new__(CudaModel)
    m.stream = dev.stream
    m.hidden_host = buf = dev._pinned(n * H * 4)
    buf.view = lambda dt, off=0, count=None, a=buf.array: \
        a[off: off + count * np.dtype(dt).itemsize].view(dt)
    exact = _bf16_exact(r, (n, H))
    bits = exact.astype(ml_dtypes.bfloat16).view(np.uint16)
    for f32 in (False, True):
        m.f32 = f32
        dst = dev.arena.take((n, H), np.float32 if f32 else np.uint16, "h")
        for given in (exact, exact.astype(ml_dtypes.bfloat16), exact.astype(np.float64)):
            dev._dev(dst.ptr, dst.nbytes)[:] = 0xFF
            m._put_hidden(dst, host_rows(given))
            got = dev._dev(dst.ptr, dst.nbytes).view(np.float32 if f32 else np.uint16)
            assert np.array_equal(got.reshape(n, H), exact if f32 else bits), (f32, given.dtype)
    assert host_rows(exact.astype(ml_dtypes.bfloat16)).dtype == ml_dtypes.bfloat16
    assert host_rows(exact.astype(np.float64)).dtype == np.float32
    assert host_rows([[1, 2]]).dtype == np.float32
