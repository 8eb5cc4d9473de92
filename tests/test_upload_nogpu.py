"""cuda/upload.py on a fake driver: every weight lands byte for byte at its device address, in
pieces through each loader thread's pinned ring (a buffer is reused only after its copy's event),
with parallel loaders; a loader's error reaches the caller and leaves no buffer behind."""
import threading

import ml_dtypes
import numpy as np
import pytest

from ninfer.errors import ArtifactError
from ninfer.models.qwen3_5.cuda import upload as up
from ninfer.models.qwen3_5.cuda import weights as wplan


class FakeDevice:
    """Device memory as one byte array; copies are deferred until the stream syncs or an event
    after them is waited on (as async copies are), so a buffer rewritten too early shows. The
    queue is one stream's: loader threads enqueue and wait on it at once, so it is locked (as
    the driver's is); an event waits for the copies enqueued before it was recorded."""

    def __init__(self, nbytes):
        self.mem = np.full(nbytes, 0xAB, np.uint8)
        self.queue, self.pinned, self.freed = [], {}, []
        self.next_host = 1 << 20
        self.lock = threading.RLock()
        self.done = 0           # copies run so far (queue positions are done + index)

    def enqueue(self, item):
        with self.lock:
            self.queue.append(item)
            return self.done + len(self.queue)      # the count an event recorded now waits for

    def run_queue(self, upto=None):
        with self.lock:
            n = len(self.queue) if upto is None else max(0, upto - self.done)
            for dst, src, size in self.queue[:n]:
                self.mem[dst: dst + size] = self.pinned[src][:size]      # reads the buffer NOW
            del self.queue[:n]
            self.done += n

    def install(self, monkeypatch):
        dev = self

        class Pinned:
            def __init__(self, nbytes):
                self.nbytes, self.ptr = nbytes, dev.next_host
                dev.next_host += nbytes + 4096
                self.array = np.zeros(nbytes, np.uint8)
                dev.pinned[self.ptr] = self.array

            def free(self):
                dev.freed.append(self.ptr)

        class Event:
            def __init__(self, timing=True):
                self.mark = 0

            def record(self, stream):
                with dev.lock:
                    self.mark = dev.done + len(dev.queue)

            def synchronize(self):
                dev.run_queue(self.mark)

            def destroy(self):
                pass

        def copy(dst, src, n, stream):
            dev.enqueue((dst, src, n))
        monkeypatch.setattr(up._d, "PinnedBuffer", Pinned)
        monkeypatch.setattr(up._d, "Event", Event)
        monkeypatch.setattr(up._d, "copy_htod_async", copy)


class Stream:
    def __init__(self, dev):
        self.dev = dev

    def synchronize(self):
        self.dev.run_queue()


class Dst:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeArtifact:
    def __init__(self, tensors, bad=()):
        self.tensors, self.bad = tensors, set(bad)

    def has(self, name):
        return name in self.tensors

    def is_quantized(self, name):
        return False

    def tensor(self, name):
        if name in self.bad:
            raise ArtifactError(f"object {name!r}: payload checksum mismatch")
        return self.tensors[name]


def _weights(rng, sizes):
    return {f"w{i}": rng.standard_normal(n).astype(ml_dtypes.bfloat16) for i, n in enumerate(sizes)}


@pytest.mark.parametrize("workers", [1, 3])
def test_every_weight_lands_at_its_address(monkeypatch, workers):
    rng = np.random.default_rng(0)
    # pieces of 1 KiB: most weights span several, one is exactly a piece, one is tiny
    monkeypatch.setattr(up, "PIECE_BYTES", 1024)
    sizes = [1500, 512, 4000, 3, 2048, 777]
    tensors = _weights(rng, sizes)
    dev = FakeDevice(sum(2 * n for n in sizes) + 64)
    dev.install(monkeypatch)
    jobs, ptr = [], 0
    for name, a in tensors.items():
        jobs.append(up.UploadJob(Dst(ptr), (a.size,), wplan.BF16, ((name, None),)))
        ptr += a.nbytes
    bound = []
    up.upload_all(FakeArtifact(tensors), jobs, Stream(dev), {}, None, workers=workers,
                  progress=False, bind_context=lambda: bound.append(threading.get_ident()))
    assert not dev.queue
    for job, a in zip(jobs, tensors.values()):
        got = dev.mem[job.dst.ptr: job.dst.ptr + a.nbytes]
        np.testing.assert_array_equal(got, a.view(np.uint8))
    assert dev.mem[ptr:].tolist() == [0xAB] * 64              # nothing written past the weights
    # each loader thread bound the model's context once, before its ring's first copy; every
    # pinned buffer went back
    assert 1 <= len(bound) == len(set(bound)) <= workers
    assert threading.get_ident() not in bound
    assert sorted(dev.freed) == sorted(dev.pinned) and len(dev.freed) == len(bound) * up.NUM_BUFFERS


def test_a_reader_error_reaches_the_caller_and_frees_the_ring(monkeypatch):
    rng = np.random.default_rng(1)
    tensors = _weights(rng, [100, 200, 300, 400])
    dev = FakeDevice(4096)
    dev.install(monkeypatch)
    jobs = [up.UploadJob(Dst(0), (a.size,), wplan.BF16, ((n, None),)) for n, a in tensors.items()]
    with pytest.raises(ArtifactError, match="checksum"):
        up.upload_all(FakeArtifact(tensors, bad={"w2"}), jobs, Stream(dev), {}, None, workers=2,
                      progress=False)
    assert dev.pinned and sorted(dev.freed) == sorted(dev.pinned)


def test_a_widened_weight_goes_through_the_callers_path(monkeypatch):
    rng = np.random.default_rng(2)
    tensors = _weights(rng, [300, 50])
    dev = FakeDevice(4096)
    dev.install(monkeypatch)
    seen = []

    def widen(job, host):
        seen.append((job.sources[0][0], host.view(np.uint16).copy()))
    jobs = [up.UploadJob(Dst(0), (300,), wplan.BF16, (("w0", None),)),
            up.UploadJob(Dst(600), (50,), wplan.BF16, (("w1", None),), widen=True)]
    up.upload_all(FakeArtifact(tensors), jobs, Stream(dev), {}, widen, workers=2, progress=False)
    assert not dev.queue
    assert [n for n, _ in seen] == ["w1"]
    np.testing.assert_array_equal(seen[0][1], tensors["w1"].view(np.uint16))
    np.testing.assert_array_equal(dev.mem[:600], tensors["w0"].view(np.uint8))
