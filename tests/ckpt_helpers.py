"""Write small synthetic Hugging Face Qwen3.5 checkpoint directories with numpy + safetensors (no torch).

Tensor names and shapes follow transformers' modeling_qwen3_5.py / modeling_qwen3_5_moe.py (and, for
`mtp.*`, the release checkpoints' MTP block). Values are random; they test the converter's plumbing,
not the model's math (the torch-built fixtures under tests/fixtures do that).

    from ckpt_helpers import write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", sharded=True)
    ckpt.tensors        # {source name: np.ndarray} exactly as written
    ckpt.config         # the config.json dict
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
         "Qwen3_5MoeForConditionalGeneration")

TINY_TEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    hidden_act="silu", max_position_embeddings=256, attention_bias=False,
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    eos_token_id=95, pad_token_id=None,
)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24, norm_topk_prob=True)
TINY_VISION = dict(depth=1, hidden_size=16, hidden_act="gelu_pytorch_tanh", intermediate_size=24,
                   num_heads=2, in_channels=3, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16)

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class Checkpoint:
    path: pathlib.Path
    config: dict
    tensors: dict = field(default_factory=dict)     # source name -> array as written
    files: list = field(default_factory=list)       # safetensors file names


def text_tensor_shapes(t: dict, prefix: str) -> dict:
    """HF source names -> shapes of one text model (or, with prefix 'mtp.', its MTP block) for the
    text config dict `t` (HF keys). Per-expert MoE names; see `fuse_expert_names`."""
    H, V = t["hidden_size"], t["vocab_size"]
    nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, K = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv
    is_mtp = prefix == "mtp."
    n = t.get("mtp_num_hidden_layers", 1) if is_mtp else t["num_hidden_layers"]
    types = (["full_attention"] * n if is_mtp else t.get("layer_types") or [
        "full_attention" if (i + 1) % t.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(n)])
    s = {}
    if is_mtp:
        s.update({"mtp.fc.weight": [H, 2 * H], "mtp.pre_fc_norm_embedding.weight": [H],
                  "mtp.pre_fc_norm_hidden.weight": [H], "mtp.norm.weight": [H]})
    else:
        s.update({f"{prefix}embed_tokens.weight": [V, H], f"{prefix}norm.weight": [H]})
    for i, kind in enumerate(types):
        p = f"{prefix}layers.{i}."
        s[p + "input_layernorm.weight"] = [H]
        s[p + "post_attention_layernorm.weight"] = [H]
        if kind == "linear_attention":
            a = p + "linear_attn."
            s.update({a + "in_proj_qkv.weight": [conv, H], a + "in_proj_z.weight": [nv * dv, H],
                      a + "in_proj_b.weight": [nv, H], a + "in_proj_a.weight": [nv, H],
                      a + "conv1d.weight": [conv, 1, K], a + "dt_bias": [nv], a + "A_log": [nv],
                      a + "norm.weight": [dv], a + "out_proj.weight": [H, nv * dv]})
        else:
            a = p + "self_attn."
            s.update({a + "q_proj.weight": [2 * nh * hd, H], a + "k_proj.weight": [nkv * hd, H],
                      a + "v_proj.weight": [nkv * hd, H], a + "o_proj.weight": [H, nh * hd],
                      a + "q_norm.weight": [hd], a + "k_norm.weight": [hd]})
            if t.get("attention_bias"):
                s.update({a + "q_proj.bias": [2 * nh * hd], a + "k_proj.bias": [nkv * hd],
                          a + "v_proj.bias": [nkv * hd], a + "o_proj.bias": [H]})
        m = p + "mlp."
        if "num_experts" in t:
            E, I, S = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
            s[m + "gate.weight"] = [E, H]
            for e in range(E):
                s.update({f"{m}experts.{e}.gate_proj.weight": [I, H],
                          f"{m}experts.{e}.up_proj.weight": [I, H],
                          f"{m}experts.{e}.down_proj.weight": [H, I]})
            s.update({m + "shared_expert.gate_proj.weight": [S, H],
                      m + "shared_expert.up_proj.weight": [S, H],
                      m + "shared_expert.down_proj.weight": [H, S],
                      m + "shared_expert_gate.weight": [1, H]})
        else:
            I = t["intermediate_size"]
            s.update({m + "gate_proj.weight": [I, H], m + "up_proj.weight": [I, H],
                      m + "down_proj.weight": [H, I]})
    return s


def vision_tensor_shapes(v: dict, prefix: str = "model.visual.") -> dict:
    d, C, T, P = v["hidden_size"], v["in_channels"], v["temporal_patch_size"], v["patch_size"]
    merged = d * v["spatial_merge_size"] ** 2
    s = {prefix + "patch_embed.proj.weight": [d, C, T, P, P], prefix + "patch_embed.proj.bias": [d],
         prefix + "pos_embed.weight": [v["num_position_embeddings"], d]}
    for b in range(v["depth"]):
        p = f"{prefix}blocks.{b}."
        s.update({p + "norm1.weight": [d], p + "norm1.bias": [d], p + "norm2.weight": [d],
                  p + "norm2.bias": [d], p + "attn.qkv.weight": [3 * d, d], p + "attn.qkv.bias": [3 * d],
                  p + "attn.proj.weight": [d, d], p + "attn.proj.bias": [d],
                  p + "mlp.linear_fc1.weight": [v["intermediate_size"], d],
                  p + "mlp.linear_fc1.bias": [v["intermediate_size"]],
                  p + "mlp.linear_fc2.weight": [d, v["intermediate_size"]],
                  p + "mlp.linear_fc2.bias": [d]})
    s.update({prefix + "merger.norm.weight": [d], prefix + "merger.norm.bias": [d],
              prefix + "merger.linear_fc1.weight": [merged, merged],
              prefix + "merger.linear_fc1.bias": [merged],
              prefix + "merger.linear_fc2.weight": [v["out_hidden_size"], merged],
              prefix + "merger.linear_fc2.bias": [v["out_hidden_size"]]})
    return s


def fuse_expert_names(tensors: dict) -> dict:
    """Replace per-expert tensors by transformers' fused `experts.gate_up_proj` [E, 2I, H] (gate rows
    first) and `experts.down_proj` [E, H, I]."""
    groups = {}
    for name in list(tensors):
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            k = parts.index("experts")
            base, e, proj = ".".join(parts[:k + 1]), int(parts[k + 1]), parts[k + 2]
            groups.setdefault(base, {}).setdefault(proj, {})[e] = tensors.pop(name)
    for base, projs in groups.items():
        E = len(projs["down_proj"])
        tensors[base + ".gate_up_proj"] = np.stack(
            [np.concatenate([projs["gate_proj"][e], projs["up_proj"][e]], axis=0) for e in range(E)])
        tensors[base + ".down_proj"] = np.stack([projs["down_proj"][e] for e in range(E)])
    return tensors


def write_checkpoint(path, arch: str, text_cfg_overrides: dict | None = None, *, sharded=False,
                     num_shards: int = 3, fused_experts=False, tied=False, dtype="bfloat16",
                     mixed_dtypes=False, mtp: bool | None = None, vision: bool | None = None,
                     frontend=True, drop=(), replace=None, seed=0) -> Checkpoint:
    """Write config.json, weights and (with frontend) tokenizer/generation/preprocessor files.

    tied: config says tie_word_embeddings and lm_head.weight is absent (as HF saves it).
    mixed_dtypes: A_log, dt_bias and norms in float32, the rest in `dtype`.
    mtp / vision: carry mtp.* / model.visual.* tensors (default: for ConditionalGeneration only).
    drop / replace: remove or overwrite source tensors by name after generation (for bad inputs)."""
    if arch not in ARCHS and not arch.startswith("Unknown"):
        raise ValueError(f"unknown arch {arch}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    is_moe, is_cond = "Moe" in arch, "Conditional" in arch
    mtp = is_cond if mtp is None else mtp
    vision = is_cond if vision is None else vision

    text = dict(TINY_TEXT, **(TINY_MOE if is_moe else {}))
    text["model_type"] = "qwen3_5_moe_text" if is_moe else "qwen3_5_text"
    text["tie_word_embeddings"] = bool(tied)
    text["mtp_num_hidden_layers"] = 1 if mtp else 0
    text.update(text_cfg_overrides or {})
    if is_cond:
        config = {"architectures": [arch], "model_type": "qwen3_5_moe" if is_moe else "qwen3_5",
                  "text_config": text, "vision_config": dict(TINY_VISION),
                  "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92,
                  "vision_end_token_id": 93, "tie_word_embeddings": bool(tied)}
        prefix = "model.language_model."
    else:
        config = dict(text, architectures=[arch])
        prefix = "model."

    shapes = text_tensor_shapes(text, prefix)
    if not tied:
        shapes["lm_head.weight"] = [text["vocab_size"], text["hidden_size"]]
    if mtp:
        shapes.update(text_tensor_shapes(text, "mtp."))
    if vision:
        shapes.update(vision_tensor_shapes(TINY_VISION))

    def make(name, shape):
        dt = dtype
        if mixed_dtypes and (name.endswith(("A_log", "dt_bias")) or "norm" in name):
            dt = "float32"
        return rng.standard_normal(shape).astype(np.float32).astype(
            ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt))

    tensors = {name: make(name, shape) for name, shape in shapes.items()}
    if fused_experts:
        tensors = fuse_expert_names(tensors)
    for name in drop:
        tensors.pop(name)
    tensors.update(replace or {})

    ckpt = Checkpoint(path=path, config=config, tensors=tensors)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(ckpt, sharded, num_shards)
    if frontend:
        _write_frontend(path, is_cond)
    return ckpt


def _write_weights(ckpt: Checkpoint, sharded: bool, num_shards: int) -> None:
    names = sorted(ckpt.tensors)
    if not sharded:
        save_file({n: ckpt.tensors[n] for n in names}, str(ckpt.path / "model.safetensors"))
        ckpt.files = ["model.safetensors"]
        return
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[k::num_shards]
        save_file({n: ckpt.tensors[n] for n in part}, str(ckpt.path / fname))
        weight_map.update({n: fname for n in part})
        ckpt.files.append(fname)
    total = sum(a.nbytes for a in ckpt.tensors.values())
    (ckpt.path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _write_frontend(path: pathlib.Path, is_cond: bool) -> None:
    vocab = {f"t{i}": i for i in range(90)}
    vocab.update({"<|im_start|>": 90, "<|im_end|>": 91, "<|endoftext|>": 95})
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                 "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
                 "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
         "chat_template": CHAT_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [91, 95], "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    if is_cond:
        (path / "preprocessor_config.json").write_text(json.dumps(
            {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))


def load_tensors(path) -> dict:
    """{source name: array} of every *.safetensors file in a checkpoint directory."""
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# ------------------------------------------------------------------------------------ checking

def expected_logical(source: str) -> str:
    """The mapping of docs/internals.md, restated independently of ninfer/convert/names.py."""
    for a, b in (("model.language_model.", "text."), ("model.visual.", "vision."),
                 ("model.", "text."), ("lm_head.", "text.lm_head."), ("mtp.", "mtp.")):
        if source.startswith(a):
            return b + source[len(a):]
    raise AssertionError(source)


def raw(a):
    return np.ascontiguousarray(a).tobytes()


def check_artifact_matches(art, tensors: dict, *, tied: bool):
    """Every source tensor ({HF name: array}) is reachable in the Artifact `art` under its logical
    name with identical dtype and bytes (per-expert tensors inside the fused objects), and the
    artifact binds nothing else."""
    seen = set()
    experts = {}
    for src, arr in tensors.items():
        lg = expected_logical(src)
        parts = lg.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            k = parts.index("experts")
            experts.setdefault(".".join(parts[:k + 1]), {})[(int(parts[k + 1]), parts[k + 2])] = arr
            continue
        if lg == "text.lm_head.weight" and tied:
            continue
        got = art.tensor(lg)
        assert got.dtype == arr.dtype and got.shape == arr.shape, lg
        assert raw(got) == raw(arr), lg
        seen.add(lg)
        if lg.endswith("experts.gate_up_proj"):
            experts.setdefault(lg.rsplit(".", 1)[0], None)
    for base, pieces in experts.items():
        fused = art.tensor(base + ".gate_up_proj")
        down = art.tensor(base + ".down_proj")
        I = fused.shape[1] // 2
        if pieces is not None:                                  # per-expert source
            E = fused.shape[0]
            assert len(pieces) == 3 * E
            for e in range(E):
                assert raw(fused[e, :I]) == raw(pieces[(e, "gate_proj")])
                assert raw(fused[e, I:]) == raw(pieces[(e, "up_proj")])
                assert raw(down[e]) == raw(pieces[(e, "down_proj")])
                assert fused.dtype == pieces[(e, "gate_proj")].dtype
        assert raw(art.tensor(base + ".gate_proj")) == raw(fused[:, :I])   # view bindings
        assert raw(art.tensor(base + ".up_proj")) == raw(fused[:, I:])
        assert np.shares_memory(art.tensor(base + ".gate_proj"), fused)
        seen |= {base + ".gate_up_proj", base + ".down_proj", base + ".gate_proj", base + ".up_proj"}
    embed = art.tensor("text.embed_tokens.weight")
    head = art.tensor("text.lm_head.weight")
    assert np.shares_memory(embed, head) == tied
    assert art.manifest["metadata"]["tied_lm_head"] == tied
    seen.add("text.lm_head.weight")
    assert set(art.binding_names()) == seen
