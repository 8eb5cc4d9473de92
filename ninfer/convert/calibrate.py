"""Calibrated quantization (`--calibration FILE`): GPTQ-style error compensation for the
fp8 / int8 / int4 layouts, from the input statistics of each projection on a small text.

1. `input_hessians`: run the unquantized model (numpy backend) over the calibration text and sum,
   per quantized projection, H = sum_t x_t x_t^T of its inputs (float64; MoE experts: per expert,
   over the tokens routed to it, the down projection over its SwiGLU activations). The model's
   `ops.linear` / `ops.swiglu` / `ops.moe_experts` are wrapped for the duration of each run
   (weights are recognised by identity), so the model code itself stays unchanged. Sequential
   mode (the recipe's default): one forward per layer, layer i's statistics taken with layers < i
   already running their quantized weights (GPTQ's sequential calibration).
2. `gptq_codes` / `gptq_fp8`: quantize a matrix column by column in the layout of
   docs/artifact.md 3.2.1, each column's rounding error pushed onto the not yet quantized columns
   in proportion to H^-1 (Frantar et al., "GPTQ", 2022; act-order with static groups). The
   result is an ordinary quantized object: only the codes (and the int group ranges) differ from
   plain rounding, so every reader decodes it as before.

Cost: one numpy forward of the calibration text per layer plus O(rows * cols^2) per matrix:
seconds to minutes for the reference models, impractical on CPU for multi-billion-parameter
checkpoints.
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


def input_hessians(artifact_path, text: str, max_tokens: int, quantize=None) -> dict:
    """{logical weight name: H} from the unquantized artifact run over `text` (its first
    max_tokens tokens). With `quantize(name, w, h) -> w'` (sequential mode) the layers are
    calibrated one at a time: layer i's statistics come from a forward in which layers < i
    already run their quantized weights, and layer i's weights are then replaced by `quantize`'s
    (one forward per layer)."""
    from ..engine import Engine
    with Engine(artifact_path, backend="numpy", purpose="scoring") as engine:
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
                engine.score(ids)
            return rec.result(experts)
        out = {}
        for mine in layers:
            rec = _Hessians({id(p[key]): name for p, key, name in mine})
            with _recording(rec):
                engine.score(ids)
            hess = rec.result(experts)
            for p, key, name in mine:
                if name in hess:
                    p[key][...] = quantize(name, p[key], hess[name])    # in place: same id
            out.update(hess)
    return out


def hessians_for_checkpoint(src_dir, text: str, max_tokens: int, quantize=None) -> dict:
    """Convert `src_dir` value-preserving into a temporary artifact and calibrate on it."""
    from .convert import convert_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "calibration.ninfer"
        convert_checkpoint(src_dir, path, progress=False)
        return input_hessians(path, text, max_tokens, quantize)


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
    perm, U, diag = _order_and_factor(h)
    qmax = (1 << (bits - 1)) - 1                       # 7 or 127
    low, high = (0, 2 * qmax + 1) if asymmetric else (-qmax - 1 if bits == 4 else -qmax, qmax)
    ngroups = -(-C // group)
    scale = np.empty((n, ngroups), np.float64)
    zero = np.zeros((n, ngroups), np.float64)
    for j in range(ngroups):
        c0, c1 = j * group, min((j + 1) * group, C)
        scale[:, j], zero[:, j] = _group_params(W[:, c0:c1], diag[c0:c1], qmax, low, high,
                                                asymmetric)
    Wp = W[:, perm]
    s_of, z_of = scale[:, perm // group], zero[:, perm // group]
    codes = np.empty((n, C), np.int64)
    for i in range(C):
        q = np.clip(np.rint(Wp[:, i] / s_of[:, i]) + z_of[:, i], low, high)
        codes[:, perm[i]] = q
        err = (Wp[:, i] - (q - z_of[:, i]) * s_of[:, i]) / U[i, i]
        Wp[:, i + 1:] -= np.outer(err, U[i, i + 1:])
    return codes, scale.astype(np.float32), (zero.astype(np.uint8) if asymmetric else None)


def gptq_fp8(w: np.ndarray, h: np.ndarray, block: tuple):
    """w [n, C] float, h [C, C] -> (codes float8_e4m3fn [n, C], scale f32 [ceil(n/br),
    ceil(C/bc)]) in the fp8_block layout: the block scales of quantize.encode (amax / 448 over
    each [br, bc] block of w), then GPTQ over the e4m3 grid (act-order, as gptq_codes)."""
    from .quantize import FP8, FP8_MAX, encode
    _, scale, _ = encode("fp8_block", np.asarray(w, np.float32)[None], block)
    scale = scale[0]
    br, bc = block
    W = np.array(w, np.float64)
    n, C = W.shape
    perm, U, _ = _order_and_factor(h)
    s_rows = np.repeat(scale.astype(np.float64), br, axis=0)[:n]          # [n, nbc]
    Wp = W[:, perm]
    codes = np.empty((n, C), FP8)
    for i in range(C):
        s = s_rows[:, perm[i] // bc]
        q = np.clip(Wp[:, i] / s, -FP8_MAX, FP8_MAX).astype(np.float32).astype(FP8)
        codes[:, perm[i]] = q
        err = (Wp[:, i] - q.astype(np.float64) * s) / U[i, i]
        Wp[:, i + 1:] -= np.outer(err, U[i, i + 1:])
    return codes, scale


ACT_ORDER = True
CLIP_GRID = np.linspace(1.0, 0.6, 21)      # range shrink factors searched per group


def _order_and_factor(h) -> tuple:
    """(perm, U, diag) of statistics h [C, C]: damped (an input never seen gets 1 on the
    diagonal: nothing to compensate), the column order (decreasing diag with ACT_ORDER) and the
    upper Cholesky factor U of inv(H) in that order (inv(H)[perm][:, perm] = U^T U)."""
    H = np.array(h, np.float64)
    dead = np.diag(H) <= 0
    H[dead, dead] = 1.0
    H += DAMP * np.mean(np.diag(H)) * np.eye(len(H))
    diag = np.diag(H).copy()
    perm = np.argsort(-diag, kind="stable") if ACT_ORDER else np.arange(len(H))
    try:
        U = np.linalg.cholesky(np.linalg.inv(H[np.ix_(perm, perm)])).T
    except np.linalg.LinAlgError as exc:
        raise ConvertError(f"calibration: input statistics not positive definite ({exc})") from exc
    return perm, U, diag


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
