"""MemoryPlan: how many KV pages and State slots the pools hold, and what they cost in bytes.

One arithmetic for every place that sizes the pools:

    default_max_context(...)   the CLI's max_context when none is given (commands.py)
    plan_pools(options, ...)   the Program's pool sizes (program/program.py)
    plan_device_pools(...)     the CUDA model's pages from the free device memory
                               (cuda/device_memory.py adds the weights and the workspace)

Pools, per sequence slot and per page:

    KV pool     num_kv_pages x page_size tokens x (K, V) x full-attention layers
    State pool  num_seq_slots (one per running sequence) + num_cache_slots (context-cache
                checkpoints); each slot one conv state + one recurrent state per GDN layer

Backend-neutral: numbers and options in, numbers out; a backend adds what it alone knows (the
CUDA arena's alignment slack, its workspace).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ...errors import RequestError
from ...options import draft_tokens


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-int(num_tokens) // int(page_size))


# the most State slots the context cache takes, whatever memory it is given: past a few hundred
# checkpoints the cache's linear scans (retention ranks, victims) would cost more than they save
MAX_CACHE_SLOTS = 256


def num_cache_slots(num_seq_slots: int, device_share: float, *, cache_bytes: float = 0,
                    state_bytes: int = 0) -> int:
    """State slots of the context cache's checkpoints; 0 when it is off. As many State images
    (state_bytes each) as cache_bytes holds, up to MAX_CACHE_SLOTS: a host Program gives its
    States device_share of the KV pool's bytes, a device plan also device_share of the memory
    nothing else uses (plan_device_pools). A fixed count gave a 9B with 8 sequences 10
    checkpoints, each overflow a synchronous demotion to the host on a request's path. Never
    fewer than the floor: 2 * share of the sequence slots, at least 2, at most
    num_seq_slots + 2."""
    if device_share <= 0:
        return 0
    floor = min(max(2, math.ceil(2 * device_share * num_seq_slots)), num_seq_slots + 2)
    if state_bytes <= 0:
        return floor
    return max(floor, min(int(cache_bytes // state_bytes), MAX_CACHE_SLOTS))


def max_state_slots(num_seq_slots: int) -> int:
    """The State slots a device plan always reserves for num_seq_slots sequences (the floor of
    num_cache_slots at any share, so a Program of other options on the same model still has
    room); the plan adds the cache's larger count when memory holds it."""
    return 2 * num_seq_slots + 2


def snapshot_slots(options) -> int:
    """The State slots a speculative verify writes its per-token States into (on a backend whose
    verify keeps them: the CUDA model): num_draft_tokens + 1 per sequence slot, after the
    sequences' and the context cache's (program/speculative.py)."""
    if getattr(options, "speculative", None) is None:
        return 0
    return max(int(options.max_concurrency), 1) * (draft_tokens(options) + 1)


def kv_bytes_per_token(text, itemsize: float) -> float:
    """Bytes of one token's K and V over every full-attention layer (itemsize may be fractional:
    1-byte codes plus a float32 scale per head)."""
    return 2 * len(text.attention_layer_ids) * text.num_key_value_heads * text.head_dim * itemsize


def quantized_page_bytes(page_size: int, kv_heads: int, head_dim: int) -> tuple:
    """(codes, whole) bytes of one quantized KV page of one layer's K (or V) on the device
    (kv_dtype "fp8" / "int8"): its page_size * kv_heads * head_dim one-byte codes padded to 4
    bytes, then one float32 scale per token and kv head (kernels/common.py kvq_row)."""
    codes = -(-int(page_size) * kv_heads * head_dim // 4) * 4
    return codes, codes + 4 * int(page_size) * kv_heads


def kv_layer_shapes(text, extra: tuple = ()) -> list:
    """(kv heads, head_dim) of every KV layer of a pool: the model's full-attention layers, then
    `extra` (a drafter's layers, which may have a geometry of their own: a DFlash drafter)."""
    return [(text.num_key_value_heads, text.head_dim)] * len(text.attention_layer_ids) \
        + [(int(nkv), int(hd)) for nkv, hd in extra]


def kv_page_bytes(text, page_size: int, kv_itemsize: int, kv_dtype: Optional[str] = None,
                  extra: tuple = ()) -> int:
    """Bytes of one KV page over every full-attention layer (and the `extra` layers of
    kv_layer_shapes), K and V: kv_itemsize bytes a value, or with kv_dtype "fp8" / "int8" the
    codes and scales of quantized_page_bytes."""
    if kv_dtype is not None:
        return 2 * sum(quantized_page_bytes(page_size, nkv, hd)[1]
                       for nkv, hd in kv_layer_shapes(text, extra))
    return 2 * sum(int(page_size) * nkv * hd * int(kv_itemsize)
                   for nkv, hd in kv_layer_shapes(text, extra))


def state_slot_bytes(text) -> int:
    """Bytes of one State slot (float32 conv + recurrent state of every GDN layer)."""
    return len(text.linear_layer_ids) * 4 * (
        text.linear_conv_dim * (text.linear_conv_kernel_dim - 1) +
        text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim)


def pool_bytes(text, num_pages: int, page_size: int, num_state_slots: int, kv_itemsize: int,
               region_slack_bytes: int = 0, kv_dtype: Optional[str] = None,
               extra_kv: tuple = ()) -> int:
    """Bytes of a KV pool of num_pages and a State pool of num_state_slots; region_slack_bytes
    per pool array (one K and one V per attention layer, one conv and one recurrent per GDN layer)
    covers an allocator's alignment. kv_dtype "fp8" / "int8": quantized pages (kv_page_bytes).
    extra_kv: a drafter's KV layers, (kv heads, head_dim) each (kv_layer_shapes)."""
    kv = kv_page_bytes(text, page_size, kv_itemsize, kv_dtype, extra_kv) * num_pages
    arrays = 2 * len(kv_layer_shapes(text, extra_kv)) + 2 * len(text.linear_layer_ids)
    return kv + state_slot_bytes(text) * num_state_slots + region_slack_bytes * arrays


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    page_size: int
    max_pages_per_seq: int          # one max_context sequence
    num_kv_pages: int
    num_seq_slots: int              # max_concurrency
    num_cache_slots: int            # context-cache State checkpoints, after the sequences'
    num_snapshot_slots: int = 0     # a speculative verify's per-token States, after the cache's
    weights_bytes: int = 0          # the rest: what a backend's plan adds (0: not planned here)
    workspace_bytes: int = 0
    pool_bytes: int = 0
    free_bytes: Optional[int] = None
    device: str = ""

    @property
    def num_state_slots(self) -> int:
        return self.num_seq_slots + self.num_cache_slots

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.workspace_bytes + self.pool_bytes


def plan_pools(options, *, held_kv_pages: Optional[int] = None,
               held_state_slots: Optional[int] = None, kv_page_bytes: int = 0,
               state_bytes: int = 0) -> MemoryPlan:
    """The Program's pools: options.num_kv_pages when given; else every sequence slot at
    max_context, or the held_kv_pages a backend's memory holds (Model.max_kv_pages) if fewer.
    The cache's State slots: plan_cache_slots over those pages. Raises RequestError when one
    max_context sequence would not fit."""
    page_size, num_seq_slots = int(options.page_size), int(options.max_concurrency)
    per_seq = pages_for(options.max_context, page_size)
    num_pages = options.num_kv_pages or min(num_seq_slots * per_seq, held_kv_pages or math.inf)
    if num_pages < per_seq:
        raise RequestError(
            f"Engine option num_kv_pages={num_pages}: one max_context={int(options.max_context)} "
            f"sequence needs {per_seq} pages of {page_size} tokens")
    cache = plan_cache_slots(options, int(num_pages), held_state_slots=held_state_slots,
                             kv_page_bytes=kv_page_bytes, state_bytes=state_bytes)
    return MemoryPlan(page_size=page_size, max_pages_per_seq=per_seq, num_kv_pages=int(num_pages),
                      num_seq_slots=num_seq_slots, num_cache_slots=cache)


def plan_cache_slots(options, num_kv_pages: int, *, held_state_slots: Optional[int] = None,
                     kv_page_bytes: int = 0, state_bytes: int = 0) -> int:
    """The Program's context-cache State slots: those the backend's memory plan holds beyond
    the sequences' (held_state_slots, Model.max_state_slots; the plan sized them from these
    options), else num_cache_slots over share of a pool of num_kv_pages (kv_page_bytes a
    page, state_bytes a State image)."""
    share, num_seq_slots = options.prefix_cache_device_share, int(options.max_concurrency)
    if held_state_slots is not None:
        return max(0, int(held_state_slots) - num_seq_slots) if share > 0 else 0
    return num_cache_slots(num_seq_slots, share, state_bytes=state_bytes,
                           cache_bytes=share * num_kv_pages * kv_page_bytes)


def plan_device_pools(text, options, *, fixed_bytes: int, free_bytes: int, kv_itemsize: int,
                      margin_bytes: int, region_slack_bytes: int = 0,
                      kv_dtype: Optional[str] = None, extra_kv: tuple = ()) -> MemoryPlan:
    """Pools in device memory: options.num_kv_pages when given; else every sequence slot at
    max_context (more could never be used), or fewer when the memory left after fixed_bytes, the
    State pool (max_state_slots) and margin_bytes holds fewer, down to one sequence. Fewer than one
    sequence: every slot's pages are kept, and the caller's memory check says what is short.
    The State pool's bytes include a speculative verify's snapshot slots (snapshot_slots).
    Then the context cache's State slots beyond max_state_slots: num_cache_slots over share of
    these pages' bytes or of the memory left after them, whichever is more, as far as that
    memory holds them (the pages come first).
    kv_dtype "fp8" / "int8": quantized pages, about (head_dim + 4) / (2 head_dim) of bf16's.
    extra_kv: a drafter's KV layers in every page, (kv heads, head_dim) each."""
    page_size = int(options.page_size)
    num_seq_slots = max(int(options.max_concurrency), 1)
    slots = max_state_slots(num_seq_slots)
    per_seq = pages_for(options.max_context, page_size)
    snaps = snapshot_slots(options)

    def reserve(pages, num_slots=slots):
        return pool_bytes(text, pages, page_size, num_slots + snaps, kv_itemsize,
                          region_slack_bytes, kv_dtype, extra_kv)
    page_bytes = reserve(1) - reserve(0)
    if options.num_kv_pages:
        num_pages = int(options.num_kv_pages)
    else:
        want = num_seq_slots * per_seq
        left = free_bytes - margin_bytes - fixed_bytes - reserve(0)
        fit = want if page_bytes == 0 else max(int(left // page_bytes), 0)
        num_pages = min(want, fit) if fit >= per_seq else want
    # the cache's States: share of the KV pool's bytes, or share of the memory left unused
    # after the pages (a big device), whichever is more, as far as that memory holds them
    state_bytes = state_slot_bytes(text)
    share = options.prefix_cache_device_share
    left = max(0, free_bytes - margin_bytes - fixed_bytes - reserve(num_pages))
    cache = num_cache_slots(num_seq_slots, share, state_bytes=state_bytes,
                            cache_bytes=share * max(num_pages * page_bytes, left))
    extra = max(0, num_seq_slots + cache - slots)
    if extra and state_bytes:
        slots += min(extra, left // state_bytes)
    return MemoryPlan(page_size=page_size, max_pages_per_seq=per_seq, num_kv_pages=num_pages,
                      num_seq_slots=num_seq_slots, num_cache_slots=slots - num_seq_slots,
                      num_snapshot_slots=snaps, pool_bytes=reserve(num_pages, slots),
                      free_bytes=free_bytes)


def default_max_context(text, *, max_concurrency: int, kv_itemsize: float, weights_bytes: int,
                        free_bytes: Optional[int]) -> tuple:
    """(max_context, is_bounded): the model's max_position_embeddings, bounded (to a multiple of
    256, at least 256) so that the KV cache of max_concurrency full-length sequences takes at most
    half of free_bytes after the weights; free_bytes None: unknown, not bounded."""
    limit = int(text.max_position_embeddings)
    per_token = int(kv_bytes_per_token(text, kv_itemsize))
    if free_bytes is None or not per_token:
        return limit, False
    room = max(0, free_bytes // 2 - weights_bytes) // (per_token * max_concurrency)
    if room >= limit:
        return limit, False
    return max(256, int(room) // 256 * 256), True
