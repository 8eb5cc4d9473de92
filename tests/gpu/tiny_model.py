"""A tiny random Qwen3.5 artifact in memory (logical names of docs/internals.md), with the geometry
the CUDA kernels support (head_dim multiple of 64, GDN heads multiple of 32)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ninfer.models.qwen3_5.config import ModelConfig, TextConfig
from ninfer.models.qwen3_5.fakes import TensorArtifact

LIN, FULL = "linear_attention", "full_attention"
ROUTER_SCALE = 3.0
# The whole-model MoE check routes every token to all experts (top-k = E): any top-k < E made the
# tiny model chaotic, a 7% logit gap from near-tie flips that bf16 rounding anywhere upstream
# triggers (a CPU emulation of that rounding alone reproduced it). Selection itself is qualified
# against the float64 oracle in test_ops_gpu.test_router_topk; the expert paths run the same.
MOE_EXPERTS = 4


def tiny_config(moe: bool = False, tied: bool = False, hidden: int = 64) -> ModelConfig:
    layers = (LIN, LIN, LIN, FULL, LIN, FULL)
    t = TextConfig(vocab_size=320, hidden_size=hidden, intermediate_size=96, num_hidden_layers=len(layers),
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                   tie_word_embeddings=tied, rope_theta=10000.0, partial_rotary_factor=0.25,
                   mrope_section=(3, 3, 2), mrope_interleaved=True, linear_conv_kernel_dim=4,
                   linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                   linear_num_value_heads=4, layer_types=layers,
                   is_moe=moe, num_experts=MOE_EXPERTS if moe else 0,
                   num_experts_per_tok=MOE_EXPERTS if moe else 0,
                   moe_intermediate_size=32 if moe else 0,
                   shared_expert_intermediate_size=48 if moe else 0, norm_topk_prob=True)
    arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
    return ModelConfig(architecture=arch, text=t)


class TinyArtifact(TensorArtifact):
    path = "<tiny artifact>"

    def __init__(self, config: ModelConfig, seed: int = 0):
        t = config.text
        r = np.random.default_rng(seed)
        H, V = t.hidden_size, t.vocab_size
        T = {}

        def mat(name, *shape, scale=1.0):
            T[name] = (scale * r.standard_normal(shape) / np.sqrt(shape[-1])).astype(ml_dtypes.bfloat16)

        def vec(name, n, scale=0.1, offset=0.0, dtype=ml_dtypes.bfloat16):
            T[name] = (offset + scale * r.standard_normal(n)).astype(dtype)

        mat("text.embed_tokens.weight", V, H, scale=8.0)
        if t.tie_word_embeddings:
            T["text.lm_head.weight"] = T["text.embed_tokens.weight"]
        else:
            mat("text.lm_head.weight", V, H, scale=4.0)
        vec("text.norm.weight", H)
        nh, nkv, hd = t.num_attention_heads, t.num_key_value_heads, t.head_dim
        for i, kind in enumerate(t.layer_types):
            p = f"text.layers.{i}."
            vec(p + "input_layernorm.weight", H)
            vec(p + "post_attention_layernorm.weight", H)
            if kind == FULL:
                a = p + "self_attn."
                mat(a + "q_proj.weight", 2 * nh * hd, H)
                mat(a + "k_proj.weight", nkv * hd, H)
                mat(a + "v_proj.weight", nkv * hd, H)
                mat(a + "o_proj.weight", H, nh * hd)
                vec(a + "q_norm.weight", hd)
                vec(a + "k_norm.weight", hd)
            else:
                g = p + "linear_attn."
                C, Vd, nv = t.linear_conv_dim, t.linear_value_dim, t.linear_num_value_heads
                mat(g + "in_proj_qkv.weight", C, H)
                mat(g + "in_proj_z.weight", Vd, H)
                mat(g + "in_proj_b.weight", nv, H)
                mat(g + "in_proj_a.weight", nv, H)
                T[g + "conv1d.weight"] = (0.5 * r.standard_normal((C, 1, t.linear_conv_kernel_dim))
                                          ).astype(ml_dtypes.bfloat16)
                vec(g + "dt_bias", nv, scale=0.5, dtype=np.float32)
                vec(g + "A_log", nv, scale=0.5, dtype=np.float32)
                vec(g + "norm.weight", t.linear_value_head_dim, offset=1.0)
                mat(g + "out_proj.weight", H, Vd)
            m = p + "mlp."
            if t.is_moe:
                E, I, Is = t.num_experts, t.moe_intermediate_size, t.shared_expert_intermediate_size
                mat(m + "gate.weight", E, H, scale=ROUTER_SCALE)
                mat(m + "experts.gate_up_proj", E, 2 * I, H)
                mat(m + "experts.down_proj", E, H, I)
                mat(m + "shared_expert.gate_proj.weight", Is, H)
                mat(m + "shared_expert.up_proj.weight", Is, H)
                mat(m + "shared_expert.down_proj.weight", H, Is)
                mat(m + "shared_expert_gate.weight", 1, H)
            else:
                I = t.intermediate_size
                mat(m + "gate_proj.weight", I, H)
                mat(m + "up_proj.weight", I, H)
                mat(m + "down_proj.weight", H, I)
        super().__init__(config, T)


class PackedExpertsArtifact(TinyArtifact):
    """TinyArtifact with its routed experts stored packed, as `convert --quantize` stores them
    (`layout` fp8_block / int8_block / int4_block, `block` its scale block): both backends decode
    the same codes, the CUDA one on its packed-expert paths (decode GEMV, prefill grouped or
    dequantized)."""

    def __init__(self, config: ModelConfig, layout: str, block: tuple, asym: bool = False,
                 seed: int = 0):
        from ninfer.artifact.format import QuantizedTensor
        from ninfer.convert.quantize import encode
        super().__init__(config, seed)
        self._q = {}
        for name in [n for n in self._t if n.endswith(("experts.gate_up_proj",
                                                       "experts.down_proj"))]:
            w = self._t.pop(name).astype(np.float32)
            stored, scale, zero = encode(layout, w, block, asymmetric=asym)
            self._q[name] = QuantizedTensor(layout, w.shape, tuple(block), stored, scale, zero,
                                            None)

    def has(self, name: str) -> bool:
        return name in self._t or name in self._q

    def binding_names(self) -> list:
        return sorted(list(self._t) + list(self._q))

    def is_quantized(self, name: str) -> bool:
        return name in self._q

    def quantized(self, name: str):
        return self._q[name]

    def binding_info(self, name: str) -> dict:
        return {"object": name, "view": None}


def mtp_artifact(kind: str, hidden: int = 64) -> TinyArtifact:
    """The tiny model (dense or moe) with a random MTP head (tensors as mtp_param_shapes names
    them; norm weights near 0, as zero-centred norms have); hidden 128: wide enough for the int8
    draft head (EngineOptions.draft_head)."""
    import dataclasses
    from ninfer.models.qwen3_5.mtp import mtp_param_shapes
    cfg = tiny_config(moe=kind == "moe", hidden=hidden)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, mtp_num_hidden_layers=1))
    art = TinyArtifact(cfg, seed=3)
    r = np.random.default_rng(5)
    for name, shape in mtp_param_shapes(cfg.text).items():
        if len(shape) == 1:
            a = 0.1 * r.standard_normal(shape)
        else:
            a = r.standard_normal(shape) / np.sqrt(shape[-1])
        art._t[name] = a.astype(ml_dtypes.bfloat16)
    return art
