"""Vision preprocessing (issue 18) against transformers' Qwen3-VL processors.

The references in tests/fixtures/vision/ come from tools/make_vision_fixtures.py: transformers'
PIL-backend image processor, Qwen3VLProcessor's placeholder expansion, Qwen3VLVideoProcessor's
frame sampling and patchify. No torch here.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from fixture_utils import FIXTURES_DIR, fixture_dir
from ninfer.models.qwen3_5.frontend import image_preprocess as V

VISION_DIR = FIXTURES_DIR / "vision"


@pytest.fixture(scope="module")
def ref():
    with np.load(VISION_DIR / "reference.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def procs():
    img = V.VisionProcessing.from_json(
        json.loads((VISION_DIR / "preprocessor_config.json").read_text()))
    vid = V.VisionProcessing.from_json(
        json.loads((VISION_DIR / "video_preprocessor_config.json").read_text()), video=True)
    return img, vid


def _tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(fixture_dir("cond_gen") / "tokenizer.json"))


def test_config_reads_the_processor_files(procs):
    img, vid = procs
    assert (img.patch_size, img.temporal_patch_size, img.merge_size, img.factor) == (4, 2, 2, 8)
    assert (img.min_pixels, img.max_pixels) == (256, 1536)
    assert (vid.max_pixels, vid.fps, vid.min_frames, vid.max_frames) == (8192, 2, 4, 8)
    assert img.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))


def test_images_equal_transformers_pixels(ref, procs):
    """One image downscaled (37x53 -> 32x40), one upscaled to min_pixels (14x9 -> 24x16): the
    processor's pixel_values bit for bit and its grids."""
    img, _ = procs
    media = [V.process_image(ref["image_0"], img), V.process_image(ref["image_1"], img)]
    assert [m.grid_thw for m in media] == [tuple(g) for g in ref["two_images_grid"]]
    got = np.concatenate([m.pixels for m in media])
    assert got.dtype == np.float32 and got.shape == ref["two_images_pixels"].shape
    np.testing.assert_array_equal(got, ref["two_images_pixels"])
    np.testing.assert_array_equal(media[0].pixels, ref["image_pixels"])


def test_numpy_resize_equals_the_fixture_without_pillow(ref, procs, monkeypatch):
    """The numpy resample (no Pillow installed) gives the same pixels on the fixture images."""
    import builtins
    real_import = builtins.__import__

    def no_pil(name, *a, **k):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_pil)
    img, _ = procs
    got = np.concatenate([V.process_image(ref["image_0"], img).pixels,
                          V.process_image(ref["image_1"], img).pixels])
    np.testing.assert_array_equal(got, ref["two_images_pixels"])
    with pytest.raises(V.MediaError, match="Pillow"):
        V.process_image(b"\x89PNG....", img)


@pytest.mark.parametrize("axis", ["width", "height"])
def test_numpy_resample_pass_equals_pillow(axis):
    """Each pass of the numpy resample is Pillow's bicubic bit for bit (up and down, odd sizes)."""
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(7 if axis == "width" else 8)
    for _ in range(60):
        H, W, n = (int(v) for v in rng.integers(1, 70, 3))
        img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        h, w = (H, n) if axis == "width" else (n, W)
        want = np.asarray(Image.fromarray(img).resize((w, h), Image.BICUBIC))
        np.testing.assert_array_equal(V.resize_bicubic_numpy(img, h, w), want,
                                      err_msg=f"{H}x{W} -> {h}x{w}")


def test_smart_resize_rounding():
    # the fixture's two images, plus ties of Python's round (half to even) and the limits
    assert V.smart_resize(37, 53, 8, 256, 1536) == (32, 40)
    assert V.smart_resize(14, 9, 8, 256, 1536) == (24, 16)
    assert V.smart_resize(20, 60, 8, 16, 10 ** 6) == (16, 64)      # 2.5 -> 2, 7.5 -> 8
    assert V.smart_resize(1000, 1000, 28, 56 * 56, 28 * 28 * 1280) == (980, 980)   # 1008^2 > max
    with pytest.raises(V.MediaError, match="aspect ratio"):
        V.smart_resize(1, 201, 8, 16, 10 ** 6)
    assert V.video_smart_resize(4, 16, 24, 2, 8, 256, 8192) == (16, 24)
    with pytest.raises(V.MediaError, match="at least 2 frames"):
        V.video_smart_resize(1, 16, 24, 2, 8, 256, 8192)


def test_video_equals_transformers(ref, procs):
    """8 frames at 4 fps sampled at 2 fps -> frames [0, 2, 5, 7], two temporal patches at 0.25 s
    and 1.5 s; pixel_values_videos bit for bit."""
    _, vid = procs
    assert V.sample_frame_indices(8, 4.0, vid).tolist() == [0, 2, 5, 7]
    m = V.process_video(ref["video"], vid, fps=float(ref["video_fps"]))
    assert m.grid_thw == tuple(ref["video_grid"][0])
    assert m.timestamps == pytest.approx((0.25, 1.5))
    np.testing.assert_array_equal(m.pixels, ref["video_pixels"])
    # a list of frames is the same video; an odd count repeats the last frame
    m2 = V.process_video(list(ref["video"]), vid, fps=4.0)
    np.testing.assert_array_equal(m2.pixels, m.pixels)
    odd = V.process_video(ref["video"][:5], vid.__class__(**{**vid.__dict__,
                                                            "do_sample_frames": False}), fps=4.0)
    assert odd.grid_thw[0] == 3 and odd.timestamps == pytest.approx((0.125, 0.625, 1.0))


@pytest.mark.parametrize("prompt", ["image", "two_images", "video"])
def test_placeholder_expansion_equals_the_processor(ref, procs, prompt):
    img, vid = procs
    if prompt == "video":
        media = [V.process_video(ref["video"], vid, fps=float(ref["video_fps"]))]
    else:
        count = 2 if prompt == "two_images" else 1
        media = [V.process_image(ref[f"image_{i}"], img) for i in range(count)]
    text = V.expand_placeholders(str(ref[f"{prompt}_text"]), media)
    ids = _tokenizer().encode(text, add_special_tokens=False).ids
    assert ids == ref[f"{prompt}_ids"].tolist()
    if prompt == "video":
        assert "<0.2 seconds><|vision_start|>" in text and "<1.5 seconds>" in text


def test_placeholder_count_mismatch_is_an_error(ref, procs):
    img, _ = procs
    m = V.process_image(ref["image_1"], img)
    with pytest.raises(V.MediaError, match="no image placeholder"):
        V.expand_placeholders("text only", [m])
    with pytest.raises(V.MediaError, match="more media placeholders"):
        V.expand_placeholders(str(ref["two_images_text"]), [m])


def test_decoded_bytes_equal_the_array(ref, procs):
    Image = pytest.importorskip("PIL.Image")
    img, _ = procs
    buf = io.BytesIO()
    Image.fromarray(ref["image_0"]).save(buf, format="PNG")
    np.testing.assert_array_equal(V.process_image(buf.getvalue(), img).pixels,
                                  V.process_image(ref["image_0"], img).pixels)
    rgba = np.dstack([ref["image_1"], np.full(ref["image_1"].shape[:2], 255, np.uint8)])
    np.testing.assert_array_equal(V.to_rgb_array(Image.fromarray(rgba)), ref["image_1"])


@pytest.mark.parametrize("bad, reason", [
    (np.zeros((0, 5, 3), np.uint8), "empty"),
    (np.zeros((5, 5, 3), np.float32), "uint8"),
    (np.zeros((5, 5), np.uint8), "uint8"),
    ("a/path.png", "bytes, a PIL image or a numpy array"),
    (b"not an image", "not decodable"),
])
def test_bad_images_name_the_reason(bad, reason, procs):
    if isinstance(bad, bytes):
        pytest.importorskip("PIL")
    with pytest.raises(V.MediaError, match=reason):
        V.process_image(bad, procs[0])


def test_too_many_pixels_is_refused():
    with pytest.raises(V.MediaError, match="pixels, over"):
        V.to_rgb_array(np.zeros((20, 20, 3), np.uint8), max_pixels=399)
