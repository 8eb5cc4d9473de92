"""Qwen3.5 configuration: parse a Hugging Face `config.json` (any accepted layout) into plain data.

Accepted architectures (the model code is one; these differ only in layout and MoE):
  Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM                  text config at the top level
  Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
                                                            `text_config` + `vision_config`
Defaults follow transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from ...errors import ArtifactError

ARCHITECTURES = {
    "Qwen3_5ForCausalLM": (False, False),                 # (is_moe, is_conditional_generation)
    "Qwen3_5MoeForCausalLM": (True, False),
    "Qwen3_5ForConditionalGeneration": (False, True),
    "Qwen3_5MoeForConditionalGeneration": (True, True),
}

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True, slots=True)
class TextConfig:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    # rotary
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple = (11, 11, 10)
    mrope_interleaved: bool = True
    # Gated DeltaNet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple = ()
    # MoE (is_moe False -> dense SwiGLU with intermediate_size)
    is_moe: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # MTP
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_ids(self) -> list:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_layer_ids(self) -> list:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def linear_key_dim(self) -> int:      # total q (= k) width of a GDN layer
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:    # total v (= z, output) width of a GDN layer
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:     # channels of the causal conv (q, k, v concatenated)
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    text: TextConfig
    vision: Optional[dict] = None            # raw vision_config; carried, not executed yet
    special_token_ids: dict = field(default_factory=dict)   # image_token_id, vision_start_token_id, ...
    dflash: Optional["DFlashConfig"] = None  # the DFlash drafter's, when the artifact carries one

    @property
    def is_moe(self) -> bool:
        return self.text.is_moe

    def to_json(self) -> dict:
        d = {"architecture": self.architecture, "text": asdict(self.text),
             "vision": self.vision, "special_token_ids": dict(self.special_token_ids)}
        d["text"]["mrope_section"] = list(self.text.mrope_section)
        d["text"]["layer_types"] = list(self.text.layer_types)
        d["text"]["eos_token_id"] = list(self.text.eos_token_id)
        if self.dflash is not None:         # (absent otherwise: older readers see no new key)
            d["dflash"] = self.dflash.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        """Inverse of to_json (the form stored in an artifact manifest)."""
        try:
            t = dict(d["text"])
            for k in ("mrope_section", "layer_types", "eos_token_id"):
                t[k] = tuple(t.get(k, ()))
            text = TextConfig(**t)
            dflash = d.get("dflash")
            cfg = cls(architecture=d["architecture"], text=text, vision=d.get("vision"),
                      special_token_ids=dict(d.get("special_token_ids", {})),
                      dflash=None if dflash is None else DFlashConfig.from_json(dflash))
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"manifest model config: malformed ({exc})") from exc
        _validate(cfg)
        return cfg


def parse_hf_config(hf: dict) -> ModelConfig:
    """Parse a Hugging Face config.json dict. Raises ArtifactError for unknown architectures or
    inconsistent geometry."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ArtifactError(
            f"config.json: unsupported architecture {archs or '(none)'}; "
            f"expected one of {sorted(ARCHITECTURES)}")
    is_moe, is_cond = ARCHITECTURES[arch]
    text_hf = dict(hf.get("text_config") or hf) if is_cond else dict(hf)
    vision = hf.get("vision_config") if is_cond else None
    special = {k: hf[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id") if k in hf}

    defaults = TextConfig()
    get = lambda k, dflt=None: text_hf.get(k, getattr(defaults, k) if dflt is None else dflt)  # noqa: E731

    def flag(key, default):
        value = text_hf.get(key, hf.get(key, default))
        if not isinstance(value, bool):
            raise ArtifactError(f"config.json: {key} must be true or false, got {value!r}")
        return value

    rope = dict(text_hf.get("rope_parameters") or text_hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        # yarn / linear / dynamic scaling change the frequencies; the kernels run plain RoPE
        raise ArtifactError(f"config.json: rope_parameters.rope_type "
                            f"{rope.get('rope_type', rope.get('type'))!r} is not supported "
                            "(only 'default' RoPE)")
    rope_theta = rope.get("rope_theta", text_hf.get("rope_theta", defaults.rope_theta))
    partial = rope.get("partial_rotary_factor", text_hf.get("partial_rotary_factor", 0.25))
    n_layers = int(get("num_hidden_layers"))
    head_dim = text_hf.get("head_dim") or defaults.head_dim
    eos = text_hf.get("eos_token_id", hf.get("eos_token_id"))
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    moe = _moe_fields(text_hf, flag) if is_moe else {}
    text = TextConfig(
        vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")), num_hidden_layers=n_layers,
        num_attention_heads=int(get("num_attention_heads")),
        num_key_value_heads=int(get("num_key_value_heads")),
        head_dim=int(head_dim), rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=flag("tie_word_embeddings", False),
        attention_bias=flag("attention_bias", False), hidden_act=str(get("hidden_act")),
        max_position_embeddings=int(get("max_position_embeddings")),
        rope_theta=float(rope_theta), partial_rotary_factor=float(partial),
        mrope_section=_mrope_section(rope.get("mrope_section", (11, 11, 10))),
        # transformers' Qwen3.5 always interleaves (it ignores mrope_interleaved): so do we
        mrope_interleaved=True,
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim")),
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        linear_num_key_heads=int(get("linear_num_key_heads")),
        linear_num_value_heads=int(get("linear_num_value_heads")),
        layer_types=_layer_types(text_hf, n_layers),
        mtp_num_hidden_layers=int(text_hf.get("mtp_num_hidden_layers", 0)),
        eos_token_id=eos, **moe)
    cfg = ModelConfig(architecture=arch, text=text, vision=vision, special_token_ids=special)
    _validate(cfg)
    return cfg


def _mrope_section(value) -> tuple:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ArtifactError(f"config.json: rope_parameters.mrope_section must be a list of "
                            f"integers, got {value!r}")
    return tuple(value)


def _layer_types(text_hf: dict, n_layers: int) -> tuple:
    """`layer_types` when given, else every `full_attention_interval`-th layer is full attention."""
    layer_types = text_hf.get("layer_types")
    if layer_types is None:
        interval = int(text_hf.get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                       for i in range(n_layers)]
    return tuple(layer_types)


def _moe_fields(text_hf: dict, flag) -> dict:
    """TextConfig fields of a sparse-MoE checkpoint (defaults: transformers Qwen3_5MoeTextConfig)."""
    return dict(is_moe=True, num_experts=int(text_hf.get("num_experts", 256)),
                num_experts_per_tok=int(text_hf.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(text_hf.get("moe_intermediate_size", 512)),
                shared_expert_intermediate_size=int(
                    text_hf.get("shared_expert_intermediate_size", 512)),
                norm_topk_prob=flag("norm_topk_prob", True))


def _validate(cfg: ModelConfig) -> None:
    t = cfg.text

    def bad(rule):
        raise ArtifactError(f"model config: {rule}")

    if cfg.architecture not in ARCHITECTURES:
        bad(f"unsupported architecture {cfg.architecture!r}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings",
                 "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads"):
        if getattr(t, name) < 1:
            bad(f"{name} must be >= 1, got {getattr(t, name)}")
    if not t.rms_norm_eps > 0:
        bad(f"rms_norm_eps must be > 0, got {t.rms_norm_eps}")
    if not t.rope_theta > 0:
        bad(f"rope_theta must be > 0, got {t.rope_theta}")
    if not t.is_moe and t.intermediate_size < 1:
        bad(f"intermediate_size must be >= 1, got {t.intermediate_size}")
    if len(t.layer_types) != t.num_hidden_layers:
        bad(f"layer_types has {len(t.layer_types)} entries for {t.num_hidden_layers} layers")
    unknown = set(t.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
    if unknown:
        bad(f"unknown layer types {sorted(unknown)}")
    if t.num_attention_heads % max(t.num_key_value_heads, 1):
        bad(f"num_attention_heads {t.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {t.num_key_value_heads}")
    if t.linear_num_value_heads % max(t.linear_num_key_heads, 1):
        bad(f"linear_num_value_heads {t.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {t.linear_num_key_heads}")
    if not 0 < t.partial_rotary_factor <= 1:
        bad(f"partial_rotary_factor must be in (0, 1], got {t.partial_rotary_factor}")
    if t.rotary_dim % 2 or t.rotary_dim > t.head_dim:
        bad(f"rotary dim {t.rotary_dim} must be even and <= head_dim {t.head_dim}")
    if len(t.mrope_section) != 3 or any(s < 0 for s in t.mrope_section):
        bad(f"mrope_section {list(t.mrope_section)} must be 3 non-negative section sizes (t, h, w)")
    # interleaved sections (Qwen3.5) index frequencies j % 3 == 1 / 2 below 3*sec, clipped at
    # rotary_dim/2: transformers slices the same way, so any sizes run (transformers' default
    # [11, 11, 10] with a small head_dim included). Contiguous sections (Qwen2-VL style) are split
    # by size, which needs them to cover rotary_dim/2 exactly.
    if not t.mrope_interleaved and sum(t.mrope_section) * 2 != t.rotary_dim \
            and FULL_ATTENTION in t.layer_types:
        bad(f"mrope_section {list(t.mrope_section)} sums to {sum(t.mrope_section)}, expected "
            f"rotary_dim/2 = {t.rotary_dim // 2} (contiguous sections, mrope_interleaved false)")
    if t.is_moe and not 0 < t.num_experts_per_tok <= t.num_experts:
        bad(f"num_experts_per_tok {t.num_experts_per_tok} out of range for {t.num_experts} experts")
    if t.hidden_act != "silu":
        bad(f"hidden_act {t.hidden_act!r} unsupported (Qwen3.5 uses silu)")
    if cfg.dflash is not None:
        cfg.dflash.validate(t)


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """A DFlash block-diffusion drafter's geometry (dflash.py; docs/artifact.md section 8): a few
    Qwen3-style decoder layers of the target's hidden size over the features of the target's
    layers `target_layer_ids`, drafting `block_size - 1` tokens in one pass."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: tuple
    block_size: int
    mask_token_id: int

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "DFlashConfig":
        d = dict(d)
        d["target_layer_ids"] = tuple(d.get("target_layer_ids", ()))
        return cls(**d)

    def validate(self, text: TextConfig) -> None:
        """ArtifactError unless this drafter fits the target `text`."""
        def bad(rule):
            raise ArtifactError(f"DFlash drafter config: {rule}")
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size != text.hidden_size:
            bad(f"hidden_size {self.hidden_size} != the target's {text.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            bad(f"head_dim {self.head_dim} must be even (rotary)")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            bad("rms_norm_eps and rope_theta must be > 0")
        ids = self.target_layer_ids
        if not ids or any(not 0 <= i < text.num_hidden_layers for i in ids) \
                or len(set(ids)) != len(ids):
            bad(f"target_layer_ids {list(ids)} must be distinct layers of the target's "
                f"{text.num_hidden_layers}")
        if self.block_size < 2:
            bad(f"block_size {self.block_size} must be >= 2 (the anchor and a draft)")
        if not 0 <= self.mask_token_id < text.vocab_size:
            bad(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {text.vocab_size})")


def parse_dflash_config(hf: dict, text: TextConfig) -> DFlashConfig:
    """A DFlash drafter's Hugging Face config.json (z-lab's layout: Qwen3 geometry at the top
    level, `dflash_config` with target_layer_ids, block_size, mask_token_id; the latter two may
    sit at the top level) -> DFlashConfig, validated against the target. ArtifactError for a
    drafter this engine does not run (DFlash2's extra modules, RoPE scaling, biases)."""
    extra = dict(hf.get("dflash_config") or {})

    def get(key, default=None):
        value = extra.get(key, hf.get(key, default))
        if value is None:
            raise ArtifactError(f"DFlash drafter config.json: {key} is missing")
        return value
    for key in ("conv_kernel_size", "selector_rank"):       # DFlash2's modules
        if extra.get(key, hf.get(key)) is not None:
            raise ArtifactError(f"DFlash drafter config.json: {key} (DFlash2) is not supported")
    if hf.get("attention_bias") or (hf.get("rope_scaling") or {}).get("rope_type",
                                                                       "default") != "default":
        raise ArtifactError("DFlash drafter config.json: attention biases and RoPE scaling are "
                            "not supported")
    if str(hf.get("hidden_act", "silu")) != "silu":
        raise ArtifactError(f"DFlash drafter config.json: hidden_act {hf['hidden_act']!r} unsupported")
    heads = int(get("num_attention_heads"))
    cfg = DFlashConfig(
        hidden_size=int(get("hidden_size")), num_hidden_layers=int(get("num_hidden_layers")),
        num_attention_heads=heads, num_key_value_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or int(get("hidden_size")) // heads),
        intermediate_size=int(get("intermediate_size")),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(get("rope_theta", 10000.0)),
        target_layer_ids=tuple(int(i) for i in get("target_layer_ids")),
        block_size=int(get("block_size", 16)), mask_token_id=int(get("mask_token_id")))
    cfg.validate(text)
    return cfg
