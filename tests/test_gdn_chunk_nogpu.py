"""The chunked gated delta rule (kernels/gdn_chunk.py, cuda/gdn_chunk.py) without a GPU: its
kernels on numba-cuda's CPU simulator against the float64 oracle and the recurrent kernel (and
the recurrent kernel's snapshot variant for a speculative verify), PTX
for sm_90 at the real head geometries (shared memory within the static limit, the scan's state in
registers), the host helpers, the geometry refusal and the runner's choice of path."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ninfer.errors import DeviceError
from ninfer.models.qwen3_5.config import TextConfig
from ninfer.models.qwen3_5.cuda import gdn_chunk as gc
from ninfer.models.qwen3_5.cuda.kernel_set import (check_geometry, gdn_chunk_specs,
                                                    geometry_specs)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# fp32 arithmetic against the float64 oracle (tests/gpu/gpu_harness.py TOL_F32); tf32 operands
# on the tensor cores (TOL_TF32: 10 mantissa bits, 2^-11 relative each, fp32 accumulation)
TOL_F32 = 1e-5
TOL_TF32 = 2e-3


# ---- the kernels on the simulator --------------------------------------------------------------

def _simulate(case):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_gdn_chunk.py"),
                             case], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_chunked_kernels_on_the_simulator():
    """Rows of 1, Cn-1, Cn, Cn+1 and 2-3 chunks in one batch, fresh and continued states, dk with
    4 lanes (3 rows each) and 8 lanes (a group of 4 adjacent rows, as at dk 128), dv below and
    above one 32-column block, 2 and 3 value heads per key head, strong decays (the float64
    log-decay sums), NaN-poisoned outputs and buffers. "tc": the tensor-core variants (two warps:
    a chunk of 32), a fresh row of 40 tokens (a full and a partial chunk) beside a continued
    1-token row."""
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    procs = {case: _simulate(case) for case in ("small", "decay", "tc")}     # in parallel
    for case, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        res = json.loads(out.strip().splitlines()[-1])[case]
        tol = TOL_TF32 if case == "tc" else TOL_F32
        assert res["spare_slot_untouched"], res
        if case == "tc":
            # the scan's state pass and output pass ran
            assert {"gdn_chunk_state_tc", "gdn_chunk_out_tc"} <= set(res["kernels"]), res
        for key in ("chunk_out", "chunk_state"):
            assert res[key] < tol, (case, key, res)
        if "rec_out" in res:
            # the recurrent kernel on the same inputs: both agree with the oracle and each other
            for key in ("rec_out", "rec_state"):
                assert res[key] < TOL_F32, (case, key, res)
            for key in ("chunk_vs_rec_out", "chunk_vs_rec_state"):
                assert res[key] < tol, (case, key, res)
            assert res["rec_spare_slot_untouched"], res


def test_recurrent_kernel_with_snapshots_on_the_simulator():
    """gdn_recurrent_snap and conv_state_update_snap (a speculative verify's State, issue 25):
    each row's S after each of its 1 .. 5 tokens lands in its snapshot slots (against the float64
    oracle run on the row's prefixes), its conv window too (exact: copies), a row without
    snapshots beside them, fresh and continued states; outputs and final states as
    gdn_recurrent's (bitwise the same outputs); no other slot written."""
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    p = _simulate("snap")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])["snap"]
    assert res["num_snaps"] == 13 and res["others_untouched"], res
    assert res["conv_windows_exact"] and res["conv_others_untouched"], res
    assert res["vs_plain_out"] == 0.0, res
    for key in ("out", "state", "snaps"):
        assert res[key] < TOL_F32, (key, res)


# ---- PTX at the real geometries ----------------------------------------------------------------

def _decls(ptx, space):
    return [int(x) for x in re.findall(rf"\.{space}\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]", ptx)]


@pytest.mark.parametrize("nv", [48, 32])        # 27B: 16/48 heads of 128; 9B and 35B-A3B: 16/32
def test_chunked_kernels_compile_to_ptx_at_the_real_geometry(nv):
    from ninfer.core.cuda import kernels as K
    specs = gdn_chunk_specs(128, 128, 16, nv)
    assert set(specs) == {"gdn_chunk_prep", "gdn_chunk_scan"}
    assert dict(specs["gdn_chunk_scan"].params)["Cn"] == 16
    try:
        ptx = {name: K.compile_spec(sp, (9, 0)) for name, sp in specs.items()}
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    for name, text in ptx.items():
        assert ".target sm_90" in text and K.entry_name(text)
        shared = sum(_decls(text, "shared"))
        assert 0 < shared <= gc.STATIC_SMEM_BYTES, (name, shared)
    assert sum(_decls(ptx["gdn_chunk_scan"], "shared")) == gc.scan_smem(16, 128)
    assert sum(_decls(ptx["gdn_chunk_prep"], "shared")) == gc.prep_smem(16)
    # the scan keeps its state slice (dk/KS rows x NC columns) in registers: no local memory
    assert sum(_decls(ptx["gdn_chunk_scan"], "local")) == 0


@pytest.mark.parametrize("nv", [48, 32])
def test_tensor_core_kernels_compile_to_ptx_at_the_real_geometry(nv):
    """The tf32 variants at dk = dv = 128: mma.sync m16n8k8 tf32 in each, shared memory as
    tc_prep_smem / tc_pass_smem say (within the static limit), the scan's state slice and
    accumulators in registers (no local memory): the prep and the scan's two passes."""
    from ninfer.core.cuda import kernels as K
    specs = gdn_chunk_specs(128, 128, 16, nv, tc=True)
    passes = {"gdn_chunk_state_tc", "gdn_chunk_out_tc"}
    assert set(specs) == {"gdn_chunk_prep_tc"} | passes
    try:
        ptx = {name: K.compile_spec(sp, (9, 0)) for name, sp in specs.items()}
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    for name, text in ptx.items():
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text, name
        assert "cvt.rna.tf32.f32" in text, name
        assert sum(_decls(text, "local")) == 0, name
    assert sum(_decls(ptx["gdn_chunk_prep_tc"], "shared")) == gc.tc_prep_smem() \
        <= gc.STATIC_SMEM_BYTES
    for name in passes:
        assert sum(_decls(ptx[name], "shared")) == gc.tc_pass_smem(128) <= gc.STATIC_SMEM_BYTES


# ---- host helpers, geometry, the runner's path -------------------------------------------------

def test_tensor_core_variants_take_the_release_geometries():
    """dk = dv = 128 (every Qwen3.5 release) and 64 take the tf32 variants; a key dim that is no
    multiple of 64 or whose state slice outgrows the shared memory (256) keeps the fp32 ones,
    as does every float32 model (its exactness is the point)."""
    assert gc.tc_ok(128, 128) and gc.tc_ok(64, 64) and gc.tc_ok(128, 64)
    assert not gc.tc_ok(256, 128) and not gc.tc_ok(12, 20) and not gc.tc_ok(64, 40)
    assert not gc.tc_ok(96, 128)
    cfg = TextConfig(layer_types=("linear_attention",), num_hidden_layers=1,
                     linear_key_head_dim=128, linear_value_head_dim=128)
    tc_names = {"gdn_chunk_prep_tc", "gdn_chunk_state_tc", "gdn_chunk_out_tc"}
    assert tc_names <= set(geometry_specs(cfg))
    assert not {"gdn_chunk_prep", "gdn_chunk_scan"} & set(geometry_specs(cfg))
    f32 = geometry_specs(cfg, f32=True)
    assert {"gdn_chunk_prep", "gdn_chunk_scan"} <= set(f32)
    assert not {n for n in f32 if n.endswith("_tc")}
    cfg256 = TextConfig(layer_types=("linear_attention",), num_hidden_layers=1,
                        linear_key_head_dim=256, linear_value_head_dim=128)
    assert {"gdn_chunk_prep", "gdn_chunk_scan"} <= set(geometry_specs(cfg256))



def test_chunk_size_fits_both_kernels_shared_memory():
    assert gc.chunk_size(64) == 16             # the measured choice (CHUNK_SIZES' comment)
    assert gc.chunk_size(128) == 16
    assert gc.chunk_size(256) == 16
    for dk in range(4, 1025, 4):
        cn = gc.chunk_size(dk)
        assert cn in gc.CHUNK_SIZES
        assert gc.scan_smem(cn, dk) <= gc.STATIC_SMEM_BYTES and gc.prep_smem(cn) <= gc.STATIC_SMEM_BYTES
        # preferred: every size listed before the chosen one does not fit
        earlier = gc.CHUNK_SIZES[:gc.CHUNK_SIZES.index(cn)]
        assert all(gc.scan_smem(c, dk) > gc.STATIC_SMEM_BYTES for c in earlier)
    assert gc.scan_threads(128) == 128 and gc.scan_threads(12) == 64
    # the scan's columns of one thread live in one warp-aligned block: NT a multiple of 32
    assert all(gc.scan_threads(dk) % 32 == 0 for dk in (4, 8, 12, 128))


def test_max_chunks_and_workspace():
    rows = [(0, 1, 0), (1, 64, 5), (65, 65, 0)]
    assert gc.max_chunks(rows, 130, 3, 64) == 2
    assert gc.max_chunks([(0, 1, 0)], 1, 1, 64) == 1
    assert gc.max_chunks(None, 130, 3, 64) == 2          # no row info: the longest possible row
    assert gc.max_chunks(None, 131, 3, 64) == 3          # (n - b + 1 tokens)
    shapes = gc.buffer_shapes(4096, 48, 128, 64)
    assert shapes == {"w": (4096, 48, 128), "p": (4096, 48, 64), "g": (4096, 48, 2)}
    # P at the larger of the two paths' chunks (64, the tensor cores')
    assert gc.workspace_bytes(4096, 48, 128) == 4 * 4096 * 48 * (128 + 64 + 2)
    # the tensor-core scan's chunk-start states: 4096 / 64 + 8 slots of [48, 128, 128]
    assert gc.buffer_shapes(4096, 48, 128, 64, 128, 8)["s"] == (72, 48, 128, 128)
    assert gc.workspace_bytes(4096, 48, 128, 128, 8) == 4 * 4096 * 48 * (128 + 64 + 2) \
        + 4 * 72 * 48 * 128 * 128


def test_chunk_slots_are_distinct_and_within_the_bound():
    """kernels/gdn_chunk_tc.chunk_slot over every row layout of up to 5 rows and 300 tokens
    (chunks of 16): each chunk of a call its own slot, all below state_chunk_slots."""
    import numpy as np
    r = np.random.default_rng(0)
    cn = 16
    for _ in range(400):
        lengths = r.integers(1, 80, r.integers(1, 6))
        qs = np.concatenate([[0], np.cumsum(lengths)])
        slots = [q0 // cn + row + z for row, (q0, ln) in enumerate(zip(qs, lengths))
                 for z in range(-(-int(ln) // cn))]
        assert len(set(slots)) == len(slots)
        assert max(slots) < gc.state_chunk_slots(int(qs[-1]), len(lengths), cn)


def test_geometry_refuses_a_key_dim_no_chunk_fits(monkeypatch):
    cfg = TextConfig(layer_types=("linear_attention",), num_hidden_layers=1,
                     linear_key_head_dim=128)
    check_geometry(cfg)
    assert {"gdn_chunk_prep", "gdn_chunk_scan"} <= set(geometry_specs(cfg, f32=True))
    monkeypatch.setattr(gc, "CHUNK_SIZES", (4096,))
    with pytest.raises(DeviceError, match="chunked delta rule's shared memory"):
        check_geometry(cfg)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, st, name, grid, block, args, smem=0):
        self.calls.append((name, tuple(grid), tuple(block), args))


class _KernelNames:
    """A kernel set whose kernels are their names: a recorder in place of StepRunner.launch
    sees which kernel each launch names (none fused into the GEMV: no specs)."""
    specs = frozenset()

    def __getattr__(self, name):
        return name


class _Buf:
    def __init__(self, name):
        self.name, self.ptr = name, hash(name) & 0xFFFFFF


@pytest.mark.parametrize("tc", [False, True])
@pytest.mark.parametrize("rows,decode", [([(0, 1, 3), (1, 1, 0)], True),
                                         ([(0, 70, 0), (70, 1, 9)], False),
                                         ([(0, 1, 0), (1, 1, 0), (2, 2, 0)], False)])
def test_runner_takes_the_chunked_path_for_every_non_decode_call(rows, decode, tc):
    from ninfer.models.qwen3_5.cuda.runner import StepResources, StepRunner
    cfg = TextConfig(layer_types=("linear_attention",), num_hidden_layers=1,
                     linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12,
                     linear_value_head_dim=40)
    ws = type("WS", (), {})()
    for name in ("x", "proj", "mid", "core", "act", "h", "gdn_w", "gdn_p", "gdn_g"):
        setattr(ws, name, _Buf(name))
    ws.gdn_tc = tc
    ws.gdn_cn = gc.TC_CHUNK if tc else gc.chunk_size(12)
    ws.gdn_s = _Buf("gdn_s") if tc else None
    ws.gdn_rows = 3
    r = StepRunner(StepResources(cfg=cfg, ws=ws, weights={}, lt=None, kernels=_KernelNames(),
                                 num_sms=1, b_cap=1, moe_gemv_tokens=1, n_cap=64, route_host=None, media=None),
                   invariant=False, attn_tc_min_tokens=64)
    r.rows = rows
    rec = _Recorder()
    r.launch = rec
    r.gemm = lambda *a, **k: None
    meta = type("Meta", (), {k: _Buf(k) for k in ("token_row", "query_start", "context_lens",
                                                  "state_slots")})()
    state = type("State", (), {"conv": [_Buf("conv")], "recurrent": [_Buf("rec")]})()
    lw = {k: _Buf(k) for k in ("input_norm", "w_in", "conv_w", "a_log", "dt_bias", "norm_w",
                               "w_out")}
    n, b = sum(ln for _, ln, _ in rows), len(rows)
    r.gdn(None, meta, n, b, lw, state, 0)
    names = [c[0] for c in rec.calls]
    if decode:
        assert "gdn_recurrent" in names and not any(x.startswith("gdn_chunk") for x in names)
        return
    assert "gdn_recurrent" not in names
    sfx = "_tc" if tc else ""
    assert not any(x.startswith("gdn_chunk") and x.endswith("_tc") != tc for x in names)
    longest = max(ln for _, ln, _ in rows)
    chunks = -(-longest // ws.gdn_cn)
    if tc:
        # the scan as its state pass (the scan's grid) and output pass (a block per chunk and
        # value block), both through the chunk-start states buffer; U / V' / O share `core`
        prep, state_pass, out_pass = (next(c for c in rec.calls if c[0] == k) for k in
                                      ("gdn_chunk_prep_tc", "gdn_chunk_state_tc",
                                       "gdn_chunk_out_tc"))
        nb = -(-40 // gc.TC_VB)
        assert prep[1] == (b, 6, chunks)
        assert state_pass[1] == (b, 6, nb) and out_pass[1] == (b, 6, chunks * nb)
        assert prep[2] == state_pass[2] == out_pass[2] == (2 * gc.TC_CHUNK,)
        assert state_pass[3][:3] == (ws.core, ws.gdn_w, ws.gdn_s)
        assert state_pass[3][5] is state.recurrent[0]
        assert out_pass[3][:3] == (ws.core, ws.gdn_p, ws.gdn_s)
        assert names.index("gdn_chunk_prep_tc") < names.index("gdn_chunk_state_tc") \
            < names.index("gdn_chunk_out_tc") < names.index("gated_rmsnorm")
        # more rows than the chunk-start states were sized for: refused, nothing launched
        rec.calls.clear()
        ws.gdn_rows = b - 1
        with pytest.raises(ValueError, match="rows in one call"):
            r.gdn(None, meta, n, b, lw, state, 0)
        assert not any(c[0].startswith("gdn_chunk") for c in rec.calls)
        return
    prep, scan = (next(c for c in rec.calls if c[0] == k + sfx)
                  for k in ("gdn_chunk_prep", "gdn_chunk_scan"))
    assert prep[1] == (b, 6, chunks)
    if tc:      # (a fake geometry: the launch sizes only; tc_ok decides for real models)
        assert prep[2] == scan[2] == (2 * gc.TC_CHUNK,) and scan[1] == (b, 6, -(-40 // gc.TC_VB))
    else:
        assert prep[2] == (gc.PREP_THREADS,)
        assert scan[1] == (b, 6, 2) and scan[2] == (gc.scan_threads(12),)
    # both read the same qkv / gates / state the recurrent kernel reads, U and O share `core`
    assert prep[3][0] is ws.core and scan[3][0] is ws.core and prep[3][4] is ws.mid
    C, Vd, nv = cfg.linear_conv_dim, cfg.linear_value_dim, 6
    assert prep[3][6:9] == (C + Vd + 2 * nv, C + Vd + nv, C + Vd)
    assert scan[3][5] is state.recurrent[0]
    assert names.index("gdn_chunk_prep" + sfx) < names.index("gdn_chunk_scan" + sfx) \
        < names.index("gated_rmsnorm")
