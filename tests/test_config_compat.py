"""Checkpoints saved from transformers' own Qwen3.5 config classes convert and run with transformers'
numbers (issue 11). The case that used to be refused: a text config whose rope_parameters has no
mrope_section gets transformers' default [11, 11, 10], which exceeds rotary_dim/2 with a small
head_dim; transformers slices the interleaved sections (text positions make it plain RoPE).

tests/fixtures_compat/default_rope (made by tools/make_compat_fixture.py with transformers) runs
everywhere; the live tests (dense and MoE, built here) need torch and transformers."""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

import ninfer
from ninfer.convert import convert_checkpoint
from ninfer.errors import ArtifactError, ConvertError
from ninfer.models.qwen3_5.config import parse_hf_config

FIXTURE = pathlib.Path(__file__).parent / "fixtures_compat" / "default_rope"
# float32 numpy vs float32 torch (measured <= 1e-7 on the fixture); a RoPE with theta doubled is
# off by 1e-3 there, no RoPE by 5e-2
ATOL, RTOL = 2e-5, 1e-4


def _logits(path, ids):
    with ninfer.Engine(path, purpose="scoring", prefill_chunk=16) as engine:
        return engine.score(ids, return_logits=True).logits


def test_transformers_default_rope_fixture_matches_its_logits(tmp_path):
    hf = json.loads((FIXTURE / "config.json").read_text())
    assert "mrope_section" not in hf["rope_parameters"]
    assert parse_hf_config(hf).text.mrope_section == (11, 11, 10)
    assert parse_hf_config(hf).text.rotary_dim == 4
    ref = np.load(FIXTURE / "logits.npz")
    out = convert_checkpoint(FIXTURE, tmp_path / "m.ninfer", progress=False)
    np.testing.assert_allclose(_logits(out, ref["ids"]), ref["logits"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("patch, field", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_theta": 1e4, "mrope_section": [1, -2, 1]}}, "mrope_section"),
])
def test_what_the_kernels_cannot_run_is_refused_naming_the_field(tmp_path, patch, field):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, src)
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, **patch}))
    with pytest.raises((ConvertError, ArtifactError), match=field):
        convert_checkpoint(src, tmp_path / "m.ninfer", progress=False)


# ---- live: built with transformers here ---------------------------------------------------------

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             max_position_embeddings=512)


def _save(tmp_path, moe: bool):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48)
        cls = transformers.Qwen3_5MoeForCausalLM
    else:
        cfg = transformers.Qwen3_5TextConfig(**SMALL)
        cls = transformers.Qwen3_5ForCausalLM
    assert "mrope_section" not in (cfg.rope_parameters or {})     # transformers' default applies
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():                 # as tools/make_compat_fixture.py does
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(30.0)
    model.save_pretrained(tmp_path / "ckpt")
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_transformers_default_text_config_converts_and_matches_logits(tmp_path, moe):
    torch = pytest.importorskip("torch")
    model = _save(tmp_path, moe)
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert parse_hf_config(hf).text.mrope_section == (11, 11, 10)
    out = convert_checkpoint(tmp_path / "ckpt", tmp_path / "m.ninfer", progress=False)
    ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], size=37).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0].numpy()
    np.testing.assert_allclose(_logits(out, ids), want, atol=ATOL, rtol=RTOL)
