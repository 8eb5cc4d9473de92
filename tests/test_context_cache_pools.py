"""The context cache's physical primitives: page reference counts (PagePool + the _hot twin),
the pools' copy ops (numpy, and the CUDA pools on a fake driver: device memory is one numpy
byte array), and the checkpoint store's tiers and copy-on-write."""
import importlib

import threading

import numpy as np
import pytest

from ninfer._hot import pages_py
from ninfer.contracts import ProgramError
from ninfer.models.qwen3_5.config import TextConfig
from ninfer.models.qwen3_5.program.page_ledger import PagePool
from ninfer.models.qwen3_5.state import KVPool, StatePool

try:
    compiled = importlib.import_module("ninfer._hot.pages")
except ImportError:
    compiled = None
IMPLS = [pytest.param(pages_py, id="python")] + (
    [pytest.param(compiled, id="compiled")] if compiled is not None else [])


def _cfg():
    return TextConfig(layer_types=("linear_attention",) * 3 + ("full_attention",) * 2,
                      num_hidden_layers=5, num_key_value_heads=2, head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
                      linear_value_head_dim=4)


# ---- reference counts ----------------------------------------------------------------------------
def _random_refcount_ops(impl, seed):
    rng = np.random.default_rng(seed)
    num_pages, rows, width = 17, 3, 8
    free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
    num_free = num_pages
    refcount = np.zeros(num_pages, np.int32)
    tables = np.full((rows, width), -1, np.int32)
    mapped = [0] * rows
    for _ in range(300):
        r = int(rng.integers(rows))
        if rng.random() < 0.5:
            n = int(rng.integers(0, min(num_free, width - mapped[r]) + 1))
            num_free = impl.take_pages(free, num_free, tables[r], mapped[r], n)
            refcount[tables[r, mapped[r]:mapped[r] + n]] = 1
            mapped[r] += n
        elif rng.random() < 0.5 and mapped[r]:
            # share row r's first pages into an empty row (a bind of a cache entry)
            other = next((o for o in range(rows) if not mapped[o]), None)
            if other is not None:
                k = int(rng.integers(1, mapped[r] + 1))
                tables[other, :k] = tables[r, :k]
                refcount[tables[r, :k]] += 1
                mapped[other] = k
        else:
            keep = int(rng.integers(0, mapped[r] + 1))
            num_free = impl.release_pages(free, num_free, refcount, tables[r], keep, mapped[r])
            mapped[r] = keep
        counted = np.bincount(np.concatenate([tables[i, :mapped[i]] for i in range(rows)]),
                              minlength=num_pages)
        assert np.array_equal(counted, refcount)
        assert sorted(free[:num_free].tolist()) == np.flatnonzero(counted == 0).tolist()
    return free[:num_free].copy(), tables, refcount


def _pool_dev(fake, host_reserve=None):
    """The PoolDevice of a fake model (its arena, stream, bind, graph forgetting, f32)."""
    from ninfer.models.qwen3_5.cuda.device_pools import HostStaging, PoolDevice
    return PoolDevice(fake.arena, fake.stream, fake._current, fake._forget_graphs_of,
                      HostStaging(), bool(getattr(fake, "f32", False)),
                      host_reserve=host_reserve)


@pytest.mark.parametrize("seed", [0, 1])
def test_release_pages_twin_equals_compiled(seed):
    (f0, t0, r0), (f1, t1, r1) = [_random_refcount_ops(impl, seed)
                                  for impl in (pages_py, compiled or pages_py)]
    for a, b in ((f0, f1), (t0, t1), (r0, r1)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_release_pages_rejects_unreferenced_pages(impl):
    free = np.zeros(4, np.int32)
    refcount = np.zeros(4, np.int32)
    row = np.array([2, -1, -1], np.int32)
    with pytest.raises(ValueError, match="unreferenced"):
        impl.release_pages(free, 0, refcount, row, 0, 1)        # page 2 has no holder
    with pytest.raises(ValueError, match="unmapped"):
        impl.release_pages(free, 0, refcount, row, 0, 2)
    refcount[2] = 2
    assert impl.release_pages(free, 0, refcount, row, 0, 1) == 0   # still held elsewhere
    assert refcount[2] == 1 and row[0] == -1


def test_page_pool_sharing_and_its_audit():
    pool = PagePool(8, 4, 3, 4)
    assert pool.grow(0, 10)                      # 3 pages
    shared = pool.pages_of(0)[:2]
    pool.hold(shared)                            # a cache entry holds the two full pages
    pool.map_shared(1, shared)                   # and a second sequence maps them
    assert pool.grow(1, 12)
    pool.check({0, 1}, held=shared)
    assert pool.num_free == 4 and pool.num_sole(shared) == 0
    pool.shrink(0, 0)
    pool.shrink(1, 0)
    assert pool.num_free == 6 and pool.num_sole(shared) == 2
    pool.check(set(), held=shared)
    pool.refcount[shared[0]] += 1                # a lost reference: the audit names the page
    with pytest.raises(ProgramError, match="reference counts"):
        pool.check(set(), held=shared)
    pool.refcount[shared[0]] -= 1
    pool.drop(shared)
    assert pool.num_free == 8
    pool.check(set())
    with pytest.raises(ProgramError, match="free"):
        pool.map_shared(2, shared)               # free pages cannot be shared


# ---- numpy pool copies ---------------------------------------------------------------------------
def test_numpy_pool_copies_copy_every_layer_and_check_arguments():
    rng = np.random.default_rng(0)
    kv, st = KVPool.allocate(_cfg(), 6, 4), StatePool.allocate(_cfg(), 3)
    for a in kv.k + kv.v + st.conv + st.recurrent:
        a[...] = rng.standard_normal(a.shape)
    before = kv.read_pages([0, 1, 2, 3, 4, 5])
    kv.copy_pages([1, 4], [3, 0])
    after = kv.read_pages([0, 1, 2, 3, 4, 5])
    for b, a in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a[3], b[1])
        np.testing.assert_array_equal(a[0], b[4])
        np.testing.assert_array_equal(a[[1, 2, 4, 5]], b[[1, 2, 4, 5]])
    image = st.read(2)
    st.copy(2, 0)
    for a, b in zip(st.read(0)[0] + st.read(0)[1], image[0] + image[1]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(IndexError):
        kv.copy_pages([6], [0])
    with pytest.raises(ValueError, match="overlap"):
        kv.copy_pages([1], [1])
    with pytest.raises(ValueError, match="sources"):
        kv.copy_pages([1, 2], [3])
    with pytest.raises(IndexError):
        st.copy(0, 3)


# ---- CUDA pool copies on a fake driver ---------------------------------------------------------
class _Machine:
    """Device memory as one byte array at BASE; pinned host buffers as numpy arrays."""
    BASE = 1 << 40

    def __init__(self, monkeypatch, nbytes):
        from ninfer.core.cuda import driver as d
        from ninfer.core.cuda.arena import Arena
        self.mem = np.zeros(nbytes, np.uint8)
        self.host, self.next_host, self.dtod = {}, 1 << 20, 0
        self.lock = threading.Lock()
        dev = self.dev
        monkeypatch.setattr(d, "mem_alloc", lambda n: self.BASE)
        monkeypatch.setattr(d, "memset_d8_async",
                            lambda dst, v, n, st: dev(dst, n).__setitem__(slice(None), v))
        monkeypatch.setattr(d, "copy_htod_async", lambda dst, src, n, st: dev(dst, n).__setitem__(
            slice(None), self.host_bytes(src, n)))
        monkeypatch.setattr(d, "copy_dtoh_async", lambda dst, src, n, st: self.host_bytes(
            dst, n).__setitem__(slice(None), dev(src, n)))
        monkeypatch.setattr(d, "copy_dtod_async", self._dtod)
        monkeypatch.setattr(d, "copy2d_dtod_async", self._dtod2d)
        monkeypatch.setattr(d, "PinnedBuffer", self._pinned)
        self.arena, self.stream, self.f32 = Arena(nbytes), _Stream(), False

    def _dtod(self, dst, src, n, st):
        assert st is self.stream                  # on the model's stream, in order with steps
        self.dtod += 1
        self.dev(dst, n)[:] = self.dev(src, n).copy()

    def _dtod2d(self, dst, dst_pitch, src, src_pitch, width, height, st):
        assert st is self.stream                  # a State slot's rows of every layer at once
        self.dtod += 1
        for i in range(height):
            self.dev(dst + i * dst_pitch, width)[:] = self.dev(src + i * src_pitch, width).copy()

    def dev(self, ptr, n):
        off = ptr - self.BASE
        assert 0 <= off and off + n <= self.mem.size, "device access outside the arena"
        return self.mem[off:off + n]

    def host_bytes(self, ptr, n):
        base = max(b for b in self.host if b <= ptr)
        return self.host[base][ptr - base:ptr - base + n]

    def _pinned(self, nbytes):
        m = self

        class Pinned:
            def __init__(self):
                # (a PinnedReserve pins on its own thread while the pools allocate staging)
                with m.lock:
                    self.ptr, self.array = m.next_host, np.zeros(max(int(nbytes), 1), np.uint8)
                    m.host[self.ptr] = self.array
                    m.next_host += int(nbytes) + 4096

            def free(self):
                m.host.pop(self.ptr, None)
        return Pinned()

    # what the pools use of the model
    def _current(self):
        pass

    def _forget_graphs_of(self, pool):
        pass


class _Stream:
    handle = 0

    def synchronize(self):
        pass


@pytest.mark.parametrize("f32", [False, True], ids=["bf16", "f32"])
def test_cuda_pool_copies_equal_the_numpy_pools(monkeypatch, f32):
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool, DeviceStatePool
    m = _Machine(monkeypatch, 4 << 20)
    m.f32 = f32
    cfg = _cfg()
    rng = np.random.default_rng(1)
    kv, st = DeviceKVPool(_pool_dev(m), cfg, 6, 4), DeviceStatePool(_pool_dev(m), cfg, 3)
    ref_kv, ref_st = KVPool.allocate(cfg, 6, 4), StatePool.allocate(cfg, 3)
    # bf16-representable values: the device KV stores bf16, the host image is float32
    img = tuple([(rng.standard_normal((6,) + a.shape[1:])
                  .astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
                 for a in ref_kv.k] for _ in range(2))
    kv.write_pages(range(6), img)
    ref_kv.write_pages(range(6), img)
    for s in range(3):
        image = ([rng.standard_normal(a.shape[1:]).astype(np.float32) for a in ref_st.conv],
                 [rng.standard_normal(a.shape[1:]).astype(np.float32) for a in ref_st.recurrent])
        st.write(s, image)
        ref_st.write(s, image)
    kv.copy_pages([5, 2], [1, 4])
    ref_kv.copy_pages([5, 2], [1, 4])
    st.copy(1, 2)
    ref_st.copy(1, 2)
    # a page copy per K / V array (two runs each); a State slot: one 2D copy per kind
    assert m.dtod == 2 * 2 * len(cfg.attention_layer_ids) + 2
    got, want = kv.read_pages(range(6)), ref_kv.read_pages(range(6))
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_array_equal(a, b)
    for s in range(3):
        for a, b in zip(st.read(s)[0] + st.read(s)[1], ref_st.read(s)[0] + ref_st.read(s)[1]):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(IndexError):
        kv.copy_pages([0], [6])                  # past the pool: another pool's memory
    with pytest.raises(IndexError):
        st.copy(3, 0)
    with pytest.raises(ValueError, match="overlap"):
        st.copy(1, 1)


@pytest.mark.parametrize("reserve", [False, True], ids=["pinned-on-demand", "reserve"])
def test_checkpoint_store_host_tier_on_the_cuda_pools(monkeypatch, reserve):
    """The CUDA pools' host tier (cuda/host_tier.py) under the checkpoint store: a host capture
    and a demotion copy pages and State into pinned rows, an install writes them back exactly
    (bf16 bits as they are), and dropping or promoting gives every row back, so a long run
    reuses the tier's chunks instead of pinning more host memory. With a PinnedReserve both
    pools' chunks are carved from it (one pinned buffer, nothing pinned on the way)."""
    from ninfer.models.qwen3_5.cuda.device_pools import DeviceKVPool, DeviceStatePool
    from ninfer.models.qwen3_5.cuda.host_tier import PinnedReserve
    from ninfer.models.qwen3_5.program.checkpoint_store import CheckpointStore
    from ninfer.models.qwen3_5.program.page_ledger import SlotPool
    from ninfer.models.qwen3_5.program.snapshots import host_bytes
    m = _Machine(monkeypatch, 8 << 20)
    cfg, rng, page = _cfg(), np.random.default_rng(4), 4
    res = PinnedReserve(80 << 20, m._current) if reserve else None   # (chunks of 32 MB)
    kv, st = DeviceKVPool(_pool_dev(m, res), cfg, 24, page), \
        DeviceStatePool(_pool_dev(m, res), cfg, 6)
    img = tuple([(rng.standard_normal((24,) + a.shape[1:]).astype(np.float32).view(np.uint32)
                  & 0xFFFF0000).view(np.float32) for a in kv.k] for _ in range(2))
    kv.write_pages(range(24), img)
    for s in range(3):
        st.write(s, ([rng.standard_normal(a.shape[1:]).astype(np.float32) for a in st.conv],
                     [rng.standard_normal(a.shape[1:]).astype(np.float32) for a in st.recurrent]))
    pages = PagePool(24, page, 3, 6)
    probe = kv.start_read_pages([0]).result()
    page_bytes = host_bytes(probe)
    probe.release()
    assert page_bytes * 2 == host_bytes(kv.read_pages([0]))       # bf16 bits, not float32
    store = CheckpointStore(kv, st, pages, SlotPool(3, first=3), page_bytes=page_bytes,
                            state_bytes=host_bytes(st.read(0)), host_budget_bytes=1 << 30,
                            device_page_budget=24)
    tokens = np.arange(1, 11, dtype=np.int32)
    assert pages.grow(0, 10)
    store.capture_host(1, tokens, pages.block_tables[0], 0)          # 3 pages, a partial one
    store.capture_device(2, tokens[:8], pages.block_tables[0], 0)
    store.demote(2)
    assert not store.info(1).on_device and not store.info(2).on_device
    tier_kv, tier_st = kv._tier, st._tier
    assert tier_kv.num_rows - tier_kv.num_free == 3 + 2 and tier_st.num_rows - tier_st.num_free == 2
    store.install(1, 1)                                              # host -> fresh pages
    assert set(pages.pages_of(1).tolist()).isdisjoint(pages.pages_of(0).tolist())
    got, want = kv.read_pages(pages.pages_of(1)), kv.read_pages(pages.pages_of(0)[:3])
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(st.read(1)[0] + st.read(1)[1], st.read(0)[0] + st.read(0)[1]):
        np.testing.assert_array_equal(a, b)
    store.promote(1, pages.block_tables[1], 1)                       # back on the device
    store.drop(2)
    assert tier_kv.num_free == tier_kv.num_rows and tier_st.num_free == tier_st.num_rows
    store.check()
    if reserve:                    # every chunk of both tiers inside the reserve's buffer
        base, = [p for p, a in m.host.items() if a.size == res.nbytes]
        chunks = kv._tier._chunks + st._tier._chunks
        assert kv._tier.chunks_pinned == st._tier.chunks_pinned == 0 and len(chunks) == 2
        assert all(base <= c.ptr and c.ptr + c.array.size <= base + res.nbytes for c in chunks)
        assert 0 < res.bytes_left < res.nbytes
    pinned = len(m.host)
    for turn in range(4):                                            # captures and drops reuse
        store.capture_host(10 + turn, tokens, pages.block_tables[0], 0)
        store.drop(10 + turn)
    assert len(m.host) == pinned and tier_kv.num_free == tier_kv.num_rows
    kv.close()
    st.close()
    if reserve:
        assert base in m.host                                        # the reserve, until freed
        res.free()
        assert base not in m.host
    else:
        assert len(m.host) < pinned                                  # the tiers' chunks freed


def test_pinned_reserve_hands_out_aligned_disjoint_chunks_then_hostrows_pin_on_demand(
        monkeypatch):
    """PinnedReserve: pinned once on its thread; HostRows carve chunks from it (page-aligned,
    disjoint, inside it), and when it is used up pin on demand, counted in chunks_pinned and
    pin_seconds; a reserve that could not pin leaves the tier pinning on demand."""
    from ninfer.core.cuda import driver as d
    from ninfer.errors import DeviceError
    from ninfer.models.qwen3_5.cuda.host_tier import HostRows, PinnedReserve
    m = _Machine(monkeypatch, 1 << 20)
    res = PinnedReserve(3 * 4096 + 100, m._current)
    assert res.bytes_left == res.nbytes and len(m.host) == 1
    base = next(iter(m.host))
    rows = HostRows([1000, 500], chunk_bytes=3000, reserve=res)      # chunks of 3000 bytes
    got = rows.take(2)
    assert got == [0, 1] and rows.chunks_pinned == 0 and rows.num_rows == 2
    c0 = rows._chunks[0]
    assert c0.ptr == base and c0.array.size == 3000
    rows.take(4)                                                     # two more chunks
    ptrs = [c.ptr for c in rows._chunks]
    assert ptrs == [base, base + 4096, base + 8192] and rows.chunks_pinned == 0
    assert res.bytes_left == 100
    rows.take(2)                                                     # the reserve is used up
    assert rows.chunks_pinned == 1 and len(m.host) == 2
    c0.array[:] = 7                                                  # disjoint views
    assert not rows._chunks[1].array.any()
    rows.free()
    assert len(m.host) == 1                                          # the reserve's own buffer
    res.free()
    assert not m.host

    def fail(nbytes):
        raise DeviceError("cuMemHostAlloc failed: CUDA_ERROR_OUT_OF_MEMORY")
    monkeypatch.setattr(d, "PinnedBuffer", fail)
    broken = PinnedReserve(1 << 20, m._current)
    assert broken.bytes_left == 0 and broken.take(10) is None
    broken.free()


def test_host_rows_take_the_lowest_rows_and_reuse_them_after_their_event(monkeypatch):
    """HostRows: chunks added as needed, the lowest free rows taken (a checkpoint's rows mostly
    runs), runs cut at chunk ends (a chunk's rows are contiguous only within it), rows given
    back after an event only once it has passed."""
    from ninfer.models.qwen3_5.cuda.host_tier import HostRows
    m = _Machine(monkeypatch, 1 << 20)
    rows = HostRows([64, 32], chunk_bytes=3 * 96)
    assert rows.rows_per_chunk == 3 and rows.num_rows == 0 and rows.pin_seconds == 0.0
    assert rows.take(4) == [0, 1, 2, 3] and rows.num_rows == 6 and len(m.host) == 2
    pinned = rows.pin_seconds
    assert pinned > 0.0                            # (the two chunks' allocation, timed)
    assert rows.runs([5, 6, 7, 8], [0, 1, 2, 3]) == [[5, 0, 3], [8, 3, 1]]
    assert rows.runs([5, 7], [0, 1]) == [[5, 0, 1], [7, 1, 1]]
    # array 1's block of chunk 0 starts after array 0's three rows
    assert rows.ptr(1, 2) - rows.ptr(0, 0) == 3 * 64 + 2 * 32
    assert rows.ptr(0, 3) == rows._chunks[1].ptr

    class Event:
        passed = False

        def query(self):
            return self.passed

        def synchronize(self):
            self.passed = True

        def destroy(self):
            pass
    event = Event()
    rows.give([1, 2], after=event)
    assert rows.take(2) == [4, 5]                  # 1 and 2 wait for their copies
    event.passed = True
    assert rows.take(1) == [1] and rows.num_free == 1
    assert rows.pin_seconds == pinned               # reused rows: nothing pinned
    rows.give([0, 1, 3, 4, 5])
    rows.give([2], after=Event())
    rows.free()                                    # waits for what is pending, frees the chunks
    assert rows.num_rows == 0 and not m.host
