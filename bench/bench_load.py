"""Where loading weights spends its time, pass by pass, on one artifact (host and PCIe rates).

    PYTHONPATH=. python bench/bench_load.py ARTIFACT [--threads 1,4,8,15]

Each pass runs over every payload object of the artifact (in the page cache: read once first),
split across T threads, and prints GB/s of the artifact's bytes:
  crc32      the per-object checksum the reader verifies (zlib; releases the GIL)
  finite     the bf16 inf/nan scan read_host runs (weights._bf16_all_finite)
  to_pinned  copying the mapped bytes into pinned buffers (what the upload ring does)
  h2d        cuMemcpyHtoDAsync from pinned memory, 64 MiB pieces on one stream (PCIe alone)
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ninfer.artifact.reader import Artifact  # noqa: E402
from ninfer.models.qwen3_5.cuda.weights import _bf16_all_finite  # noqa: E402

PIECE = 64 << 20


def pieces(art):
    """(offset, nbytes) pieces of at most PIECE bytes over every object."""
    out = []
    for o in art._objects.values():
        for off in range(0, o["nbytes"], PIECE):
            out.append((o["offset"] + off, min(PIECE, o["nbytes"] - off)))
    return out


def timed(fn, items, threads):
    t0 = time.perf_counter()
    if threads == 1:
        for it in items:
            fn(it)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, items))
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", default="1,4,8,15")
    args = ap.parse_args(argv)
    art = Artifact(args.artifact, verify="none")
    mm = memoryview(art._mm)
    work = pieces(art)
    total = sum(n for _, n in work)
    with open(args.artifact, "rb", buffering=0) as f:       # into the page cache
        buf = bytearray(PIECE)
        while f.readinto(buf):
            pass

    def crc(p):
        zlib.crc32(mm[p[0]: p[0] + p[1]])

    def finite(p):
        _bf16_all_finite(np.frombuffer(mm, np.uint16, p[1] // 2, p[0]))

    from ninfer.core.cuda import driver as _d
    dev = _d.Device(0)
    dev.make_current()
    pinned = [_d.PinnedBuffer(PIECE) for _ in range(16)]
    import threading
    local = threading.local()
    ids = iter(range(10**9))

    def to_pinned(p):
        if not hasattr(local, "buf"):
            local.buf = pinned[next(ids) % len(pinned)]
        local.buf.array[: p[1]] = np.frombuffer(mm, np.uint8, p[1], p[0])

    rows = []
    for T in [int(x) for x in args.threads.split(",")]:
        for name, fn in (("crc32", crc), ("finite", finite), ("to_pinned", to_pinned)):
            local.__dict__.clear()
            dt = timed(fn, work, T)
            rows.append((name, T, total / dt / 1e9))
            print(f"{name:10s} T={T:2d}: {total / dt / 1e9:6.1f} GB/s", flush=True)
    stream = _d.Stream()
    dst = _d.mem_alloc(PIECE * 8)
    t0 = time.perf_counter()
    n = 0
    for i in range(max(1, total // PIECE)):
        _d.copy_htod_async(dst + (i % 8) * PIECE, pinned[i % 4].ptr, PIECE, stream)
        n += PIECE
    stream.synchronize()
    dt = time.perf_counter() - t0
    rows.append(("h2d", 1, n / dt / 1e9))
    print(f"h2d        pinned, one stream: {n / dt / 1e9:6.1f} GB/s", flush=True)
    print("\n| pass | threads | GB/s |\n|---|---|---|")
    for name, T, r in rows:
        print(f"| {name} | {T} | {r:.1f} |")


if __name__ == "__main__":
    main()
