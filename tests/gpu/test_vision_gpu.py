"""Images and video on the CUDA backend (issue 18): the numpy vision tower on the host (the numpy
backend's own code), its output copied over the placeholders' embedding rows of an eager prefill,
MRoPE's 3-D positions in the rope kernel. On the tiny multimodal fixtures (cond_gen,
moe_cond_gen) with tests/fixtures/vision's processor configs and transformers' references
(tools/make_vision_fixtures.py). The CPU-side twin is tests/gpu/sim_media.py on the simulator."""
import numpy as np
import pytest

from fixture_utils import NUMPY_REL_TOL, assert_logits_close
from gpu_harness import TOL_FIXTURE_BF16, rel_err
# the artifacts with the processor configs, the reference and the chat of the numpy tests
from test_vision_engine import artifacts, chat, ref   # noqa: F401 (fixtures)

from ninfer.options import EngineOptions

pytestmark = pytest.mark.gpu
VISION_TOKENS = (256, 257, 258, 259)


@pytest.mark.parametrize("name", ["cond_gen", "moe_cond_gen"])
def test_cuda_float32_greedy_chat_equals_transformers(name, artifacts, ref):
    """Engine(backend='cuda', dtype='float32'): the vision chat's greedy tokens equal
    transformers' (reference margins >= 0.002; float32 CUDA sits ~1e-6 from numpy). Prefill
    chunks of 16 cut the media across calls."""
    from ninfer import Engine, SamplingParams
    want = ref[f"{name}_chat_greedy"].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True,
                            logit_bias={t: -100.0 for t in VISION_TOKENS})
    with Engine(artifacts[name], backend="cuda", dtype="float32", max_concurrency=2,
                max_context=256, prefill_chunk=16) as engine:
        assert engine._core.program.accepts_media
        r = engine.generate(chat(ref), params, enable_thinking=False)
    assert r.num_prompt_tokens == len(ref["chat_ids"])
    assert r.token_ids == want, f"{name} cuda: {r.token_ids} != transformers {want}"


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", TOL_FIXTURE_BF16)])
def test_cuda_media_prefill_logits_equal_numpy(dtype, tol, artifacts, ref):
    """forward(media=) of the whole chat prompt, every position's logits: CUDA against the numpy
    backend (float32: the same arithmetic; bfloat16: its storage rounding, measured ~8% on these
    32-wide fixtures, test_fixtures_gpu), and the numpy first step against transformers."""
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5 import load_model
    from ninfer.models.qwen3_5.batch import ForwardBatch
    from ninfer.models.qwen3_5.frontend import Frontend

    with Artifact(artifacts["cond_gen"]) as art:
        p = Frontend.from_artifact(art).prepare(chat(ref), enable_thinking=False)
        cpu = load_model(art, EngineOptions(backend="numpy"))
        gpu = load_model(art, EngineOptions(backend="cuda", dtype=dtype, max_concurrency=1,
                                            max_context=256, prefill_chunk=256, page_size=16))
        # the numpy tower's encoding into both (the device tower has its own test below)
        enc = cpu.encode_media(p.token_ids, p.media, p.mrope_positions)
        T = p.num_tokens
        out = []
        for model in (cpu, gpu):
            kv, state = model.new_kv_pool(17, 16), model.new_state_pool(1)
            batch = ForwardBatch(token_ids=p.token_ids, positions=enc.positions_for(0, T),
                                 query_start=np.array([0, T], np.int32),
                                 context_lens=np.array([0], np.int32),
                                 block_tables=np.arange(16, dtype=np.int32).reshape(1, -1),
                                 state_slots=np.array([0], np.int32))
            out.append(model.forward(batch, kv, state, all_logits=True, media=enc.rows_in(0, T)))
            for pool in (kv, state):
                if hasattr(pool, "close"):
                    pool.close()
        gpu.close()
        cpu.close()
    lc, lg = out
    assert rel_err(lg, lc) < tol, f"{dtype}: rel err {rel_err(lg, lc):.2e}"
    keep = np.ones(lc.shape[1], bool)
    keep[list(VISION_TOKENS)] = False
    assert_logits_close(lc[-1, keep], ref["cond_gen_chat_first_logits"][keep], "numpy first",
                        tol=NUMPY_REL_TOL)


def _tower_27b_widths(seed: int):
    """The 27B tower's widths (hidden 1152, 16 heads of 72, MLP 4304, out 5120) at depth 2,
    random weights; (config, parameters, the generator for the inputs)."""
    from ninfer.models.qwen3_5.vision_tower import VisionConfig
    cfg = VisionConfig(depth=2, hidden_size=1152, num_heads=16, intermediate_size=4304,
                       in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       num_position_embeddings=2304, out_hidden_size=5120)
    r = np.random.default_rng(seed)
    params = {k: (r.standard_normal(s) / np.sqrt(s[-1] if len(s) > 1 else 4)).astype(np.float32)
              for k, s in cfg.param_shapes().items()}
    return cfg, params, r


@pytest.mark.parametrize("dtype, tol, flash", [("float32", 1e-4, False), ("bfloat16", 2e-2, False),
                                               ("bfloat16", 2e-2, True)])
def test_device_vision_tower_equals_numpy(gpu, dtype, tol, flash):
    """cuda/vision.py on the device against the numpy tower: the 27B tower's widths (hidden
    1152, 16 heads of 72, MLP 4304, out 5120) at depth 2, random weights; a 32 x 32-patch image
    and a 2-frame video of 16 x 16 in one call; the attention as GEMMs in one pass and, with a
    small score budget, in passes of query rows, or (flash, bf16) on the tensor cores in one
    kernel (tests/gpu/sim_vision.py is its simulator twin)."""
    from ninfer.core.cuda.cublaslt import CublasLt
    from ninfer.models.qwen3_5.cuda import vision as dv
    from ninfer.models.qwen3_5.vision_tower import VisionTower
    cfg, params, r = _tower_27b_widths(seed=0)
    grids = [(1, 32, 32), (2, 16, 16)]
    n = sum(t * h * w for t, h, w in grids)
    pixels = r.standard_normal((n, 3 * 2 * 16 * 16)).astype(np.float32)
    want = VisionTower(cfg, params).encode(pixels, grids)
    f32 = dtype == "float32"
    for score_bytes in (dv.SCORE_BYTES, 4 << 20):
        ws = gpu.arena.take((32 << 20,), np.uint8, "cuBLASLt workspace")
        lt = CublasLt(ws.ptr, 32 << 20, f32=f32)
        tower = dv.DeviceVisionTower(cfg, params, arena=gpu.arena, kernels=gpu.cache, lt=lt,
                                     stream=gpu.stream, f32=f32, max_patches=n,
                                     score_bytes=score_bytes, flash=flash)
        try:
            got = tower.encode(pixels, grids)
            assert rel_err(got, want) < tol, (score_bytes, rel_err(got, want))
            assert tower.encode(pixels, grids).tobytes() == got.tobytes()    # deterministic
        finally:
            tower.close()
            lt.close()
            for a in list(tower.buf.values()) + list(tower.w.values()) + [ws]:
                gpu.arena.give(a)


def test_device_vision_tower_on_a_share_of_the_sms(gpu):
    """load_device_vision with sm_count: while busy(), the tower on a green context's stream of
    16 SMs (driver.SmStream) with its GEMMs sized for them, else on its own stream (every SM).
    Kernels loaded in the primary context and cuBLASLt run on both, and both outputs equal the
    numpy tower's; close() releases both lanes."""
    from ninfer.core.cuda.arena import Arena
    from ninfer.models.qwen3_5.cuda import vision as dv
    from ninfer.models.qwen3_5.vision_tower import VisionTower
    cfg, params, r = _tower_27b_widths(seed=3)
    grids = [(1, 24, 32)]
    pixels = r.standard_normal((24 * 32, 3 * 2 * 16 * 16)).astype(np.float32)
    want = VisionTower(cfg, params).encode(pixels, grids)
    busy = [False]
    arena = Arena(dv.plan_bytes(cfg, 24 * 32))         # (the model's share: this is all it takes)
    tower = dv.load_device_vision(cfg, params, arena=arena, kernels=gpu.cache,
                                  bind=gpu.dev.make_current, f32=False, max_patches=24 * 32,
                                  sm_count=16, device=gpu.dev, busy=lambda: busy[0])
    try:
        assert tower.flash and tower._lanes is not None
        (own, own_lt), (share, share_lt) = tower._lanes
        assert 16 <= share.sm_count < gpu.dev.num_sms and share_lt.sm_count == share.sm_count
        assert own_lt.sm_count == 0
        outs = {}
        for busy[0] in (False, True, False):
            outs[busy[0]] = got = tower.encode(pixels, grids)
            assert tower.stream is (share if busy[0] else own)
            assert rel_err(got, want) < 2e-2, (busy[0], rel_err(got, want))
        assert tower.encode(pixels, grids).tobytes() == outs[False].tobytes()
    finally:
        tower.close()
        arena.close()
    assert share.handle is None and share.green is None and own.handle is None
