"""The numpy vision tower and MRoPE positions (issue 18) against transformers'
Qwen3_5(Moe)ForConditionalGeneration in float32, on the tiny release-layout checkpoints cond_gen and
moe_cond_gen with the prompts of tests/fixtures/vision/ (one image, two images of different sizes,
a video): the tower's merged output, get_rope_index's positions and the whole model's logits."""
from __future__ import annotations

import numpy as np
import pytest

from fixture_utils import (FIXTURES_DIR, NUMPY_REL_TOL, assert_logits_close, convert_fixture,
                           rel_err)

PROMPTS = ("image", "two_images", "video")
MODELS = ("cond_gen", "moe_cond_gen")
PAGE = 16


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURES_DIR / "vision" / "reference.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5.model import NumpyModel
    from ninfer.models.qwen3_5.vision_tower import VisionTower

    out, cache = tmp_path_factory.mktemp("vision_art"), {}

    def get(name):
        if name not in cache:
            art = Artifact(convert_fixture(name, out))
            cache[name] = (art, VisionTower.from_artifact(art), NumpyModel.from_artifact(art))
        return cache[name]
    yield get
    for art, _, model in cache.values():
        model.close()
        art.close()


def _grids(ref, p):
    kind = 2 if p == "video" else 1
    return [(kind, tuple(int(v) for v in g)) for g in ref[f"{p}_grid"]]


def _forward(model, ids, pos, media_rows, embeds, split):
    """Prefill in chunks of `split` tokens; each chunk gets the media rows that fall in it."""
    from ninfer.models.qwen3_5.batch import ForwardBatch

    T = len(ids)
    table = np.arange((T + PAGE - 1) // PAGE, dtype=np.int32)
    kv, state = model.new_kv_pool(len(table), PAGE), model.new_state_pool(1)
    out = []
    for s in range(0, T, split):
        e = min(T, s + split)
        batch = ForwardBatch(token_ids=ids[s:e], positions=np.ascontiguousarray(pos[:, s:e]),
                             query_start=np.array([0, e - s], np.int32),
                             context_lens=np.array([s], np.int32),
                             block_tables=table.reshape(1, -1), state_slots=np.array([0], np.int32))
        inside = (media_rows >= s) & (media_rows < e)
        media = (media_rows[inside] - s, embeds[inside]) if embeds is not None else None
        out.append(model.forward(batch, kv, state, all_logits=True, media=media))
    return np.concatenate(out)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tower_output_equals_transformers(prompt, ref, loaded):
    _, tower, _ = loaded("cond_gen")
    got = tower.encode(ref[f"{prompt}_pixels"], ref[f"{prompt}_grid"])
    assert got.shape == ref[f"{prompt}_embeds"].shape
    err = rel_err(got, ref[f"{prompt}_embeds"])
    assert err <= 1e-5, f"{prompt}: vision tower rel. error {err:.2e}"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_rope_positions_equal_get_rope_index(prompt, ref):
    from ninfer.models.qwen3_5.frontend.media import rope_positions

    pos, nxt = rope_positions(ref[f"{prompt}_mm_types"], _grids(ref, prompt), 2)
    np.testing.assert_array_equal(pos, ref[f"{prompt}_positions"])
    assert nxt == pos.max() + 1
    # a later turn continues from the previous turn's next position on all three axes
    later, _ = rope_positions(ref[f"{prompt}_mm_types"], _grids(ref, prompt), 2, start=100)
    np.testing.assert_array_equal(later, ref[f"{prompt}_positions"] + 100)
    with pytest.raises(ValueError, match="do not match"):
        rope_positions(ref[f"{prompt}_mm_types"], _grids(ref, prompt)[:-1], 2)


@pytest.mark.parametrize("split", [10 ** 6, 7], ids=["one-piece", "chunks-of-7"])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(name, prompt, split, ref, loaded):
    """Tower -> embeddings at the placeholders -> text model at the MRoPE positions: the logits
    of every position. Chunks of 7 cut images and video frames across prefill steps."""
    from ninfer.models.qwen3_5.frontend.media import rope_positions

    _, tower, model = loaded(name)
    ids, types = ref[f"{prompt}_ids"], ref[f"{prompt}_mm_types"]
    pos, _ = rope_positions(types, _grids(ref, prompt), 2)
    embeds = tower.encode(ref[f"{prompt}_pixels"], ref[f"{prompt}_grid"])
    rows = np.nonzero(types)[0]
    assert len(rows) == len(embeds)
    got = _forward(model, ids, pos.astype(np.int32), rows, embeds, split)
    want = ref[f"{name}_{prompt}_logits"]
    assert_logits_close(got, want, f"{name} {prompt} split {split}", tol=NUMPY_REL_TOL)
    if split > len(ids):
        # the media matter: the placeholders' own embeddings give other logits
        assert rel_err(_forward(model, ids, pos.astype(np.int32), rows, None, split), want) > 1e-2


def test_text_only_artifact_has_no_tower(tmp_path):
    from ninfer.artifact import Artifact
    from ninfer.errors import ArtifactError
    from ninfer.models.qwen3_5.vision_tower import VisionTower

    with Artifact(convert_fixture("dense", tmp_path)) as art:
        with pytest.raises(ArtifactError, match="no vision tower"):
            VisionTower.from_artifact(art)


def test_deepstack_config_is_refused():
    from ninfer.errors import ArtifactError
    from ninfer.models.qwen3_5.vision_tower import VisionConfig

    base = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=4,
                num_position_embeddings=16, out_hidden_size=32)
    assert VisionConfig.from_dict(base).head_dim == 8
    with pytest.raises(ArtifactError, match="deepstack"):
        VisionConfig.from_dict(dict(base, deepstack_visual_indexes=[0]))


def test_equal_media_are_encoded_once(ref, loaded, monkeypatch):
    """The tower caches encodings by content hash: the same image again (a later turn) is not
    re-encoded; another image is; the cache stays within its byte budget."""
    from ninfer.models.qwen3_5.frontend.image_preprocess import Media

    _, tower, _ = loaded("cond_gen")
    calls = []
    real = tower.encode
    monkeypatch.setattr(tower, "encode", lambda *a: calls.append(1) or real(*a))
    grid = tuple(int(v) for v in ref["image_grid"][0])
    a = Media("image", ref["image_pixels"], grid, 2)
    b = Media("image", ref["image_pixels"].copy(), grid, 2)           # equal content
    c = Media("image", ref["image_pixels"] + np.float32(0.5), grid, 2)
    first = tower.encode_medium(a)
    assert tower.encode_medium(b) is first and len(calls) == 1
    assert rel_err(first, ref["image_embeds"]) <= 1e-5
    monkeypatch.setattr(tower, "CACHE_BYTES", first.nbytes)       # room for one encoding
    assert not np.array_equal(tower.encode_medium(c), first) and len(calls) == 2
    assert tower._cache_bytes <= first.nbytes                       # c evicted a
    tower.encode_medium(a)
    assert len(calls) == 3
