"""Sparse MoE: softmax top-k routing and SwiGLU experts from fused weights, float32.

Tie rule: experts with equal router probability are ranked by lower expert index first (a stable
sort). torch.topk on CPU breaks ties in an unspecified order, so exact ties are the one place where
the choice may differ from transformers; with real-valued router logits they do not occur.
"""
from __future__ import annotations

import numpy as np

from .elementwise import silu


def route_topk(router_logits: np.ndarray, top_k: int, normalize: bool = True) -> tuple:
    """router_logits [N, E] -> (weights [N, top_k] float32, expert_ids [N, top_k] int64),
    best first. Softmax over all experts in float32; when `normalize` the chosen k weights are
    rescaled to sum to 1 (norm_topk_prob)."""
    x = router_logits.astype(np.float32, copy=False)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(np.float32), ids


def moe_experts(x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray,
                gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """sum_k weights[:, k] * expert_{ids[:, k]}(x), expert_e(x) = down_e(silu(gate_e x) * up_e x).

    x [N, H]; gate_up [E, 2I, H] (gate rows [0, I), up rows [I, 2I)); down [E, H, I]."""
    inter = down.shape[2]
    out = np.zeros_like(x, dtype=np.float32)
    for e in np.unique(expert_ids):
        tok, slot = np.nonzero(expert_ids == e)                  # a token picks an expert at most once
        gu = x[tok] @ gate_up[e].T
        y = (silu(gu[:, :inter]) * gu[:, inter:]) @ down[e].T
        out[tok] += y * weights[tok, slot][:, None]
    return out
