"""The reference models' DFlash drafters (ninfer/demo_models/<name>-dflash.npz, trained by
tools/train_dflash.py): the compact drafter form (save -> load -> expand into a drafter directory)
and the shipped files' names, shapes and size."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from ninfer.models.qwen3_5.config import parse_dflash_config, parse_hf_config
from ninfer.models.qwen3_5.dflash import PREFIX, dflash_param_shapes
from ninfer.reference_models import (CompactDrafter, CompactModel, drafter_path, expand_drafter,
                                     model_path, save_compact_drafter)

MAX_FILE_BYTES = 2 << 20
TARGET_LAYER_IDS = {"dense": [1, 3, 5], "moe": [0, 2, 3]}
IM_START = 248045                       # the mask token: <|image_pad|> is not a kept id


def drafter_config(layer_ids, mask_token_id=IM_START) -> dict:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "intermediate_size": 384, "rms_norm_eps": 1e-6,
            "rope_theta": 10000000.0, "vocab_size": 248320, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "max_position_embeddings": 32768, "block_size": 8,
            "dflash_config": {"target_layer_ids": list(layer_ids), "block_size": 8,
                              "mask_token_id": mask_token_id}}


def expected_shapes(cfg: dict) -> dict:
    """{tensor name: shape} the engine reads for this drafter config (dflash.py's table, which
    tests/test_dflash.py holds to the drafter's math and the converter checks)."""
    target = parse_hf_config(CompactModel(model_path("dense")).config).text   # (both fit it)
    shapes = dflash_param_shapes(parse_dflash_config(cfg, target))
    return {n[len(PREFIX):]: s for n, s in shapes.items()}


def test_compact_drafter_round_trip(tmp_path):
    cfg = drafter_config([1, 3, 5])
    rng = np.random.default_rng(0)
    tensors = {n: (rng.standard_normal(s) * (0.05 if len(s) == 2 else 1.0)).astype(np.float32)
               for n, s in expected_shapes(cfg).items()}
    meta = {"target": "dense", "steps": 1}
    save_compact_drafter(tmp_path / "d.npz", cfg, meta, tensors)
    with np.load(tmp_path / "d.npz") as z:                  # the compact conventions
        assert "__vocab__" not in z.files
        assert z["fc.weight.__q"].dtype == np.int8 and z["fc.weight.__s"].shape == (128,)
        assert z["norm.weight"].dtype == np.float32
    d = CompactDrafter(tmp_path / "d.npz")
    assert d.config == cfg and d.meta == meta and d.kept_ids is None
    assert set(d.names) == set(tensors)
    for n, w in tensors.items():
        got = d.tensor(n)
        assert got.shape == w.shape and got.dtype == np.float32
        if w.ndim == 1:
            np.testing.assert_array_equal(got, w)
        else:                                               # half a quantization step per row
            step = np.max(np.abs(w), axis=-1, keepdims=True) / 127.0
            assert np.all(np.abs(got - w) <= 0.5 * step * (1 + 1e-5))
    out = expand_drafter(tmp_path / "d.npz", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text()) == cfg
    st = load_file(str(out / "model.safetensors"))
    assert {n: v.shape for n, v in st.items()} == {n: w.shape for n, w in tensors.items()}
    for n, v in st.items():
        assert v.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(v.astype(np.float32),
                                      d.tensor(n).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_expand_drafter_refuses_a_model(tmp_path):
    with pytest.raises(ValueError, match="not a compact DFlash drafter"):
        expand_drafter(model_path("dense"), tmp_path / "hf")


def test_unknown_drafter_is_a_clear_error():
    with pytest.raises(ValueError, match="no DFlash drafter for 'nope'"):
        drafter_path("nope")
    with pytest.raises(ValueError, match="no reference model 'dense-dflash'"):
        model_path("dense-dflash")                          # a drafter is not a model


@pytest.mark.parametrize("name", sorted(TARGET_LAYER_IDS))
def test_shipped_drafter(name):
    path = drafter_path(name)
    assert path.stat().st_size <= MAX_FILE_BYTES
    d = CompactDrafter(path)
    target = CompactModel(model_path(name))
    H = target.config["hidden_size"]
    assert d.config == drafter_config(TARGET_LAYER_IDS[name], d.config["dflash_config"]
                                      ["mask_token_id"])
    assert d.config["hidden_size"] == H and d.config["vocab_size"] == target.config["vocab_size"]
    assert max(TARGET_LAYER_IDS[name]) < target.config["num_hidden_layers"]
    assert {n: d.tensor(n).shape for n in d.names} == expected_shapes(d.config)
    # the mask token embeds to a non-zero row of the target's embedding
    mask = d.config["dflash_config"]["mask_token_id"]
    assert mask in target.kept_ids
    assert np.any(target.tensor("model.embed_tokens.weight")[mask] != 0)
    m = d.meta
    assert m["target"] == name and m["target_layer_ids"] == TARGET_LAYER_IDS[name]
    assert m["mask_token"]["id"] == mask and m["steps"] > 0
    figures = m["heldout"]
    assert figures["block_size"] == 8 and len(figures["accept_rate_by_position"]) == 7
    # trained: an untrained drafter accepts ~0.0002 drafts per block (tools/train_dflash.py eval
    # --untrained); these accept about one
    assert figures["mean_accepted"] > 0.5
