"""Media encoded beside the worker's cycles (runtime/media_encoder.py): while a request's images
encode on their own thread, the requests already resident keep decoding; the image request is
bound once its media are ready and gives the tokens of an instant encode; a cancel or deadline
while encoding ends it with nothing left behind; a tower that refuses the media ends that request
with the reason and leaves the engine ready for the next."""
import dataclasses
import threading

import numpy as np
import pytest

from ninfer.api import SamplingParams
from ninfer.models.qwen3_5.vision_tower import PromptMedia
from runtime_helpers import make_core, prompt, reference_tokens

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class WithMedia:
    """A prepared prompt with one (stand-in) image: the fake model's encoder below places no
    embeddings, so its tokens are the text-only run's."""
    token_ids: np.ndarray
    text: str = ""
    num_reusable_tokens: int = 0
    media: tuple = ("image",)
    mrope_positions: object = None
    media_digest: bytes = b"\x01" * 16


def _core_with_a_slow_tower():
    """(core, gate, calls): the tower blocks until gate is set, then gives text positions and no
    embeddings; prompts of 7 tokens carry an image, others are text."""
    core, _ = make_core(max_concurrency=2, max_context=64)
    gate, calls = threading.Event(), []

    def encode(ids, media, positions):
        calls.append(threading.current_thread().name)
        assert gate.wait(30)
        if len(ids) == 7 and ids[0] == 0:
            raise ValueError("2 placeholder tokens for 1 media embeddings")
        return PromptMedia(np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))),
                           0, np.zeros(0, np.int64), np.zeros((0, 1), np.float32))
    core.program.model.encode_media = encode
    real = core.frontend.prepare

    def prepare(p, **kw):
        got = real(p, **kw)
        return WithMedia(got.token_ids, got.text) if len(got.token_ids) == 7 else got
    core.frontend.prepare = prepare
    return core, gate, calls


def test_residents_decode_while_an_image_encodes():
    core, gate, calls = _core_with_a_slow_tower()
    text, image = prompt(1, 5), prompt(2, 7)
    first = core.submit(text, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert first.result(timeout=20).token_ids        # resident before the image arrives
    long = core.submit(prompt(3, 5), SamplingParams(max_tokens=40, temperature=0.0,
                                                   ignore_eos=True))
    pic = core.submit(image, GREEDY)
    # the tower is blocked: the text request runs to its end meanwhile
    assert long.result(timeout=20).token_ids == reference_tokens(
        prompt(3, 5), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert core.stats()["waiting"] == 1 and calls and calls[0].startswith("ninfer-media")
    gate.set()
    assert pic.result(timeout=20).token_ids == reference_tokens(image, GREEDY)
    core.shutdown()
    core.program.assert_all_free()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_request_ending_while_its_image_encodes_leaves_nothing(how):
    core, gate, _ = _core_with_a_slow_tower()
    kw = {"timeout_s": 0.2} if how == "deadline" else {}
    pic = core.submit(prompt(2, 7), GREEDY, **kw)
    if how == "cancel":
        pic.cancel()
    res = pic.result(timeout=20)
    assert res.finish_reason == "cancelled" and res.token_ids == []
    assert res.error == (None if how == "cancel" else "deadline exceeded (timeout_s)")
    gate.set()
    after = prompt(4, 7)                       # the next image request encodes and runs
    assert core.submit(after, GREEDY).result(timeout=20).token_ids == \
        reference_tokens(after, GREEDY)
    assert core.health == "ready" and core.media_encoder.num_encoding == 0
    core.shutdown()
    core.program.assert_all_free()


def test_media_the_tower_refuses_end_that_request_only():
    core, gate, _ = _core_with_a_slow_tower()
    gate.set()
    bad = np.concatenate([[0], prompt(5, 6)]).astype(np.int32)      # (the stand-in's trigger)
    res = core.submit(bad, GREEDY).result(timeout=20)
    assert res.finish_reason == "error" and "media: 2 placeholder tokens" in res.error
    good = prompt(6, 7)
    assert core.submit(good, GREEDY).result(timeout=20).token_ids == reference_tokens(good, GREEDY)
    assert core.health == "ready"
    core.shutdown()
    core.program.assert_all_free()


def test_the_first_waiting_request_encodes_while_every_lane_is_busy():
    """The queue's head starts encoding before a lane frees, so it is ready when one does."""
    core, gate, calls = _core_with_a_slow_tower()
    encode, busy = core.program.model.encode_media, []

    def counting(ids, media, positions):          # the lanes taken when the encode starts
        busy.append(core.stats()["residents"])
        return encode(ids, media, positions)
    core.program.model.encode_media = counting
    long = SamplingParams(max_tokens=58, temperature=0.0, ignore_eos=True)
    # each step takes 3 ms: the two long requests hold both lanes for ~0.2 s
    core.program.model.on_forward = lambda batch: threading.Event().wait(0.003)
    hold = [core.submit(prompt(10 + i, 5), long) for i in range(2)]
    pic = core.submit(prompt(2, 7), GREEDY)
    for _ in range(2000):
        if busy:
            break
        threading.Event().wait(0.005)
    assert busy == [2]                             # encoding while both lanes are taken
    gate.set()
    assert [h.result(timeout=20).finish_reason for h in hold] == ["length", "length"]
    assert pic.result(timeout=20).token_ids == reference_tokens(prompt(2, 7), GREEDY)
    core.shutdown()
    core.program.assert_all_free()
