"""What a speculative Engine's plain unit costs against plain decoding's step (issue 25's floor).

A speculative Engine runs k = 0 units as plain decode steps launched ahead, like plain
decoding, but each keeps its rows' final-normed hidden states (a B x hidden device-to-host copy
after the graph) and the host queues them per row for the drafter; its model also holds the
drafter (a KV layer in every page, the verify buffers). This runs, in one process and one
Engine configuration each: plain decoding; the speculative Engine with the draft policy held
at k = 0 (every unit a plain keep-hidden step); the same without the hidden copy (zeros
queued instead: the drafter never runs, as k stays 0); plain decoding again (drift). Each
prints the median commit-to-commit time of a plain unit of the full batch after another.

    python bench/bench_plain_units.py --batch 8 --max-tokens 200 [--order plain,held,...]

Measured (H100, 2026-12-07, bench/results_h100_plain_units_1207.log): the order decides, not the
kind: a process's first Engine steps in 6.99-7.00 ms (9B, B = 8), every later one in 7.14-7.16,
plain or speculative, with the hidden copy or without. So bench_speculative runs each
configuration in a process of its own.
"""
import argparse
import pathlib

import numpy as np

import bench_speculative
from bench_engine import make_artifact, prompt_ids
from ninfer.models.qwen3_5.program import draft_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--workdir", default="/tmp/ninfer-bench")
    ap.add_argument("--order", default="plain,held,nocopy,plain,held",
                    help="the runs, in order, each a fresh Engine in this process: plain, held "
                         "(k held at 0), nocopy (held, without the hidden copy)")
    args = ap.parse_args()
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    ids = [np.asarray(prompt_ids(48, seed), np.int32) for seed in range(max(8, args.batch))]
    path = make_artifact(args.shape, pathlib.Path(args.workdir), direct=True, mtp=True)[0]
    on = dict(backend="cuda", dtype=None, batch=args.batch, drafter="mtp", draft_vocab=None)
    choose, queue = draft_policy.DraftPolicy.choose, CudaModel._queue_step_hidden

    def zeros(self, turn, B, src, H):
        return lambda: np.zeros((B, H), np.float32)

    kinds = {"plain": ("plain decoding", 0, False, False),
             "held": ("speculative, k held at 0", 4, True, False),
             "nocopy": ("speculative, k held at 0, no hidden copy", 4, True, True)}
    runs = [kinds[name] for name in args.order.split(",")]
    print(f"{args.shape}, B = {args.batch}, {args.max_tokens} greedy tokens a request")
    print("| run | tok/s wall | plain unit, median ms commit to commit (units) |")
    print("|---|---|---|")
    try:
        for label, k, held, no_copy in runs:
            draft_policy.DraftPolicy.choose = (lambda self, *a, **kw: 0) if held else choose
            CudaModel._queue_step_hidden = zeros if no_copy else queue
            r = bench_speculative.run(path, ids, k, args.max_tokens, policy="adaptive", **on)
            ms, n = r["plain_step_ms"]
            print(f"| {label} | {r['wall_tok_s']:.1f} | {ms:.3f} ({n}) |", flush=True)
    finally:
        draft_policy.DraftPolicy.choose, CudaModel._queue_step_hidden = choose, queue


if __name__ == "__main__":
    main()
