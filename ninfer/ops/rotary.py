"""Partial rotary embedding with (interleaved) multimodal MRoPE positions, float32.

The rotary part is the first `rotary_dim` channels of each head, rotated rotate-half style:
channel i pairs with channel i + rotary_dim/2 and both use frequency index j = i mod rotary_dim/2.
Each frequency index j takes its position from one of the three position axes (t, h, w):

    interleaved (Qwen3.5):  j % 3 == 1 and j < 3*sec[1] -> h ;  j % 3 == 2 and j < 3*sec[2] -> w ;
                            otherwise -> t                     (t h w t h w ... t t)
    contiguous (Qwen2-VL):  [0, sec[0]) -> t, [sec[0], sec[0]+sec[1]) -> h, the rest -> w
Text tokens have t == h == w, which reduces to plain 1-D RoPE.
"""
from __future__ import annotations

import numpy as np


def mrope_axis_of_frequency(half: int, mrope_section, interleaved: bool) -> np.ndarray:
    """[half] int: which position axis (0 t, 1 h, 2 w) drives each frequency index."""
    j = np.arange(half)
    axis = np.zeros(half, np.int64)
    if interleaved:
        axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    else:
        s0, s1 = mrope_section[0], mrope_section[0] + mrope_section[1]
        axis[s0:s1] = 1
        axis[s1:] = 2
    return axis


def mrope_cos_sin(positions: np.ndarray, rotary_dim: int, theta: float, mrope_section,
                  interleaved: bool = True) -> tuple:
    """positions [3, N] int -> (cos, sin) [N, rotary_dim] float32.

    Frequencies follow transformers' float32 arithmetic (inv_freq, then position * inv_freq) so
    that large positions round the same way as the reference."""
    half = rotary_dim // 2
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32)
                                             / np.float32(rotary_dim)))).astype(np.float32)
    axis = mrope_axis_of_frequency(half, mrope_section, interleaved)
    pos = np.asarray(positions).astype(np.float32)[axis]         # [half, N]: per-frequency position
    freqs = pos.T * inv_freq                                      # [N, half]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [N, heads, head_dim]; cos, sin [N, rotary_dim] -> rotated copy of x."""
    rd = cos.shape[-1]
    half = rd // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x_rot = x[..., :rd]
    rotated = np.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x.astype(np.float32, copy=True)
    out[..., :rd] = x_rot * c + rotated * s
    return out
