"""Calibrated quantization (`--calibration FILE`): GPTQ-style error compensation for the
fp8 / int8 / int4 layouts, from the input statistics of each projection on a small text.

1. `input_hessians`: run the unquantized model (numpy backend) over the calibration text and sum,
   per quantized projection, H = sum_t x_t x_t^T of its inputs (float64; MoE experts: per expert,
   over the tokens routed to it, the down projection over its SwiGLU activations). The model's
   `ops.linear` / `ops.swiglu` / `ops.moe_experts` are wrapped for the duration of each run
   (weights are recognised by identity), so the model code itself stays unchanged. Sequential
   mode (the recipe's default): one forward per layer, layer i's statistics taken with layers < i
   already running their quantized weights (GPTQ's sequential calibration).
2. `gptq.gptq_codes` / `gptq.gptq_fp8` (gptq.py): quantize a matrix column by column in the
   layout of docs/artifact.md 3.2.1, each column's rounding error pushed onto the not yet
   quantized columns in proportion to H^-1. The result is an ordinary quantized object: only the
   codes (and the int group ranges) differ from plain rounding, so every reader decodes it as
   before. `convert.hessians_for_checkpoint` ties the two to a checkpoint.

Cost: one numpy forward of the calibration text per layer plus O(rows * cols^2) per matrix:
seconds to minutes for the reference models, impractical on CPU for multi-billion-parameter
checkpoints.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import ops
from ..engine import Engine
from ..errors import ConvertError

MIN_TOKENS = 16             # an expert that saw fewer calibration tokens is rounded plainly

# numpy model parameter key -> the logical leaf (docs/internals.md) of the weight it holds
_LEAF_OF = {
    "in_proj_qkv": "linear_attn.in_proj_qkv.weight", "in_proj_z": "linear_attn.in_proj_z.weight",
    "out_proj": "linear_attn.out_proj.weight", "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight", "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
    "shared_gate_proj": "mlp.shared_expert.gate_proj.weight",
    "shared_up_proj": "mlp.shared_expert.up_proj.weight",
    "shared_down_proj": "mlp.shared_expert.down_proj.weight",
    "experts_gate_up": "mlp.experts.gate_up_proj", "experts_down": "mlp.experts.down_proj"}


class _Hessians:
    """Sums x x^T per weight (by identity) and, for experts, per expert; counts tokens."""

    def __init__(self, names_by_id: dict):
        self.names = names_by_id
        self.sums: dict = {}            # (logical, expert or None) -> [H float64, tokens]

    def add(self, weight, x, expert=None) -> None:
        name = self.names.get(id(weight))
        if name is None or len(x) == 0:
            return
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        entry = self.sums.setdefault((name, expert), [0.0, 0])
        entry[0] = entry[0] + x.T @ x
        entry[1] += len(x)

    def result(self, num_experts: dict) -> dict:
        """{logical: H [C, C] or (for experts) list of H-or-None per expert}."""
        out = {}
        for (name, expert), (h, n) in self.sums.items():
            if expert is None:
                out[name] = h
            else:
                out.setdefault(name, [None] * num_experts[name])[expert] = \
                    h if n >= MIN_TOKENS else None
        return out


@contextlib.contextmanager
def _recording(rec: _Hessians):
    """Wrap the three ops the numpy layers call for their projections."""
    linear, swiglu, moe_experts = ops.linear, ops.swiglu, ops.moe_experts

    def rec_linear(x, weight, bias=None):
        rec.add(weight, x)
        return linear(x, weight, bias)

    def rec_swiglu(x, gate_w, up_w, down_w):
        rec.add(gate_w, x)
        rec.add(up_w, x)
        act = ops.silu(linear(x, gate_w)) * linear(x, up_w)
        rec.add(down_w, act)
        return linear(act, down_w)

    def rec_moe(x, expert_ids, weights, gate_up, down):
        inter = down.shape[2]
        for e in np.unique(expert_ids):
            tok = np.nonzero((expert_ids == e).any(axis=-1))[0]
            gu = x[tok] @ gate_up[e].T
            rec.add(gate_up, x[tok], int(e))
            rec.add(down, ops.silu(gu[:, :inter]) * gu[:, inter:], int(e))
        return moe_experts(x, expert_ids, weights, gate_up, down)

    ops.linear, ops.swiglu, ops.moe_experts = rec_linear, rec_swiglu, rec_moe
    try:
        yield
    finally:
        ops.linear, ops.swiglu, ops.moe_experts = linear, swiglu, moe_experts


def _forward(engine, ids) -> None:
    """Run the layers over ids (the projections' inputs are all that is recorded): the
    embedding path stops at the final norm, sparing the vocabulary-wide logits of scoring."""
    engine.embed(ids)


def input_hessians(artifact_path, text: str, max_tokens: int, quantize=None) -> dict:
    """{logical weight name: H} from the unquantized artifact run over `text` (its first
    max_tokens tokens). With `quantize(name, w, h) -> w'` (sequential mode) the layers are
    calibrated one at a time: layer i's statistics come from a forward in which layers < i
    already run their quantized weights, and layer i's weights are then replaced by `quantize`'s
    (one forward per layer)."""
    with Engine(artifact_path, backend="numpy", purpose="scoring",     # embed checks the length
                max_context=max(2, max_tokens)) as engine:
        ids = np.asarray(engine.tokenize(text)[:max_tokens], np.int32)
        if len(ids) < 2:
            raise ConvertError(f"calibration text has {len(ids)} tokens: need at least 2")
        layers = []                 # per layer: [(param dict, key, logical name)]
        experts = {}
        for i, layer in enumerate(engine.model._layers):
            mine = [(p, key, f"text.layers.{i}.{leaf}") for p in (layer[1].p, layer[3].p)
                    for key, leaf in _LEAF_OF.items() if key in p]
            experts.update({name: p[key].shape[0] for p, key, name in mine
                            if key.startswith("experts_")})
            layers.append(mine)
        if quantize is None:
            rec = _Hessians({id(p[key]): name for mine in layers for p, key, name in mine})
            with _recording(rec):
                _forward(engine, ids)
            return rec.result(experts)
        out = {}
        for mine in layers:
            rec = _Hessians({id(p[key]): name for p, key, name in mine})
            with _recording(rec):
                _forward(engine, ids)
            hess = rec.result(experts)
            for p, key, name in mine:
                if name in hess:
                    p[key][...] = quantize(name, p[key], hess[name])    # in place: same id
            out.update(hess)
    return out
