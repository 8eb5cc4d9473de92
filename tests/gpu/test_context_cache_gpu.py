"""The context cache on the device (issue 12), seconds each:

* the pools' copy ops (cuMemcpyDtoDAsync per page / slot and layer array) copy exactly;
* teacher-forced logits after a hit (shared full pages, a copy of the partly filled page, a State
  slot copy: what `CheckpointStore.install` does) equal a cold prefill's within the bf16 model
  tolerance, and their greedy tokens are equal;
* through the Engine (float32, exact): turn 2 of a chat binds turn 1's continuation and gives
  the cold run's greedy tokens.
"""
import numpy as np
import pytest

from fixture_utils import convert_fixture
from gpu_harness import TOL_FIXTURE_BF16, rel_err

from ninfer import Engine
from ninfer.api import SamplingParams
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.options import EngineOptions

pytestmark = pytest.mark.gpu
PAGE = 16
MARGIN_BF16 = 0.1        # as tests/gpu/test_fixtures_gpu.py: below it bf16 may flip the argmax


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return convert_fixture("dense", tmp_path_factory.mktemp("ninfer_cache_cuda"))


def _gpu_model(path, dtype=None):
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5 import load_model
    return load_model(Artifact(path), EngineOptions(backend="cuda", max_concurrency=2,
                                                    max_context=256, prefill_chunk=128,
                                                    page_size=PAGE, dtype=dtype))


def test_device_pool_copies_are_exact(path):
    gpu = _gpu_model(path)
    rng = np.random.default_rng(0)
    kv, st = gpu.new_kv_pool(6, PAGE), gpu.new_state_pool(3)
    try:
        # bf16-representable values, so the host image round-trips exactly
        img = tuple([(rng.standard_normal((6,) + a.shape[1:]).astype(np.float32)
                      .view(np.uint32) & 0xFFFF0000).view(np.float32) for a in kv.k]
                    for _ in range(2))
        kv.write_pages(range(6), img)
        kv.copy_pages([5, 2], [1, 4])
        got = kv.read_pages(range(6))
        for g, w in zip(got[0] + got[1], img[0] + img[1]):
            np.testing.assert_array_equal(g[[1, 4]], w[[5, 2]])
            np.testing.assert_array_equal(g[[0, 2, 3, 5]], w[[0, 2, 3, 5]])
        image = ([rng.standard_normal(a.shape[1:]).astype(np.float32) for a in st.conv],
                 [rng.standard_normal(a.shape[1:]).astype(np.float32) for a in st.recurrent])
        st.write(0, image)
        st.copy(0, 2)
        for g, w in zip(st.read(2)[0] + st.read(2)[1], image[0] + image[1]):
            np.testing.assert_array_equal(g, w)
    finally:
        kv.close()
        st.close()
        gpu.close()


def test_hit_teacher_forced_logits_equal_cold_prefill_bf16(path):
    """Turn 1 prefills [0, p) into pages 0..2 (p = 37: two full pages + a partial one) and slot
    0; the hit shares pages 0, 1, gets a copy of page 2 in page 8 and of slot 0 in slot 1, and
    prefills [p, n) there. Its logits equal a cold prefill of [0, n) in pages 4..7, slot 2."""
    gpu = _gpu_model(path)
    rng = np.random.default_rng(3)
    n, p = 61, 37
    ids = rng.integers(3, 256, n).astype(np.int32)
    kv, st = gpu.new_kv_pool(12, PAGE), gpu.new_state_pool(3)
    try:
        cold = gpu.forward(ForwardBatch.single(ids, 0, np.arange(4, 8), 2), kv, st,
                           all_logits=True)
        gpu.forward(ForwardBatch.single(ids[:p], 0, np.arange(0, 3), 0), kv, st)
        kv.copy_pages([2], [8])                  # copy-on-write of the partly filled page
        st.copy(0, 1)
        hit = gpu.forward(ForwardBatch.single(ids[p:], p, [0, 1, 8, 9], 1), kv, st,
                          all_logits=True)
        assert rel_err(hit, cold[p:]) < TOL_FIXTURE_BF16
        # greedy tokens equal wherever the cold top-2 margin is above the bf16 resolution
        top2 = np.sort(cold[p:], axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > MARGIN_BF16
        assert clear.any()
        assert np.array_equal(hit.argmax(-1)[clear], cold[p:].argmax(-1)[clear])
        # the shared pages were only read: turn 1's row continues exactly as before
        again = gpu.forward(ForwardBatch.single(ids[p:], p, [0, 1, 2, 3], 0), kv, st,
                            all_logits=True)
        assert rel_err(again, hit) < 1e-6
    finally:
        kv.close()
        st.close()
        gpu.close()


@pytest.mark.parametrize("chain", [True, False], ids=["pipelined", "serial"])
def test_engine_turn_2_binds_the_continuation_float32(path, chain, monkeypatch):
    """Turn 2 binds turn 1's continuation: prompt + answer up to the last token that ran. With
    the pipelined decode the step launched ahead ran the last sampled token too (its output
    discarded), so the continuation holds it; one by one it never ran."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    monkeypatch.setattr(CudaModel, "chains_token_steps", chain)
    rng = np.random.default_rng(6)
    turn1 = rng.integers(3, 256, 29).astype(np.int32)
    params = SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0)

    def chat(**options):
        with Engine(path, backend="cuda", dtype="float32", max_concurrency=2, max_context=256,
                    prefill_chunk=16, page_size=8, debug_checks=True, **options) as engine:
            r1 = engine.generate(turn1, params)
            turn2 = np.concatenate([turn1, np.asarray(r1.token_ids, np.int32),
                                    rng.integers(3, 256, 11).astype(np.int32)])
            r2 = engine.generate(turn2, params)
            assert engine.health == "ready"
            return r1, r2, engine.stats()

    state = rng.bit_generator.state
    c1, c2, _ = chat(prefix_cache=False)
    rng.bit_generator.state = state
    w1, w2, stats = chat()
    assert (w1.token_ids, w2.token_ids) == (c1.token_ids, c2.token_ids)
    assert w2.num_cached_tokens == 29 + 7 - 1 + int(chain) and c2.num_cached_tokens == 0
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_device_bytes"] > 0


def test_async_host_copies_equal_the_synchronous_ones(path, monkeypatch):
    """CudaModel.async_host_copies: the pools' start_read_pages / start_read on the copy stream,
    after a step queued on the model's stream (the event between the streams orders them), give
    read_pages' / read's bytes (a bf16 pool's image as bf16 bits, which write_pages takes back);
    then a chat whose checkpoints are demoted ahead of need (a device share of 12 of 40 pages; at 4 every
    checkpoint went straight to the host, nothing was demoted) gives the
    tokens of the synchronous store (float32)."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    monkeypatch.setattr(CudaModel, "async_host_copies", True)
    gpu = _gpu_model(path)
    rng = np.random.default_rng(3)
    kv, st = gpu.new_kv_pool(40, PAGE), gpu.new_state_pool(2)
    try:
        assert kv.reads_async and st.reads_async
        img = tuple([(rng.standard_normal((40,) + a.shape[1:]).astype(np.float32)
                      .view(np.uint32) & 0xFFFF0000).view(np.float32) for a in kv.k]
                    for _ in range(2))
        kv.write_pages(range(40), img)
        kv.copy_pages(range(20), range(20, 40))       # queued on the model's stream first
        pages = [21, 22, 23, 30, 5, 39]
        reads = [kv.start_read_pages(pages) for _ in range(3)]     # several in flight
        want = kv.read_pages(pages)
        for r in reads:
            got = r.result()
            assert r.done()
            for g, w in zip(got[0] + got[1], want[0] + want[1]):
                assert g.dtype == np.uint16
                np.testing.assert_array_equal((g.astype(np.uint32) << 16).view(np.float32), w)
        kv.write_pages([0, 1, 2, 3, 4, 5], reads[0].result())   # bf16 bits written as they are
        back = kv.read_pages([0, 1, 2, 3, 4, 5])
        for g, w in zip(back[0] + back[1], want[0] + want[1]):
            np.testing.assert_array_equal(g, w)
        image = ([rng.standard_normal(a.shape[1:]).astype(np.float32) for a in st.conv],
                 [rng.standard_normal(a.shape[1:]).astype(np.float32) for a in st.recurrent])
        st.write(1, image)
        got = st.start_read(1).result()
        for g, w in zip(got[0] + got[1], image[0] + image[1]):
            np.testing.assert_array_equal(g, w)
    finally:
        kv.close()
        st.close()
        gpu.close()
    rng = np.random.default_rng(8)
    turns = [rng.integers(3, 256, 40).astype(np.int32)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)

    def chat(asynchronous):
        monkeypatch.setattr(CudaModel, "async_host_copies", asynchronous)
        out = []
        with Engine(path, backend="cuda", dtype="float32", max_concurrency=2, max_context=256,
                    prefill_chunk=16, page_size=8, num_kv_pages=40, debug_checks=True,
                    prefix_cache_host_bytes=256 << 20,
                    prefix_cache_device_fraction=0.3) as engine:
            prompt = turns[0]
            for t in range(4):
                res = engine.generate(prompt, params, session="s")
                out.append((res.token_ids, res.num_cached_tokens))
                prompt = np.concatenate([prompt, np.asarray(res.token_ids, np.int32),
                                         rng.integers(3, 256, 9).astype(np.int32)])
            stats = engine.stats()
            assert engine.health == "ready"
        return out, stats
    state = rng.bit_generator.state
    sync, _ = chat(False)
    rng.bit_generator.state = state
    got, stats = chat(True)
    assert got == sync and stats["prefix_cache_demotions"] > 0


def test_image_prompts_reuse_only_with_the_same_media_on_cuda(tmp_path_factory):
    """The numpy test of tests/test_context_cache_model.py on CUDA (float32: the cold and the
    cached runs' greedy tokens equal): an image prompt's checkpoint is keyed with its media
    digest, bound by the same prompt with the same image, never by another image's."""
    from test_context_cache_model import image_prompts_reuse_only_with_the_same_media
    image_prompts_reuse_only_with_the_same_media(tmp_path_factory, backend="cuda",
                                                 dtype="float32")
