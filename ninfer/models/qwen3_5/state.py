"""Physical layouts of the per-sequence model state, numpy backend (the Program owns the pools).

KV pool, one pair per full-attention layer (indexed by attention-layer ordinal, not layer id):
    k[a], v[a]: [num_pages, page_size, num_key_value_heads, head_dim]   float32
                (kv_dtype fp8 / int8: ops/kv_quant.QuantizedPages, codes + per-page scales)
State pool (the StateImage), one pair per Gated DeltaNet layer (indexed by linear-layer ordinal):
    conv[l]:      [num_slots, linear_conv_dim, linear_conv_kernel_dim - 1]   float32
                  the last K-1 conv *inputs* (pre-activation qkv), oldest first
    recurrent[l]: [num_slots, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]
                  float32, S in `o = q^T S` convention (k_dim x v_dim per value head)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...contracts import ReadyRead
from ...ops.kv_quant import QuantizedPages
from .config import TextConfig


@dataclass(slots=True)
class KVPool:
    page_size: int
    k: list
    v: list
    reads_async = False         # (contracts.KVPoolProtocol: host reads are done at once)

    @classmethod
    def allocate(cls, cfg: TextConfig, num_pages: int, page_size: int,
                 dtype=np.float32, kv_dtype: str | None = None) -> "KVPool":
        """kv_dtype "fp8" / "int8": each layer a QuantizedPages (ops/kv_quant.py)."""
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        n = len(cfg.attention_layer_ids)
        if kv_dtype is not None:
            return cls(page_size, [QuantizedPages(shape, kv_dtype) for _ in range(n)],
                       [QuantizedPages(shape, kv_dtype) for _ in range(n)])
        return cls(page_size, [np.zeros(shape, dtype) for _ in range(n)],
                   [np.zeros(shape, dtype) for _ in range(n)])

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's pages (codes and scales when quantized)."""
        return sum(a.nbytes for a in self.k + self.v)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def read_pages(self, pages) -> tuple:
        """Host copy of the given pages (Snapshot): (k list, v list) of [len(pages), ...] arrays
        (a quantized layer's pages as bytes: kv_quant.QuantizedPages.raw)"""
        idx = np.asarray(pages, dtype=np.int64)
        return [_read(k, idx) for k in self.k], [_read(v, idx) for v in self.v]

    def start_read_pages(self, pages) -> ReadyRead:
        return ReadyRead(self.read_pages(pages))

    def write_pages(self, pages, data: tuple) -> None:
        idx = np.asarray(pages, dtype=np.int64)
        for dst, src in zip(self.k + self.v, list(data[0]) + list(data[1])):
            if isinstance(dst, QuantizedPages):
                dst.set_raw(idx, src)
            else:
                dst[idx] = src

    def copy_pages(self, src_pages, dst_pages) -> None:
        """Page dst_pages[i] becomes a copy of src_pages[i] in every layer (the context cache's
        copy-on-write of a partly filled page); the two lists are disjoint."""
        src, dst = _copy_indices(src_pages, dst_pages, self.num_pages, "KV page")
        for a in self.k + self.v:
            if isinstance(a, QuantizedPages):
                a.copy(src, dst)
            else:
                a[dst] = a[src]


@dataclass(slots=True)
class StatePool:
    conv: list
    recurrent: list
    reads_async = False

    @classmethod
    def allocate(cls, cfg: TextConfig, num_slots: int) -> "StatePool":
        n = len(cfg.linear_layer_ids)
        conv = (num_slots, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1)
        rec = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
               cfg.linear_value_head_dim)
        return cls([np.zeros(conv, np.float32) for _ in range(n)],
                   [np.zeros(rec, np.float32) for _ in range(n)])

    @property
    def num_slots(self) -> int:
        return self.conv[0].shape[0] if self.conv else 0

    def zero(self, slot: int) -> None:
        for a in self.conv + self.recurrent:
            a[slot] = 0

    def read(self, slot: int) -> tuple:
        """Host copy of one slot's StateImage (Snapshot / provisional backup)."""
        return [c[slot].copy() for c in self.conv], [r[slot].copy() for r in self.recurrent]

    def start_read(self, slot: int) -> ReadyRead:
        return ReadyRead(self.read(slot))

    def write(self, slot: int, image: tuple) -> None:
        for dst, src in zip(self.conv, image[0]):
            dst[slot] = src
        for dst, src in zip(self.recurrent, image[1]):
            dst[slot] = src

    def copy(self, src_slot: int, dst_slot: int) -> None:
        """Slot dst_slot's StateImage becomes a copy of src_slot's (a context-cache checkpoint
        taken or installed without a host round trip)."""
        (src,), (dst,) = _copy_indices([src_slot], [dst_slot], self.num_slots, "state slot")
        for a in self.conv + self.recurrent:
            a[dst] = a[src]


def _read(layer, idx) -> np.ndarray:
    return layer.raw(idx) if isinstance(layer, QuantizedPages) else layer[idx].copy()


def _copy_indices(src, dst, count: int, what: str) -> tuple:
    """(src, dst) as int64 arrays of one length, in [0, count), the two sets disjoint: the one
    check of a pool copy's arguments, shared by both backends."""
    src = np.asarray(src, np.int64).reshape(-1)
    dst = np.asarray(dst, np.int64).reshape(-1)
    if len(src) != len(dst):
        raise ValueError(f"{what} copy: {len(src)} sources for {len(dst)} destinations")
    for ids in (src, dst):
        if ids.size and (ids.min() < 0 or ids.max() >= count):
            raise IndexError(f"{what} copy: ids {ids.tolist()} outside [0, {count})")
    if len(np.unique(dst)) != len(dst) or np.intersect1d(src, dst).size:
        raise ValueError(f"{what} copy: destinations {dst.tolist()} repeat or overlap the "
                         f"sources {src.tolist()}")
    return src, dst
