"""Programmatic dependent launch (docs/gpu.md): every kernel waits for the one before it, so a
model gives bit-identical outputs with it on and off, eager and in decode graphs."""
import numpy as np
import pytest

from test_model_gpu import Seqs, batch_for, options
from tiny_model import TinyArtifact, tiny_config

from ninfer.core.cuda import kernels as K

pytestmark = pytest.mark.gpu


def _run(gpu, V):
    """Logits of a 3-row prefill (eager) then 4 decode steps (graphs), fixed inputs."""
    r = np.random.default_rng(11)
    s = Seqs(gpu)
    try:
        rows, ctxs = [0, 1, 2], [13, 5, 30]
        out = [gpu.forward(batch_for(s, rows, [r.integers(0, V, c) for c in ctxs], [0, 0, 0]),
                           s.kv, s.state)]
        for _ in range(4):
            out.append(gpu.forward(batch_for(s, rows, [r.integers(0, V, 1) for _ in rows], ctxs),
                                   s.kv, s.state))
            ctxs = [c + 1 for c in ctxs]
        return out
    finally:
        s.close()


@pytest.mark.parametrize("moe", [False, True])
def test_outputs_are_identical_with_and_without_pdl(moe, monkeypatch):
    from ninfer.models.qwen3_5.cuda_model import load_cuda_model
    art = TinyArtifact(tiny_config(moe=moe), seed=5)
    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv(K.PDL_ENV, pdl)
        gpu = load_cuda_model(art, options())
        try:
            results[pdl] = _run(gpu, gpu.config.text.vocab_size)
            cache = gpu.kernels.__dict__["_cache"]
            if pdl == "1" and gpu.device.cc >= (9, 0):
                assert cache.pdl and cache.get(next(iter(gpu.kernels.specs.values()))).pdl
            if pdl == "0":
                assert not cache.pdl
        finally:
            gpu.close()
    for a, b in zip(results["1"], results["0"]):
        assert np.isfinite(a).all() and np.array_equal(a, b)
