"""Load invariance on the GPU (issue 19): does a request's output depend on what else runs?

    PYTHONPATH=.:bench python bench/bench_invariance.py [--experiment] [--bitwise] [--cost]
        [--shapes 9b] [--out results.json]

--experiment  the issue's experiment in both modes and both dtypes: a random 2B-shaped model (real
              vocabulary), 8 prompts of 100..149 random ids, 64 tokens each, greedy and seeded
              (temperature 0.9, top_p 0.9, seed 11); each prompt alone vs all 8 together with
              num_kv_pages=40 (pauses: Snapshot and Replay). Prints how many of 8 are identical.
--bitwise     one row's decode logits among B = 1..8 rows: the largest |difference| from B = 1.
--cost        the model-step bench (bench_decode.bench_shape: decode B = 1, 2, 4, 8 at context
              2048, prefill 512 / 4096) with and without batch_invariant.

tests/gpu/test_load_invariance_gpu.py asserts the batch_invariant rows of the first two.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench_decode import bench_shape, make_config, measure_ceilings

NUM_PROMPTS, MAX_TOKENS = 8, 64
SEEDED = dict(temperature=0.9, top_p=0.9, seed=11)


def options(dtype, invariant, **kw):
    from ninfer.options import EngineOptions
    base = dict(backend="cuda", dtype=dtype, max_concurrency=8, max_context=256, num_kv_pages=40,
                host_snapshot_bytes=64 << 20, batch_invariant=invariant)
    return EngineOptions(**{**base, **kw})


def prompts(vocab: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(n)).astype(np.int32)
            for n in rng.integers(100, 150, NUM_PROMPTS)]


def experiment(dtype, invariant, *, shape="2b", logprobs_rows=(), log=print) -> dict:
    """Each prompt alone, then all together under KV pressure, greedy and seeded, in one Engine
    core (40 pages hold one 256-token request alone; 8 together must pause). `logprobs_rows`:
    prompts that also ask for logprobs (their batches sample on the host)."""
    from ninfer.api import SamplingParams
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from ninfer.models.qwen3_5.program import Program
    from ninfer.runtime.engine_core import EngineCore
    from ninfer.models.qwen3_5.fakes import FakeFrontend
    cfg = make_config(shape)
    opts = options(dtype, invariant)
    t0 = time.perf_counter()
    model = CudaModel(cfg, opts, random_seed=1234)
    program = core = None
    out = dict(dtype=dtype, batch_invariant=invariant)
    try:
        program = Program(model, opts)
        program.warm_up()
        core = EngineCore(program, FakeFrontend(cfg.text.vocab_size, ()), opts)
        ps = prompts(cfg.text.vocab_size)
        for name, extra in (("greedy", dict(temperature=0.0)), ("seeded", SEEDED)):
            params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                     logprobs=2 if i in logprobs_rows else None, **extra)
                      for i in range(NUM_PROMPTS)]
            alone = [core.submit(p, q).result(timeout=600).token_ids
                     for p, q in zip(ps, params)]
            handles = [core.submit(p, q) for p, q in zip(ps, params)]
            together = [h.result(timeout=600).token_ids for h in handles]
            assert all(len(t) == MAX_TOKENS for t in alone + together)
            out[name] = sum(a == b for a, b in zip(alone, together))
            out[name + "_first_diff"] = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                              None) for a, b in zip(alone, together)]
        st = core.stats()
        out.update({k: st[k] for k in ("pauses", "snapshot_resumes", "replay_resumes")})
    finally:
        if core is not None:
            core.shutdown()
        if program is not None:
            program.kv.close()
            program.state.close()
        model.close()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    log(json.dumps(out))
    return out


def bitwise_rows(model, *, seed=0) -> dict:
    """Prefill 8 rows of different lengths, then decode one step of row 0 among B - 1 others
    (placed in the middle of the batch) for B = 1..8, State restored after each step. Returns
    B -> row 0's fp32 logits [V]."""
    from ninfer.models.qwen3_5.batch import ForwardBatch
    V = model.text.vocab_size
    ctx = np.array([37, 100, 61, 5, 140, 77, 16, 120], np.int32)
    page, per_row = 16, 12
    kv = model.new_kv_pool(len(ctx) * per_row, page)
    state = model.new_state_pool(len(ctx))
    try:
        tables = np.arange(len(ctx) * per_row, dtype=np.int32).reshape(len(ctx), per_row)
        rng = np.random.default_rng(seed)
        for r, n in enumerate(ctx):
            model.forward(ForwardBatch.single(rng.integers(3, V, int(n)), 0, tables[r], r), kv, state)
        backups = [state.read(r) for r in range(len(ctx))]
        nxt = rng.integers(3, V, len(ctx)).astype(np.int32)
        out = {}
        for B in range(1, len(ctx) + 1):
            others = list(range(1, B))
            rows = others[:(B - 1) // 2] + [0] + others[(B - 1) // 2:]
            batch = ForwardBatch(token_ids=nxt[rows], positions=ForwardBatch.text_positions(
                ctx[rows], [1] * B), query_start=np.arange(B + 1, dtype=np.int32),
                context_lens=ctx[rows], block_tables=tables[rows],
                state_slots=np.array(rows, np.int32))
            out[B] = model.forward(batch, kv, state)[rows.index(0)].copy()
            for r in rows:
                state.write(r, backups[r])
        return out
    finally:
        kv.close()
        state.close()


def bitwise(dtype, invariant, *, shape="2b", log=print) -> dict:
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    model = CudaModel(make_config(shape), options(dtype, invariant, num_kv_pages=96),
                      random_seed=1234)
    try:
        rows = bitwise_rows(model)
    finally:
        model.close()
    diffs = {B: float(np.max(np.abs(rows[B] - rows[1]))) for B in rows}
    out = dict(dtype=dtype, batch_invariant=invariant, max_abs_diff_vs_B1=diffs)
    log(json.dumps(out))
    return out


def cost(shapes, log=print) -> list:
    from ninfer.core.cuda import driver as d
    bw, rate = measure_ceilings(d.Device(0))
    rows = []
    for name in shapes:
        for inv in (False, True):
            for r in bench_shape(name, bw, rate, [512, 4096], [2048], [1, 2, 4, 8], 20, log,
                                 invariant=inv):
                rows.append({**r, "batch_invariant": inv})
    log("shape  kind     size  default      invariant    cost")
    key = lambda r: (r["shape"], r["kind"], r.get("B", r.get("T")))   # noqa: E731
    base = {key(r): r for r in rows if not r["batch_invariant"]}
    for r in rows:
        if r["batch_invariant"] and key(r) in base:
            b = base[key(r)]
            log(f"{r['shape']:5s}  {r['kind']:7s}  {key(r)[2]:5d}  {b['tok_s']:9.1f}    "
                f"{r['tok_s']:9.1f}    {100 * (b['tok_s'] / r['tok_s'] - 1):+.1f}% time")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiment", action="store_true")
    ap.add_argument("--bitwise", action="store_true")
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--modes", default="default,invariant")
    ap.add_argument("--shapes", default="9b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    log = lambda s: print(s, flush=True)   # noqa: E731
    modes = [m == "invariant" for m in args.modes.split(",")]
    res = dict(experiment=[], bitwise=[], cost=[])
    for dtype in ("float32", "bfloat16"):
        for inv in modes:
            if args.bitwise:
                res["bitwise"].append(bitwise(dtype, inv, log=log))
            if args.experiment:
                res["experiment"].append(experiment(dtype, inv, log=log))
    if args.cost:
        res["cost"] = cost(args.shapes.split(","), log)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
