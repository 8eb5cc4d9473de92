"""bench_engine's artifacts: written with no checkpoint on disk (--direct, the random source the
converter reads as it goes) they hold exactly the tensors of the checkpoint-and-convert path, also
when a tensor spans many of the random block's tiles and when one row is longer than the block."""
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import bench_engine as be  # noqa: E402
from ninfer.artifact import Artifact  # noqa: E402


@pytest.mark.parametrize("block", [1000, 20])
def test_direct_artifact_equals_the_converted_checkpoint(tmp_path, monkeypatch, block):
    monkeypatch.setattr(be, "RANDOM_VALUES", block)
    a, _, _ = be.make_artifact("tiny", tmp_path / "a")
    b, _, _ = be.make_artifact("tiny", tmp_path / "b", direct=True)
    assert not (tmp_path / "b" / "tiny-hf").exists()
    with Artifact(str(a)) as x, Artifact(str(b)) as y:
        assert x.binding_names() == y.binding_names()
        for name in x.binding_names():
            u, v = np.asarray(x.tensor(name)), np.asarray(y.tensor(name))
            assert u.shape == v.shape and u.dtype == v.dtype, name
            np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8), err_msg=name)
