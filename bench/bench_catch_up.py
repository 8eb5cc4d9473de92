"""Where the MTP drafter's catch-up feeds go (issue 25): bench_speculative's runs (same arguments)
with every catch-up feed (Speculator._catch_up: the positions rows decoded plainly since their
last draft, fed in one call) timed, the runner's per-kernel events on during it, and each feed run
again twice right after, outside its timing: at the same token count (warm: what the feed costs)
and at one token fewer (a new count: what a first use of that count costs). The probes rewrite
the same KV entries with the same values, so the run's tokens are unchanged; its speed figures
are not the bench's (the probes and the events add their time).

    python bench/bench_catch_up.py --backend cuda --shapes 9b --batch 8 --prompts 8 --ks "" \
        --adaptive 4 --max-tokens 200

Measured (H100, 2026-12-07, before cuBLASLt shared its algorithms past 8 rows): a feed of 337
positions took 19.5 ms of kernels the first time, 3.3 ms again at 337, 9.3 ms at 336 (plans
0.9 ms of it); the time is the GEMMs' (the first launch of a kernel the heuristic picks for a
new row count), with CUDA_MODULE_LOADING=EAGER too.
"""
from __future__ import annotations

import collections
import sys
import time

import bench_speculative
from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter, token_pieces
from ninfer.models.qwen3_5.program import speculative


def main() -> None:
    feeds, probes = [], []
    kernels = collections.defaultdict(float)
    catch_up = speculative.Speculator._catch_up
    forward_argmax = CudaDrafter.forward_argmax

    last = []                   # the feed's (drafter, batch, hidden, kv), for the probes

    def timed_catch_up(self, prog, seqs):
        queued = [s for s in seqs if s.seq_id in self._lag]
        positions = sum(sum(len(c) for c in self._lag[s.seq_id][1]) for s in queued)
        runner = prog.model.runner
        runner.profile = []
        last.clear()
        t = time.perf_counter()
        try:
            catch_up(self, prog, seqs)
        finally:
            wall = time.perf_counter() - t
            profile = runner.profile_summary() if runner.profile is not None else {}
        for name, ms in profile.items():
            kernels[name] += ms
        if queued:
            feeds.append((len(queued), positions, wall * 1e3, sum(profile.values())))
        if last:
            probes.append(probe(*last))

    def recorded(self, batch, hidden, kv):
        last[:] = [self, batch, hidden, kv]
        return forward_argmax(self, batch, hidden, kv)

    def probe(drafter, batch, hidden, kv) -> list:
        """The feed again (after it, outside its timing): at its token count, then one fewer."""
        n, lt, row = int(batch.num_tokens), drafter.model.lt, []
        for sub, idx in ((batch, None), token_pieces(batch, n - 1)[0] if n > 1 else (None, None)):
            if sub is None:
                continue
            h = hidden if idx is None else hidden[idx]
            plans, t = lt.plan_seconds, time.perf_counter()
            drafter._argmax(sub, h, kv, last_only=True)       # (split past a call's tokens)
            row.append((int(sub.num_tokens), (time.perf_counter() - t) * 1e3,
                        (lt.plan_seconds - plans) * 1e3))
        return row

    speculative.Speculator._catch_up = timed_catch_up
    CudaDrafter.forward_argmax = recorded
    # (the probes patch this process: every run in it, not one process a run)
    sys.argv.append("--in-process")
    try:
        bench_speculative.main()
    finally:
        speculative.Speculator._catch_up = catch_up
        CudaDrafter.forward_argmax = forward_argmax
    print("\ncatch-up feeds (rows, positions: wall ms, kernel ms):")
    for rows, positions, wall, kernel in feeds:
        print(f"  {rows} rows, {positions} positions: {wall:.2f} ms wall, {kernel:.2f} ms kernels")
    print("the same feed again (tokens: wall ms, of it GEMM plans ms), then one token fewer:")
    for row in probes:
        print("  " + "; ".join(f"{n}: {wall:.2f} ms (plans {plans:.2f})"
                               for n, wall, plans in row))
    print("kernels over the feeds (ms): " + ", ".join(
        f"{name} {ms:.2f}" for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
