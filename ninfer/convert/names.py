"""Source (Hugging Face) tensor names -> logical parameter names, and the text shapes a config implies.

The logical names are docs/internals.md's table "Logical parameter names".
"""
from __future__ import annotations

import re

from ..errors import ConvertError
from ..models.qwen3_5.config import TextConfig
from ..models.qwen3_5.load import text_param_shapes

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
    """{logical name: shape} of every text parameter the config implies (experts fused): the
    Model's own table, so converter and binder cannot disagree."""
    return text_param_shapes(t, with_lm_head=with_lm_head)


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
