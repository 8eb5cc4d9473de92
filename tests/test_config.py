"""parse_hf_config: every accepted layout, defaults that match transformers, and clear refusals."""
import pytest

from ninfer.errors import ArtifactError
from ninfer.models.qwen3_5.config import (FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig,
                                          parse_hf_config)

TEXT = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "rope_parameters": {"rope_theta": 1e6,
                                                         "partial_rotary_factor": 0.25,
                                                         "mrope_section": [1, 1, 0]}}


def test_dense_causal_lm_default_layer_pattern():
    cfg = parse_hf_config({"architectures": ["Qwen3_5ForCausalLM"], **TEXT})
    # transformers: layer i is full attention when (i + 1) % full_attention_interval == 0 (4)
    assert cfg.text.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,) + \
        (LINEAR_ATTENTION,) * 2
    assert cfg.text.attention_layer_ids == [3] and cfg.text.linear_layer_ids == [0, 1, 2, 4, 5]
    assert cfg.text.rotary_dim == 4 and cfg.text.rope_theta == 1e6
    assert not cfg.is_moe and cfg.vision is None


def test_conditional_generation_reads_text_config_and_keeps_vision():
    hf = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
          "text_config": {**TEXT, "num_experts": 8, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                          "full_attention_interval": 2},
          "vision_config": {"depth": 2}, "image_token_id": 248056}
    cfg = parse_hf_config(hf)
    assert cfg.is_moe and cfg.text.num_experts == 8 and cfg.text.num_experts_per_tok == 2
    assert cfg.text.layer_types[1] == FULL_ATTENTION and cfg.text.layer_types[0] == LINEAR_ATTENTION
    assert cfg.vision == {"depth": 2} and cfg.special_token_ids == {"image_token_id": 248056}
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("patch, words", [
    ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ({"layer_types": ["sliding"] * 6}, "unknown layer types"),
    ({"num_attention_heads": 5}, "not a multiple"),
    ({"linear_num_value_heads": 3}, "not a multiple"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"hidden_size": 0}, "hidden_size must be >= 1"),
    ({"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 1e308}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_theta": 1e6, "mrope_section": [2, -1, 2]}}, "mrope_section"),
    ({"rope_parameters": {"rope_theta": 1e6, "mrope_section": [2, 2]}}, "mrope_section"),
    ({"rope_parameters": {"rope_theta": 1e6, "mrope_section": "2,2,2"}}, "mrope_section"),
])
def test_bad_configs_are_refused_with_the_rule(patch, words):
    hf = {"architectures": ["Qwen3_5ForCausalLM"], **TEXT, **patch}
    with pytest.raises(ArtifactError, match=words):
        parse_hf_config(hf)
