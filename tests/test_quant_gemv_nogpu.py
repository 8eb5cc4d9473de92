"""kernels/quant_gemv.py (fp8 / int8 weight-only GEMV, not wired into the CUDA model, unmeasured
on a GPU) on numba-cuda's CPU simulator: tests/gpu/sim_quant_gemv.py in a subprocess (the
simulator must be on before numba is imported) against a float64 decode of the same bytes."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

GEMV_REL_TOL = 1e-6         # float32 accumulation over <= 300 products vs float64


def test_quant_gemv_kernels_on_the_simulator():
    pytest.importorskip("numba.cuda")
    pytest.importorskip("ml_dtypes")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tests/gpu")]))
    res = subprocess.run([sys.executable, "-W", "ignore", str(root / "tests/gpu/sim_quant_gemv.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    errs = json.loads(res.stdout.strip().splitlines()[-1])
    assert errs.pop("decode/every_code_max_abs_diff") == 0.0     # e4m3 decode is exact
    assert len(errs) == 4 and all(e < GEMV_REL_TOL for e in errs.values()), errs
