"""The context cache's host tier on CUDA: pinned host rows in a device pool's own layout.

A checkpoint demoted to the host (or captured there) was copied into one pinned staging buffer,
then unpacked into fresh numpy arrays, and written back the other way round. On the H200 that
ran at ~1 GB/s (100-600 ms a 9B checkpoint, on the request's path): the fresh arrays fault their
pages in and a copy over the staging buffer's size took a pinned buffer of its own. Here the
host tier is `HostRows`: rows of pinned memory shaped like the device rows they mirror (a KV
page of every K and V array, or a State slot of every conv and recurrent array), allocated by
chunks as needed and reused once given back. A device -> host copy lands in its place and a host
-> device copy reads from it, one copy per array per run of rows consecutive on both sides.

A `TierImage` is such rows as a host image: what the pools' start_read_pages / start_read give
and write_pages / write take back. release() gives its rows back, after the copies that read
them have run (an event). Read as a tuple it is (k list, v list) / (conv list, recurrent list)
of numpy copies, for anyone else (tests).

Pinning is the expensive part of a first copy: cuMemHostAlloc locks and zeroes its pages at
~2.3 GB/s on the H200 host, so a 9B State image (53 MB) pinned on demand cost a request ~25 ms
and a turn that demoted seven checkpoints 159 of its 186 ms of copies. `PinnedReserve` pins the
host tier's budget ahead, on a thread beside the weight load, and HostRows carve their chunks
from it; only what outgrows it is pinned on a request's path (timed: pin_seconds).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from ....core.cuda import driver as _d

CHUNK_BYTES = 32 << 20      # a KV chunk: 64 pages of the 9B in bf16; a State image is its own
_ALIGN = 4096               # chunks of a reserve start on a page

log = logging.getLogger("ninfer.cuda")


class _Slice:
    """A chunk carved from a PinnedReserve: PinnedBuffer's ptr and array; free() is the
    reserve's (at its close)."""
    __slots__ = ("ptr", "array", "nbytes")

    def __init__(self, ptr: int, array, nbytes: int):
        self.ptr, self.array, self.nbytes = ptr, array, nbytes

    def free(self) -> None:
        pass


class PinnedReserve:
    """nbytes of pinned host memory, pinned by a thread started here (bind: make the context
    current in it), handed out by take() until it is used up. Chunks are never given back one by
    one (HostRows keeps its chunks until it is freed), so it is a bump allocator; free() after
    every user is done."""

    def __init__(self, nbytes: int, bind: Callable[[], None]):
        self.nbytes = int(nbytes)
        self._buf: Optional[_d.PinnedBuffer] = None
        self._used = 0
        self._thread = threading.Thread(target=self._pin, args=(bind,), daemon=True,
                                        name="ninfer-pin-host-tier")
        self._thread.start()

    def _pin(self, bind) -> None:
        try:
            bind()
            self._buf = _d.PinnedBuffer(self.nbytes)
        except Exception as exc:   # noqa: BLE001 - the tier pins on demand instead
            log.warning("could not pin %d bytes for the context cache's host tier ahead (%s); "
                        "its copies pin as they go", self.nbytes, exc)

    @property
    def bytes_left(self) -> int:
        self._thread.join()
        return self.nbytes - self._used if self._buf is not None else 0

    def take(self, nbytes: int) -> Optional[_Slice]:
        """nbytes of the reserve (waits for the pinning thread), or None when too few are left."""
        nbytes = int(nbytes)
        if nbytes > self.bytes_left:
            return None
        start = self._used
        self._used = min(self.nbytes, -(-(start + nbytes) // _ALIGN) * _ALIGN)
        return _Slice(self._buf.ptr + start, self._buf.array[start:start + nbytes], nbytes)

    def free(self) -> None:
        """(after every HostRows carved from it was freed and the streams synchronised)"""
        self._thread.join()
        if self._buf is not None:
            self._buf.free()
            self._buf = None


class HostRows:
    """Pinned rows for device arrays whose rows are row_bytes[a] bytes: chunks of
    rows_per_chunk rows laid out array by array, so consecutive rows of one chunk are
    contiguous in each array's block."""

    def __init__(self, row_bytes, chunk_bytes: int = CHUNK_BYTES,
                 reserve: Optional[PinnedReserve] = None):
        self.reserve = reserve
        self.row_bytes = [int(b) for b in row_bytes]
        self.rows_per_chunk = max(1, int(chunk_bytes) // max(sum(self.row_bytes), 1))
        self._starts = np.concatenate([[0], np.cumsum(self.row_bytes)[:-1]]) * self.rows_per_chunk
        self._chunks: list = []
        self._free: list = []            # row ids
        self._pending: list = []         # (rows, event): free once the event has passed
        self.pin_seconds = 0.0           # spent pinning new chunks (on the caller's path)
        self.chunks_pinned = 0           # chunks pinned on the caller's path (the reserve used up)

    @property
    def num_rows(self) -> int:
        return len(self._chunks) * self.rows_per_chunk

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list:
        """n rows, the lowest free ones (so a checkpoint's rows are mostly runs); chunks are
        added when too few are free."""
        self._reclaim(wait=False)
        while len(self._free) < n:
            first = self.num_rows
            t0 = time.perf_counter()
            size = self.rows_per_chunk * sum(self.row_bytes)
            chunk = self.reserve.take(size) if self.reserve is not None else None
            if chunk is None:
                chunk = _d.PinnedBuffer(size)
                self.chunks_pinned += 1
            self._chunks.append(chunk)
            self.pin_seconds += time.perf_counter() - t0
            self._free.extend(range(first, first + self.rows_per_chunk))
        self._free.sort()
        rows, self._free = self._free[:n], self._free[n:]
        return rows

    def give(self, rows, after=None) -> None:
        """Rows back, at once or (after: an event recorded after the copies that read them)
        once it has passed."""
        if after is None:
            self._free.extend(int(r) for r in rows)
        else:
            self._pending.append((list(rows), after))

    def _reclaim(self, wait: bool) -> None:
        still = []
        for rows, event in self._pending:
            if wait or event.query():
                if wait:
                    event.synchronize()
                event.destroy()
                self._free.extend(rows)
            else:
                still.append((rows, event))
        self._pending = still

    def ptr(self, array: int, row: int) -> int:
        c, r = divmod(int(row), self.rows_per_chunk)
        return self._chunks[c].ptr + int(self._starts[array]) + r * self.row_bytes[array]

    def runs(self, dev_rows, host_rows) -> list:
        """(first device row, first host row, count) of each run where both advance by one
        within one chunk."""
        runs = []
        for d, h in zip(dev_rows, host_rows):
            d, h = int(d), int(h)
            if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == h \
                    and h % self.rows_per_chunk:
                runs[-1][2] += 1
            else:
                runs.append([d, h, 1])
        return runs

    def enqueue_out(self, arrays, dev_rows, host_rows, stream) -> None:
        """Queue device rows -> host rows of every array on stream."""
        runs = self.runs(dev_rows, host_rows)
        for a, arr in enumerate(arrays):
            size = self.row_bytes[a]
            for d, h, n in runs:
                _d.copy_dtoh_async(self.ptr(a, h), arr.at(d), n * size, stream)

    def enqueue_in(self, arrays, host_rows, dev_rows, stream) -> None:
        """Queue host rows -> device rows of every array on stream."""
        runs = self.runs(dev_rows, host_rows)
        for a, arr in enumerate(arrays):
            size = self.row_bytes[a]
            for d, h, n in runs:
                _d.copy_htod_async(arr.at(d), self.ptr(a, h), n * size, stream)

    def arrays(self, arrays, host_rows) -> list:
        """numpy copies of host_rows, one array per device array (its dtype and row shape)."""
        out = []
        for a, arr in enumerate(arrays):
            size = self.row_bytes[a]
            rows = [self._chunks[r // self.rows_per_chunk].array[
                int(self._starts[a]) + (r % self.rows_per_chunk) * size:][:size]
                for r in host_rows]
            flat = np.concatenate(rows) if rows else np.zeros(0, np.uint8)
            out.append(flat.view(arr.dtype).reshape((len(host_rows),) + tuple(arr.shape[1:])))
        return out

    def free(self) -> None:
        """(after the streams were synchronised: no copy reads or writes the rows)"""
        self._reclaim(wait=True)
        for c in self._chunks:
            c.free()
        self._chunks, self._free = [], []


class TierImage:
    """Rows of a HostRows holding a host image of device rows of `arrays`. `in_use`: an event
    after the last queued copy that reads the rows (release waits for it before reuse)."""

    def __init__(self, tier: HostRows, rows: list, arrays, split: int,
                 convert: Callable[[list], list] = None):
        self.tier, self.rows, self._arrays, self._split = tier, list(rows), arrays, int(split)
        self._convert = convert or (lambda arrs: arrs)
        self.in_use = None

    @property
    def nbytes(self) -> int:
        return len(self.rows) * sum(self.tier.row_bytes)

    def parts(self) -> tuple:
        arrs = self._convert(self.tier.arrays(self._arrays, self.rows))
        return list(arrs[:self._split]), list(arrs[self._split:])

    def __iter__(self):
        return iter(self.parts())

    def __getitem__(self, i):
        return self.parts()[i]

    def __len__(self) -> int:
        return 2

    def used_until(self, event) -> None:
        if self.in_use is not None:
            self.in_use.destroy()
        self.in_use = event

    def release(self) -> None:
        if self.rows:
            self.tier.give(self.rows, self.in_use)
            self.rows, self.in_use = [], None


class TierRead:
    """A device -> host read into fresh rows of `tier`, queued on `stream`: with `after` (the
    model's stream) the copy stream, after an event on it, beside the steps; without, the
    model's stream, waited for at once. done() asks without waiting; result() waits and gives
    the TierImage."""

    def __init__(self, tier: HostRows, arrays, dev_rows, split: int, convert, *, stream,
                 bind: Callable[[], None], after=None):
        bind()
        self._bind = bind
        dev_rows = list(dev_rows)
        self.image = TierImage(tier, tier.take(len(dev_rows)), arrays, split, convert)
        if after is None:
            tier.enqueue_out(arrays, dev_rows, self.image.rows, stream)
            stream.synchronize()
            self._done = None
            return
        before = _d.Event(timing=False)
        before.record(after)
        stream.wait(before)
        tier.enqueue_out(arrays, dev_rows, self.image.rows, stream)
        self._done = _d.Event(timing=False)
        self._done.record(stream)
        before.destroy()            # (the wait was queued: destroying a recorded event is safe)

    def done(self) -> bool:
        if self._done is None:
            return True
        self._bind()
        return self._done.query()

    def result(self) -> TierImage:
        if self._done is not None:
            self._bind()
            self._done.synchronize()
            self._done.destroy()
            self._done = None
        return self.image
