"""The MTP head's step on the GPU against a decode step (issue 25's "one draft token <= 0.15x one
decode step"), at the bench shapes, random bf16 weights:

    PYTHONPATH=.:bench python bench/bench_mtp.py [--shapes 9b,27b,35b-a3b] [--ctx 2048]
        [--feed 64] [--verify 4] [--steps 20]

Per shape: the captured decode graph's step at B = 1 (GPU time between events, as bench_decode
measures it); one MTP step of 1 token (StepRunner.mtp launched eagerly: launches count, as they
would not inside a graph; GPU time between events around its launches, no host copies), and the
drafter's feed of `--feed` positions in one call (program/speculative.py LAG_TOKENS); and the
target's verify of `--verify` positions (the last token and k = verify - 1 drafts: StepRunner.run
with the State snapshots, eager, every position's logits: issue 25's "<= 1.25x one decode step"),
and the same through its captured verify graph (what the Engine launches);
each as a fraction of the decode step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from bench_decode import SHAPES, decode_batch, make_config
from ninfer.core.cuda import driver as d
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.cuda_model import CudaModel
from ninfer.options import EngineOptions


def gpu_ms(model, fn, steps: int) -> float:
    """Median GPU milliseconds of fn() between two events on the model's stream."""
    ev0, ev1 = d.Event(), d.Event()
    times = []
    for _ in range(steps):
        ev0.record(model.stream)
        fn()
        ev1.record(model.stream)
        ev1.synchronize()
        times.append(ev0.elapsed_ms(ev1))
    return float(np.median(times))


def bench_shape(name: str, ctx: int, feed: int, steps: int, verify: int = 4) -> dict:
    cfg_m = make_config(name)
    cfg_m = dataclasses.replace(cfg_m, text=dataclasses.replace(cfg_m.text,
                                                                 mtp_num_hidden_layers=1))
    cfg = cfg_m.text
    page = 16
    opts = EngineOptions(backend="cuda", max_concurrency=1, max_context=ctx + feed + 16,
                         page_size=page, prefill_chunk=max(feed, 64),
                         num_draft_tokens=min(max(verify - 1, 1), 4))
    model = CudaModel(cfg_m, opts, random_seed=1234, mtp=True)
    try:
        pages_per_row = (ctx + feed + page - 1) // page + 2
        kv = model.new_kv_pool(pages_per_row, page)
        state = model.new_state_pool(1 + verify)
        rng = np.random.default_rng(0)
        batch = decode_batch(1, ctx, page, pages_per_row, rng, cfg.vocab_size)
        for _ in range(3):
            model.decode_greedy(batch, kv, state)
        decode = gpu_ms(model, lambda: model.decode_greedy(batch, kv, state), steps)
        out = {"shape": name, "ctx": ctx, "decode_ms": decode}
        for label, n in (("draft", 1), ("feed", feed)):
            table = np.arange(pages_per_row, dtype=np.int32).reshape(1, -1)
            start = ctx - n + 1
            b = ForwardBatch.single(rng.integers(0, cfg.vocab_size, n).astype(np.int32), start,
                                    table, 0)
            h = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
            model.mtp_forward(b, h, kv, with_logits=False)   # warm-up (plans, modules)
            model._upload_meta(model.eager_layout, model.eager_meta, 0, b,
                               np.array([n - 1], np.int32))
            ms = gpu_ms(model, lambda: model.runner.mtp(model.stream, model.eager_meta, n, 1, 1,
                                                         kv), steps)
            out[f"{label}_ms"] = ms
            out[f"{label}_vs_decode"] = ms / decode
        # the verify: the row's last token and verify - 1 drafts at the context's end, the State
        # after each into slots 1 .. verify
        table = np.arange(pages_per_row, dtype=np.int32).reshape(1, -1)
        b = ForwardBatch.single(rng.integers(0, cfg.vocab_size, verify).astype(np.int32), ctx,
                                table, 0)
        every = np.arange(verify, dtype=np.int32)
        model.verify_forward(b, kv, state, every, snap_base=[1])          # warm-up
        model._upload_meta(model.eager_layout, model.eager_meta, 0, b, every)
        rows = [(0, verify, ctx)]
        ms = gpu_ms(model, lambda: model.runner.run(model.stream, model.eager_meta, verify, 1,
                                                    verify, kv, state, rows=rows,
                                                    snap=model.ws.snap.ptr), steps)
        out["verify_ms"], out["verify_vs_decode"] = ms, ms / decode
        # the same through its captured graph (decode_graphs.verify: + the final norm of every
        # token, the drafter's feed), as CudaModel.verify_forward / verify_tokens launch it
        graph = model.graphs.verify(verify, 1, kv, state, model.eager_meta, model.ws.snap.ptr)
        ms = gpu_ms(model, graph.launch, steps)
        out["verify_graph_ms"], out["verify_graph_vs_decode"] = ms, ms / decode
        kv.close()
        state.close()
        return out
    finally:
        model.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="9b,27b,35b-a3b")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--feed", type=int, default=64)
    ap.add_argument("--verify", type=int, default=4, help="verify positions (k + 1)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
        t0 = time.perf_counter()
        rows.append(bench_shape(name, args.ctx, args.feed, args.steps, args.verify))
        print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n| shape | decode step ms (graph) | 1 draft token ms (eager) | vs decode | "
          f"feed of {args.feed} ms | vs decode | verify of {args.verify} ms (eager) | vs decode | "
          "verify (graph) ms | vs decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['decode_ms']:.2f} | {r['draft_ms']:.3f} | "
              f"{r['draft_vs_decode']:.3f} | {r['feed_ms']:.3f} | {r['feed_vs_decode']:.3f} | "
              f"{r['verify_ms']:.3f} | {r['verify_vs_decode']:.3f} | "
              f"{r['verify_graph_ms']:.3f} | {r['verify_graph_vs_decode']:.3f} |")


if __name__ == "__main__":
    main()
