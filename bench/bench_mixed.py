"""Decode rows beside a prefill, through the public Engine: the cycle's decode rows and the
prefill chunk as one forward (`Model.mixed_batches`) against two (a decode step, then the chunk).

    PYTHONPATH=.:bench python bench/bench_mixed.py --shape 9b [--decoders 7] [--prompt 4096]
    PYTHONPATH=.:bench python bench/bench_mixed.py --backend numpy --shape tiny   (CPU smoke)

--decoders requests decode (greedy, ignore_eos) until a --prompt-token request arrives; timed:
that request's TTFT and the decoders' tokens per second while it prefills (the decode rows ride
on its chunks when merged). Both ways run in one process, one Engine each; their greedy tokens
must agree (the numpy backend always merges: its figure is the host's work only).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import ninfer  # noqa: E402
from ninfer.api import SamplingParams  # noqa: E402
from bench_engine import make_artifact, prompt_ids  # noqa: E402


def one_way(path, args, mixed: bool) -> dict:
    if args.backend == "cuda":
        from ninfer.models.qwen3_5.cuda_model import CudaModel
        CudaModel.mixed_batches = mixed          # read by the Program the Engine builds
    with ninfer.Engine(str(path), backend=args.backend, max_concurrency=args.decoders + 1,
                       max_context=args.prompt + args.gen + 64,
                       prefill_chunk=args.prefill_chunk, prefix_cache=False) as engine:
        program = engine._core.program
        engine.generate(prompt_ids(64, 1), SamplingParams(max_tokens=2, temperature=0.0))
        params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
        decoders = [engine.submit(prompt_ids(32, 10 + r), params) for r in range(args.decoders)]
        while engine.stats()["tokens_generated"] < 2 + 16 * args.decoders:
            time.sleep(0.001)                     # every decoder is past its prefill
        n0, t0 = engine.stats()["tokens_generated"], time.perf_counter()
        res = engine.submit(prompt_ids(args.prompt, 99),
                            SamplingParams(max_tokens=1, temperature=0.0)).result()
        t1 = time.perf_counter()
        n1 = engine.stats()["tokens_generated"] - 1          # (the long request's own token)
        tokens = [h.result().token_ids for h in decoders]
        return dict(mixed=bool(program.merges_units), ttft_ms=1e3 * (t1 - t0),
                    decode_tok_s=(n1 - n0) / (t1 - t0), long_token=res.token_ids,
                    tokens=tokens)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--shape", default="9b", help="bench_decode.SHAPES name, or tiny")
    ap.add_argument("--workdir", default="/tmp/ninfer-bench")
    ap.add_argument("--decoders", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--gen", type=int, default=512, help="tokens per decoder (past the prefill)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path, _, _ = make_artifact(args.shape, workdir)
    ways = [one_way(path, args, mixed) for mixed in ((True, False) if args.backend == "cuda"
                                                     else (True,))]
    if len(ways) == 2:
        # bf16: a decode row computed in a chunk's GEMM rounds differently from the decode
        # graph's, so a near-tie may pick another token (the float32 identity is tests/gpu's
        # test_mixed_batches_give_the_same_tokens)
        same = sum(a == b for a, b in zip(ways[0]["tokens"], ways[1]["tokens"]))
        print(f"greedy tokens: {same} of {args.decoders} decoders identical both ways")
    for w in ways:
        print(f"{args.shape} {args.backend} {'one forward ' if w['mixed'] else 'two forwards'}: "
              f"{args.decoders} decoders + a {args.prompt}-token prompt: TTFT "
              f"{w['ttft_ms']:.1f} ms, decoders {w['decode_tok_s']:.0f} tok/s during it",
              flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            [{k: v for k, v in w.items() if k != "tokens"} for w in ways], indent=1))


if __name__ == "__main__":
    main()
