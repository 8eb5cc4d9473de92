"""Converter: synthetic HF checkpoints of all four architectures, single-file and sharded, per-expert and
fused MoE, tied and untied, checked byte for byte against the source tensors."""
import json

import ml_dtypes
import numpy as np
import pytest
from ckpt_helpers import ARCHS, CHAT_TEMPLATE, check_artifact_matches, write_checkpoint

import ninfer
import ninfer.cli
from ninfer.artifact import Artifact
from ninfer.convert import Recipe, ValuePreserving, convert_checkpoint
from ninfer.convert import source as source_mod
from ninfer.models import model_config
from ninfer.models.qwen3_5.config import parse_hf_config


CASES = [(arch, sharded, fused, tied)
         for arch in ARCHS for sharded in (False, True) for fused in (False, True)
         for tied in (False, True)
         if "Moe" in arch or not fused]          # fused_experts only changes MoE checkpoints


@pytest.mark.parametrize("arch,sharded,fused,tied", CASES)
def test_convert_round_trip(tmp_path, arch, sharded, fused, tied):
    ckpt = write_checkpoint(tmp_path / "ckpt", arch, sharded=sharded, fused_experts=fused, tied=tied,
                            seed=CASES.index((arch, sharded, fused, tied)))
    out = tmp_path / "m.ninfer"
    assert convert_checkpoint(ckpt.path, out, progress=False) == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.ninfer"]
    with Artifact(out, verify="eager") as art:
        assert model_config(art) == parse_hf_config(ckpt.config)
        assert art.name == arch
        check_artifact_matches(art, ckpt.tensors, tied=tied)
        want = ["text", "vision", "mtp"] if "Conditional" in arch else ["text"]
        assert art.manifest["components"] == want
        assert art.manifest["metadata"]["recipe"] == "value-preserving"
        if "Moe" in arch:
            assert art.manifest["metadata"]["source"]["expert_layout"] == \
                ("fused" if fused else "per_expert")
        # every text binding except the gate/up views is consumed at a use-site, all A16Only
        used = {u["binding"] for u in art.uses}
        text = {b for b in art.binding_names() if b.startswith("text.")
                and not b.endswith(("experts.gate_proj", "experts.up_proj"))}
        assert used == text
        assert {u["activation"] for u in art.uses} == {"A16Only"}
        assert art.resource("tokenizer.json") == (ckpt.path / "tokenizer.json").read_bytes()
        assert art.resource("chat_template.jinja").decode() == CHAT_TEMPLATE
        assert json.loads(art.resource("generation_config.json"))["eos_token_id"] == [91, 95]
        assert (art.resource("preprocessor_config.json") is not None) == ("Conditional" in arch)


def test_mixed_source_dtypes_preserved(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", mixed_dtypes=True)
    out = convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", name="tiny-moe", progress=False)
    with Artifact(out) as art:
        assert art.name == "tiny-moe"
        assert art.tensor("text.layers.0.linear_attn.A_log").dtype == np.float32
        assert art.tensor("text.norm.weight").dtype == np.float32
        assert art.tensor("text.layers.0.linear_attn.in_proj_qkv.weight").dtype == ml_dtypes.bfloat16
        check_artifact_matches(art, ckpt.tensors, tied=False)


def test_float32_checkpoint(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", dtype="float32")
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        assert art.tensor("text.embed_tokens.weight").dtype == np.float32
        check_artifact_matches(art, ckpt.tensors, tied=False)


def test_tie_detected_from_missing_lm_head(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", drop=["lm_head.weight"])
    assert ckpt.config["tie_word_embeddings"] is False
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        check_artifact_matches(art, ckpt.tensors, tied=True)


def test_config_tie_wins_over_stored_lm_head(tmp_path):
    extra = np.ones((96, 32), ml_dtypes.bfloat16)
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", tied=True,
                            replace={"lm_head.weight": extra})
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        assert np.shares_memory(art.tensor("text.lm_head.weight"),
                                art.tensor("text.embed_tokens.weight"))


def test_causal_lm_with_language_model_prefix(tmp_path):
    # transformers' qwen3_5_text conversion accepts `model.language_model.*` for ForCausalLM too.
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForConditionalGeneration", mtp=False,
                            vision=False)
    flat = dict(ckpt.config["text_config"], architectures=["Qwen3_5ForCausalLM"])
    (ckpt.path / "config.json").write_text(json.dumps(flat))
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        assert model_config(art).architecture == "Qwen3_5ForCausalLM"
        check_artifact_matches(art, ckpt.tensors, tied=False)


def test_attention_bias_and_custom_layer_types(tmp_path):
    types = ["full_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention"]
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM",
                            {"attention_bias": True, "num_hidden_layers": 5, "layer_types": types})
    assert "model.layers.2.self_attn.q_proj.bias" in ckpt.tensors
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        assert list(model_config(art).text.layer_types) == types
        check_artifact_matches(art, ckpt.tensors, tied=False)
        uses = {u["binding"]: u for u in art.uses}
        assert uses["text.layers.2.self_attn.q_proj.bias"]["site"] == "text.layers.2.self_attn.q_proj"
        assert uses["text.layers.2.self_attn.q_proj.bias"]["inputs"] == [1]


def test_chat_template_file_takes_precedence(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    (ckpt.path / "chat_template.jinja").write_text("{{ messages }}")
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        assert art.resource("chat_template.jinja") == b"{{ messages }}"


def test_named_chat_templates_pick_default(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    tc = json.loads((ckpt.path / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (ckpt.path / "tokenizer_config.json").write_text(json.dumps(tc))
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        assert art.resource("chat_template.jinja") == b"D"


def test_no_frontend_files_is_fine(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", frontend=False)
    with Artifact(convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)) as art:
        assert art.resource_names() == ["config.json"]
        assert art.resource("tokenizer.json") is None


class RecordingRecipe(ValuePreserving):
    def __init__(self):
        self.pieces = []

    def encode(self, logical, piece):
        self.pieces.append((logical, piece.nbytes))
        return piece


@pytest.mark.parametrize("fused", [False, True])
def test_streams_in_bounded_pieces(tmp_path, monkeypatch, fused):
    """Row-block streaming: no piece handed to the recipe exceeds the chunk limit (or one row)."""
    monkeypatch.setattr(source_mod, "CHUNK_BYTES", 256)
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", fused_experts=fused)
    recipe = RecordingRecipe()
    out = convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False, recipe=recipe)
    H, I = 32, 16
    biggest_row = 2 * I * H * 2                 # one expert's gate_up slab in bf16
    assert max(n for _, n in recipe.pieces) <= max(256, biggest_row)
    assert sum(1 for lg, _ in recipe.pieces if lg == "text.embed_tokens.weight") > 1
    with Artifact(out) as art:
        check_artifact_matches(art, ckpt.tensors, tied=False)


class UpcastRecipe(Recipe):
    """Not value-preserving: exercises the hook the quantized recipes will use."""
    name = "upcast-f32"

    def stored(self, logical, source_dtype, shape):
        return np.dtype(np.float32), "row_major"

    def encode(self, logical, piece):
        return piece.astype(np.float32)

    def activation(self, logical):
        return "AllowA8"


def test_recipe_hook(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    out = convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False, recipe=UpcastRecipe())
    with Artifact(out) as art:
        assert art.manifest["metadata"]["recipe"] == "upcast-f32"
        w = art.tensor("text.layers.0.linear_attn.out_proj.weight")
        src = ckpt.tensors["model.layers.0.linear_attn.out_proj.weight"]
        assert w.dtype == np.float32 and np.array_equal(w, src.astype(np.float32))
        assert {u["activation"] for u in art.uses} == {"AllowA8"}


def test_progress_bar_goes_to_stderr(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "convert ckpt" in captured.err


def test_cli_convert_success(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForConditionalGeneration", sharded=True)
    out = tmp_path / "m.ninfer"
    assert ninfer.cli.main(["convert", str(ckpt.path), str(out), "--quiet", "--name", "x"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    with Artifact(out) as art:
        assert art.name == "x"

