"""Checkpoints saved from transformers' own Qwen3.5 config classes convert and run with transformers'
numbers (issue 11). The case that used to be refused: a text config whose rope_parameters has no
mrope_section gets transformers' default [11, 11, 10], which exceeds rotary_dim/2 with a small
head_dim; transformers slices the interleaved sections (text positions make it plain RoPE)."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ninfer  # noqa: E402
from ninfer.convert import convert_checkpoint  # noqa: E402
from ninfer.errors import ArtifactError, ConvertError  # noqa: E402
from ninfer.models.qwen3_5.config import parse_hf_config  # noqa: E402

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             max_position_embeddings=512)
# logits of float32 numpy vs float32 torch on a 4-layer model
ATOL, RTOL = 2e-4, 2e-4


def _save(tmp_path, moe: bool):
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
    with torch.no_grad():                 # non-trivial norms and gates (init leaves them 0 / 1)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "ckpt")
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_transformers_default_text_config_converts_and_matches_logits(tmp_path, moe):
    model = _save(tmp_path, moe)
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert parse_hf_config(hf).text.mrope_section == (11, 11, 10)
    out = convert_checkpoint(tmp_path / "ckpt", tmp_path / "m.ninfer", progress=False)
    ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], size=37).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0].numpy()
    with ninfer.Engine(out, purpose="scoring", prefill_chunk=16) as engine:
        got = engine.score(ids, return_logits=True).logits
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("patch, field", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_theta": 1e4, "mrope_section": [1, -2, 1]}}, "mrope_section"),
])
def test_what_the_kernels_cannot_run_is_refused_naming_the_field(tmp_path, patch, field):
    _save(tmp_path, moe=False)
    path = tmp_path / "ckpt" / "config.json"
    hf = json.loads(path.read_text())
    path.write_text(json.dumps({**hf, **patch}))
    with pytest.raises((ConvertError, ArtifactError), match=field):
        convert_checkpoint(tmp_path / "ckpt", tmp_path / "m.ninfer", progress=False)
