"""Source (Hugging Face) tensor names -> logical parameter names, and the text shapes a config implies.

The logical names are docs/internals.md's table "Logical parameter names".
"""
from __future__ import annotations

import re

from ..errors import ConvertError
from ..models.qwen3_5.config import FULL_ATTENTION, TextConfig

# Checked in order: `model.language_model.` and `model.visual.` before the bare `model.`.
PREFIXES = (
    ("model.language_model.", "text."),     # ForConditionalGeneration release layout
    ("model.visual.", "vision."),
    ("model.", "text."),                    # ForCausalLM
    ("lm_head.", "text.lm_head."),
    ("mtp.", "mtp."),
)
# Buffers some exporters save; they are recomputed, never weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
PER_EXPERT = re.compile(
    r"^(?P<base>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_GATE_UP = "gate_up_proj"
FUSED_DOWN = "down_proj"


def logical_name(source: str) -> str | None:
    """The logical name of a source tensor; None for ignored buffers."""
    if source.endswith(IGNORED_SUFFIXES):
        return None
    for src_prefix, dst_prefix in PREFIXES:
        if source.startswith(src_prefix):
            return dst_prefix + source[len(src_prefix):]
    raise ConvertError(f"unexpected tensor {source!r}: not under "
                       f"{', '.join(p for p, _ in PREFIXES)}")


def component(logical: str) -> str:
    return logical.split(".", 1)[0]


def expected_text_shapes(t: TextConfig, *, with_lm_head: bool) -> dict:
    """{logical name: shape} of every text parameter the config implies (experts fused)."""
    H, V = t.hidden_size, t.vocab_size
    nh, nkv, hd = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    nv, dv, K = t.linear_num_value_heads, t.linear_value_head_dim, t.linear_conv_kernel_dim
    conv = t.linear_conv_dim
    s = {"text.embed_tokens.weight": (V, H), "text.norm.weight": (H,)}
    if with_lm_head:
        s["text.lm_head.weight"] = (V, H)
    for i, kind in enumerate(t.layer_types):
        p = f"text.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        if kind == FULL_ATTENTION:
            a = p + "self_attn."
            s.update({a + "q_proj.weight": (2 * nh * hd, H), a + "k_proj.weight": (nkv * hd, H),
                      a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd),
                      a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
            if t.attention_bias:
                s.update({a + "q_proj.bias": (2 * nh * hd,), a + "k_proj.bias": (nkv * hd,),
                          a + "v_proj.bias": (nkv * hd,), a + "o_proj.bias": (H,)})
        else:
            a = p + "linear_attn."
            s.update({a + "in_proj_qkv.weight": (conv, H), a + "in_proj_z.weight": (nv * dv, H),
                      a + "in_proj_b.weight": (nv, H), a + "in_proj_a.weight": (nv, H),
                      a + "conv1d.weight": (conv, 1, K), a + "dt_bias": (nv,), a + "A_log": (nv,),
                      a + "norm.weight": (dv,), a + "out_proj.weight": (H, nv * dv)})
        s.update(mlp_shapes(t, p + "mlp."))
    return s


def mlp_shapes(t: TextConfig, m: str) -> dict:
    H = t.hidden_size
    if not t.is_moe:
        I = t.intermediate_size
        return {m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H),
                m + "down_proj.weight": (H, I)}
    E, I, S = t.num_experts, t.moe_intermediate_size, t.shared_expert_intermediate_size
    return {m + "gate.weight": (E, H),
            m + "experts." + FUSED_GATE_UP: (E, 2 * I, H), m + "experts." + FUSED_DOWN: (E, H, I),
            m + "shared_expert.gate_proj.weight": (S, H), m + "shared_expert.up_proj.weight": (S, H),
            m + "shared_expert.down_proj.weight": (H, S), m + "shared_expert_gate.weight": (1, H)}


def expert_piece_shape(t: TextConfig, proj: str) -> tuple:
    """Shape of one per-expert source tensor."""
    H, I = t.hidden_size, t.moe_intermediate_size
    return (H, I) if proj == "down_proj" else (I, H)


# Operand order of the parameters a module consumes that are not `<module>.weight` / `.bias`.
_PARAM_POSITIONS = {"dt_bias": 0, "A_log": 1, FUSED_GATE_UP: 0, FUSED_DOWN: 1}


def use_site(logical: str) -> tuple[str, int]:
    """(site, weight-operand position) of a text parameter: `<module>.weight` feeds the module at
    position 0 and `.bias` at 1; bare parameters (dt_bias, A_log, fused experts) feed their parent."""
    module, leaf = logical.rsplit(".", 1)
    if leaf == "weight":
        return module, 0
    if leaf == "bias":
        return module, 1
    return module, _PARAM_POSITIONS.get(leaf, 0)
