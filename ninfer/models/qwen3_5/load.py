"""Binder: read the logical parameters (docs/internals.md) from an artifact into float32 arrays.

Every tensor is looked up by its logical name, its shape checked against the config, and converted
to float32 once. A missing or mis-shaped binding raises ArtifactError naming the tensor.
"""
from __future__ import annotations

import numpy as np

from ...errors import ArtifactError
from .config import FULL_ATTENTION, TextConfig


class ParamReader:
    """Reads `text.*` logical tensors as float32, checking shapes; shares one float32 copy
    between bindings that view the same stored bytes (a tied lm_head)."""

    def __init__(self, artifact):
        self._artifact = artifact
        self._converted = []          # (stored view, float32 copy) for sharing detection

    def __call__(self, name: str, shape: tuple) -> np.ndarray:
        art = self._artifact
        if hasattr(art, "has") and not art.has(name):
            raise ArtifactError(f"missing binding {name!r} (expected shape {list(shape)})")
        raw = art.tensor(name)
        if tuple(raw.shape) != tuple(shape):
            raise ArtifactError(f"binding {name!r}: shape {list(raw.shape)} != expected {list(shape)}")
        for stored, f32 in self._converted:
            if stored.shape == raw.shape and stored.dtype == raw.dtype and \
                    stored.__array_interface__["data"][0] == raw.__array_interface__["data"][0]:
                return f32
        f32 = np.ascontiguousarray(raw, dtype=np.float32)
        if not np.all(np.isfinite(f32)):
            raise ArtifactError(f"binding {name!r}: contains non-finite values")
        self._converted.append((raw, f32))
        return f32


def read_text_params(artifact, cfg: TextConfig) -> dict:
    """{"embed", "lm_head", "norm", "layers": [per-layer dict]} of float32 arrays."""
    read = ParamReader(artifact)
    H, V = cfg.hidden_size, cfg.vocab_size
    params = {"embed": read("text.embed_tokens.weight", (V, H)),
              "lm_head": read("text.lm_head.weight", (V, H)),
              "norm": read("text.norm.weight", (H,)),
              "layers": []}
    for i, kind in enumerate(cfg.layer_types):
        p = f"text.layers.{i}."
        layer = {"input_norm": read(p + "input_layernorm.weight", (H,)),
                 "post_norm": read(p + "post_attention_layernorm.weight", (H,))}
        layer.update(_attention(read, p + "self_attn.", cfg) if kind == FULL_ATTENTION
                     else _linear_attention(read, p + "linear_attn.", cfg))
        layer.update(_moe(read, p + "mlp.", cfg) if cfg.is_moe else _dense_mlp(read, p + "mlp.", cfg))
        params["layers"].append(layer)
    return params


def _linear_attention(read, p, cfg: TextConfig) -> dict:
    H, nv = cfg.hidden_size, cfg.linear_num_value_heads
    conv, vd = cfg.linear_conv_dim, cfg.linear_value_dim
    return {"in_proj_qkv": read(p + "in_proj_qkv.weight", (conv, H)),
            "in_proj_z": read(p + "in_proj_z.weight", (vd, H)),
            "in_proj_b": read(p + "in_proj_b.weight", (nv, H)),
            "in_proj_a": read(p + "in_proj_a.weight", (nv, H)),
            "conv_w": read(p + "conv1d.weight", (conv, 1, cfg.linear_conv_kernel_dim))[:, 0, :],
            "dt_bias": read(p + "dt_bias", (nv,)),
            "A_log": read(p + "A_log", (nv,)),
            "gdn_norm": read(p + "norm.weight", (cfg.linear_value_head_dim,)),
            "out_proj": read(p + "out_proj.weight", (H, vd))}


def _attention(read, p, cfg: TextConfig) -> dict:
    H, hd = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    d = {"q_proj": read(p + "q_proj.weight", (2 * nq, H)),
         "k_proj": read(p + "k_proj.weight", (nkv, H)),
         "v_proj": read(p + "v_proj.weight", (nkv, H)),
         "o_proj": read(p + "o_proj.weight", (H, nq)),
         "q_norm": read(p + "q_norm.weight", (hd,)),
         "k_norm": read(p + "k_norm.weight", (hd,))}
    if cfg.attention_bias:
        d.update(q_bias=read(p + "q_proj.bias", (2 * nq,)), k_bias=read(p + "k_proj.bias", (nkv,)),
                 v_bias=read(p + "v_proj.bias", (nkv,)), o_bias=read(p + "o_proj.bias", (H,)))
    return d


def _dense_mlp(read, p, cfg: TextConfig) -> dict:
    H, inter = cfg.hidden_size, cfg.intermediate_size
    return {"gate_proj": read(p + "gate_proj.weight", (inter, H)),
            "up_proj": read(p + "up_proj.weight", (inter, H)),
            "down_proj": read(p + "down_proj.weight", (H, inter))}


def _moe(read, p, cfg: TextConfig) -> dict:
    H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    si = cfg.shared_expert_intermediate_size
    return {"router": read(p + "gate.weight", (E, H)),
            "experts_gate_up": read(p + "experts.gate_up_proj", (E, 2 * inter, H)),
            "experts_down": read(p + "experts.down_proj", (E, H, inter)),
            "shared_gate_proj": read(p + "shared_expert.gate_proj.weight", (si, H)),
            "shared_up_proj": read(p + "shared_expert.up_proj.weight", (si, H)),
            "shared_down_proj": read(p + "shared_expert.down_proj.weight", (H, si)),
            "shared_expert_gate": read(p + "shared_expert_gate.weight", (1, H))}
