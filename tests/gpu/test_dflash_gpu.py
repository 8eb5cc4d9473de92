"""A DFlash drafter on the GPU (issue 30; cuda/dflash.py): its feed and block pass against the
numpy drafter (dflash_cases.py, which the simulator also runs: sim_dflash.py) and the target's
verify handing the drafter's features. The Engine's tokens with speculative='dflash' against
plain decoding's are test_speculative_gpu.py's (DRAFTERS)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # (tests/: helpers)
import dflash_cases   # noqa: E402
from gpu_harness import TOL_MODEL_BF16, TOL_MODEL_F32   # noqa: E402

from ninfer.artifact import Artifact   # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("geometry", ["target", "own"])
def test_feed_block_and_verify_features_equal_the_numpy_drafter(tmp_path, geometry):
    """Two rows fed (one in two calls), one block pass: the drafts' hidden states within the
    whole-model tolerance (float32; the simulator measured 1.8e-7) and the same argmax drafts;
    bf16 within its tolerance (simulator: 2.6e-3). The verify's features (the outputs of the
    drafter's target layers) and logits as the numpy model's, and a plain decode step's
    features (launch_tokens(keep_hidden=True, hidden_layers=...): a k = 0 unit's). The block
    pass through its captured graph equals the eager one bit for bit, and gives the same drafts
    without its hidden states. geometry: the drafter's KV heads and head_dim the target's, or
    its own (dflash_cases.GEOMETRIES: its pool layers of their own page shape)."""
    with Artifact(dflash_cases.artifact(tmp_path, geometry)) as art:
        out = dflash_cases.run(art, "verify", graphs=True)
    f, b = out["float32"], out["bfloat16"]
    assert f["hidden"] < TOL_MODEL_F32 and f["ids_equal"], f
    assert b["hidden"] < TOL_MODEL_BF16 and b["ids_agree"] >= 0.75, b
    assert f["kv_layers"] == f["target_kv_layers"] + 2                 # the drafter's, last
    for d, tol in ((f, TOL_MODEL_F32), (b, TOL_MODEL_BF16)):
        assert d["verify_logits"] < tol and d["verify_features"] < tol, d
        assert d["step_features"] < tol, d          # a plain step's (keep_hidden) features
        assert d["graph_equal"] and d["no_hidden"], d
