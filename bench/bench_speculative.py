"""Speculative decoding with the MTP head through the Engine (issue 15), numpy backend.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python bench/bench_speculative.py [--models dense,moe]
        [--ks 1,2,3,4] [--adaptive 4] [--prompts 4] [--prompt-tokens 48] [--max-tokens 64]
        [--json out.json]

For each trained reference model: greedy generation of `--max-tokens` tokens after `--prompts`
windows of the held-out text (`--prompt-tokens` ids each), one request at a time, without
speculation (k = 0), with speculative="mtp" at each fixed k (draft_policy="fixed"), and with the
default adaptive policy up to `--adaptive` drafts (the units it ran at each k reported). Checks
that every run's tokens equal k = 0's, then reports per run: acceptance by draft position
(accepted / drafted, the Engine's stats), tokens per verify step (emitted / verify steps), the
recompute share (verify steps that rolled back, tokens run again), decode throughput and its
ratio to k = 0, in process CPU seconds (the figure to compare on a shared machine) and in wall
seconds; and where a speculative run's CPU time goes: target forwards, drafting, the drafter
feed, the State recompute, sampling/other.

These are numpy (CPU) figures of 4-5 M-parameter models whose 248,320 x 128 lm_head is most of a
step's work: they show the mechanism, not a GPU speed-up (no CUDA draft/verify path exists yet).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import numpy as np

from ninfer import Engine, SamplingParams
from ninfer.demo import ensure_reference_artifact
from ninfer.eval import dataset_path
from ninfer.models.qwen3_5.frontend.tokenizer import Tokenizer
from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json
from ninfer.models.qwen3_5.mtp import MtpDrafter
from ninfer.models.qwen3_5.model import NumpyModel
from ninfer.models.qwen3_5.program import speculative


def prompts(count: int, length: int) -> list:
    ids = np.asarray(Tokenizer(cached_qwen3_5_tokenizer_json()).encode(
        dataset_path("heldout").read_text(encoding="utf-8")), np.int32)
    starts = np.linspace(0, len(ids) - length - 1, count).astype(int)
    return [ids[s:s + length] for s in starts]


class CpuClock:
    """Process CPU seconds spent inside wrapped functions, by part (outermost call only)."""

    def __init__(self):
        self.seconds: dict = {}
        self._depth = 0

    @contextlib.contextmanager
    def wrap(self, owner, name: str, part: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            t = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds[part] = self.seconds.get(part, 0.0) + time.process_time() - t
        setattr(owner, name, timed)
        try:
            yield
        finally:
            setattr(owner, name, original)


def run(path, ids_list, k: int, max_tokens: int, policy: str = "fixed") -> dict:
    kw = {} if k == 0 else dict(speculative="mtp", num_draft_tokens=k, draft_policy=policy)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    clock = CpuClock()
    with Engine(path, max_concurrency=1, max_context=256, prefix_cache=False, **kw) as engine, \
            clock.wrap(NumpyModel, "final_hidden", "target forward"), \
            clock.wrap(NumpyModel, "forward", "target forward"), \
            clock.wrap(MtpDrafter, "logits", "target forward"), \
            clock.wrap(MtpDrafter, "draft_greedy", "draft"), \
            clock.wrap(MtpDrafter, "draft_argmax", "draft"), \
            clock.wrap(speculative.MtpSpeculator, "_catch_up", "drafter feed"), \
            clock.wrap(speculative.MtpSpeculator, "_recompute", "State recompute"):
        engine.generate(ids_list[0][:8], SamplingParams(max_tokens=4))      # warm the caches
        clock.seconds.clear()
        base = engine.stats()
        tokens, wall, cpu = [], 0.0, 0.0
        for ids in ids_list:
            c, t = time.process_time(), time.perf_counter()
            result = engine.generate(ids, params)
            cpu += time.process_time() - c
            wall += time.perf_counter() - t
            tokens.append(result.token_ids)
        stats = engine.stats()
    n = sum(len(t) for t in tokens)
    out = dict(k=k, policy=policy if k else "plain", tokens=tokens, num_tokens=n, cpu_s=cpu, wall_s=wall,
               cpu_tok_s=n / cpu, wall_tok_s=n / wall, parts=dict(clock.seconds))
    if k:
        delta = {key: stats[key] - base.get(key, 0) for key in
                 ("spec_verify_rows", "spec_emitted_tokens", "spec_draft_tokens",
                  "spec_accepted_tokens", "spec_recompute_rows", "spec_recompute_tokens")}
        drafted = np.array(stats["spec_drafted_by_position"]) - \
            np.array(base.get("spec_drafted_by_position", [0] * k))
        accepted = np.array(stats["spec_accepted_by_position"]) - \
            np.array(base.get("spec_accepted_by_position", [0] * k))
        units = np.array(stats["spec_units_by_k"]) - \
            np.array(base.get("spec_units_by_k", [0] * (k + 1)))
        out.update(delta, acceptance=(accepted / np.maximum(drafted, 1)).tolist(),
                   tokens_per_verify=delta["spec_emitted_tokens"] / max(delta["spec_verify_rows"], 1),
                   units_by_k=units.tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--adaptive", type=int, default=4, metavar="K",
                    help="one more run with draft_policy='adaptive' up to K drafts (0: none)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    ids_list = prompts(args.prompts, args.prompt_tokens)
    report = {}
    for name in args.models.split(","):
        path = ensure_reference_artifact(name)
        plain = run(path, ids_list, 0, args.max_tokens)
        rows = [plain]
        for k in (int(x) for x in args.ks.split(",")):
            r = run(path, ids_list, k, args.max_tokens)
            if r["tokens"] != plain["tokens"]:
                raise SystemExit(f"{name} k={k}: tokens differ from plain decoding")
            rows.append(r)
        if args.adaptive:
            r = run(path, ids_list, args.adaptive, args.max_tokens, policy="adaptive")
            if r["tokens"] != plain["tokens"]:
                raise SystemExit(f"{name} adaptive: tokens differ from plain decoding")
            rows.append(r)
        print(f"\n{name}: {args.prompts} prompts x {args.max_tokens} greedy tokens, one at a time "
              f"(numpy; tokens equal plain decoding at every k)")
        print("| k | acceptance by draft position | tokens / verify | recompute (steps, tokens) "
              "| tok/s CPU | speed-up CPU | tok/s wall | speed-up wall | CPU: target / draft / "
              "feed / recompute / other |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            parts = r["parts"]
            known = sum(parts.values())
            split = " / ".join(f"{parts.get(p, 0.0) / r['cpu_s']:.0%}" for p in
                               ("target forward", "draft", "drafter feed", "State recompute"))
            split += f" / {(r['cpu_s'] - known) / r['cpu_s']:.0%}"
            label = r["k"] if r["policy"] != "adaptive" else \
                f"adaptive <= {r['k']} (units at k = 0..{r['k']}: " \
                f"{'/'.join(str(u) for u in r['units_by_k'])})"
            if r["k"]:
                acc = ", ".join(f"{a:.2f}" for a in r["acceptance"])
                spec = (f"{acc} | {r['tokens_per_verify']:.2f} | "
                        f"{r['spec_recompute_rows']}/{r['spec_verify_rows']}, "
                        f"{r['spec_recompute_tokens']}")
            else:
                spec = "(plain decoding) | 1 | -"
            print(f"| {label} | {spec} | {r['cpu_tok_s']:.1f} | "
                  f"{r['cpu_tok_s'] / plain['cpu_tok_s']:.2f}x | {r['wall_tok_s']:.1f} | "
                  f"{r['wall_tok_s'] / plain['wall_tok_s']:.2f}x | {split} |")
        report[name] = [{key: v for key, v in r.items() if key != "tokens"} for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
