"""Video files and frame lists (issue 18): PyAV decoding (the `vision` extra) with
Qwen3VLVideoProcessor's frame sampling, and frames given as numpy arrays or PIL images.

Synthetic videos are written with PyAV in the test (lossless codecs, so frames read back exactly);
the whole module skips cleanly without it. The oracle for the sampling is transformers'
Qwen3VLVideoProcessor.sample_frames on the decoded video's metadata (skipped without
transformers); the fixture video written to a file must give the pixels transformers' processor
gave for its frames (tests/fixtures/vision/reference.npz), so the logits test_vision_model pins
for that video hold for the file too, which the last test checks end to end."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.models.qwen3_5.frontend import image_preprocess as V
# the reference and the fixture's processor configs; the artifacts carrying those configs
from test_vision_engine import artifacts   # noqa: F401 (fixture)
from test_vision_preprocess import procs, ref   # noqa: F401 (fixtures)

av = pytest.importorskip("av", reason="video files need PyAV (the vision extra)")


@pytest.fixture(scope="module")
def vid(procs):
    return procs[1]


def write_video(path, frames, fps, container="avi", codec="png", pix_fmt="rgb24"):
    """uint8 [F, H, W, 3] -> a lossless file (avi/png records its frame count; mkv/ffv1 does
    not, which takes read_video's counting pass)."""
    with av.open(str(path), "w", format=container) as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for f in frames:
            for pk in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f),
                                                          format="rgb24")):
                out.mux(pk)
        for pk in s.encode():
            out.mux(pk)


def _numbered(n, h=16, w=24):
    """Frame i is filled with a value that names it (frames read back tell their index)."""
    return np.stack([np.full((h, w, 3), (7 * i) % 256, np.uint8) for i in range(n)])


@pytest.mark.parametrize("n, fps", [(30, 10), (7, 25), (50, 3), (9, 4)])
@pytest.mark.parametrize("container, codec, pix_fmt", [("avi", "png", "rgb24"),
                                                       ("matroska", "ffv1", "bgr0")])
def test_sampled_frames_equal_the_processor_choice(tmp_path, vid, n, fps, container, codec,
                                                   pix_fmt):
    vp = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    from transformers.video_utils import VideoMetadata

    frames = _numbered(n)
    path = tmp_path / f"v.{container}"
    write_video(path, frames, fps, container, codec, pix_fmt)
    got, idx, got_fps = V.read_video(path, vid)
    proc = vp.Qwen3VLVideoProcessor(fps=vid.fps, min_frames=vid.min_frames,
                                    max_frames=vid.max_frames)
    want = proc.sample_frames(VideoMetadata(total_num_frames=n, fps=float(fps)))
    assert got_fps == fps
    assert idx.tolist() == want.tolist()
    np.testing.assert_array_equal(got, frames[want])      # the very frames, decoded exactly


def test_fixture_video_file_equals_the_processor_pixels(tmp_path, ref, vid):
    """The fixture's 8 frames at 4 fps as a file: sampling picks 4 frames at 2 fps, and the
    pixels and timestamps equal transformers' processor output for them."""
    path = tmp_path / "clip.avi"
    write_video(path, ref["video"], int(ref["video_fps"]))
    m = V.process_video_file(path, vid)
    assert m.grid_thw == tuple(ref["video_grid"][0])
    np.testing.assert_array_equal(m.pixels, ref["video_pixels"])
    frames = V.process_video(list(ref["video"]), vid, fps=float(ref["video_fps"]))
    assert m.timestamps == frames.timestamps


def test_frames_as_pil_images_equal_arrays(ref, vid):
    Image = pytest.importorskip("PIL.Image")
    a = V.process_video(list(ref["video"]), vid, fps=4.0)
    b = V.process_video([Image.fromarray(f) for f in ref["video"]], vid, fps=4.0)
    np.testing.assert_array_equal(a.pixels, b.pixels)
    assert a.timestamps == b.timestamps


def test_bad_video_files_are_media_errors(tmp_path, vid):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video at all" * 10)
    with pytest.raises(V.MediaError, match="not decodable"):
        V.read_video(junk, vid)
    with pytest.raises(V.MediaError):
        V.read_video(tmp_path / "missing.mp4", vid)


def test_video_path_prompt_logits_equal_transformers(tmp_path, ref, artifacts):
    """Engine-side end to end: {"type": "video", "path": ...} in chat messages gives the prompt
    transformers' processor builds for the same frames and the logits of the oracle's video
    prompt (the fixture video prompt's text, rendered raw: its placeholder expanded)."""
    from fixture_utils import NUMPY_REL_TOL, assert_logits_close
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5.batch import ForwardBatch
    from ninfer.models.qwen3_5.frontend import Frontend
    from ninfer.models.qwen3_5.model import NumpyModel

    path = tmp_path / "clip.avi"
    write_video(path, ref["video"], int(ref["video_fps"]))
    with Artifact(artifacts["cond_gen"]) as art:
        fe = Frontend.from_artifact(art)
        m = fe.vision.process([{"role": "user", "content": [{"type": "video",
                                                             "path": str(path)}]}])[0]
        text = V.expand_placeholders(str(ref["video_text"]), [m])
        ids = fe.tokenize(text)
        np.testing.assert_array_equal(ids, ref["video_ids"])
        model = NumpyModel.from_artifact(art)
        enc = model.encode_media(ids, [m], ref["video_positions"])
        T = len(ids)
        table = np.arange((T + 15) // 16, dtype=np.int32)
        kv, state = model.new_kv_pool(len(table), 16), model.new_state_pool(1)
        batch = ForwardBatch(token_ids=ids, positions=enc.positions_for(0, T),
                             query_start=np.array([0, T], np.int32),
                             context_lens=np.array([0], np.int32),
                             block_tables=table.reshape(1, -1), state_slots=np.array([0], np.int32))
        got = model.forward(batch, kv, state, all_logits=True, media=enc.rows_in(0, T))
        model.close()
    assert_logits_close(got, ref["cond_gen_video_logits"], "video from a file", tol=NUMPY_REL_TOL)
