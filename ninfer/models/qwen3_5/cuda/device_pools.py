"""Device KV and State pools, carved from the model's arena. Same layouts and host-facing methods
as `state.py` (KV is bf16 on the device, fp32 for a dtype="float32" model; host copies are float32):

    k[a], v[a]      [num_pages, page_size, nkv, head_dim]  bf16 (fp32)
                    kv_dtype "fp8" / "int8": uint8 [num_pages, page bytes], each page its codes
                    [page_size, nkv, head_dim] (padded to 4 bytes) then its float32 scales
                    [page_size, nkv] (memory_plan.quantized_page_bytes, kernels/common.py
                    kvq_row); host copies are numpy's (ops/kv_quant.QuantizedPages.raw: codes
                    then scales, no padding), so they move the bytes as they are
    conv[l]         [num_slots, conv_dim, K-1]              fp32
    recurrent[l]    [num_slots, nv, dk, dv]                 fp32
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ....contracts import ReadyRead
from ....core.cuda import driver as _d
from ....core.cuda.arena import DeviceArray, _round_up
from ..config import TextConfig
from .host_tier import HostRows, PinnedReserve, TierImage, TierRead
from ..memory_plan import kv_layer_shapes, quantized_page_bytes
from ..state import _copy_indices


def _bf16_bits(a) -> np.ndarray:
    if getattr(a, "dtype", None) == np.uint16:      # bf16 bits already (start_read_pages')
        return np.ascontiguousarray(a)
    import ml_dtypes
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


def _f32_array(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32)


def _bits_f32(u16) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _checked_indices(indices, count: int, what: str) -> list:
    """Plain ints in [0, count): a device address past the pool is another pool's memory (or
    the weights), where numpy would raise IndexError."""
    out = [int(i) for i in np.asarray(indices).reshape(-1)]
    bad = [i for i in out if not 0 <= i < count]
    if bad:
        raise IndexError(f"{what} {bad[0]} out of range [0, {count})")
    return out


def _check_image(arrs, host, lead: tuple, what: str) -> None:
    """`host` holds one array per pool array, each of shape lead + that array's row shape."""
    if len(host) != len(arrs):
        raise ValueError(f"{what}: {len(host)} layer arrays for {len(arrs)} layers")
    for a, h in zip(arrs, host):
        if np.shape(h) != lead + a.shape[1:]:
            raise ValueError(f"{what}: array of shape {list(np.shape(h))}, expected "
                             f"{list(lead + a.shape[1:])}")


class HostStaging:
    """The pinned host memory the pools' host copies go through, kept between copies: a
    cuMemHostAlloc + cuMemFreeHost of tens of MB costs milliseconds, and the context cache reads
    and writes State images and pages (demote, promote, host-tier captures, Snapshots) on the
    worker thread between decode steps. One buffer, grown to the largest copy up to keep_bytes;
    a larger copy (a Snapshot of a long sequence) takes a buffer of its own for that call. The
    copies are synchronous, so one buffer serves every pool of the model."""

    def __init__(self, keep_bytes: int = 256 << 20):
        self.keep_bytes = int(keep_bytes)
        self._buf = None
        self._buf_bytes = 0

    def take(self, nbytes: int):
        if nbytes > self.keep_bytes:
            return _d.PinnedBuffer(nbytes)
        if self._buf is None or self._buf_bytes < nbytes:
            self.free()
            self._buf, self._buf_bytes = _d.PinnedBuffer(nbytes), nbytes
        return self._buf

    def give(self, buf) -> None:
        if buf is not self._buf:
            buf.free()

    def free(self) -> None:
        if self._buf is not None:
            self._buf.free()
            self._buf, self._buf_bytes = None, 0


def _runs(src_rows, dst_rows=None) -> list:
    """(first source row, first destination row, count) of each maximal run where both advance
    by one (dst_rows None: the positions 0, 1, 2, ... of a packed host buffer): one copy per run
    instead of one per row. A prefill chunk takes its pages together, so a checkpoint's or a
    Snapshot's pages are mostly runs; each copy costs microseconds of host time, and a 10K-token
    checkpoint of the 9B is 625 pages x 16 arrays."""
    src = [int(r) for r in src_rows]
    dst = list(range(len(src))) if dst_rows is None else [int(r) for r in dst_rows]
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _rows_bytes(arrays, rows) -> int:
    return len(rows) * sum(a.nbytes // a.shape[0] for a in arrays)


def _enqueue_rows_out(arrays, rows, buf, stream) -> None:
    """Queue the host copies of rows `rows` of each array into pinned `buf`, array after array
    (one copy per run of consecutive rows)."""
    runs, off = _runs(rows), 0
    for a in arrays:
        size = a.nbytes // a.shape[0]
        for r, i, n in runs:
            _d.copy_dtoh_async(buf.ptr + off + i * size, a.at(r), n * size, stream)
        off += len(rows) * size


def _unpack_rows(arrays, rows, buf) -> list:
    """The host arrays of what _enqueue_rows_out copied into buf (copies: buf is reused)."""
    out, off = [], 0
    for a in arrays:
        n = len(rows) * (a.nbytes // a.shape[0])
        out.append(buf.array[off: off + n].view(a.dtype).reshape((len(rows),) + a.shape[1:])
                   .copy())
        off += n
    return out


def _copy_rows_out(arrays, rows, stream, staging: HostStaging) -> list:
    """Host copies of rows `rows` of each device array (one pinned buffer, one copy per run of
    consecutive rows, one sync: a snapshot of a long sequence is thousands of pages)."""
    buf = staging.take(_rows_bytes(arrays, rows))
    try:
        _enqueue_rows_out(arrays, rows, buf, stream)
        stream.synchronize()
        return _unpack_rows(arrays, rows, buf)
    finally:
        staging.give(buf)


class PinnedPool:
    """Pinned host buffers for the asynchronous pools' writes of plain host arrays (a resume
    from a Snapshot; several in flight at once, so not HostStaging's one buffer), kept for
    reuse up to keep_bytes: allocating tens of MB of pinned memory costs milliseconds on the
    worker thread. (Reads for the context cache go to the host tier, host_tier.py.)"""

    def __init__(self, keep_bytes: int = 512 << 20):
        self.keep_bytes = int(keep_bytes)
        self._free: list = []
        self._pending: list = []        # (buffer, event): back in the pool once it has passed

    def take(self, nbytes: int):
        self._reclaim()
        fits = [b for b in self._free if b.nbytes >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.nbytes)
            self._free.remove(buf)
            return buf
        return _d.PinnedBuffer(max(int(nbytes), 1))

    def give(self, buf) -> None:
        self._free.append(buf)
        while sum(b.nbytes for b in self._free) > self.keep_bytes:
            big = max(self._free, key=lambda b: b.nbytes)
            self._free.remove(big)
            big.free()

    def give_after(self, buf, event) -> None:
        """Give buf back once `event` (recorded after the copies that read it) has passed."""
        self._pending.append((buf, event))

    def _reclaim(self) -> None:
        still = []
        for buf, event in self._pending:
            if event.query():
                event.destroy()
                self.give(buf)
            else:
                still.append((buf, event))
        self._pending = still

    def free(self) -> None:
        """(after the streams were synchronised: every pending copy has run)"""
        for buf, event in self._pending:
            event.destroy()
            buf.free()
        for b in self._free:
            b.free()
        self._free, self._pending = [], []


def _tier_read(dev: "PoolDevice", tier: HostRows, arrays, rows, split: int, parts):
    """Rows of arrays into fresh rows of tier: a TierRead on the copy stream after the steps
    queued so far, or (no copy stream) on the model's stream, waited for now."""
    if dev.copy_stream is not None:
        return TierRead(tier, arrays, rows, split, parts, stream=dev.copy_stream, bind=dev.bind,
                        after=dev.stream)
    return ReadyRead(TierRead(tier, arrays, rows, split, parts, stream=dev.stream,
                              bind=dev.bind).result())


def _tier_write(dev: "PoolDevice", tier: HostRows, arrays, rows, image: TierImage,
                what: str) -> None:
    """A TierImage back into rows of arrays on the model's stream: waited for now, or (with a
    copy stream: the asynchronous pools) marked by an event the image's release waits for."""
    if image.tier is not tier or len(image.rows) != len(rows):
        raise ValueError(f"{what} image: {len(image.rows)} rows of another pool's host tier "
                         f"or for {len(rows)} rows")
    dev.bind()
    tier.enqueue_in(arrays, image.rows, rows, dev.stream)
    if dev.copy_stream is None:
        dev.stream.synchronize()
    else:
        event = _d.Event(timing=False)
        event.record(dev.stream)
        image.used_until(event)


def _free_tier(dev: "PoolDevice", tier: Optional[HostRows]) -> None:
    if tier is not None:
        dev.stream.synchronize()
        if dev.copy_stream is not None:
            dev.copy_stream.synchronize()
        tier.free()


def _copy_rows_in(arrays, rows, images, stream, staging: HostStaging,
                  pinned: "PinnedPool" = None) -> None:
    """Write images[i][j] (host, the array's dtype) into row rows[j] of arrays[i]. With `pinned`
    (the pools' asynchronous copies): through a buffer of its own that goes back to the pool
    once an event after the copies has passed, so nothing waits here; the model's stream runs
    the copies before any step queued after them."""
    pool = staging if pinned is None else pinned
    buf = pool.take(_rows_bytes(arrays, rows))
    runs = _runs(rows)
    try:
        off = 0
        for a, image in zip(arrays, images):
            size = a.nbytes // a.shape[0]
            n = len(rows) * size
            buf.array[off: off + n] = np.ascontiguousarray(image, a.dtype).reshape(-1).view(np.uint8)
            for r, i, k in runs:
                _d.copy_htod_async(a.at(r), buf.ptr + off + i * size, k * size, stream)
            off += n
    except BaseException:
        stream.synchronize()          # copies queued before the failure still read buf
        pool.give(buf)
        raise
    if pinned is None:
        stream.synchronize()          # the pinned buffer is reused by the next copy
        staging.give(buf)
    else:
        event = _d.Event(timing=False)
        event.record(stream)
        pinned.give_after(buf, event)


def _copy_rows(arrays, src_rows, dst_rows, stream) -> None:
    """Row dst_rows[i] of every array becomes a copy of row src_rows[i]: device to device on
    the model's stream, so in order with the steps before and after it (nothing waits). One
    copy per run where both advance by one (the callers' _copy_indices refused sources and
    destinations that share a row, so a run never overlaps itself)."""
    runs = _runs(src_rows, dst_rows)
    for a in arrays:
        size = a.nbytes // a.shape[0]
        for s, d, n in runs:
            _d.copy_dtod_async(a.at(d), a.at(s), n * size, stream)


def _take_all(arena, shapes, dtype, what: str) -> list:
    """One arena array per shape, all or none (a pool that does not fit leaks nothing)."""
    taken = []
    try:
        for shape in shapes:
            taken.append(arena.take(shape, dtype, what))
    except BaseException:
        for a in taken:
            arena.give(a)
        raise
    return taken


@dataclass(frozen=True)
class PoolDevice:
    """What a device pool uses: the arena its arrays live in, the stream its copies run on,
    bind() (make the context current in this thread), on_close(pool) (the model destroys the
    graphs captured over the pool), staging (the pinned memory host copies go through), f32
    (float32 KV instead of bf16) and kv_dtype ("fp8" / "int8": quantized KV, f32 unused)."""
    arena: object
    stream: object
    bind: Callable[[], None]
    on_close: Callable[[object], None]
    staging: HostStaging
    f32: bool = False
    kv_dtype: Optional[str] = None
    # host reads that run beside the model's steps (start_read_pages / start_read): a second
    # stream and its pinned buffers; None: those reads are synchronous (reads_async False)
    copy_stream: object = None
    pinned: Optional[PinnedPool] = None
    # the host tier's memory pinned ahead (host_tier.PinnedReserve), shared by both pools' tiers
    host_reserve: Optional[PinnedReserve] = None


class DeviceKVPool:
    def __init__(self, dev: PoolDevice, cfg: TextConfig, num_pages: int, page_size: int,
                 extra: tuple = ()):
        """extra: attention layers past the model's (a drafter's, last), (kv heads, head_dim)
        each (memory_plan.kv_layer_shapes), paged alike, so every page copy carries them."""
        self.page_size = int(page_size)
        self._dev = dev
        layers = kv_layer_shapes(cfg, extra)
        shapes = [(int(num_pages), self.page_size, nkv, hd) for nkv, hd in layers]
        n = len(layers)
        self._f32 = bool(dev.f32)
        self.kv_dtype = dev.kv_dtype
        dtype = np.float32 if self._f32 else np.uint16
        if self.kv_dtype is not None:
            # per layer, (codes bytes, page bytes, host page bytes): a host page is codes +
            # scales without the padding
            self._qpages = [quantized_page_bytes(*shp[1:])
                            + (int(np.prod(shp[1:])) + 4 * int(np.prod(shp[1:3])),)
                            for shp in shapes]
            shapes, dtype = [(int(num_pages), q[1]) for q in self._qpages], np.uint8
        kv = _take_all(dev.arena, shapes * 2, dtype, f"KV pool ({num_pages} pages)")
        self.k, self.v = kv[:n], kv[n:]
        self._num_pages = int(num_pages)
        self._tier: Optional[HostRows] = None      # the host tier's rows, made when first read
        # a pool dropped without close() (scoring's temporary pools) still returns its pages
        weakref.finalize(self, dev.arena.give_later, self.k + self.v)
        for a in self.k + self.v:
            _d.memset_d8_async(a.ptr, 0, a.nbytes, dev.stream)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def reads_async(self) -> bool:
        return self._dev.copy_stream is not None

    def read_pages(self, pages) -> tuple:
        """Host copy of the given pages: float32 [len(pages), page_size, nkv, head_dim] per
        layer, or with kv_dtype the numpy backend's bytes (QuantizedPages.raw)."""
        pages = _checked_indices(pages, self._num_pages, "KV page")
        self._dev.bind()
        rows = _copy_rows_out(self.k + self.v, pages, self._dev.stream, self._dev.staging)
        return self._image(rows, (lambda b: b) if self._f32 else _bits_f32)

    def start_read_pages(self, pages):
        """The pages into the pool's host tier (host_tier.py; contracts.KVPoolProtocol): on the
        copy stream beside the steps, or synchronously without one. The image is a TierImage
        of the pool's own bytes (a bf16 pool's stay bf16 bits), which write_pages takes back:
        the context cache's host tier keeps it only to write it back, and float32 would double
        its bytes and cost the worker a conversion each way."""
        pages = _checked_indices(pages, self._num_pages, "KV page")
        return _tier_read(self._dev, self._host_tier(), self.k + self.v, pages, len(self.k),
                          self._tier_parts)

    @property
    def host_pin_seconds(self) -> float:
        """Time its host tier spent pinning new memory (part of the copies' time)."""
        return self._tier.pin_seconds if self._tier is not None else 0.0

    def _host_tier(self) -> HostRows:
        if self._tier is None:
            self._tier = HostRows([a.nbytes // a.shape[0] for a in self.k + self.v],
                                  reserve=self._dev.host_reserve)
        return self._tier

    def _tier_parts(self, arrays) -> list:
        return [self._host_bytes(a, i) for i, a in enumerate(arrays)] \
            if self.kv_dtype is not None else arrays

    def _image(self, rows, widen) -> tuple:
        """(k list, v list) of the rows of self.k + self.v: quantized pages as numpy's bytes,
        else each through `widen`."""
        out = [self._host_bytes(b, i) if self.kv_dtype is not None else widen(b)
               for i, b in enumerate(rows)]
        n = len(self.k)
        return out[:n], out[n:]

    def write_pages(self, pages, data: tuple) -> None:
        pages = _checked_indices(pages, self._num_pages, "KV page")
        if isinstance(data, TierImage):
            _tier_write(self._dev, self._tier, self.k + self.v, pages, data, "KV pages")
            return
        if self.kv_dtype is not None:
            hosts = list(data[0]) + list(data[1])
            if len(hosts) != len(self.k) + len(self.v):
                raise ValueError(f"KV pages image: {len(hosts)} layer arrays for "
                                 f"{len(self.k) + len(self.v)}")
            images = [self._device_bytes(h, len(pages), i) for i, h in enumerate(hosts)]
        else:
            for arrs, host in zip((self.k, self.v), data):
                _check_image(arrs, host, (len(pages),), "KV pages image")
            host = _f32_array if self._f32 else _bf16_bits
            images = [host(h) for h in list(data[0]) + list(data[1])]
        self._dev.bind()
        _copy_rows_in(self.k + self.v, pages, images, self._dev.stream, self._dev.staging,
                      self._dev.pinned)

    def _host_bytes(self, rows, i: int) -> np.ndarray:
        """Device page rows of array i (of self.k + self.v) -> numpy's host bytes (the padding
        after the codes dropped)."""
        codes, whole, qhost = self._qpages[i % len(self.k)]
        used = qhost - (whole - codes)
        return rows if codes == used else np.concatenate([rows[:, :used], rows[:, codes:]], 1)

    def _device_bytes(self, host, n: int, i: int) -> np.ndarray:
        """numpy's host bytes of n pages of array i -> device page rows (zero padding after the
        codes)."""
        codes, whole, qhost = self._qpages[i % len(self.k)]
        if np.shape(host) != (n, qhost):
            raise ValueError(f"KV pages image: array of shape {list(np.shape(host))}, expected "
                             f"{[n, qhost]} (bytes of {self.kv_dtype} pages)")
        host = np.asarray(host, np.uint8)
        used = qhost - (whole - codes)
        out = np.zeros((n, whole), np.uint8)
        out[:, :used] = host[:, :used]
        out[:, codes:] = host[:, used:]
        return out

    def copy_pages(self, src_pages, dst_pages) -> None:
        """Page dst_pages[i] becomes a copy of src_pages[i] in every layer (numpy KVPool's
        contract): one cuMemcpyDtoDAsync per page and layer array."""
        src, dst = _copy_indices(src_pages, dst_pages, self._num_pages, "KV page")
        self._dev.bind()
        _copy_rows(self.k + self.v, src.tolist(), dst.tolist(), self._dev.stream)

    def close(self) -> None:
        self._dev.bind()
        self._dev.on_close(self)
        _free_tier(self._dev, self._tier)
        self._tier = None
        for a in self.k + self.v:
            self._dev.arena.give(a)
        self.k, self.v = [], []


class DeviceStatePool:
    """The GDN States: per linear layer a conv window array [slots, conv_dim, kernel - 1] and a
    recurrent array [slots, nv, dk, dv] (fp32). Each kind is ONE arena allocation, layer after
    layer (each layer's slots 256-byte aligned), so a slot's rows of every layer lie one layer's
    bytes apart and one 2D copy moves them all (copy: a speculative select, a context-cache
    capture or install), instead of a copy per layer array (48 driver calls a slot at 9B)."""

    def __init__(self, dev: PoolDevice, cfg: TextConfig, num_slots: int):
        self._dev = dev
        n = len(cfg.linear_layer_ids)
        S = self._num_slots = int(num_slots)
        kinds = ((cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1),
                 (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))
        # per kind: (the whole allocation, one layer's bytes: the 2D copy's pitch)
        self._wholes = []
        views = []
        if n:
            pitches = [_round_up(S * 4 * int(np.prod(row))) for row in kinds]
            wholes = _take_all(dev.arena, [(n * p // 4,) for p in pitches], np.float32,
                               f"state pool ({num_slots} slots)")
            self._wholes = list(zip(wholes, pitches))
            views = [[DeviceArray(w.ptr + i * p, (S,) + row, np.float32) for i in range(n)]
                     for (w, p), row in zip(self._wholes, kinds)]
        self.conv, self.recurrent = views if views else ([], [])
        self._tier: Optional[HostRows] = None      # the host tier's rows, made when first read
        weakref.finalize(self, dev.arena.give_later, [w for w, _ in self._wholes])
        for w, _ in self._wholes:
            _d.memset_d8_async(w.ptr, 0, w.nbytes, dev.stream)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def zero(self, slot: int) -> None:
        slot, = _checked_indices(slot, self._num_slots, "state slot")
        self._dev.bind()
        st = self._dev.stream
        for a in self.conv + self.recurrent:
            _d.memset_d8_async(a.at(slot), 0, a.nbytes // a.shape[0], st)
        st.synchronize()

    @property
    def reads_async(self) -> bool:
        return self._dev.copy_stream is not None

    def read(self, slot: int) -> tuple:
        slot, = _checked_indices(slot, self._num_slots, "state slot")
        self._dev.bind()
        return self._image(_copy_rows_out(self.conv + self.recurrent, [slot], self._dev.stream,
                                          self._dev.staging))

    @property
    def host_pin_seconds(self) -> float:
        """Time its host tier spent pinning new memory (part of the copies' time)."""
        return self._tier.pin_seconds if self._tier is not None else 0.0

    def start_read(self, slot: int):
        """The slot into the pool's host tier, as DeviceKVPool.start_read_pages
        (contracts.StatePoolProtocol)."""
        slot, = _checked_indices(slot, self._num_slots, "state slot")
        if self._tier is None:
            self._tier = HostRows([a.nbytes // a.shape[0] for a in self.conv + self.recurrent],
                                  reserve=self._dev.host_reserve)
        return _tier_read(self._dev, self._tier, self.conv + self.recurrent, [slot],
                          len(self.conv), lambda arrays: [a[0] for a in arrays])

    def _image(self, arrays) -> tuple:
        n = len(self.conv)
        return [a[0] for a in arrays[:n]], [a[0] for a in arrays[n:]]

    def write(self, slot: int, image: tuple) -> None:
        slot, = _checked_indices(slot, self._num_slots, "state slot")
        if isinstance(image, TierImage):
            _tier_write(self._dev, self._tier, self.conv + self.recurrent, [slot], image,
                        "StateImage")
            return
        for arrs, host in zip((self.conv, self.recurrent), image):
            _check_image(arrs, host, (), "StateImage")
        self._dev.bind()
        _copy_rows_in(self.conv + self.recurrent, [slot],
                      [np.asarray(h, np.float32)[None] for h in list(image[0]) + list(image[1])],
                      self._dev.stream, self._dev.staging, self._dev.pinned)

    def copy(self, src_slot: int, dst_slot: int) -> None:
        """Slot dst_slot's StateImage becomes a copy of src_slot's (numpy StatePool's contract):
        one 2D copy per kind over every layer (a copy per layer array where a layer's bytes
        exceed the 2D copy's pitch limit)."""
        src, dst = _copy_indices([src_slot], [dst_slot], self._num_slots, "state slot")
        self._dev.bind()
        s, d = int(src[0]), int(dst[0])
        for (whole, pitch), arrays in zip(self._wholes, (self.conv, self.recurrent)):
            row = arrays[0].nbytes // self._num_slots
            if pitch <= _d.MAX_PITCH:
                _d.copy2d_dtod_async(arrays[0].at(d), pitch, arrays[0].at(s), pitch, row,
                                     len(arrays), self._dev.stream)
            else:
                _copy_rows(arrays, [s], [d], self._dev.stream)

    def close(self) -> None:
        self._dev.bind()
        self._dev.on_close(self)
        _free_tier(self._dev, self._tier)
        self._tier = None
        for w, _ in self._wholes:
            self._dev.arena.give(w)
        self._wholes, self.conv, self.recurrent = [], [], []
