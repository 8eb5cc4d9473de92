"""A speculative verify's acceptance kernels (kernels/speculate.py, issue 25) without a GPU: on
numba-cuda's CPU simulator against a numpy oracle of program/speculative.py's rule."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("seed", [0, 1])
def test_acceptance_and_state_select_on_the_simulator(seed):
    """37 rows of k = 0 .. 4 drafts (plain rows among them), each accepting a random prefix of
    its drafts or all of them: spec_accept's produced counts and kept snapshot slots equal the
    oracle's (outputs poisoned first), and state_select copies each speculative row's kept
    snapshot over its own slot, word for word, 300-word rows over a 2 x 64-thread grid, and
    changes no other row; spec_feed (the MTP feed behind a verify) turns the rows' token ids
    into their picks, points each row's output row at its last produced position and moves the
    chain steps' context lengths and positions by the produced count, and nothing else."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_speculate.py"),
                          str(seed)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["speculative_rows"] > 20 and out["full_accepts"] > 0, out
    assert out["produced_mismatches"] == 0 and out["keep_mismatches"] == 0, out
    assert out["state_exact"], out
    assert out["feed_out_rows_exact"] and out["feed_token_ids_exact"], out
    assert out["feed_chain_exact"], out
    assert out["rows_changed"] == out["rows_expected_changed"] == out["speculative_rows"], out
