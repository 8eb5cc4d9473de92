"""Quantized KV pages (EngineOptions.kv_dtype "fp8" / "int8"), numpy backend.

One layer's keys (or values) are stored as codes [num_pages, page_size, kv_heads, head_dim] with
one float32 scale per token and kv head, scale [num_pages, page_size, kv_heads]:

    value[p, t, h, d] = code[p, t, h, d] * scale[p, t, h]
    fp8:  code float8_e4m3fn = e4m3(value / scale) (round to nearest even), scale = amax / 448
    int8: code int8 = rint(value / scale) in [-127, 127],                  scale = amax / 127

amax over the head_dim values of that token and head (all zero: scale 1). Why per token and not
per page: a token's stored bytes then depend on that token alone, never on which tokens shared
its page or in what chunks the page was filled, so a sequence's output stays independent of
batching, prefill chunking, pauses and replays, as with unquantized KV (docs/architecture.md). A
per-page scale would re-round a page's earlier tokens whenever a later one raised its amax. The
scale costs 4 bytes per head_dim codes: with head_dim 128, 132 bytes per token and head against
256 for bf16 (0.52x).

`QuantizedPages` stands where the float32 array of an unquantized pool stands: `pages[ids]`
gives dequantized float32 pages (what paged attention gathers) and `pages[ids, offsets] = x`
writes tokens (what write_paged_kv does); host copies, restores and page copies move the raw
codes and scales (`raw` / `set_raw` / `copy`), so a paused and resumed sequence reads exactly the
bytes it left.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

KV_DTYPES = ("fp8", "int8")
_CODE = {"fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0), "int8": (np.dtype(np.int8), 127.0)}


def quantize(values: np.ndarray, kv_dtype: str) -> tuple:
    """values [..., kv_heads, head_dim] (float) -> (codes of the same shape, scale float32
    [..., kv_heads]): one scale per token and head."""
    dtype, top = _CODE[kv_dtype]
    x = np.asarray(values, np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(top), 1.0).astype(np.float32)
    q = x / scale[..., None]
    if kv_dtype == "int8":
        q = np.clip(np.rint(q), -127, 127)
    else:
        q = np.clip(q, -top, top)            # amax / scale may round a hair above 448
    return q.astype(dtype), scale


def dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes [..., kv_heads, head_dim], scale [..., kv_heads] -> float32 values."""
    return codes.astype(np.float32) * scale[..., None]


class QuantizedPages:
    """One layer's K (or V) pages of a quantized KVPool."""

    def __init__(self, shape: tuple, kv_dtype: str):
        if kv_dtype not in _CODE:
            raise ValueError(f"kv_dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        self.kv_dtype = kv_dtype
        self.codes = np.zeros(shape, _CODE[kv_dtype][0])
        self.scale = np.ones(shape[:3], np.float32)

    @property
    def shape(self) -> tuple:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def __getitem__(self, pages) -> np.ndarray:
        """Dequantized float32 pages."""
        return dequantize(self.codes[pages], self.scale[pages])

    def __setitem__(self, key, values) -> None:
        """pages[page_ids, offsets] = values [N, kv_heads, head_dim] (new tokens)."""
        self.codes[key], self.scale[key] = quantize(values, self.kv_dtype)

    def raw(self, pages) -> np.ndarray:
        """Host copy of the given pages as bytes uint8 [len(pages), page bytes]: each page's
        codes, then its scales (one plain array, so host-memory accounting counts it as is)."""
        idx = np.asarray(pages, np.int64)
        n = len(idx)
        return np.concatenate([self.codes[idx].view(np.uint8).reshape(n, -1),
                               self.scale[idx].view(np.uint8).reshape(n, -1)], axis=1)

    def set_raw(self, pages, data: np.ndarray) -> None:
        idx = np.asarray(pages, np.int64)
        n, split = len(idx), int(np.prod(self.shape[1:]))
        data = np.ascontiguousarray(data, np.uint8).reshape(n, -1)
        self.codes[idx] = data[:, :split].view(self.codes.dtype).reshape(n, *self.shape[1:])
        self.scale[idx] = data[:, split:].view(np.float32).reshape(n, *self.scale.shape[1:])

    def copy(self, src, dst) -> None:
        self.codes[dst] = self.codes[src]
        self.scale[dst] = self.scale[src]

    def __array_function__(self, func, types, args, kwargs):
        """np.zeros_like(pages): an empty layer of the same shape and kv_dtype (how the MTP
        drafter adds its layer to a pool, models/qwen3_5/mtp.py join_kv_pool)."""
        if func is np.zeros_like and not kwargs:
            return QuantizedPages(self.shape, self.kv_dtype)
        return NotImplemented
