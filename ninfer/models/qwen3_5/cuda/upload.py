"""Weights from the mapped artifact to the device at page-cache speed.

    reader threads (N)                      the loading thread, in plan order
    read_host: checksum, finiteness,  -->   64 MiB piece -> pinned buffer k -> async H2D on the
    dtype view (zlib and numpy release      model's stream, event k recorded; buffer k is reused
    the GIL: the passes run in parallel)    only after event k (k cycles over a few buffers)

Reads run at most `ahead` tensors in front of the uploads, so host memory stays bounded (a tensor
is a zero-copy view of the mapping unless its sources are concatenated). The copies into pinned
memory overlap the previous pieces' transfers; nothing is synchronised per tensor.
"""
from __future__ import annotations

import os
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ....core.cuda import driver as _d
from . import weights as wplan

PIECE_BYTES = 64 << 20
NUM_BUFFERS = 3


@dataclass(frozen=True, slots=True)
class UploadJob:
    dst: object             # arena array (has .ptr)
    shape: tuple
    dtype: str              # wplan.BF16 / F32: the stored kind read_host converts from
    sources: tuple
    widen: bool = False     # fp32 model: bf16 bits widened on the device (caller's path)


class PinnedRing:
    """A few pinned buffers used in turn for async host -> device copies on one stream."""

    def __init__(self, stream, piece_bytes: int = None, num_buffers: int = None):
        self.stream, self.piece_bytes = stream, int(piece_bytes or PIECE_BYTES)
        num_buffers = num_buffers or NUM_BUFFERS
        self.buffers, self.events = [], []
        try:
            for _ in range(num_buffers):
                self.buffers.append(_d.PinnedBuffer(self.piece_bytes))
                self.events.append(_d.Event(timing=False))
        except BaseException:
            self.close()
            raise
        self._in_flight = [False] * num_buffers
        self._next = 0

    def put(self, dst_ptr: int, host: np.ndarray) -> None:
        flat = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        for off in range(0, flat.size, self.piece_bytes):
            n = min(self.piece_bytes, flat.size - off)
            k = self._next
            if self._in_flight[k]:
                self.events[k].synchronize()        # its previous copy has read the buffer
            self.buffers[k].array[:n] = flat[off: off + n]
            _d.copy_htod_async(dst_ptr + off, self.buffers[k].ptr, n, self.stream)
            self.events[k].record(self.stream)
            self._in_flight[k] = True
            self._next = (k + 1) % len(self.buffers)

    def drain(self) -> None:
        self.stream.synchronize()
        self._in_flight = [False] * len(self.buffers)

    def close(self) -> None:
        for e in self.events:
            e.destroy()
        for b in self.buffers:
            b.free()
        self.events, self.buffers = [], []


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def upload_all(artifact, jobs: list, stream, expected: dict, widen_one, *,
               workers: int = None, progress: bool = None) -> None:
    """Read every job's host image in parallel and upload it in order. `widen_one(job, host,
    staging)` uploads an fp32-widened job synchronously (after the ring has drained).
    progress: a bar on stderr (default: when stderr is a terminal)."""
    workers = workers or default_workers()
    ahead = 2 * workers
    total = sum(int(np.prod(j.shape)) * (2 if j.dtype == wplan.BF16 else 4) for j in jobs)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False)
    ring = PinnedRing(stream)
    pending: deque = deque()
    todo = iter(jobs)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="ninfer-load") as pool:
            try:
                def refill():
                    while len(pending) < ahead:
                        job = next(todo, None)
                        if job is None:
                            return
                        pending.append((job, pool.submit(wplan.read_host, artifact, job.shape,
                                                         job.dtype, job.sources, expected)))
                refill()
                while pending:
                    job, future = pending.popleft()
                    host = future.result()
                    refill()
                    if job.widen:
                        ring.drain()
                        widen_one(job, host, ring.buffers[0])
                    else:
                        ring.put(job.dst.ptr, host)
                    if bar is not None:
                        bar.update(host.nbytes)
            finally:
                for _, future in pending:
                    future.cancel()
        ring.drain()
    finally:
        ring.close()
        if bar is not None:
            bar.close()
