"""Media on the CUDA backend without a GPU (issue 18).

Fast: CudaModel's media plumbing on a fake driver (tests/test_cuda_nogpu.py's _FakeDevice): the
tower's rows land on the right rows of the hidden buffer, one copy per run of adjacent rows;
media force an eager call; bad media rows are refused. Slow (minutes, NINFER_SIM_MODEL=1, as the
whole-model simulator test): tests/gpu/sim_media.py, an image prompt through the CUDA model's whole
launch sequence on numba-cuda's simulator against the numpy backend, float32."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _media_rows(dev, n_cap=16, H=8):
    """(the writer of a CudaModel of n_cap tokens, hidden size H; its hidden buffer)"""
    from ninfer.models.qwen3_5.cuda.media_rows import MediaRows
    h = dev.arena.take((n_cap, H), np.float32, "h")
    return MediaRows(h, H, n_cap), h


def test_media_rows_land_on_their_hidden_rows(monkeypatch):
    from test_cuda_nogpu import _FakeDevice
    dev = _FakeDevice(monkeypatch, 1 << 20)

    def pinned(nbytes):                     # _FakeDevice's pinned buffers, with view()
        buf = dev._pinned(nbytes)
        buf.view = lambda dtype, off=0, count=None: buf.array[off:].view(dtype)[:count]
        return buf
    monkeypatch.setattr("ninfer.core.cuda.driver.PinnedBuffer", pinned)
    from ninfer.models.qwen3_5.cuda.media_rows import checked_media
    writer, hidden = _media_rows(dev)
    copies = []
    real = dev._htod
    monkeypatch.setattr("ninfer.core.cuda.driver.copy_htod_async",
                        lambda dst, src, n, st: copies.append(n) or real(dst, src, n, st))
    h = dev._dev(hidden.ptr, 16 * 8 * 4).view(np.float32).reshape(16, 8)
    h[:] = -7.0                                           # the gathered embeddings (poison)
    rows = np.array([2, 3, 4, 9, 10, 15])
    vecs = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    batch = SimpleNamespace(num_tokens=16)
    writer.write(dev.stream, checked_media(batch, (rows, vecs), 8))
    np.testing.assert_array_equal(h[rows], vecs)
    untouched = np.setdiff1d(np.arange(16), rows)
    assert np.all(h[untouched] == -7.0)
    assert copies == [3 * 32, 2 * 32, 1 * 32]              # one copy per run of adjacent rows
    for bad_rows, bad_vecs in ((rows[::-1], vecs), (rows, vecs[:, :4]), (rows + 1, vecs),
                               (np.array([1, 1]), vecs[:2])):
        with pytest.raises(ValueError, match="media rows"):
            checked_media(batch, (bad_rows, bad_vecs), 8)


def test_media_force_an_eager_call(monkeypatch):
    """A decode-shaped batch (one token per row) with media runs eagerly: a graph replays the
    embedding gather and would never see the media."""
    from ninfer.models.qwen3_5.batch import ForwardBatch
    from ninfer.models.qwen3_5 import cuda_model as cm
    m = cm.CudaModel.__new__(cm.CudaModel)
    m.options = SimpleNamespace(graphs=True)
    m.b_cap, m.checks_batches = 4, False
    m.text = SimpleNamespace(hidden_size=8, vocab_size=5)
    m._current = lambda: None
    seen = []
    m._eager = lambda batch, kv, state, out_rows, media=None: seen.append(("eager", media))

    class Graph(Exception):
        pass

    def graph(*a):
        raise Graph
    m._decode_launch = graph
    b = ForwardBatch.single([3], 0, [0])
    m.forward(b, None, None, media=(np.array([0]), np.ones((1, 8), np.float32)))
    assert seen[0][0] == "eager" and seen[0][1][0].tolist() == [0]
    with pytest.raises(Graph):                   # no media rows in this batch: the graph
        m.forward(b, None, None, media=(np.zeros(0, np.int64), np.zeros((0, 8), np.float32)))


def test_cuda_model_plans_the_device_tower(monkeypatch, tmp_path):
    """A multimodal checkpoint on the cuda backend: the tower's arena share (weights, buffers
    for vision_max_patches, its cuBLASLt workspace) is in the memory plan and the arena, and
    its kernels (not the flash attention's) are in the model's kernel set;
    vision_max_patches=0 plans none (the numpy tower then). A fake device: the load stops at
    the arena."""
    from fake_plan_device import ArenaReached, install, record_kernel_specs
    from fixture_utils import fixture_dir
    from ninfer.artifact import Artifact
    from ninfer.convert import convert_checkpoint
    from ninfer.models.qwen3_5 import cuda_model as cm
    from ninfer.models.qwen3_5.load import model_config
    from ninfer.models.qwen3_5.cuda import vision as dv
    from ninfer.models.qwen3_5.cuda.kernel_set import VISION_KERNELS, vision_specs
    from ninfer.models.qwen3_5.vision_tower import VisionConfig
    from ninfer.options import EngineOptions
    path = tmp_path / "cond_gen.ninfer"
    convert_checkpoint(fixture_dir("cond_gen"), path, progress=False)
    install(monkeypatch, 3 << 30)
    seen = record_kernel_specs(monkeypatch)
    plans, specs = {}, {}
    with Artifact(path) as art:
        config = model_config(art)
        vcfg = VisionConfig.from_dict(config.vision)
        for patches in (0, 1026, 4096):
            m = cm.CudaModel.__new__(cm.CudaModel)
            with pytest.raises(ArenaReached):
                cm.CudaModel.__init__(m, config, EngineOptions(
                    backend="cuda", max_context=1 << 20, max_concurrency=8,
                    vision_max_patches=patches), artifact=art)
            plans[patches], specs[patches] = m.memory_plan, set(seen["specs"])
    for patches, planned in ((1026, 1024), (4096, 4096)):      # (whole merge blocks)
        extra = plans[patches].workspace_bytes - plans[0].workspace_bytes
        assert extra == dv.plan_bytes(vcfg, planned), (patches, extra)
        assert plans[patches].total_bytes == plans[0].total_bytes + extra   # (the arena's)
        assert specs[patches] - specs[0] == set(vision_specs(False, vcfg.head_dim))
        assert "vis_flash_attention" in specs[patches]      # (bf16: the flash attention)
    assert not set(VISION_KERNELS) & specs[0]


@pytest.mark.skipif(os.environ.get("NINFER_SIM_MODEL") != "1",
                    reason="minutes on the simulator: set NINFER_SIM_MODEL=1")
def test_image_prompt_on_the_simulator_matches_numpy():
    """tests/gpu/sim_media.py: one-piece prefill, a prefill cut inside the image and the decode
    step after it, float32 CUDA on the simulator within 1e-5 of numpy; without the media the
    numpy logits move by far more (the media matter)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_media.py")],
                         env=env, capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prefill"] < 1e-5 and out["chunked"] < 1e-5 and out["decode"] < 1e-5, out
    assert out["without_media"] > 1e-2, out


def _sim_vision(part: str) -> dict:
    pytest.importorskip("numba.cuda")            # (the CUDA Python packages: CI's first pass)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_vision.py"),
                          part], env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_device_vision_kernels_on_the_simulator():
    """kernels/vision.py on the simulator against float64: the float32 variants to 1e-6, the
    bf16 ones within their storage rounding (2^-9 relative, 4e-3 with the sums' rounding)."""
    out = _sim_vision("kernels")
    assert len(out) == 18, out
    for name, err in out.items():
        assert err < (1e-6 if name.endswith("/f32") else 4e-3), (name, err)


def test_device_vision_tower_on_the_simulator_equals_numpy():
    """cuda/vision.py's whole launch sequence (tests/gpu/sim_vision.py, its two reduction
    kernels as numpy twins) against the numpy tower: float32 within 1e-5 (measured 1e-7),
    bfloat16 within 1e-2 (measured 2.4e-3: weights and GEMM inputs rounded to bf16 through 2
    blocks and the merger), both GELUs, the attention scores in one pass and in passes of query
    rows of one head, and bf16's tensor-core attention (vis_flash_attention), also with its
    layers handed between two streams (share_sms: the lane flips every layer)."""
    out = _sim_vision("tower")
    assert len(out) == 8, out
    for name, err in out.items():
        assert err < (1e-5 if "/float32/" in name else 1e-2), (name, err)
