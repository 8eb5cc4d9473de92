"""The MTP head's step on the GPU against a decode step (issue 25's "one draft token <= 0.15x one
decode step"), at the bench shapes, random bf16 weights:

    PYTHONPATH=.:bench python bench/bench_mtp.py [--shapes 9b,27b,35b-a3b] [--ctx 2048]
        [--feed 64] [--verify 4] [--steps 20] [--batch 1,8]

Per shape: the captured decode graph's step at B = 1 (GPU time between events, as bench_decode
measures it); one MTP step of 1 token (StepRunner.mtp launched eagerly: launches count, as they
would not inside a graph; GPU time between events around its launches, no host copies), and the
drafter's feed of `--feed` positions in one call (program/speculative.py LAG_TOKENS); and the
target's verify of `--verify` positions (the last token and k = verify - 1 drafts: StepRunner.run
with the State snapshots, eager, every position's logits: issue 25's "<= 1.25x one decode step"),
and the same through its captured verify graph (what the Engine launches);
each as a fraction of the decode step. `--batch B,...`: the same at B rows each (the decode step of
B rows, B rows' draft tokens, B rows' feeds, a verify of B x `--verify` tokens: the cost the
adaptive policy weighs at that B; the eager verify at B > 1 is left out).
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


def bench_shape(name: str, ctx: int, feed: int, steps: int, verify: int = 4, B: int = 1,
                draft_vocab: int = None) -> dict:
    cfg_m = make_config(name)
    cfg_m = dataclasses.replace(cfg_m, text=dataclasses.replace(cfg_m.text,
                                                                 mtp_num_hidden_layers=1))
    cfg = cfg_m.text
    page = 16
    opts = EngineOptions(backend="cuda", max_concurrency=B, max_context=ctx + feed + 16,
                         page_size=page, prefill_chunk=max(B * feed, 64),
                         num_draft_tokens=min(max(verify - 1, 1), 4), draft_vocab=draft_vocab)
    model = CudaModel(cfg_m, opts, random_seed=1234, mtp=True)
    try:
        pages_per_row = (ctx + feed + page - 1) // page + 2
        kv = model.new_kv_pool(B * pages_per_row, page)
        state = model.new_state_pool(B + B * verify)
        rng = np.random.default_rng(0)
        batch = decode_batch(B, ctx, page, pages_per_row, rng, cfg.vocab_size)
        tables = np.asarray(batch.block_tables)
        for _ in range(3):
            model.decode_greedy(batch, kv, state)
        decode = gpu_ms(model, lambda: model.decode_greedy(batch, kv, state), steps)
        out = {"shape": name, "ctx": ctx, "batch": B, "decode_ms": decode}
        # a draft's head over the first draft_vocab ids (EngineOptions.draft_vocab: what the
        # drafter runs; their int8 copy, EngineOptions.draft_head, where the model made one),
        # the same rows in bf16 (draft_bf16), and over every id (draft_full: the head before
        # draft_vocab)
        int8 = model.weights.get("draft_head")
        for label, n, vocab, copy in (("draft", 1, model.draft_vocab, int8),
                                      ("draft_bf16", 1, model.draft_vocab, None),
                                      ("draft_full", 1, None, None),
                                      ("feed", feed, model.draft_vocab, int8)):
            model.weights.pop("draft_head", None)
            if copy is not None:
                model.weights["draft_head"] = copy
            b = rows_batch(B, n, ctx - n + 1, tables, rng, cfg.vocab_size)
            h = rng.standard_normal((B * n, cfg.hidden_size)).astype(np.float32)
            model.mtp_forward(b, h, kv, with_logits=False)   # warm-up (plans, modules)
            last = np.arange(1, B + 1, dtype=np.int32) * n - 1
            model._upload_meta(model.eager_layout, model.eager_meta, 0, b, last)
            model.runner.mtp(model.stream, model.eager_meta, B * n, B, B, kv, vocab=vocab)
            ms = gpu_ms(model, lambda: model.runner.mtp(model.stream, model.eager_meta, B * n, B,
                                                         B, kv, vocab=vocab), steps)
            out[f"{label}_ms"] = ms
            out[f"{label}_vs_decode"] = ms / decode
        # the verify: each row's last token and verify - 1 drafts at the context's end, row r's
        # State after each into slots B + r * verify ..
        b = rows_batch(B, verify, ctx, tables, rng, cfg.vocab_size)
        every = np.arange(B * verify, dtype=np.int32)
        snaps = B + verify * np.arange(B)
        model.verify_forward(b, kv, state, every, snap_base=snaps)        # warm-up
        model._upload_meta(model.eager_layout, model.eager_meta, 0, b, every)
        if B == 1:
            rows = [(0, verify, ctx)]
            ms = gpu_ms(model, lambda: model.runner.run(model.stream, model.eager_meta, verify,
                                                        1, verify, kv, state, rows=rows,
                                                        snap=model.ws.snap.ptr), steps)
            out["verify_ms"], out["verify_vs_decode"] = ms, ms / decode
        else:
            out["verify_ms"] = out["verify_vs_decode"] = float("nan")
        # the same through its captured graph (decode_graphs.verify: + the final norm of every
        # token, the drafter's feed), as CudaModel.verify_forward / verify_tokens launch it
        graph = model.graphs.verify(B * verify, B, kv, state, model.eager_meta,
                                    model.ws.snap.ptr)
        ms = gpu_ms(model, graph.launch, steps)
        out["verify_graph_ms"], out["verify_graph_vs_decode"] = ms, ms / decode
        kv.close()
        state.close()
        return out
    finally:
        model.close()


def rows_batch(B: int, n: int, start: int, tables, rng, V: int) -> ForwardBatch:
    """B text rows of n random tokens each at positions start .. start + n - 1."""
    return ForwardBatch(rng.integers(0, V, B * n).astype(np.int32),
                        ForwardBatch.text_positions([start] * B, [n] * B),
                        np.arange(B + 1, dtype=np.int32) * n, np.full(B, start, np.int32),
                        tables, np.arange(B, dtype=np.int32))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="9b,27b,35b-a3b")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--feed", type=int, default=64)
    ap.add_argument("--verify", type=int, default=4, help="verify positions (k + 1)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", default="1", metavar="B,...", help="rows of each call")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="EngineOptions.draft_vocab (default: the Engine's)")
    args = ap.parse_args(argv)
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
        for B in (int(x) for x in args.batch.split(",")):
            t0 = time.perf_counter()
            rows.append(bench_shape(name, args.ctx, args.feed, args.steps, args.verify, B,
                                    args.draft_vocab))
            print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n| shape | B | decode step ms (graph) | 1 draft token ms (eager; bf16 rows; every id) "
          "| vs decode | "
          f"feed of {args.feed} ms | vs decode | verify of {args.verify} ms (eager) | vs decode | "
          "verify (graph) ms | vs decode |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['decode_ms']:.2f} | {r['draft_ms']:.3f} "
              f"({r['draft_bf16_ms']:.3f}; {r['draft_full_ms']:.3f}) | {r['draft_vs_decode']:.3f} "
              f"({r['draft_bf16_vs_decode']:.3f}; {r['draft_full_vs_decode']:.3f}) | "
              f"{r['feed_ms']:.3f} | {r['feed_vs_decode']:.3f} | "
              f"{r['verify_ms']:.3f} | {r['verify_vs_decode']:.3f} | "
              f"{r['verify_graph_ms']:.3f} | {r['verify_graph_vs_decode']:.3f} |")


if __name__ == "__main__":
    main()
