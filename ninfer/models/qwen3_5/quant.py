"""Quantized weights on the numpy backend: decode each quantized binding to float32 at load.

The encodings are docs/artifact.md 3.2.1; this is their reference decoder:

    value[..., r, c] = (q[..., r, c] - zero[..., r // br, c // bc]) * scale[..., r // br, c // bc]

q: fp8_block float8_e4m3fn, int8_block int8, int4_block the 4-bit unsigned nibble c of byte
c // 2 (even c: bits 0-3, odd c: bits 4-7); zero: the zero object (int4 asymmetric), 8 for a
symmetric int4 parent, 0 otherwise. The CUDA backend runs the packed codes themselves
(cuda/qweights.py, kernels/quant_gemv.py).
"""
from __future__ import annotations

import numpy as np

from ...errors import ArtifactError

# Elements decoded per step: bounds the float32 temporaries of a large parent (an embedding).
_STEP_ELEMENTS = 1 << 24


def dequantize(qt, name: str = "") -> np.ndarray:
    """float32 values of a QuantizedTensor (`Artifact.quantized(name)`), its view applied."""
    *lead, rows, cols = qt.shape
    br, bc = qt.block
    data = qt.data.reshape(-1, *qt.data.shape[-2:])           # [M, R, C'] over leading dims
    scale = np.asarray(qt.scale, np.float32).reshape(-1, *qt.scale.shape[-2:])
    zero = None if qt.zero is None else qt.zero.reshape(-1, *qt.zero.shape[-2:])
    if zero is not None and int(zero.max(initial=0)) > 15:
        raise ArtifactError(f"binding {name!r}: int4 zero point {int(zero.max())} > 15")
    out = np.empty((data.shape[0], rows, cols), np.float32)
    band = max(br, (_STEP_ELEMENTS // max(cols, 1)) // br * br)     # whole row blocks per step
    for m in range(data.shape[0]):
        for r0 in range(0, rows, band):
            r1 = min(r0 + band, rows)
            q = _codes(qt.layout, data[m, r0:r1], cols)
            s = _expand(scale[m, r0 // br: -(-r1 // br)], br, bc, r1 - r0, cols)
            if zero is not None:
                q -= _expand(zero[m, r0 // br: -(-r1 // br)], br, bc, r1 - r0, cols)
            elif qt.layout == "int4_block":
                q -= 8.0
            out[m, r0:r1] = q * s
    out = out.reshape(*lead, rows, cols)
    if not np.all(np.isfinite(out)):
        raise ArtifactError(f"binding {name!r}: dequantized values are not all finite")
    return _apply_view(out, qt.view)


def dequantized(artifact, name: str, cache: dict) -> np.ndarray:
    """The float32 values of quantized binding `name`, decoded once per (object, view) in
    `cache` (a tied lm_head quantized with its embedding shares one copy)."""
    info = artifact.binding_info(name)
    key = (info["object"], repr(info["view"]))
    if key not in cache:
        cache[key] = dequantize(artifact.quantized(name), name)
    return cache[key]


def _codes(layout: str, stored: np.ndarray, cols: int) -> np.ndarray:
    """float32 codes q of one row band."""
    if layout == "int4_block":
        low, high = stored & 0x0F, stored >> 4
        q = np.stack([low, high], axis=-1).reshape(stored.shape[0], -1)[:, :cols]
        return q.astype(np.float32)
    if layout in ("fp8_block", "int8_block"):
        return stored.astype(np.float32)
    raise ArtifactError(f"unknown quantized layout {layout!r}")


def _expand(per_block: np.ndarray, br: int, bc: int, rows: int, cols: int) -> np.ndarray:
    """Blocks [ceil(rows/br), ceil(cols/bc)] -> one entry per element [rows, cols]."""
    e = np.repeat(np.repeat(per_block.astype(np.float32), br, axis=0), bc, axis=1)
    return e[:rows, :cols]


def _apply_view(arr: np.ndarray, view: dict | None) -> np.ndarray:
    if view is None:
        return arr
    if view["kind"] == "slice":
        index = [slice(None)] * arr.ndim
        index[view["axis"]] = slice(view["start"], view["stop"])
        return np.ascontiguousarray(arr[tuple(index)])
    return arr.reshape(-1)[view["start"]:view["stop"]].reshape(view["shape"]).copy()




def weight_formats(artifact) -> dict:
    """{binding: (layout, activation)} of every quantized binding with a use: what a backend
    must run. The activation permission is the intersection over the binding's uses."""
    order = {"A16Only": 0, "AllowA8": 1, "AllowA4": 2}
    formats = {}
    for use in artifact.manifest["uses"]:
        b = use["binding"]
        if not artifact.is_quantized(b):
            continue
        layout = artifact.quantized(b).layout
        prev = formats.get(b, (layout, use["activation"]))[1]
        act = min(prev, use["activation"], key=order.__getitem__)
        formats[b] = (layout, act)
    return formats
