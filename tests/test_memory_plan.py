"""memory_plan.py: the one pool arithmetic gives its three former callers (commands.py's default
max_context, the Program's pool sizes, the CUDA model's KV pages and pool bytes) the numbers their
own copies gave; the old arithmetic is restated here as the reference. The context cache's State
slots (issue 28) are sized by bytes since: restated here from first principles."""
import math
import sys
import pathlib

import pytest

from ninfer.errors import RequestError
from ninfer.models.qwen3_5.config import TextConfig
from ninfer.models.qwen3_5.memory_plan import (MAX_CACHE_SLOTS, default_max_context,
                                               kv_page_bytes, max_state_slots, num_cache_slots,
                                               plan_device_pools, plan_pools, pool_bytes,
                                               snapshot_slots, state_slot_bytes)
from ninfer.models.qwen3_5.releases import release_config
from ninfer.options import EngineOptions

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cuda_shapes import SHAPES  # noqa: E402

LT = ("linear_attention",) * 3 + ("full_attention",)


def _cfg(shape):
    return TextConfig(layer_types=LT * 2, num_hidden_layers=8, **SHAPES[shape])


# ---- the old arithmetic (program.py, cuda_model.py, commands.py before issue 22) ---------------
def old_program(options, max_kv_pages):
    per_seq = -(-options.max_context // options.page_size)
    n = options.max_concurrency
    num_pages = options.num_kv_pages or min(n * per_seq, max_kv_pages or math.inf)
    share = options.prefix_cache_device_share
    cache = min(max(2, math.ceil(2 * share * n)), n + 2) if share > 0 else 0
    return per_seq, num_pages, cache


def old_state_bytes(cfg):
    return len(cfg.linear_layer_ids) * 4 * (
        cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) +
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)


def old_pool_reserve(cfg, pages, page_size, b_cap, f32, slots=None):
    kv = 2 * len(cfg.attention_layer_ids) * pages * page_size * cfg.num_key_value_heads * \
        cfg.head_dim * (4 if f32 else 2)
    slots = 2 * b_cap + 2 if slots is None else slots
    st = slots * old_state_bytes(cfg)
    return kv + st + (64 << 10) * (2 * len(cfg.attention_layer_ids) + 2 * len(cfg.linear_layer_ids))


def old_cuda_pages(cfg, options, fixed, free, f32, margin=512 << 20):
    page_size, b_cap = options.page_size, max(options.max_concurrency, 1)
    if options.num_kv_pages:
        return options.num_kv_pages
    per_seq = -(-options.max_context // page_size)
    want = b_cap * per_seq
    page_bytes = old_pool_reserve(cfg, 1, page_size, b_cap, f32) - \
        old_pool_reserve(cfg, 0, page_size, b_cap, f32)
    left = free - margin - fixed - old_pool_reserve(cfg, 0, page_size, b_cap, f32)
    fit = want if page_bytes == 0 else max(int(left // page_bytes), 0)
    return min(want, fit) if fit >= per_seq else want


def old_max_context(text, max_concurrency, itemsize, weights, free):
    limit = int(text.max_position_embeddings)
    num_full = sum(1 for t in text.layer_types if t == "full_attention")
    per_token = int(2 * num_full * text.num_key_value_heads * text.head_dim * itemsize)
    if free is not None and per_token:
        room = max(0, free // 2 - weights) // (per_token * max_concurrency)
        if room < limit:
            limit = max(256, int(room) // 256 * 256)
    return limit


OPTIONS = [dict(max_concurrency=1, max_context=2048, page_size=16),
           dict(max_concurrency=8, max_context=32768, page_size=16),
           dict(max_concurrency=4, max_context=1000, page_size=64, prefix_cache=False),
           dict(max_concurrency=3, max_context=4096, page_size=16, num_kv_pages=1000),
           dict(max_concurrency=8, max_context=512, page_size=16, prefix_cache_device_fraction=0.9)]


def _options(kw):
    fields = {f for f in EngineOptions.__dataclass_fields__}
    return EngineOptions(**{k: v for k, v in kw.items() if k in fields})


@pytest.mark.parametrize("kw", OPTIONS)
@pytest.mark.parametrize("held", [None, 10 ** 6, 300])
def test_program_pools_match_the_old_arithmetic(kw, held):
    options = _options(kw)
    per_seq, num_pages, cache = old_program(options, held)
    if num_pages < per_seq:
        with pytest.raises(RequestError, match="sequence needs"):
            plan_pools(options, held_kv_pages=held)
        return
    plan = plan_pools(options, held_kv_pages=held)
    assert (plan.max_pages_per_seq, plan.num_kv_pages, plan.num_cache_slots) == \
        (per_seq, num_pages, cache)
    assert plan.num_state_slots <= max_state_slots(options.max_concurrency)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kw", OPTIONS)
@pytest.mark.parametrize("free", [1 << 30, 24 << 30, 141 << 30])
@pytest.mark.parametrize("f32", [False, True])
def test_cuda_pages_and_pool_bytes(shape, kw, free, f32):
    """The KV pages are the old arithmetic's (the pool reserving 2B + 2 State slots); the cache's
    State slots beyond those: share of the KV pool's bytes or of the memory left after it,
    whichever is more, in State images, at most MAX_CACHE_SLOTS, as many as that memory holds."""
    cfg, options = _cfg(shape), _options(kw)
    fixed, margin = 700 << 20, 512 << 20
    plan = plan_device_pools(cfg, options, fixed_bytes=fixed, free_bytes=free,
                             kv_itemsize=4 if f32 else 2, margin_bytes=margin,
                             region_slack_bytes=64 << 10)
    pages = old_cuda_pages(cfg, options, fixed, free, f32)
    assert plan.num_kv_pages == pages
    b = max(options.max_concurrency, 1)
    share, state = options.prefix_cache_device_share, old_state_bytes(cfg)
    page = old_pool_reserve(cfg, 1, options.page_size, b, f32) - \
        old_pool_reserve(cfg, 0, options.page_size, b, f32)
    base = old_pool_reserve(cfg, pages, options.page_size, b, f32)
    left = max(0, free - margin - fixed - base)
    floor = min(max(2, math.ceil(2 * share * b)), b + 2) if share else 0
    want = max(floor, min(int(share * max(pages * page, left) // state), 256)) if share else 0
    extra = min(max(0, b + want - (2 * b + 2)), left // state)
    assert plan.num_state_slots == 2 * b + 2 + extra
    assert plan.pool_bytes == old_pool_reserve(cfg, pages, options.page_size, b, f32,
                                               slots=2 * b + 2 + extra)
    if extra:
        assert fixed + plan.pool_bytes + margin <= free
    if extra and plan.num_cache_slots < want:        # memory-bound: one more would not fit
        assert fixed + plan.pool_bytes + margin + state > free


def test_cache_slots_by_bytes_at_the_bench_shape():
    """The 9B with 8 sequences of 16K tokens (bench_context_cache's shape): 40 checkpoint States
    by the KV pool's bytes alone, where the fixed rule gave 8 (issue 28: the cache held 9
    entries with 92% of the KV pages free); a device with memory to spare gives the cache
    MAX_CACHE_SLOTS; the Program takes what the device plan holds."""
    cfg = release_config("9b")
    options = EngineOptions(max_concurrency=8, max_context=16384, page_size=16)
    page, state = kv_page_bytes(cfg, 16, 2), state_slot_bytes(cfg)
    pages = 8 * 1024
    n = num_cache_slots(8, 0.5, cache_bytes=0.5 * pages * page, state_bytes=state)
    assert n == int(0.5 * pages * page // state) == 40
    assert num_cache_slots(8, 0.5) == 8                        # the floor, without bytes
    assert num_cache_slots(8, 0.0, cache_bytes=1 << 40, state_bytes=state) == 0
    assert num_cache_slots(8, 1.0, cache_bytes=1 << 50, state_bytes=state) == MAX_CACHE_SLOTS
    assert num_cache_slots(8, 0.5, cache_bytes=1, state_bytes=state) == 8
    host = plan_pools(options, kv_page_bytes=page, state_bytes=state)
    assert (host.num_kv_pages, host.num_cache_slots) == (pages, n)
    dev = plan_device_pools(cfg, options, fixed_bytes=20 << 30, free_bytes=141 << 30,
                            kv_itemsize=2, margin_bytes=512 << 20)
    assert dev.num_kv_pages == pages and dev.num_cache_slots == MAX_CACHE_SLOTS
    assert (20 << 30) + dev.pool_bytes + (512 << 20) <= 141 << 30
    prog = plan_pools(options, held_kv_pages=dev.num_kv_pages,
                      held_state_slots=dev.num_state_slots, kv_page_bytes=page, state_bytes=state)
    assert (prog.num_kv_pages, prog.num_cache_slots) == (pages, MAX_CACHE_SLOTS)
    off = EngineOptions(max_concurrency=8, max_context=16384, page_size=16, prefix_cache=False)
    assert plan_pools(off, held_kv_pages=pages, held_state_slots=dev.num_state_slots
                      ).num_cache_slots == 0
    # short memory: the pages come first, the cache keeps the floor (2B + 2 slots in all)
    short = plan_device_pools(cfg, options, fixed_bytes=20 << 30, free_bytes=25 << 30,
                              kv_itemsize=2, margin_bytes=512 << 20)
    assert short.num_kv_pages < pages and short.num_state_slots == 2 * 8 + 2


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("itemsize", [2, 4, 1 + 4 / 128])
@pytest.mark.parametrize("free", [None, 1 << 28, 8 << 30, 1 << 40])
def test_default_max_context_matches_the_old_arithmetic(shape, itemsize, free):
    cfg = _cfg(shape)
    for conc in (1, 8):
        limit, bounded = default_max_context(cfg, max_concurrency=conc, kv_itemsize=itemsize,
                                             weights_bytes=100 << 20, free_bytes=free)
        assert limit == old_max_context(cfg, conc, itemsize, 100 << 20, free)
        assert free is not None or not bounded


def test_pool_bytes_count_every_array_once():
    cfg = _cfg(sorted(SHAPES)[0])
    assert pool_bytes(cfg, 0, 16, 0, 2) == 0
    assert pool_bytes(cfg, 0, 16, 0, 2, region_slack_bytes=1) == \
        2 * len(cfg.attention_layer_ids) + 2 * len(cfg.linear_layer_ids)


@pytest.mark.parametrize("free_gib", [141, 30])
def test_speculative_snapshot_slots_are_reserved_beside_the_others(free_gib):
    """speculative='mtp' with k drafts: the device plan's State pool holds (k+1) snapshot slots
    per sequence slot more (the CUDA verify's per-token States, speculative.py), counted in its
    bytes and not as cache slots; the Program's plan of the same pools sees the same cache."""
    cfg = release_config("9b")
    base = dict(max_concurrency=4, max_context=8192, page_size=16)
    plain, spec = EngineOptions(**base), EngineOptions(**base, speculative="mtp",
                                                       num_draft_tokens=3)
    assert snapshot_slots(plain) == 0 and snapshot_slots(spec) == 4 * 4
    kw = dict(fixed_bytes=20 << 30, free_bytes=free_gib << 30, kv_itemsize=2,
              margin_bytes=512 << 20)
    a, b = plan_device_pools(cfg, plain, **kw), plan_device_pools(cfg, spec, **kw)
    assert (a.num_snapshot_slots, b.num_snapshot_slots) == (0, 16)
    assert (20 << 30) + b.pool_bytes + (512 << 20) <= free_gib << 30
    # what the snapshots take comes out of what was left: pages first, then the cache's States
    per_state = state_slot_bytes(cfg)
    bytes_a = pool_bytes(cfg, a.num_kv_pages, 16, a.num_state_slots, 2)
    bytes_b = pool_bytes(cfg, b.num_kv_pages, 16, b.num_state_slots + 16, 2)
    assert b.pool_bytes - a.pool_bytes == bytes_b - bytes_a
    assert b.num_kv_pages <= a.num_kv_pages and b.num_state_slots <= a.num_state_slots
    if free_gib == 141:                    # memory to spare: nothing else shrinks
        assert b.pool_bytes - a.pool_bytes == 16 * per_state
        assert (b.num_kv_pages, b.num_cache_slots) == (a.num_kv_pages, a.num_cache_slots)
    prog = plan_pools(spec, held_kv_pages=b.num_kv_pages, held_state_slots=b.num_state_slots)
    assert prog.num_cache_slots == b.num_cache_slots
