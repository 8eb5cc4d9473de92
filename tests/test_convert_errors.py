"""Bad converter inputs: `python -m ninfer convert` prints one clear line, exits non-zero, and leaves no
output (nor a partial file) behind; an existing output is left untouched."""
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from ckpt_helpers import write_checkpoint

import ninfer
import ninfer.cli
from ninfer.convert import convert_checkpoint


def run_cli(capsys, src, out):
    rc = ninfer.cli.main(["convert", str(src), str(out), "--quiet"])
    captured = capsys.readouterr()
    return rc, captured.err


def assert_clean_failure(capsys, tmp_path, src, *fragments):
    out = tmp_path / "out.ninfer"
    rc, err = run_cli(capsys, src, out)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ninfer: error: ")
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])
    assert not out.exists() and not (tmp_path / "out.ninfer.partial").exists()
    return lines[0]


def bf16(shape):
    return np.zeros(shape, ml_dtypes.bfloat16)


def test_unknown_architecture(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    cfg = dict(ckpt.config, architectures=["LlamaForCausalLM"])
    (ckpt.path / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(capsys, tmp_path, ckpt.path, "unsupported architecture", "LlamaForCausalLM",
                         "Qwen3_5ForCausalLM")


def test_missing_config(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    (ckpt.path / "config.json").unlink()
    assert_clean_failure(capsys, tmp_path, ckpt.path, "config.json not found")


def test_invalid_config_json(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    (ckpt.path / "config.json").write_text("{not json")
    assert_clean_failure(capsys, tmp_path, ckpt.path, "config.json: invalid JSON")


def test_missing_directory(tmp_path, capsys):
    assert_clean_failure(capsys, tmp_path, tmp_path / "nowhere", "does not exist")


def test_missing_shard_listed_in_index(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", sharded=True)
    (ckpt.path / ckpt.files[1]).unlink()
    assert_clean_failure(capsys, tmp_path, ckpt.path, f"shard '{ckpt.files[1]}'",
                         "model.safetensors.index.json", "is missing")


def test_missing_shard_without_index(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", sharded=True)
    (ckpt.path / "model.safetensors.index.json").unlink()
    (ckpt.path / ckpt.files[2]).unlink()
    assert_clean_failure(capsys, tmp_path, ckpt.path, f"shard '{ckpt.files[2]}' is missing")


def test_no_weights(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    (ckpt.path / "model.safetensors").unlink()
    assert_clean_failure(capsys, tmp_path, ckpt.path, "no model.safetensors")


def test_index_names_tensor_absent_from_shard(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", sharded=True)
    index = json.loads((ckpt.path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = ckpt.files[0]
    (ckpt.path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_failure(capsys, tmp_path, ckpt.path, "'model.layers.9.ghost.weight'",
                         "is not in that file")


def test_malformed_index(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", sharded=True)
    index = json.loads((ckpt.path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = ["a", "b"]
    (ckpt.path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_failure(capsys, tmp_path, ckpt.path, "weight_map['model.norm.weight'] is not a file name")


def test_corrupt_safetensors(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    (ckpt.path / "model.safetensors").write_bytes(b"\xff" * 64)
    assert_clean_failure(capsys, tmp_path, ckpt.path, "unreadable safetensors file")


@pytest.mark.parametrize("arch,name", [
    ("Qwen3_5ForCausalLM", "model.layers.1.linear_attn.A_log"),
    ("Qwen3_5ForCausalLM", "model.norm.weight"),
    ("Qwen3_5ForConditionalGeneration", "model.language_model.layers.3.self_attn.q_norm.weight"),
    ("Qwen3_5MoeForCausalLM", "model.layers.2.mlp.shared_expert_gate.weight"),
])
def test_missing_tensor(tmp_path, capsys, arch, name):
    ckpt = write_checkpoint(tmp_path / "ckpt", arch, drop=[name])
    assert_clean_failure(capsys, tmp_path, ckpt.path, f"missing tensor '{name}'")


def test_missing_expert(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM",
                            drop=["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert_clean_failure(capsys, tmp_path, ckpt.path, "expert 3 up_proj", "text.layers.1.mlp.experts")


def test_missing_fused_experts(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", fused_experts=True,
                            drop=["model.layers.0.mlp.experts.down_proj"])
    assert_clean_failure(capsys, tmp_path, ckpt.path, "missing tensor 'model.layers.0.mlp.experts.down_proj'")


@pytest.mark.parametrize("arch,name,shape,expected", [
    ("Qwen3_5ForCausalLM", "model.layers.3.self_attn.q_proj.weight", (64, 32), "[128, 32]"),
    ("Qwen3_5ForCausalLM", "model.layers.0.linear_attn.conv1d.weight", (64, 4), "[64, 1, 4]"),
    ("Qwen3_5ForCausalLM", "model.embed_tokens.weight", (95, 32), "[96, 32]"),
    ("Qwen3_5MoeForCausalLM", "model.layers.0.mlp.experts.1.down_proj.weight", (32, 8), "[32, 16]"),
])
def test_shape_mismatch(tmp_path, capsys, arch, name, shape, expected):
    ckpt = write_checkpoint(tmp_path / "ckpt", arch, replace={name: bf16(shape)})
    assert_clean_failure(capsys, tmp_path, ckpt.path, f"tensor '{name}'",
                         f"expected shape {expected}", f"got {list(shape)}")


def test_fused_expert_shape_mismatch(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", fused_experts=True,
                            replace={"model.layers.0.mlp.experts.gate_up_proj": bf16((4, 16, 32))})
    assert_clean_failure(capsys, tmp_path, ckpt.path, "expected shape [4, 32, 32]", "got [4, 16, 32]")


def test_unexpected_text_tensor(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM",
                            replace={"model.layers.0.mlp.extra_proj.weight": bf16((4, 4))})
    assert_clean_failure(capsys, tmp_path, ckpt.path,
                         "unexpected tensor 'model.layers.0.mlp.extra_proj.weight'")


def test_unexpected_prefix(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM",
                            replace={"transformer.h.0.weight": bf16((4,))})
    assert_clean_failure(capsys, tmp_path, ckpt.path, "unexpected tensor 'transformer.h.0.weight'")


def test_experts_in_dense_checkpoint(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM",
                            replace={"model.layers.0.mlp.experts.0.gate_proj.weight": bf16((4, 32))})
    assert_clean_failure(capsys, tmp_path, ckpt.path, "unexpected tensor",
                         "model.layers.0.mlp.experts.0.gate_proj.weight")


def test_both_fused_and_per_expert(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM",
                            replace={"model.layers.0.mlp.experts.down_proj": bf16((4, 32, 16))})
    assert_clean_failure(capsys, tmp_path, ckpt.path, "both per-expert and", "fused")


def test_expert_dtypes_mixed(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", replace={
        "model.layers.0.mlp.experts.2.gate_proj.weight": np.zeros((16, 32), np.float32)})
    assert_clean_failure(capsys, tmp_path, ckpt.path, "experts mix dtypes")


def test_bad_geometry_in_config(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", {"num_key_value_heads": 3})
    assert_clean_failure(capsys, tmp_path, ckpt.path, "num_attention_heads 4 is not a multiple")


@pytest.mark.parametrize("key,value", [("hidden_size", "abc"), ("full_attention_interval", 0),
                                       ("num_hidden_layers", None), ("rope_parameters", 3)])
def test_wrongly_typed_config_field(tmp_path, capsys, key, value):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    cfg = dict(ckpt.config)
    cfg[key] = value
    (ckpt.path / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(capsys, tmp_path, ckpt.path, "config.json")


def test_failure_leaves_existing_output_untouched(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", drop=["model.norm.weight"])
    out = tmp_path / "out.ninfer"
    out.write_bytes(b"previous artifact")
    rc, err = run_cli(capsys, ckpt.path, out)
    assert rc == 2 and "missing tensor 'model.norm.weight'" in err
    assert out.read_bytes() == b"previous artifact"
    assert not (tmp_path / "out.ninfer.partial").exists()


def test_failure_while_streaming_removes_partial(tmp_path, monkeypatch):
    """A read error after payload bytes were written must not leave a file behind."""
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    from ninfer.convert import source as source_mod
    real = source_mod.CheckpointSource._read_chunks
    seen = []

    def flaky(self, name, *args):
        seen.append(name)
        if len(seen) == 10:
            raise OSError(5, "Input/output error")
        yield from real(self, name, *args)

    monkeypatch.setattr(source_mod.CheckpointSource, "_read_chunks", flaky)
    out = tmp_path / "out.ninfer"
    with pytest.raises(ninfer.ConvertError, match="cannot read tensor"):
        convert_checkpoint(ckpt.path, out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_unwritable_output_directory(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    rc, err = run_cli(capsys, ckpt.path, tmp_path / "no" / "dir" / "out.ninfer")
    assert rc == 2 and err.count("\n") == 1 and "cannot create" in err


def test_module_entry_point(tmp_path):
    """The real `python -m ninfer convert` process: one line on stderr, exit 2, no file."""
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM",
                            replace={"model.layers.3.self_attn.o_proj.weight": bf16((32, 32))})
    out = tmp_path / "out.ninfer"
    proc = subprocess.run([sys.executable, "-m", "ninfer", "convert", str(ckpt.path), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ninfer: error: tensor 'model.layers.3.self_attn.o_proj.weight': expected shape [32, 64] "
        "from config.json, got [32, 32]"]
    assert not out.exists() and not (tmp_path / "out.ninfer.partial").exists()


@pytest.mark.parametrize("which", ["src", "out"])
def test_path_that_is_not_a_path(tmp_path, which):
    src = tmp_path / "src"
    write_checkpoint(src, "Qwen3_5ForCausalLM")
    paths = {"src": src, "out": tmp_path / "out.ninfer", which: None}
    with pytest.raises(ninfer.ConvertError, match=f"{which}.*not a file path"):
        convert_checkpoint(paths["src"], paths["out"], progress=False)
    assert not list(tmp_path.glob("*.ninfer*"))
