"""Images and video through the numpy Engine (issue 18): a two-turn chat with an image, then a
video and another image, against transformers' generate() (greedy, float32) on the tiny
multimodal checkpoints. The artifact is converted from a copy of the fixture checkpoint with the
processor configs beside it, so this also checks that the converter carries them."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from fixture_utils import FIXTURES_DIR, NUMPY_REL_TOL, assert_logits_close, fixture_dir

VISION_DIR = FIXTURES_DIR / "vision"
CONFIGS = ("preprocessor_config.json", "video_preprocessor_config.json")


@pytest.fixture(scope="module")
def ref():
    with np.load(VISION_DIR / "reference.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from ninfer.convert import convert_checkpoint

    root, out = tmp_path_factory.mktemp("vision_engine"), {}
    for name in ("cond_gen", "moe_cond_gen"):
        src = root / name
        shutil.copytree(fixture_dir(name), src)
        for f in CONFIGS:
            shutil.copy(VISION_DIR / f, src / f)
        out[name] = root / f"{name}.ninfer"
        convert_checkpoint(src, out[name], progress=False)
    return out


def chat(ref):
    """tools/make_vision_fixtures.py's chat_messages with the media filled in."""
    return [{"role": "user", "content": [{"type": "text", "text": "qwen net"},
                                         {"type": "image", "image": ref["image_0"]}]},
            {"role": "assistant", "content": "ta del"},
            {"role": "user", "content": [{"type": "video", "video": ref["video"],
                                          "fps": float(ref["video_fps"])},
                                         {"type": "image", "image": ref["image_1"]},
                                         {"type": "text", "text": str(ref["chat_ending"])}]}]


def test_converter_carries_the_processor_configs(artifacts):
    from ninfer.artifact import Artifact

    with Artifact(artifacts["cond_gen"]) as art:
        for f in CONFIGS:
            assert art.resource(f) == (VISION_DIR / f).read_bytes()


def test_prompt_equals_the_processor_and_get_rope_index(artifacts, ref):
    """Token ids of the rendered, expanded chat equal Qwen3VLProcessor's; the MRoPE positions
    equal get_rope_index's across both turns (the second turn's media sit after the first's)."""
    from ninfer import Engine

    with Engine(artifacts["cond_gen"]) as engine:
        p = engine.frontend.prepare(chat(ref), enable_thinking=False)
    assert p.token_ids.tolist() == ref["chat_ids"].tolist()
    np.testing.assert_array_equal(p.mrope_positions, ref["chat_positions"])


@pytest.mark.parametrize("name", ["cond_gen", "moe_cond_gen"])
def test_greedy_continuation_equals_transformers(name, artifacts, ref):
    from ninfer import Engine, SamplingParams

    want = ref[f"{name}_chat_greedy"].tolist()
    # the oracle biased the vision tokens by -100 (as text they would be media to transformers)
    params = SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True,
                            logit_bias={t: -100.0 for t in (256, 257, 258, 259)})
    with Engine(artifacts[name], prefill_chunk=16) as engine:   # media cut across chunks
        r = engine.generate(chat(ref), params, enable_thinking=False)
    assert r.num_prompt_tokens == len(ref["chat_ids"])
    assert r.token_ids == want, f"{name}: {r.token_ids} != transformers {want}"


def test_first_step_logits_equal_transformers(artifacts, ref):
    """The logits after the whole prompt: Frontend -> encode_media -> the model at the MRoPE
    positions with the tower's output at the placeholders."""
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5.batch import ForwardBatch
    from ninfer.models.qwen3_5.frontend import Frontend
    from ninfer.models.qwen3_5.model import NumpyModel

    with Artifact(artifacts["cond_gen"]) as art:
        model = NumpyModel.from_artifact(art)
        p = Frontend.from_artifact(art).prepare(chat(ref), enable_thinking=False)
        enc = model.encode_media(p.token_ids, p.media, p.mrope_positions)
        T = p.num_tokens
        table = np.arange((T + 15) // 16, dtype=np.int32)
        kv, state = model.new_kv_pool(len(table), 16), model.new_state_pool(1)
        batch = ForwardBatch(token_ids=p.token_ids, positions=enc.positions_for(0, T),
                             query_start=np.array([0, T], np.int32),
                             context_lens=np.array([0], np.int32),
                             block_tables=table.reshape(1, -1), state_slots=np.array([0], np.int32))
        got = model.forward(batch, kv, state, media=enc.rows_in(0, T))
        model.close()
    keep = np.ones(got.shape[1], bool)
    keep[[256, 257, 258, 259]] = False          # the oracle's logits carry the -100 bias there
    assert_logits_close(got[0, keep], ref["cond_gen_chat_first_logits"][keep], "chat first step",
                        tol=NUMPY_REL_TOL)


def test_text_only_model_refuses_images(ref, tmp_path):
    from ninfer import Engine
    from ninfer.convert import convert_checkpoint
    from ninfer.errors import RequestError

    path = tmp_path / "dense.ninfer"
    convert_checkpoint(fixture_dir("dense"), path, progress=False)
    with Engine(path) as engine, pytest.raises(RequestError, match="text-only"):
        engine.generate(chat(ref)[:1])


def test_a_backend_without_the_tower_refuses_media(artifacts, ref):
    """A model without encode_media (no tower): the Engine says so instead of running the
    placeholders' own embeddings."""
    from ninfer import Engine
    from ninfer.errors import RequestError

    with Engine(artifacts["cond_gen"]) as engine:
        engine.model.vision = None                  # what a backend without the tower looks like
        assert not engine._core.program.accepts_media
        with pytest.raises(RequestError, match="does not run yet"):
            engine.generate(chat(ref)[:1])


def _program_greedy(art, model, options, ref, pause=None):
    """The chat's greedy tokens through a Program directly (the oracle's count, its bias on the
    vision tokens), and the kinds of the pauses taken: with `pause` ("replay", "snapshot",
    "revoked") every other step pauses the sequence and resumes it."""
    from ninfer.models.qwen3_5.frontend import Frontend
    from ninfer.models.qwen3_5.program import Program, RowDecision, SamplingSpec

    want = len(ref["cond_gen_chat_greedy"])
    p = Frontend.from_artifact(art).prepare(chat(ref), enable_thinking=False)
    prog = Program(model, options)
    spec = SamplingSpec(seed=1, logit_bias=tuple((t, -100.0) for t in (256, 257, 258, 259)))
    sid = prog.bind(p.token_ids, spec, media=(p.media, p.mrope_positions))
    out, kinds = [], set()
    for i in range(100):
        if len(out) >= want:
            break
        if pause and i % 2 == 1 and prog.unit_kind(sid) != "replay" and \
                not prog.is_protected(sid):
            rs = prog.pause(sid, allow_snapshot=pause != "replay")
            if pause == "revoked":
                rs = prog.revoke_snapshot(rs)
            kinds.add(rs.kind)
            sid = prog.resume(rs)
        assert prog.reserve_units([sid]) == [True]
        pending = prog.execute([sid])
        prog.commit(pending, [RowDecision(len(r.produced)) for r in pending.rows])
        out += list(pending.rows[0].produced)
    prog.release(sid)
    prog.assert_all_free()
    prog.model.close()
    return out[:want], kinds


@pytest.mark.parametrize("mode", ["replay", "snapshot", "revoked"])
def test_pause_resume_keeps_the_media(mode, artifacts, ref):
    """A vision sequence paused mid-prefill and mid-decode (Replay re-prefills through the media;
    a Snapshot keeps its KV) continues with transformers' greedy tokens."""
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5.model import NumpyModel
    from ninfer.options import EngineOptions

    with Artifact(artifacts["cond_gen"]) as art:
        out, kinds = _program_greedy(art, NumpyModel.from_artifact(art), EngineOptions(
            max_concurrency=2, max_context=256, prefill_chunk=24), ref, pause=mode)
    assert kinds == {"snapshot" if mode == "snapshot" else "replay"}
    assert out == ref["cond_gen_chat_greedy"].tolist()


def test_media_digest_and_a_later_turn_reuses_the_encoding(artifacts, ref, monkeypatch):
    """PreparedPrompt.media_digest names the media's content in order (b"" for text); the tower
    encodes each distinct medium once: the second turn re-sends image_0 and adds a video and
    image_1, so 3 encodings in all, not 4."""
    from ninfer import Engine, SamplingParams

    def user(*images):
        return [{"role": "user", "content": [{"type": "text", "text": "qwen net"}] + [
            {"type": "image", "image": i} for i in images]}]

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with Engine(artifacts["cond_gen"]) as engine:
        fe = engine.frontend
        d = fe.prepare(user(ref["image_0"])).media_digest
        assert isinstance(d, bytes) and len(d) == 16
        assert fe.prepare(user(ref["image_0"].copy())).media_digest == d       # content, not id
        assert fe.prepare(user(ref["image_1"])).media_digest != d
        flipped = ref["image_0"].copy()
        flipped[0, 0, 0] ^= 1                                                  # one bit
        assert fe.prepare(user(flipped)).media_digest != d
        two = fe.prepare(user(ref["image_0"], ref["image_1"])).media_digest
        assert fe.prepare(user(ref["image_1"], ref["image_0"])).media_digest != two   # order
        assert fe.prepare("plain text").media_digest == b""
        calls = []
        real = engine.model.vision.encode
        monkeypatch.setattr(engine.model.vision, "encode",
                            lambda *a: calls.append(a[1]) or real(*a))
        engine.generate(chat(ref)[:1], params, enable_thinking=False)
        assert len(calls) == 1
        engine.generate(chat(ref), params, enable_thinking=False)
        assert [tuple(g[0]) for g in calls] == [(1, 8, 10), (2, 4, 6), (1, 6, 4)]


def test_a_device_greedy_backend_gets_the_media_through_forward(artifacts, ref):
    """The CUDA model argmaxes on the device (greedy_on_device) and its decode_greedy takes no
    media. A numpy model dressed the same way (decode_greedy: argmax of a forward without media)
    still gives transformers' tokens: the Program sends every batch with media rows through
    forward(media=), the others through decode_greedy."""
    from ninfer.artifact import Artifact
    from ninfer.contracts import ImmediateTokenSteps
    from ninfer.models.qwen3_5.model import NumpyModel
    from ninfer.options import EngineOptions

    calls = []

    class DeviceGreedy(ImmediateTokenSteps, NumpyModel):
        greedy_on_device = True

        def decode_greedy(self, batch, kv, state):
            calls.append(batch.num_tokens)
            return self.forward(batch, kv, state).argmax(-1).astype(np.int32)

    with Artifact(artifacts["cond_gen"]) as art:
        out, _ = _program_greedy(art, DeviceGreedy.from_artifact(art), EngineOptions(
            max_concurrency=1, max_context=256, prefill_chunk=16), ref)
    assert calls, "no batch took the device path: the test would not show anything"
    assert out == ref["cond_gen_chat_greedy"].tolist()
