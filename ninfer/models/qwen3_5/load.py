"""Binder: read the logical parameters (docs/internals.md) from an artifact into float32 arrays.

Every tensor is looked up by its logical name, its shape checked against the config, and converted
to float32 once. A missing or mis-shaped binding raises ArtifactError naming the tensor.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import ArtifactError
from . import quant
from .config import FULL_ATTENTION, ModelConfig, TextConfig


def model_config(artifact) -> ModelConfig:
    """This family's parse of the artifact's plain manifest config (the container hands it over
    as JSON and knows nothing of Qwen); an ArtifactError names the file."""
    raw = artifact.model_config_json
    _check_config_types(raw, artifact.path)
    try:
        return ModelConfig.from_json(raw)
    except ArtifactError as exc:
        raise ArtifactError(f"{artifact.path}: {exc}") from exc
    except (TypeError, ValueError, AttributeError) as exc:   # wrongly typed config fields
        raise ArtifactError(f"{artifact.path}: manifest model config: malformed ({exc})") from exc


def _check_config_types(config: dict, where: str) -> None:
    """Each stored TextConfig field has its default's JSON type (ModelConfig.from_json does not
    type-check, and a string where an int belongs would surface much later as a TypeError)."""
    text = config.get("text")
    if not isinstance(text, dict):
        raise ArtifactError(f"{where}: manifest model config: 'text' is not an object")
    default = TextConfig()
    for f in dataclasses.fields(TextConfig):
        if f.name not in text:
            continue
        v, d = text[f.name], getattr(default, f.name)
        ok = (isinstance(v, bool) if isinstance(d, bool) else
              (isinstance(v, int) and not isinstance(v, bool)) if isinstance(d, int) else
              isinstance(v, (int, float)) and not isinstance(v, bool) if isinstance(d, float) else
              isinstance(v, str) if isinstance(d, str) else
              isinstance(v, list) if isinstance(d, tuple) else True)
        if not ok:
            raise ArtifactError(f"{where}: manifest model config: text.{f.name} is {v!r}, expected "
                                f"{'a list' if isinstance(d, tuple) else type(d).__name__}")


class ParamReader:
    """Reads `text.*` logical tensors as float32, checking shapes; shares one float32 copy
    between bindings that view the same stored bytes (a tied lm_head)."""

    def __init__(self, artifact):
        self._artifact = artifact
        self._converted = []          # (stored view, float32 copy) for sharing detection
        self._decoded = {}            # quantized: (object, view) -> float32 values

    def __call__(self, name: str, shape: tuple) -> np.ndarray:
        art = self._artifact
        if not art.has(name):
            raise ArtifactError(f"missing binding {name!r} (expected shape {list(shape)})")
        if art.is_quantized(name):          # decoded to float32 once per object + view
            return self._checked(name, shape, quant.dequantized(art, name, self._decoded))
        raw = art.tensor(name)
        if tuple(raw.shape) != tuple(shape):
            raise ArtifactError(f"binding {name!r}: shape {list(raw.shape)} != expected {list(shape)}")
        for stored, f32 in self._converted:
            if stored.shape == raw.shape and stored.dtype == raw.dtype and \
                    stored.__array_interface__["data"][0] == raw.__array_interface__["data"][0]:
                return f32
        f32 = self._checked(name, shape, np.ascontiguousarray(raw, dtype=np.float32))
        self._converted.append((raw, f32))
        return f32

    @staticmethod
    def _checked(name: str, shape: tuple, f32: np.ndarray) -> np.ndarray:
        if tuple(f32.shape) != tuple(shape):
            raise ArtifactError(f"binding {name!r}: shape {list(f32.shape)} != expected {list(shape)}")
        if not np.all(np.isfinite(f32)):
            raise ArtifactError(f"binding {name!r}: contains non-finite values")
        return f32


def text_param_shapes(cfg: TextConfig, *, with_lm_head: bool = True) -> dict:
    """{logical name: shape} of every text parameter the config implies (docs/internals.md's
    table; experts fused). The one copy of that table: the converter checks sources against it."""
    H, V = cfg.hidden_size, cfg.vocab_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nv, dv, K = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    conv = cfg.linear_conv_dim
    s = {"text.embed_tokens.weight": (V, H), "text.norm.weight": (H,)}
    if with_lm_head:
        s["text.lm_head.weight"] = (V, H)
    for i, kind in enumerate(cfg.layer_types):
        p = f"text.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        if kind == FULL_ATTENTION:
            a = p + "self_attn."
            s.update({a + "q_proj.weight": (2 * nh * hd, H), a + "k_proj.weight": (nkv * hd, H),
                      a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd),
                      a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
            if cfg.attention_bias:
                s.update({a + "q_proj.bias": (2 * nh * hd,), a + "k_proj.bias": (nkv * hd,),
                          a + "v_proj.bias": (nkv * hd,), a + "o_proj.bias": (H,)})
        else:
            a = p + "linear_attn."
            s.update({a + "in_proj_qkv.weight": (conv, H), a + "in_proj_z.weight": (nv * dv, H),
                      a + "in_proj_b.weight": (nv, H), a + "in_proj_a.weight": (nv, H),
                      a + "conv1d.weight": (conv, 1, K), a + "dt_bias": (nv,), a + "A_log": (nv,),
                      a + "norm.weight": (dv,), a + "out_proj.weight": (H, nv * dv)})
        s.update(_mlp_shapes(cfg, p + "mlp."))
    return s


def _mlp_shapes(cfg: TextConfig, m: str) -> dict:
    H = cfg.hidden_size
    if not cfg.is_moe:
        I = cfg.intermediate_size
        return {m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H),
                m + "down_proj.weight": (H, I)}
    E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return {m + "gate.weight": (E, H),
            m + "experts.gate_up_proj": (E, 2 * I, H), m + "experts.down_proj": (E, H, I),
            m + "shared_expert.gate_proj.weight": (S, H), m + "shared_expert.up_proj.weight": (S, H),
            m + "shared_expert.down_proj.weight": (H, S), m + "shared_expert_gate.weight": (1, H)}


def read_text_params(artifact, cfg: TextConfig) -> dict:
    """{"embed", "lm_head", "norm", "layers": [per-layer dict]} of float32 arrays."""
    reader, shapes = ParamReader(artifact), text_param_shapes(cfg)

    def read(name: str) -> np.ndarray:
        return reader(name, shapes[name])
    params = {"embed": read("text.embed_tokens.weight"), "lm_head": read("text.lm_head.weight"),
              "norm": read("text.norm.weight"), "layers": []}
    for i, kind in enumerate(cfg.layer_types):
        p = f"text.layers.{i}."
        layer = {"input_norm": read(p + "input_layernorm.weight"),
                 "post_norm": read(p + "post_attention_layernorm.weight")}
        layer.update(_attention(read, p + "self_attn.", cfg) if kind == FULL_ATTENTION
                     else _linear_attention(read, p + "linear_attn."))
        layer.update(_moe(read, p + "mlp.") if cfg.is_moe else _dense_mlp(read, p + "mlp."))
        params["layers"].append(layer)
    return params


def _linear_attention(read, p) -> dict:
    return {"in_proj_qkv": read(p + "in_proj_qkv.weight"),
            "in_proj_z": read(p + "in_proj_z.weight"),
            "in_proj_b": read(p + "in_proj_b.weight"), "in_proj_a": read(p + "in_proj_a.weight"),
            "conv_w": read(p + "conv1d.weight")[:, 0, :],          # depthwise: [C, 1, K] -> [C, K]
            "dt_bias": read(p + "dt_bias"), "A_log": read(p + "A_log"),
            "gdn_norm": read(p + "norm.weight"), "out_proj": read(p + "out_proj.weight")}


def _attention(read, p, cfg: TextConfig) -> dict:
    d = {name: read(p + name + ".weight")
         for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    if cfg.attention_bias:
        d.update({name[0] + "_bias": read(p + name + ".bias")
                  for name in ("q_proj", "k_proj", "v_proj", "o_proj")})
    return d


def _dense_mlp(read, p) -> dict:
    return {name: read(p + name + ".weight") for name in ("gate_proj", "up_proj", "down_proj")}


def _moe(read, p) -> dict:
    return {"router": read(p + "gate.weight"),
            "experts_gate_up": read(p + "experts.gate_up_proj"),
            "experts_down": read(p + "experts.down_proj"),
            "shared_gate_proj": read(p + "shared_expert.gate_proj.weight"),
            "shared_up_proj": read(p + "shared_expert.up_proj.weight"),
            "shared_down_proj": read(p + "shared_expert.down_proj.weight"),
            "shared_expert_gate": read(p + "shared_expert_gate.weight")}
