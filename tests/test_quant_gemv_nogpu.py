"""kernels/quant_gemv.py (the quantized decode GEMV and the prefill dequantization) on numba-cuda's
CPU simulator: tests/gpu/sim_quant_gemv.py in a subprocess (the simulator must be on before numba
is imported) against a float64 decode of the same stored bytes."""
import pytest

from sim_run import run_sim

GEMV_REL_TOL = 1e-6         # float32 accumulation over <= 384 products vs float64
DEQUANT_F32_REL_TOL = 1.2e-7   # one float32 rounding of (q - z) * s (2^-24 relative, of the max)


def test_quant_gemv_kernels_on_the_simulator():
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    out = run_sim("sim_quant_gemv.py")
    mismatches = {k: out.pop(k) for k in list(out) if k.endswith("_mismatches")}
    assert mismatches and all(v == 0 for v in mismatches.values()), mismatches
    f32 = {k: out.pop(k) for k in list(out) if k.endswith("_rel")}
    assert f32 and all(v <= DEQUANT_F32_REL_TOL for v in f32.values()), f32
    # every case ran (2.0: a poisoned output written where it must not be; 1.0: not finite)
    assert len(out) == 47 and all(e < GEMV_REL_TOL for e in out.values()), out


def test_act_quant_kernel_on_the_simulator():
    """tests/gpu/sim_act_quant.py: the W8A8 prefill input (kernels/act_quant.py) byte for byte
    equal to kv_quant.quantize per 128 columns, in cuBLASLt's scale layout, padded rows clean,
    nothing written outside; the MTP drafts' int8 head (bf16 and float32 rows) byte for byte
    kv_quant's int8 rule per row and 128 columns."""
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    import numpy as np
    out = run_sim("sim_act_quant.py", np.random.default_rng().integers(1 << 30))
    assert len(out) == 6 and all(v == [0, 0, 0] for v in out.values()), out
