"""Decode-step kernels reworked for speed (issue 26) without a GPU: on numba-cuda's CPU simulator
against float64 oracles (tests/gpu/sim_decode_kernels.py), and their host-side launch geometry
against the kernels' constants."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL_F32 = 1e-5            # float32 arithmetic against float64
TOL_BF16 = 8e-3           # one bf16 rounding of the output (2^-8 relative at most, ~2^-9 typical)


def test_decode_kernels_on_the_simulator(seed=0):
    """attn_combine with 1 to 128 splits (the unrolled and the tail loops), empty splits whose
    partials are NaN, head dims that leave a partial block of 32, tokens from t_base on: within
    float32's (or one bf16 rounding's) error of float64, rows before t_base untouched. The
    expert GEMVs' 16-byte-load path (bf16 rows of whole warp spans; the other path is
    sim_storage's): gate_up within a bf16 rounding (its output is rounded), down within float32's
    error of float64 over the same activations. router_topk (a warp a token): ids exactly a
    stable sort's (ties among the logits, one for the top), E not a multiple of 32 and above
    256, with and without renormalised weights; expert_gate_up_routed (the top-k in the gate|up
    GEMV's prologue): the ids and weights router_topk's, each pair's SwiGLU over the expert it
    picked within a bf16 rounding. argmax (16-byte groups, four a thread at once): np.argmax's
    ids exactly, ties and rows of -inf included. rmsnorm with the row in registers and wider than
    that (the two-pass loop). gather_rows (16 bytes a thread): the source rows exactly, whole and
    partial 16-byte groups. The MoE prefill's routed-row layout on the device (moe_route_count,
    _scan, _place) exactly the host's layout (moe_rows.expert_rows) for cap 0 and for a padded
    block with experts short of it and past it. The decode GEMV
    (kernels/gemv.py) within float32's error of float64: 1 to 8 tokens, the unrolled and the
    tail loops, beta 0 over a poisoned output and 1. The decode MoE layer's fused tail
    (moe_down_combine: the shared expert's SwiGLU and down, the routed experts' down, the gated
    combine and the residual add) within a bf16 rounding of float64, on rows of whole warp spans
    and rows that are not, rows past the launch untouched. gemv_norm (the RMS norm in the GEMV's
    prologue): the normed rows it stores within a bf16 rounding of float64's norm, rows past M
    untouched, the product over them within float32's error, 1 to 8 tokens."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore",
                          str(ROOT / "tests/gpu/sim_decode_kernels.py"), str(seed)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out) == 43, out
    for key, v in out.items():
        if key.endswith(("untouched", "ids")):
            assert v is True, key
        else:
            assert v < (TOL_F32 if key.endswith("f32") else TOL_BF16), (key, v)


TOL_ATTN_MMA = 8e-3       # q and the softmax weights rounded to bf16 for the mma (measured 0.9-3.1e-3)


def test_decode_attention_on_tensor_cores_on_the_simulator(seed=1):
    """kernels/attention_mma.py (the mma twins of kernels/ptx.py meet the 32 lanes of a
    simulated warp) against float64 attention over the same bf16 K/V: decode rows of empty and
    long contexts, splits past the keys, a warp with two tiles, causal prefill tokens launched
    from t_base > 0, head_dim 64 / 128 / 256, G 4 / 6 / 8 and 16 in two blocks of 8, pages of 16,
    32 and 5 keys (the
    last: each key's page read); pools poisoned (NaN) where no row
    owns a key, every partial written. The wrong rescale of one head's sum (the shuffle's
    source lane off by one) measured 0.17 here, a key past the row's length read 0.16-1.0."""
    pytest.importorskip("numba.cuda")
    from sim_run import run_sim
    out = run_sim("sim_attention_mma.py", seed)
    assert len(out) == 12, out
    for key, v in out.items():
        if key.endswith("_written"):
            assert v is True, key
        else:
            assert v < TOL_ATTN_MMA, (key, v)


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_combine_launch_matches_the_kernel():
    from ninfer.core.cuda import numba_shim
    from ninfer.core.cuda.kernels import _import_kernel_module
    from ninfer.models.qwen3_5.cuda import moe_route, runner
    numba_shim.import_numba_cuda()
    assert _import_kernel_module("attention").COMBINE_GROUPS == runner.COMBINE_GROUPS
    assert _import_kernel_module("moe").DOWN_ROWS == runner.EXPERT_DOWN_ROWS
    assert _import_kernel_module("moe").ROUTER_THREADS == runner.ROUTER_THREADS
    assert _import_kernel_module("moe").GATHER_THREADS == runner.GATHER_THREADS
    assert _import_kernel_module("moe").ROUTE_CHUNK == moe_route.ROUTE_CHUNK
    gemv = _import_kernel_module("gemv")
    assert (gemv.WARPS, gemv.MAX_M, 4 * gemv.SPAN) == (runner.GEMV_WARPS, runner.GEMV_MAX_M,
                                                       runner.GEMV_SPAN_BYTES)
    assert _import_kernel_module("moe").ROUTE_COUNT_THREADS == moe_route.COUNT_THREADS
    assert runner.combine_launch(3, 16, 256) == ((3, 16, 8), (32 * runner.COMBINE_GROUPS,))


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_gather_rows_copies_16_bytes_a_thread_in_its_ptx():
    """The vector path is one 16-byte load and one 16-byte store (kernels/ptx.py st_v4), not
    four word copies: what the rework is for."""
    from ninfer.core.cuda import kernels as K
    from ninfer.models.qwen3_5.cuda.kernel_set import spec
    try:
        ptx = K.compile_spec(spec("gather_rows"), (9, 0))
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    assert ptx.count("ld.global.nc.v4.u32") == 1 and ptx.count("st.global.v4.u32") == 1


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_every_release_gemv_norm_fits_static_shared_memory(tmp_path):
    """The norm-in-GEMV kernels a release geometry's set holds (kernel_set.norm_gemv_fits): the
    largest token count of each hidden size assembles for sm_90 (its bf16 rows and partial sums
    within 48 KB of static shared memory: one count more would not), and the rule agrees with
    the kernel's own assertion."""
    import shutil
    import subprocess
    from ninfer.core.cuda import kernels as K
    from ninfer.core.cuda.kernels import _import_kernel_module
    from ninfer.models.qwen3_5.cuda.kernel_set import geometry_specs, norm_gemv_fits, spec
    from ninfer.models.qwen3_5.releases import RELEASES, release_config
    gemv = _import_kernel_module("gemv")
    largest = {}
    for name in RELEASES:
        cfg = release_config(name)
        ms = [dict(sp.params)["M"] for n, sp in geometry_specs(cfg).items()
              if n.startswith("gemv_norm")]
        H = cfg.hidden_size
        held = cfg.is_moe or H <= 2048               # the geometries whose sets hold them
        want = [m for m in range(1, gemv.MAX_M + 1) if norm_gemv_fits(H, m)] if held else []
        assert ms == want, name
        if ms:
            largest[H] = max(ms)
    assert largest == {1024: 8, 2048: 8, 3072: 7, 4096: 5}
    for H, m in largest.items():
        gemv.gemv_norm(m, H)                           # the kernel's assertion holds
        if m < gemv.MAX_M:
            with pytest.raises(AssertionError):
                gemv.gemv_norm(m + 1, H)
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on this machine")
    for H, m in largest.items():
        try:
            ptx = K.with_grid_dependency(K.compile_spec(spec("gemv_norm", M=m, hidden=H), (9, 0)))
        except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
            pytest.skip(f"numba-cuda cannot compile here: {exc}")
        src = tmp_path / f"g{H}.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90", str(src), "-o", str(tmp_path / "g.cubin")],
                           capture_output=True, text=True)
        assert r.returncode == 0, (H, m, r.stderr)
