"""RMS norms of Qwen3.5, computed in float32 over the last axis."""
from __future__ import annotations

import numpy as np

from .elementwise import silu


def _rms_normalise(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(var + np.float32(eps)))


def rmsnorm_zero_centred(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Qwen3.5 RMSNorm: normalise, then scale by (1 + w). The stored weight is centred on zero."""
    return _rms_normalise(x, eps) * (1.0 + weight)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Plain RMSNorm: normalise, then scale by w (Qwen3's; the DFlash drafter's layers)."""
    return _rms_normalise(x, eps) * weight


def rmsnorm_gated(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gated DeltaNet output norm: w * rmsnorm(x) * silu(gate); plain (not zero-centred) weight."""
    return weight * _rms_normalise(x, eps) * silu(gate.astype(np.float32, copy=False))


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (eps inside the root, as FLA and transformers)."""
    x = x.astype(np.float32, copy=False)
    return x * (1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps)))
