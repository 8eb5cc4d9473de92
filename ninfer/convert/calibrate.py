"""Calibrated quantization (`--calibration FILE`): GPTQ-style error compensation for the
int8 / int4 group layouts, from the input statistics of each projection on a small text.

1. `input_hessians`: run the unquantized model (numpy backend) over the calibration text and sum,
   per quantized projection, H = sum_t x_t x_t^T of its inputs (float64; MoE experts: per expert,
   over the tokens routed to it, the down projection over its SwiGLU activations). The model's
   `ops.linear` / `ops.swiglu` / `ops.moe_experts` are wrapped for the duration of that one run
   (weights are recognised by identity), so the model code itself stays unchanged.
2. `gptq_codes`: quantize a matrix column by column in the group layout of docs/artifact.md
   3.2.1, each column's rounding error pushed onto the not yet quantized columns in proportion to
   H^-1 (Frantar et al., "GPTQ", 2022; no activation reordering, groups in column order). The
   result is an ordinary int4_block / int8_block object: only the codes differ from plain
   rounding, so every reader decodes it as before.

Cost: one numpy forward of the calibration text plus O(rows * cols^2) per matrix: seconds for the
reference models, impractical on CPU for multi-billion-parameter checkpoints.
"""
from __future__ import annotations

import contextlib
import pathlib
import tempfile

import numpy as np

from ..errors import ConvertError

DAMP = 0.01                 # H += DAMP * mean(diag H) * I: GPTQ's damping (H is rank-deficient
                            # when the calibration has fewer tokens than inputs, or for an expert)
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
    from .. import ops
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


def input_hessians(artifact_path, text: str, max_tokens: int) -> dict:
    """{logical weight name: H} from the unquantized artifact run over `text` (its first
    max_tokens tokens)."""
    from ..engine import Engine
    with Engine(artifact_path, backend="numpy", purpose="scoring") as engine:
        ids = np.asarray(engine.tokenize(text)[:max_tokens], np.int32)
        if len(ids) < 2:
            raise ConvertError(f"calibration text has {len(ids)} tokens: need at least 2")
        model = engine._scorer.model
        names, experts = {}, {}
        for i, layer in enumerate(model._layers):
            for p in (layer[1].p, layer[3].p):
                for key, leaf in _LEAF_OF.items():
                    if key in p:
                        names[id(p[key])] = f"text.layers.{i}.{leaf}"
                        if key.startswith("experts_"):
                            experts[names[id(p[key])]] = p[key].shape[0]
        rec = _Hessians(names)
        with _recording(rec):
            engine.score(ids)
    return rec.result(experts)


def hessians_for_checkpoint(src_dir, text: str, max_tokens: int) -> dict:
    """Convert `src_dir` value-preserving into a temporary artifact and calibrate on it."""
    from .convert import convert_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "calibration.ninfer"
        convert_checkpoint(src_dir, path, progress=False)
        return input_hessians(path, text, max_tokens)


def gptq_codes(w: np.ndarray, h: np.ndarray, group: int, *, bits: int, asymmetric: bool):
    """w [n, C] float, h [C, C] -> (codes int [n, C], scale f32 [n, ceil(C/group)], zero uint8
    of the scale's shape or None). Codes and group parameters follow quantize.encode's rules
    (asymmetric int4: range includes 0, zero = rint(-lo / s); symmetric: s = amax / qmax).

    Group parameters are fixed up front from w ("static groups"), each group's range shrunk by
    the factor of CLIP_GRID that least increases the diag(h)-weighted squared error of plain
    rounding; columns are then quantized in decreasing order of diag(h) (GPTQ's act-order), each
    column's error compensated on the remaining ones."""
    W = np.array(w, np.float64)
    n, C = W.shape
    H = np.array(h, np.float64)
    dead = np.diag(H) <= 0
    H[dead, dead] = 1.0                      # an input never seen: nothing to compensate
    H += DAMP * np.mean(np.diag(H)) * np.eye(C)
    qmax = (1 << (bits - 1)) - 1                       # 7 or 127
    low, high = (0, 2 * qmax + 1) if asymmetric else (-qmax - 1 if bits == 4 else -qmax, qmax)
    ngroups = -(-C // group)
    scale = np.empty((n, ngroups), np.float64)
    zero = np.zeros((n, ngroups), np.float64)
    for j in range(ngroups):
        c0, c1 = j * group, min((j + 1) * group, C)
        scale[:, j], zero[:, j] = _group_params(W[:, c0:c1], np.diag(H)[c0:c1], qmax, low, high,
                                                asymmetric)
    perm = np.argsort(-np.diag(H), kind="stable") if ACT_ORDER else np.arange(C)
    try:                                               # inv(H) of the permuted inputs = U^T U
        U = np.linalg.cholesky(np.linalg.inv(H[np.ix_(perm, perm)])).T
    except np.linalg.LinAlgError as exc:
        raise ConvertError(f"calibration: input statistics not positive definite ({exc})") from exc
    Wp = W[:, perm]
    s_of, z_of = scale[:, perm // group], zero[:, perm // group]
    codes = np.empty((n, C), np.int64)
    for i in range(C):
        q = np.clip(np.rint(Wp[:, i] / s_of[:, i]) + z_of[:, i], low, high)
        codes[:, perm[i]] = q
        err = (Wp[:, i] - (q - z_of[:, i]) * s_of[:, i]) / U[i, i]
        Wp[:, i + 1:] -= np.outer(err, U[i, i + 1:])
    return codes, scale.astype(np.float32), (zero.astype(np.uint8) if asymmetric else None)


ACT_ORDER = True
CLIP_GRID = np.linspace(1.0, 0.6, 21)      # range shrink factors searched per group


def _group_params(blk, weight, qmax, low, high, asymmetric):
    """(scale [n] float64 of float32 values, zero [n]) of one group of columns blk [n, g]."""
    best_err = np.full(blk.shape[0], np.inf)
    best_s, best_z = np.ones(blk.shape[0]), np.zeros(blk.shape[0])
    f32 = np.float32                 # scale arithmetic in float32, as quantize.encode does it
    lo0 = np.minimum(blk.min(1), 0.0).astype(f32)
    hi0 = np.maximum(blk.max(1), 0.0).astype(f32)
    for r in CLIP_GRID:
        if asymmetric:
            lo, hi = lo0 * f32(r), hi0 * f32(r)
            s = (hi - lo) / f32(2 * qmax + 1)
        else:
            s = np.maximum(hi0, -lo0) * f32(r) / f32(qmax)
        s = np.where(s > 0, s, f32(1.0)).astype(np.float64)
        z = np.clip(np.rint(-lo / s), low, high) if asymmetric else np.zeros_like(s)
        q = np.clip(np.rint(blk / s[:, None]) + z[:, None], low, high)
        err = (((q - z[:, None]) * s[:, None] - blk) ** 2) @ weight
        better = err < best_err
        best_err[better], best_s[better], best_z[better] = err[better], s[better], z[better]
    return best_s, best_z
