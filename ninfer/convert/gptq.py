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
