"""Host time of the MoE prefill's routed-row layout (cuda/moe_rows.expert_rows), which runs once
per MoE layer of every prefill call between a sync and the layer's next launches (the GPU waits
for it): the compiled ninfer._hot pass (when built) and its numpy twin, 35B-A3B routing (256
experts, top 8), uniform random ids.

    PYTHONPATH=. python bench/bench_moe_rows.py [--tokens 512,4096,16384]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import ninfer._hot as hot
from ninfer._hot import routes_py
from ninfer.models.qwen3_5.cuda import moe_rows


def median_ms(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e3 * float(np.median(out))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    E, K = args.experts, args.top_k
    print(f"ninfer._hot routes compiled: {hot.ROUTES_COMPILED}")
    print("| tokens | cap | rows | expert_rows ms | with the numpy twin ms |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.tokens.split(",")):
        rng = np.random.default_rng(n)
        ids = np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32).reshape(-1)
        R = 2 * n * K + moe_rows.CAP_ALIGN * E
        lay = moe_rows.expert_rows(ids, K, E, R)
        fast = median_ms(lambda: moe_rows.expert_rows(ids, K, E, R), args.reps)
        saved = hot.expert_rows_fill
        hot.expert_rows_fill = routes_py.expert_rows_fill
        try:
            twin = median_ms(lambda: moe_rows.expert_rows(ids, K, E, R), args.reps)
        finally:
            hot.expert_rows_fill = saved
        print(f"| {n} | {lay.cap} | {lay.rows} | {fast:.3f} | {twin:.3f} |")


if __name__ == "__main__":
    main()
