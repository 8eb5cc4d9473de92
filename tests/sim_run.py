"""Run a tests/gpu/sim_*.py script on numba-cuda's CPU simulator in a subprocess (the simulator
must be on before numba is imported) and return the JSON object its last line prints."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_sim(script: str, *args, timeout: int = 600) -> dict:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests/gpu")]))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu" / script),
                          *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
