"""GPTQ maths (Frantar et al., "GPTQ", 2022; act-order with static groups): quantize a matrix
column by column in the layout of docs/artifact.md 3.2.1, each column's rounding error pushed onto
the not yet quantized columns in proportion to H^-1, H = sum_t x_t x_t^T of the matrix's inputs
(calibrate.py measures H; quantize.encode_calibrated stores the result). Pure numpy, no I/O: the
bottom of the converter's imports.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..artifact import format as fmt
from ..errors import ConvertError

FP8 = fmt.DTYPES[fmt.QUANT_LAYOUTS["fp8_block"]]      # float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(FP8).max)              # 448: the largest finite e4m3 value
DAMP = 0.01                 # H += DAMP * mean(diag H) * I: GPTQ's damping (H is rank-deficient
                            # when the calibration has fewer tokens than inputs, or for an expert)


def gptq_codes(w: np.ndarray, h: np.ndarray, group: int, *, bits: int, asymmetric: bool):
    """w [n, C] float, h [C, C] -> (codes int [n, C], scale f32 [n, ceil(C/group)], zero uint8
    of the scale's shape or None). Codes and group parameters follow quantize.encode's rules
    (asymmetric int4: range includes 0, zero = rint(-lo / s); symmetric: s = amax / qmax).

    Group parameters are fixed up front ("static groups"); columns are quantized in decreasing
    order of diag(h) (GPTQ's act-order), each column's error compensated on the remaining ones.
    Candidate parameters: each group's range shrunk by the factor of CLIP_GRID that least
    increases the diag(h)-weighted error of plain rounding, and (JOINT_CLIP) one factor of
    CLIP_GRID for a whole row; every candidate is run through GPTQ and each row keeps the one of
    least output error (w - w') H (w - w')^T. REFIT passes then re-solve each row's scales by
    least squares for its codes and run GPTQ again, a row keeping whichever is better."""
    W = np.array(w, np.float64)
    perm, U, H = _order_and_factor(h)
    grid = _Grid(bits, asymmetric, group)
    cands = [_clipped_params(W, np.diag(H), grid)]
    if JOINT_CLIP:
        cands += [grid.params(W, r) for r in CLIP_GRID]
    scale, zero = (np.concatenate(c) for c in zip(*cands))     # every candidate in one pass
    codes = _gptq_pass(np.tile(W, (len(cands), 1)), perm, U, scale, zero, grid)
    best = None
    for k in range(len(cands)):
        rows = slice(k * len(W), (k + 1) * len(W))
        best = _better(best, (codes[rows], scale[rows], zero[rows]), W, H, grid)
    for _ in range(REFIT):
        codes, scale, zero = best
        scale = _refit_scales(W, H, codes, scale, zero, grid)
        best = _better(best, (_gptq_pass(W, perm, U, scale, zero, grid), scale, zero), W, H, grid)
    codes, scale, zero = best
    return codes, scale.astype(np.float32), (zero.astype(np.uint8) if asymmetric else None)


def gptq_fp8(w: np.ndarray, h: np.ndarray, block: tuple, scale: np.ndarray) -> np.ndarray:
    """w [n, C] float, h [C, C], scale f32 [ceil(n/br), ceil(C/bc)] (the fp8_block scales of
    plain rounding, amax / 448 per [br, bc] block of w) -> codes float8_e4m3fn [n, C]: GPTQ over
    the e4m3 grid with those scales (act-order, as gptq_codes)."""
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
    return codes


ACT_ORDER = True
CLIP_GRID = np.linspace(1.0, 0.6, 21)      # range shrink factors searched per group
JOINT_CLIP = True       # also try each factor for whole rows, judged by GPTQ's own result
REFIT = 2               # least-squares scale refits, each followed by a GPTQ pass


class _Grid:
    """The integer grid of one format: codes in [low, high], groups of `group` columns."""

    def __init__(self, bits: int, asymmetric: bool, group: int):
        self.qmax = (1 << (bits - 1)) - 1                   # 7 or 127
        self.asymmetric, self.group = asymmetric, group
        self.low, self.high = (0, 2 * self.qmax + 1) if asymmetric else \
            (-self.qmax - 1 if bits == 4 else -self.qmax, self.qmax)

    def spans(self, C: int):
        return [(c0, min(c0 + self.group, C)) for c0 in range(0, C, self.group)]

    def params(self, W: np.ndarray, r: float) -> tuple:
        """(scale [n, G] float64 of float32 values, zero [n, G]) of every group's range x r."""
        pairs = [self.group_params(W[:, c0:c1], r) for c0, c1 in self.spans(W.shape[1])]
        return np.stack([p[0] for p in pairs], 1), np.stack([p[1] for p in pairs], 1)

    def group_params(self, blk: np.ndarray, r: float) -> tuple:
        f32 = np.float32                 # scale arithmetic in float32, as quantize.encode does it
        lo = np.minimum(blk.min(1), 0.0).astype(f32) * f32(r)
        hi = np.maximum(blk.max(1), 0.0).astype(f32) * f32(r)
        if self.asymmetric:
            s = (hi - lo) / f32(2 * self.qmax + 1)
        else:
            s = np.maximum(hi, -lo) / f32(self.qmax)
        s = np.where(s > 0, s, f32(1.0)).astype(np.float64)
        z = np.clip(np.rint(-lo / s), self.low, self.high) if self.asymmetric \
            else np.zeros_like(s)
        return s, z

    def expand(self, per_group: np.ndarray, C: int) -> np.ndarray:
        """[n, G] -> [n, C]: each column its group's value."""
        return np.repeat(per_group, self.group, axis=1)[:, :C]

    def decode(self, codes, scale, zero) -> np.ndarray:
        C = codes.shape[1]
        return (codes - self.expand(zero, C)) * self.expand(scale, C)


def _clipped_params(W, weight, grid: _Grid) -> tuple:
    """Per group, the CLIP_GRID factor of least diag(h)-weighted plain-rounding error."""
    n, G = W.shape[0], len(grid.spans(W.shape[1]))
    scale, zero = np.ones((n, G)), np.zeros((n, G))
    for j, (c0, c1) in enumerate(grid.spans(W.shape[1])):
        blk, best_err = W[:, c0:c1], np.full(n, np.inf)
        for r in CLIP_GRID:
            s, z = grid.group_params(blk, r)
            q = np.clip(np.rint(blk / s[:, None]) + z[:, None], grid.low, grid.high)
            err = (((q - z[:, None]) * s[:, None] - blk) ** 2) @ weight[c0:c1]
            better = err < best_err
            best_err[better], scale[better, j], zero[better, j] = err[better], s[better], z[better]
    return scale, zero


def _gptq_pass(W, perm, U, scale, zero, grid: _Grid, block: int = 64) -> np.ndarray:
    """GPTQ codes [n, C] of W for fixed group parameters, columns in the order perm. The error
    of a block of columns reaches the later blocks in one matrix product (GPTQ's lazy batch
    update: the same arithmetic, a memory pass per block instead of per column)."""
    C = W.shape[1]
    Wp = W[:, perm]
    s_of, z_of = scale[:, perm // grid.group], zero[:, perm // grid.group]
    codes = np.empty(W.shape, np.int64)
    for b0 in range(0, C, block):
        b1 = min(b0 + block, C)
        err = np.empty((len(W), b1 - b0))
        for i in range(b0, b1):
            q = np.clip(np.rint(Wp[:, i] / s_of[:, i]) + z_of[:, i], grid.low, grid.high)
            codes[:, perm[i]] = q
            err[:, i - b0] = (Wp[:, i] - (q - z_of[:, i]) * s_of[:, i]) / U[i, i]
            Wp[:, i + 1:b1] -= np.outer(err[:, i - b0], U[i, i + 1:b1])
        Wp[:, b1:] -= err @ U[b0:b1, b1:]
    return codes


def _row_error(W, H, codes, scale, zero, grid: _Grid) -> np.ndarray:
    """(w - w') H (w - w')^T per row: the layer-output error GPTQ minimises."""
    D = W - grid.decode(codes, scale, zero)
    return np.einsum("nc,nc->n", D @ H, D)


def _better(best, cand, W, H, grid: _Grid):
    """Row by row, whichever of best and cand (codes, scale, zero) has less output error."""
    if best is None:
        return cand
    take = _row_error(W, H, *cand, grid) < _row_error(W, H, *best, grid)
    return tuple(np.where(take[:, None], c, b) for c, b in zip(cand, best))


def _refit_scales(W, H, codes, scale, zero, grid: _Grid) -> np.ndarray:
    """Per row, the group scales s minimising (w - sum_g s_g a_g) H (...)^T for the fixed integer
    steps a = codes - zero (a G x G least-squares system per row), rounded to float32; a row whose
    system is singular or gives a non-positive scale keeps its scales."""
    C = W.shape[1]
    spans = grid.spans(C)
    a = codes - grid.expand(zero, C)
    AH = [a[:, c0:c1] @ H[c0:c1] for c0, c1 in spans]                 # G x [n, C]
    M = np.stack([np.stack([np.einsum("nc,nc->n", ah[:, c0:c1], a[:, c0:c1])
                            for c0, c1 in spans], -1) for ah in AH], 1)   # [n, G, G]
    b = np.stack([np.einsum("nc,nc->n", ah, W) for ah in AH], -1)         # [n, G]
    ok = np.abs(np.linalg.det(M)) > 1e-300
    new = scale.copy()
    if ok.any():
        new[ok] = np.linalg.solve(M[ok], b[ok][..., None])[..., 0]
    new = new.astype(np.float32).astype(np.float64)
    bad = ~(np.isfinite(new) & (new > 0)).all(1)
    new[bad] = scale[bad]
    return new


def _order_and_factor(h) -> tuple:
    """(perm, U, H) of statistics h [C, C]: H damped (an input never seen gets 1 on the
    diagonal: nothing to compensate), the column order (decreasing diag with ACT_ORDER) and the
    upper Cholesky factor U of inv(H) in that order (inv(H)[perm][:, perm] = U^T U)."""
    H = np.array(h, np.float64)
    dead = np.diag(H) <= 0
    H[dead, dead] = 1.0
    H += DAMP * np.mean(np.diag(H)) * np.eye(len(H))
    diag = np.diag(H)
    perm = np.argsort(-diag, kind="stable") if ACT_ORDER else np.arange(len(H))
    try:
        U = np.linalg.cholesky(np.linalg.inv(H[np.ix_(perm, perm)])).T
    except np.linalg.LinAlgError as exc:
        raise ConvertError(f"calibration: input statistics not positive definite ({exc})") from exc
    return perm, U, H
