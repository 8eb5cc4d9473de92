"""Weights from the mapped artifact to the device at page-cache speed.

    loader threads (N), one tensor each at a time              the calling thread
    read_host: checksum, finiteness, dtype view (zlib and  -->  keeps a bounded window of
    numpy release the GIL); then its pieces go through the      tensors submitted, in plan
    thread's own pinned ring: copy into pinned buffer k,        order, refilled as any one
    async H2D on the model's stream, event k; buffer k is       finishes; widens the fp32
    reused only after event k                                   model's weights; syncs once

Every pass over the bytes runs in the loader threads side by side (one thread copying into pinned
memory tops out near 7 GB/s on an H200 host; 15 reach ~50). At most `ahead` tensors are in
flight, so host memory stays bounded (a tensor is a zero-copy view of the mapping unless its
sources are concatenated). Copies from several threads share the one stream: their
destinations are disjoint, so their order does not matter; nothing is synchronised per tensor.
"""
from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from ....core.cuda import driver as _d
from . import weights as wplan

PIECE_BYTES = 16 << 20
NUM_BUFFERS = 2           # per loader thread: one filling while the other's copy runs


@dataclass(frozen=True, slots=True)
class UploadJob:
    dst: object             # arena array (has .ptr)
    shape: tuple
    dtype: str              # wplan.BF16 / F32: the stored kind read_host converts from; RAW:
    sources: tuple          # `host()` gives the bytes as they go up (quantized codes, scales)
    widen: bool = False     # fp32 model: bf16 bits widened on the device (caller's path)
    host: object = None     # RAW: () -> the host array (checked there, in a loader thread)


RAW = "raw"


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

    def close(self) -> None:
        for e in self.events:
            e.destroy()
        for b in self.buffers:
            b.free()
        self.events, self.buffers = [], []


def default_workers() -> int:
    return max(1, min(16, (os.cpu_count() or 2) - 1))


class _ThreadRings:
    """One PinnedRing per loader thread, made on the thread's first tensor (after it has bound
    the model's context: the driver's current context is per thread); closed together."""

    def __init__(self, stream, bind_context):
        self.stream, self.bind_context = stream, bind_context
        self._local, self._lock, self.rings = threading.local(), threading.Lock(), []

    def mine(self) -> PinnedRing:
        ring = getattr(self._local, "ring", None)
        if ring is None:
            if self.bind_context is not None:
                self.bind_context()
            ring = PinnedRing(self.stream)
            with self._lock:
                self.rings.append(ring)
            self._local.ring = ring
        return ring

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
        self.rings = []


def upload_all(artifact, jobs: list, stream, expected: dict, widen_one, *, bind_context=None,
               workers: int = None, progress: bool = None) -> None:
    """Read and upload every job, in parallel (module docstring). `widen_one(job, host)` uploads
    an fp32-widened job synchronously, on the calling thread. `bind_context`: makes the
    model's context current (called once in each loader thread before its first copy).
    progress: a bar on stderr (default: when stderr is a terminal)."""
    workers = workers or default_workers()
    ahead = 2 * workers
    size = {wplan.BF16: 2, wplan.F32: 4, RAW: 1}      # RAW jobs' shape is their byte count
    total = sum(int(np.prod(j.shape)) * size[j.dtype] for j in jobs)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False)
    rings = _ThreadRings(stream, bind_context)
    pending: set = set()
    todo = iter(jobs)

    def load_one(job):
        host = job.host() if job.dtype == RAW else \
            wplan.read_host(artifact, job.shape, job.dtype, job.sources, expected)
        if not job.widen:
            rings.mine().put(job.dst.ptr, host)
        return job, host
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="ninfer-load") as pool:
            try:
                def refill():
                    while len(pending) < ahead:
                        job = next(todo, None)
                        if job is None:
                            return
                        pending.add(pool.submit(load_one, job))
                refill()
                while pending:
                    # whichever finishes first: waiting in plan order left the threads idle
                    # behind one large tensor (the 2 GB embedding) with the window full
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        pending.discard(future)
                        job, host = future.result()
                        if job.widen:
                            widen_one(job, host)
                        if bar is not None:
                            bar.update(host.nbytes)
                    refill()
            finally:
                for future in pending:
                    future.cancel()
    finally:
        stream.synchronize()        # every thread's copies have read their buffers
        rings.close()
        if bar is not None:
            bar.close()
