"""Causal GQA attention over a paged KV pool, float32.

Pool layout (ninfer/models/qwen3_5/state.py): k, v [num_pages, page_size, kv_heads, head_dim].
Token position p of a row lives at page block_table[p // page_size], offset p % page_size.
Query head h reads KV head h // (q_heads / kv_heads) (consecutive query heads share a KV head).
"""
from __future__ import annotations

import numpy as np


def kv_slot_mapping(block_tables, context_lens, query_start, page_size: int) -> tuple:
    """(pages [N], offsets [N]) where each new token of the packed batch is written."""
    rows = np.repeat(np.arange(len(context_lens)), np.diff(query_start))
    pos = np.asarray(context_lens)[rows] + (np.arange(query_start[-1]) - np.asarray(query_start)[rows])
    pages = np.asarray(block_tables)[rows, pos // page_size]
    return pages.astype(np.int64), (pos % page_size).astype(np.int64)


def write_paged_kv(k_pool, v_pool, k, v, pages, offsets) -> None:
    """Store new keys/values [N, kv_heads, head_dim] at (pages, offsets)."""
    k_pool[pages, offsets] = k
    v_pool[pages, offsets] = v


def paged_attention(q, k_pool, v_pool, block_tables, context_lens, query_start,
                    scale: float) -> np.ndarray:
    """q [N, q_heads, head_dim] (packed rows) -> out [N, q_heads, head_dim].

    Row r's queries are positions context_lens[r] + i; each attends causally over positions
    [0, context_lens[r] + n_r) of its own row, which must already be in the pool."""
    N, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    group = Hq // Hkv
    page_size = k_pool.shape[1]
    out = np.empty((N, Hq, hd), np.float32)
    for r in range(len(context_lens)):
        s, e = int(query_start[r]), int(query_start[r + 1])
        n, ctx = e - s, int(context_lens[r])
        if n == 0:
            continue
        L = ctx + n
        pages = block_tables[r, :-(-L // page_size)]
        keys = k_pool[pages].reshape(-1, Hkv, hd)[:L]             # [L, Hkv, hd]
        vals = v_pool[pages].reshape(-1, Hkv, hd)[:L]
        qh = np.moveaxis(q[s:e], 1, 0).reshape(Hkv, group * n, hd)
        scores = (qh @ keys.transpose(1, 2, 0)) * np.float32(scale)    # [Hkv, g*n, L]
        scores = scores.reshape(Hkv, group, n, L)
        future = np.arange(L)[None, :] > (ctx + np.arange(n))[:, None]     # [n, L]
        scores[:, :, future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        o = p.reshape(Hkv, group * n, L) @ np.moveaxis(vals, 1, 0)          # [Hkv, g*n, hd]
        out[s:e] = np.moveaxis(o.reshape(Hq, n, hd), 0, 1)
    return out
