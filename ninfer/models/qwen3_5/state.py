"""Physical layouts of the per-sequence model state, numpy backend (the Program owns the pools).

KV pool, one pair per full-attention layer (indexed by attention-layer ordinal, not layer id):
    k[a], v[a]: [num_pages, page_size, num_key_value_heads, head_dim]   float32
State pool (the StateImage), one pair per Gated DeltaNet layer (indexed by linear-layer ordinal):
    conv[l]:      [num_slots, linear_conv_dim, linear_conv_kernel_dim - 1]   float32
                  the last K-1 conv *inputs* (pre-activation qkv), oldest first
    recurrent[l]: [num_slots, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]
                  float32, S in `o = q^T S` convention (k_dim x v_dim per value head)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import TextConfig


@dataclass(slots=True)
class KVPool:
    page_size: int
    k: list
    v: list

    @classmethod
    def allocate(cls, cfg: TextConfig, num_pages: int, page_size: int,
                 dtype=np.float32) -> "KVPool":
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        n = len(cfg.attention_layer_ids)
        return cls(page_size, [np.zeros(shape, dtype) for _ in range(n)],
                   [np.zeros(shape, dtype) for _ in range(n)])

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def read_pages(self, pages) -> tuple:
        """Host copy of the given pages (Snapshot): (k list, v list) of [len(pages), ...] arrays."""
        idx = np.asarray(pages, dtype=np.int64)
        return [k[idx].copy() for k in self.k], [v[idx].copy() for v in self.v]

    def write_pages(self, pages, data: tuple) -> None:
        idx = np.asarray(pages, dtype=np.int64)
        for dst, src in zip(self.k, data[0]):
            dst[idx] = src
        for dst, src in zip(self.v, data[1]):
            dst[idx] = src


@dataclass(slots=True)
class StatePool:
    conv: list
    recurrent: list

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

    def write(self, slot: int, image: tuple) -> None:
        for dst, src in zip(self.conv, image[0]):
            dst[slot] = src
        for dst, src in zip(self.recurrent, image[1]):
            dst[slot] = src
