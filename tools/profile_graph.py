"""GPU time per kernel of a captured decode step (CUDA graph replays), read by CUPTI.

bench_decode's --profile times each launch eagerly with events around it, which counts launch
latency into every small kernel; this reads the kernels' own durations inside the graph the Engine
replays. torch.profiler is only the CUPTI reader here (a tool, not the engine): it records every
kernel the process runs, ours included.

    PYTHONPATH=.:bench python tools/profile_graph.py --shape 35b-a3b --batches 1,8 --ctx 2048
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench_decode import decode_batch, make_config
from ninfer.models.qwen3_5.cuda_model import CudaModel
from ninfer.options import EngineOptions


def short(name: str) -> str:
    """A kernel's family: numba's mangled entry names carry the Python function's name (the
    profiler shows them demangled, "module::factory::<locals>::..._kernel...", or mangled)."""
    m = re.search(r"::(\w+)::(\w+)::_3clocals", name)
    if m:
        return f"{m.group(1)}.{m.group(2)}"
    for m in re.finditer(r"\d+", name):         # Itanium mangling: <length><identifier>
        ident = name[m.end():m.end() + int(m.group())]
        if ident.endswith("_kernel"):
            return ident[:-len("_kernel")]
    if "gemv" in name.lower():
        return "cublas_gemv"
    if "gemm" in name.lower() or "xmma" in name or "sm90" in name:
        return "cublas_gemm"
    return name[:60]


def kernel_times(fn, reps: int) -> tuple:
    """{family: (us per step, launches per step)}, the summed us per step, and the kernels in
    the order they ran as (family, start us, duration us)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us, count, seq = defaultdict(float), defaultdict(int), []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dt = getattr(e, "device_time", None)
        if dt is None:
            dt = e.cuda_time
        us[short(e.name)] += dt / reps
        count[short(e.name)] += 1
        seq.append((short(e.name), e.time_range.start, dt))
    seq.sort(key=lambda x: x[1])
    return {k: (us[k], count[k] / reps) for k in us}, sum(us.values()), seq


def print_sequence(seq, first: int, count: int) -> None:
    """Kernels first .. first + count of the recorded order: each one's duration and the idle
    time since the one before it ended (the graph's launch gap)."""
    print("| # | kernel | us | gap us |")
    print("|---|---|---|---|")
    for i in range(first, min(first + count, len(seq))):
        name, start, dur = seq[i]
        gap = start - (seq[i - 1][1] + seq[i - 1][2]) if i else 0.0
        print(f"| {i} | {name} | {dur:.2f} | {gap:.2f} |")
    gaps = [seq[i][1] - (seq[i - 1][1] + seq[i - 1][2]) for i in range(1, len(seq))]
    gaps = [g for g in gaps if g < 50]          # (between steps the host waits)
    if gaps:
        print(f"gaps between kernels: median {np.median(gaps):.2f} us, "
              f"sum {sum(gaps):.0f} us over {len(gaps)}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="35b-a3b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sequence", type=int, default=0,
                    help="also print this many kernels of one step in order (from the second "
                         "layer on), each one's time and the gap before it")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cfg_m = make_config(args.shape)
    page = 16
    opts = EngineOptions(backend="cuda", max_concurrency=max(batches),
                         max_context=args.ctx + 32, page_size=page, prefill_chunk=512)
    torch.cuda.init()
    model = CudaModel(cfg_m, opts, random_seed=1234, max_tokens=512)
    pages_per_row = (args.ctx + 32 + page - 1) // page + 1
    kv = model.new_kv_pool(max(batches) * pages_per_row, page)
    state = model.new_state_pool(max(batches))
    rng = np.random.default_rng(0)
    for B in batches:
        batch = decode_batch(B, args.ctx, page, pages_per_row, rng, cfg_m.text.vocab_size)
        for _ in range(3):
            model.decode_greedy(batch, kv, state)
        table, total, seq = kernel_times(lambda: model.decode_greedy(batch, kv, state),
                                         args.reps)
        print(f"\n[{args.shape}] decode B={B} ctx={args.ctx}: kernels sum {total / 1e3:.3f} ms "
              f"per step (graph replay)")
        print("| kernel | us / step | launches / step | us / launch |")
        print("|---|---|---|---|")
        for k, (t, n) in sorted(table.items(), key=lambda kv: -kv[1][0]):
            print(f"| {k} | {t:.1f} | {n:.0f} | {t / max(n, 1):.2f} |")
        if args.sequence:
            print_sequence(seq, 3, args.sequence)
    model.close()


if __name__ == "__main__":
    main()
