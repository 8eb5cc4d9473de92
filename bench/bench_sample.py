"""Device sampling benchmark: one sampling step (parameter copy + the three sampling kernels)
over B rows of fp32 logits at the real vocabulary, per filter set, against reading the logits
once at the measured copy bandwidth; plus the host time of packing a step's requests and the
plan row 0 took (kernels/sample.py: ALL, SMALL, WIDE, FALLBACK).

    PYTHONPATH=. python bench/bench_sample.py [--vocab 248320] [--rows 1,2,4,8] [--out r.json]
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from bench_decode import copy_bandwidth
from ninfer.core.cuda import driver as d
from ninfer.core.cuda.arena import Arena
from ninfer.core.cuda.kernels import KernelCache
from ninfer.models.qwen3_5.cuda.kernel_set import spec
from ninfer.models.qwen3_5.cuda.sampler import (KERNELS, DeviceSampler, PromptCache, SampleRow,
                                                pack)
from ninfer.models.qwen3_5.program.sampling import SamplingSpec

FILTERS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_p=0.9": dict(temperature=0.8, top_p=0.9),
    "k50+p0.9+minp0.05": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "penalties+mask": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                           presence_penalty=0.5, frequency_penalty=0.2),
    "greedy+penalties": dict(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5,
                             frequency_penalty=0.2),
}
PROMPT, GENERATED = 4096, 512
PLANS = ("ALL", "SMALL", "WIDE", "FALLBACK", "greedy")


def requests(r, B, V, fields, masked):
    rows = []
    for i in range(B):
        s = SamplingSpec(seed=1000 + i, is_constrained=masked, **fields)
        mask = (r.random(V) < 0.5) if masked else None
        rows.append(SampleRow(s, PROMPT + GENERATED, r.integers(0, V, PROMPT).astype(np.int32),
                              r.integers(0, V, GENERATED).astype(np.int32), mask,
                              cache_key=("bench", i)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    V, Bs = args.vocab, [int(x) for x in args.rows.split(",")]
    dev = d.Device(0)
    st = dev.stream
    arena = Arena((2 << 30) + 16 * V * max(Bs) + (64 << 20))
    bw = copy_bandwidth(dev, arena, 1 << 30)
    cache = KernelCache(dev.cc)
    kern = SimpleNamespace(**{n: cache.get(spec(n)) for n in KERNELS})
    sampler = DeviceSampler(arena, kern, max(Bs), V, PROMPT + GENERATED)
    r = np.random.default_rng(0)
    logits_host = (r.standard_normal((max(Bs), V)) * 2).astype(np.float32)
    logits_host[:, r.choice(V, 8, replace=False)] += 12.0        # a few strong ids, long tail
    logits = arena.take(logits_host.shape, np.float32, "logits")
    d.upload(logits.ptr, logits_host, st)
    tokens = arena.take((max(Bs),), np.int32, "tokens")
    e0, e1 = d.Event(), d.Event()

    def copy_then_time(dst, src, nbytes, stream):
        # the timed step starts after the host packed it (pack us is reported on its own):
        # the parameter copy, the three launches (host gaps between them included), the kernels
        e0.record(stream)
        d.copy_htod_async(dst, src, nbytes, stream)
    sampler._d = SimpleNamespace(copy_htod_async=copy_then_time)
    table = []
    print(f"device {dev.name}; copy bandwidth {bw / 1e12:.2f} TB/s; V = {V}")
    print(f"{'B':>2} {'filters':<20} {'device us':>10} {'limit us':>9} {'ratio':>6} "
          f"{'pack us (cached prompt)':>24} {'pack us (cold)':>15} {'plan':>9}")
    for B in Bs:
        for name, fields in FILTERS.items():
            rows = requests(r, B, V, fields, masked=name == "penalties+mask")
            sampler.launch(st, logits.ptr, tokens.ptr, rows)         # warm-up, fills the cache
            times = []
            for _ in range(args.iters):
                sampler.launch(st, logits.ptr, tokens.ptr, rows)     # records e0 itself
                e1.record(st)
                e1.synchronize()
                times.append(e0.elapsed_ms(e1) * 1e3)
            dev_us = float(np.median(times))
            lay = sampler.layout
            fpar = d.download(sampler.block.ptr + lay.fpar, (B, 8), np.float64, st)
            plan = PLANS[4] if fields["temperature"] == 0.0 else PLANS[int(fpar[0, 6])]
            limit_us = B * V * 4 / bw * 1e6
            buf = np.zeros(sampler.layout.nbytes, np.uint8)
            t0 = time.perf_counter()
            for _ in range(5):
                pack(sampler.layout, buf, rows, sampler.cache)
            warm = (time.perf_counter() - t0) / 5 * 1e6
            t0 = time.perf_counter()
            pack(sampler.layout, buf, rows, PromptCache())
            cold = (time.perf_counter() - t0) * 1e6
            row = dict(B=B, vocab=V, filters=name, device_us=dev_us, limit_us=limit_us,
                       ratio=limit_us / dev_us, pack_us=warm, pack_cold_us=cold, plan=plan)
            table.append(row)
            print(f"{B:>2} {name:<20} {dev_us:>10.1f} {limit_us:>9.2f} {row['ratio']:>6.3f} "
                  f"{warm:>24.1f} {cold:>15.1f} {plan:>9}")
    t0 = time.perf_counter()
    np.unique(r.integers(0, V, 32768))
    print(f"np.unique over a 32K-token prompt: {(time.perf_counter() - t0) * 1e6:.0f} us "
          "(what the prompt cache saves per step and row)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev.name, bandwidth=bw, rows=table), f, indent=1)
    sampler.close()
    arena.close()
    dev.close()


if __name__ == "__main__":
    main()
