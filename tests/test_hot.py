"""ninfer._hot: the compiled module (when built) and its pure-Python twin give equal results."""
import importlib

import numpy as np
import pytest

import ninfer._hot as hot
from ninfer._hot import pages_py, routes_py


def _impls(name, twin):
    """ninfer._hot.<name> (None where it was not built: the twin is what runs) and the
    implementations to test: the twin, and the compiled module when there is one."""
    try:
        built = importlib.import_module(f"ninfer._hot.{name}")
    except ImportError:
        built = None
    return built, [pytest.param(twin, id="python")] + (
        [pytest.param(built, id="compiled")] if built is not None else [])


compiled, IMPLS = _impls("pages", pages_py)
routes_compiled, ROUTE_IMPLS = _impls("routes", routes_py)


def test_dispatch_picks_an_implementation():
    assert hot.IS_COMPILED == (compiled is not None)
    assert hot.pack_batch is (compiled or pages_py).pack_batch


def _random_ops(impl, seed):
    """Take/give pages for a few block-table rows at random; return the final ledger."""
    rng = np.random.default_rng(seed)
    num_pages, rows, width = 23, 4, 9
    free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
    num_free = num_pages
    tables = np.full((rows, width), -1, np.int32)
    mapped = [0] * rows
    for _ in range(200):
        r = int(rng.integers(rows))
        if rng.random() < 0.55:
            n = int(rng.integers(0, min(num_free, width - mapped[r]) + 1))
            num_free = impl.take_pages(free, num_free, tables[r], mapped[r], n)
            mapped[r] += n
        else:
            keep = int(rng.integers(0, mapped[r] + 1))
            num_free = impl.give_pages(free, num_free, tables[r], keep, mapped[r])
            mapped[r] = keep
        every = np.concatenate([tables[i, :mapped[i]] for i in range(rows)] + [free[:num_free]])
        assert sorted(every.tolist()) == list(range(num_pages))      # nothing lost or doubled
        assert all((tables[i, mapped[i]:] == -1).all() for i in range(rows))
    return free[:num_free].copy(), tables, num_free


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_page_ops_twin_equals_compiled(seed):
    results = [_random_ops(impl, seed) for impl in (pages_py, compiled or pages_py)]
    (f0, t0, n0), (f1, t1, n1) = results
    assert n0 == n1
    np.testing.assert_array_equal(f0, f1)
    np.testing.assert_array_equal(t0, t1)


@pytest.mark.parametrize("impl", IMPLS)
def test_page_ops_reject_bad_requests(impl):
    free = np.arange(4, dtype=np.int32)
    row = np.full(3, -1, np.int32)
    with pytest.raises(ValueError):
        impl.take_pages(free, 4, row, 0, 5)          # more than free
    with pytest.raises(ValueError):
        impl.take_pages(free, 4, row, 2, 2)          # past the table
    with pytest.raises(ValueError):
        impl.give_pages(free, 2, row, 0, 1)          # unmapped entry
    assert (row == -1).all()


def _pack_inputs(seed):
    rng = np.random.default_rng(seed)
    slots_total, ctx, width = 5, 40, 10
    token_buf = rng.integers(0, 1000, (slots_total, ctx), dtype=np.int32)
    tables = rng.integers(-1, 50, (slots_total, width), dtype=np.int32)
    b = int(rng.integers(1, slots_total + 1))
    slots = rng.permutation(slots_total)[:b].astype(np.int32)
    starts = rng.integers(0, 20, b).astype(np.int32)
    counts = rng.integers(0, 20, b).astype(np.int32)
    return token_buf, tables, slots, starts, counts


def _pack(impl, token_buf, tables, slots, starts, counts):
    n_max = int(counts.sum())
    out = (np.full(n_max, -7, np.int32), np.full((3, n_max), -7, np.int32),
           np.full(len(slots) + 1, -7, np.int32), np.full((len(slots), tables.shape[1]), -7, np.int32))
    n = impl.pack_batch(token_buf, tables, slots, starts, counts, *out)
    return n, out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("impl", IMPLS)
def test_pack_batch_matches_naive(impl, seed):
    token_buf, tables, slots, starts, counts = _pack_inputs(seed)
    n, (tokens, positions, qs, out_tables) = _pack(impl, token_buf, tables, slots, starts, counts)
    want_tokens = np.concatenate([token_buf[s, a:a + c] for s, a, c in zip(slots, starts, counts)])
    want_pos = np.concatenate([np.arange(a, a + c) for a, c in zip(starts, counts)])
    assert n == len(want_tokens)
    np.testing.assert_array_equal(tokens, want_tokens)
    for axis in range(3):
        np.testing.assert_array_equal(positions[axis], want_pos)
    np.testing.assert_array_equal(qs, np.concatenate([[0], np.cumsum(counts)]))
    np.testing.assert_array_equal(out_tables, tables[slots])


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_batch_rejects_span_outside_buffer(impl):
    token_buf, tables, slots, starts, counts = _pack_inputs(0)
    starts[0] = token_buf.shape[1] - 1
    counts[0] = 2
    with pytest.raises(ValueError):
        _pack(impl, token_buf, tables, slots, starts, counts)


def _decode_batch(rng, b, width, mrope=False):
    from ninfer.models.qwen3_5.batch import ForwardBatch
    ctx = rng.integers(0, 200, b).astype(np.int32)
    pos = np.stack([ctx, ctx + 3, ctx + 5]) if mrope else np.broadcast_to(ctx, (3, b))
    tables = rng.integers(-1, 500, (b, width)).astype(np.int32)
    return ForwardBatch(rng.integers(0, 1000, b).astype(np.int32), np.ascontiguousarray(pos),
                        np.arange(b + 1, dtype=np.int32), ctx, tables,
                        rng.permutation(8)[:b].astype(np.int32))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b, width, mrope", [(1, 1, False), (3, 5, True), (8, 9, False),
                                              (8, 12, True)])
def test_pack_decode_equals_the_general_packer(impl, b, width, mrope):
    """The decode fast path writes what MetaLayout.pack writes for the same batch (fields beyond
    row b are 0; block tables padded with -1 or cut at the layout's p_cap), poisoned image."""
    from ninfer.models.qwen3_5.cuda.meta import MetaLayout
    lay = MetaLayout(8, 8, 10)
    batch = _decode_batch(np.random.default_rng(b * 31 + width), b, width, mrope)
    want = np.zeros(lay.count, np.int32)
    lay.pack(want, batch, np.arange(b, dtype=np.int32))
    got = np.full(lay.count, -7, np.int32)
    words = impl.pack_decode(got, lay.field_offsets, lay.n_cap, lay.p_cap, batch.token_ids,
                             batch.positions, batch.context_lens, batch.state_slots,
                             batch.block_tables)
    assert 4 * words == lay.used_bytes(b)
    np.testing.assert_array_equal(got[:words], want[:words])


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_decode_rejects_too_many_rows(impl):
    from ninfer.models.qwen3_5.cuda.meta import MetaLayout
    lay = MetaLayout(2, 2, 4)
    batch = _decode_batch(np.random.default_rng(0), 3, 4)
    with pytest.raises(ValueError, match="rows"):
        impl.pack_decode(np.zeros(lay.count + 64, np.int32), lay.field_offsets, lay.n_cap,
                         lay.p_cap, batch.token_ids, batch.positions, batch.context_lens,
                         batch.state_slots, batch.block_tables)


# ---- the MoE prefill's row layout (routes.pyx / routes_py.py) -----------------------------------

def test_routes_dispatch_picks_an_implementation():
    assert hot.ROUTES_COMPILED == (routes_compiled is not None)
    assert hot.expert_rows_fill is (routes_compiled or routes_py).expert_rows_fill


def _routes_oracle(ids, top_k, num_experts, cap):
    """Expert by expert, pair by pair: the layout's definition, independent of either impl."""
    rows_of = {e: [p for p in range(len(ids)) if ids[p] == e] for e in range(num_experts)}
    row_of_pair = np.full(len(ids), -1, np.int64)
    nxt = num_experts * cap
    over_rows = []
    for e in range(num_experts):
        for rank, p in enumerate(rows_of[e]):
            if rank < cap:
                row_of_pair[p] = e * cap + rank
            else:
                row_of_pair[p] = nxt
                over_rows.append(nxt)
                nxt += 1
    src = np.zeros(nxt, np.int64)
    for p, row in enumerate(row_of_pair):
        src[row] = p // top_k
    return nxt, src, row_of_pair


@pytest.mark.parametrize("impl", ROUTE_IMPLS)
@pytest.mark.parametrize("tokens, top_k, num_experts, cap, skew",
                         [(1, 1, 1, 0, 0.0), (5, 2, 4, 0, 0.0), (37, 8, 64, 16, 0.0),
                          (37, 8, 64, 0, 0.9), (200, 4, 16, 16, 0.6), (64, 8, 256, 32, 0.0),
                          (9, 3, 7, 48, 0.0)])
def test_expert_rows_fill_matches_the_definition(impl, tokens, top_k, num_experts, cap, skew):
    """Row of every pair and token of every row as the layout defines them (padded block, then
    each heavy expert's overflow in expert order, pairs in order within an expert), padding
    rows 0, on poisoned outputs; uniform and skewed routing (a hot expert overflows), cap 0
    (every row overflow) and a cap no expert reaches."""
    rng = np.random.default_rng(tokens * 7 + num_experts + cap)
    ids = np.empty((tokens, top_k), np.int32)
    for t in range(tokens):
        hot_first = rng.random() < skew and top_k <= num_experts
        choice = rng.choice(num_experts, top_k, replace=False)
        if hot_first and 0 not in choice:
            choice[0] = 0
        ids[t] = choice
    ids = ids.reshape(-1)
    rows, src_want, rop_want = _routes_oracle(ids, top_k, num_experts, cap)
    counts = np.bincount(ids, minlength=num_experts).astype(np.int32)
    src = np.full(rows + 5, -9, np.int32)
    rop = np.full(len(ids), -9, np.int32)
    got = impl.expert_rows_fill(ids, top_k, num_experts, cap, counts, src, rop)
    assert got == rows
    np.testing.assert_array_equal(rop, rop_want)
    np.testing.assert_array_equal(src[:rows], src_want)
    assert (src[rows:] == -9).all()             # nothing written past the rows


def test_compiled_routes_reject_out_of_range_ids():
    if routes_compiled is None:
        pytest.skip("routes.pyx not built here")
    with pytest.raises(ValueError, match="outside"):
        routes_compiled.expert_rows_fill(np.array([0, 4], np.int32), 1, 4, 0,
                                         np.array([1, 0, 0, 0], np.int32),
                                         np.zeros(8, np.int32), np.zeros(2, np.int32))
