"""Activations and the dense projection, float32."""
from __future__ import annotations

import numpy as np


def sigmoid(x: np.ndarray) -> np.ndarray:
    # 1 / (1 + exp(-x)) is accurate for every x; for x < -88 exp overflows to inf in float32 and
    # the result is the correct 0, so only the warning needs silencing.
    with np.errstate(over="ignore"):
        e = np.exp(-x)
    e += 1
    return np.reciprocal(e, out=e)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), stable for any x (torch's threshold=20 shortcut differs by < 3e-9)."""
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype, copy=False)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [..., in] @ weight[out, in].T (HF Linear convention) -> [..., out]."""
    y = x @ weight.T
    return y if bias is None else y + bias


def swiglu(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray) -> np.ndarray:
    """down(silu(gate(x)) * up(x)); weights in [out, in]."""
    return linear(silu(linear(x, gate_w)) * linear(x, up_w), down_w)
