"""Causal depthwise conv1d with a carried state (the Gated DeltaNet short convolution)."""
from __future__ import annotations

import numpy as np


def causal_conv1d(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple:
    """Depthwise causal convolution over time, continuing from `state`; no activation.

    x      [T, C]       new inputs (pre-activation)
    state  [C, K-1]     the K-1 inputs before x, oldest first (zeros at a sequence start)
    weight [C, K]       tap K-1 multiplies the current input
    returns (y [T, C], new_state [C, K-1])

    y[t, c] = sum_j weight[c, j] * xs[t + j, c], xs = concat(state.T, x): the same sum for a prefill
    of any length and for a single decode step, so the two cannot drift apart.
    """
    T = x.shape[0]
    K = weight.shape[1]
    xs = np.concatenate([state.T.astype(np.float32, copy=False), x], axis=0)   # [K-1+T, C]
    y = xs[0:T] * weight[:, 0]
    for j in range(1, K):
        y += xs[j:j + T] * weight[:, j]
    new_state = np.ascontiguousarray(xs[T:].T) if K > 1 else state.copy()
    return y, new_state
