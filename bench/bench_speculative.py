"""Speculative decoding through the Engine (issues 15, 25 and 30): the MTP head or a DFlash drafter.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python bench/bench_speculative.py [--models dense,moe]
        [--drafter mtp|dflash] [--ks 1,2,3,4] [--adaptive 4] [--prompts 4] [--prompt-tokens 48]
        [--max-tokens 64]
        [--backend numpy|cuda] [--dtype bfloat16] [--oracle 0.5,0.9] [--json out.json]
        [--shapes 9b,27b [--workdir DIR]] [--batch B] [--no-drafts-behind] [--in-process]

For each trained reference model: greedy generation of `--max-tokens` tokens after `--prompts`
windows of the held-out text (`--prompt-tokens` ids each), one request at a time, without
speculation (k = 0), with speculative=`--drafter` at each fixed k (draft_policy="fixed"), and with the
default adaptive policy up to `--adaptive` drafts (the units it ran at each k reported). Checks
that every run's tokens equal k = 0's, then reports per run: acceptance by draft position
(accepted / drafted, the Engine's stats), tokens per verify step (emitted / verify steps), the
recompute share (verify steps that rolled back, tokens run again), decode throughput and its
ratio to k = 0, in process CPU seconds (the figure to compare on a shared machine) and in wall
seconds; and where a speculative run's CPU time goes: target forwards, drafting, the drafter
feed, on CUDA the verifies whose feed and next drafts ran behind them in one call ("behind"),
the State recompute, sampling/other.

numpy figures are of 4-5 M-parameter models whose 248,320 x 128 lm_head is most of a step's work:
they show the mechanism, not a GPU speed-up. `--backend cuda` runs the same on the GPU (wall
seconds are the figure there; the parts are wall seconds too). `--oracle p,...`: one more set of
runs per p where the drafter's proposals are replaced by the target's own next token (from the
plain run) with probability p each, else by another token: acceptance set by hand (the drafting
is still run and paid for), the speed-up as a function of acceptance. `--oracle c1/c2/...` sets
the acceptance by draft position instead (position j accepted in a share c_j of the verifies),
e.g. the dense reference model's measured 0.76/0.40/0.25/0.09 (docs/performance.md).

`--shapes 9b,...` (cuda): the same runs on random-weight models of those bench shapes with an MTP
head, or with --drafter dflash a random DFlash drafter of `--dflash-layers` layers, block 16
(bench_engine.make_artifact / write_drafter: the 9B is ~50 s to write), prompts of random ids: the issue's
9B / 27B figures at set acceptances (`--oracle`; the random head's own drafts are rejected, which
is the adaptive policy's never-lose case). `--batch B`: B requests at once, max_concurrency B.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import pickle
import sys
import tempfile
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

from isolate import run_child


def prompts(count: int, length: int) -> list:
    ids = np.asarray(Tokenizer(cached_qwen3_5_tokenizer_json()).encode(
        dataset_path("heldout").read_text(encoding="utf-8")), np.int32)
    starts = np.linspace(0, len(ids) - length - 1, count).astype(int)
    return [ids[s:s + length] for s in starts]


class CpuClock:
    """Seconds spent inside wrapped functions, by part (outermost call only): process CPU
    seconds, or with `timer` time.perf_counter wall seconds (the GPU's figure)."""

    def __init__(self, timer=time.process_time):
        self.seconds: dict = {}
        self._depth = 0
        self.timer = timer

    @contextlib.contextmanager
    def wrap(self, owner, name: str, part: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            t = self.timer()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds[part] = self.seconds.get(part, 0.0) + self.timer() - t
        setattr(owner, name, timed)
        try:
            yield
        finally:
            setattr(owner, name, original)


def parse_oracle(text: str):
    """An --oracle value: "p" (a float: each draft right with probability p, a draw of its own)
    or an acceptance profile "c1/c2/..." (a tuple, non-increasing: one draw u per row and unit,
    the draft at position j right iff u < c_j, so c_j is the share of verifies that accept
    position j: the "acceptance by draft position" this bench reports; past the profile every
    draft is wrong)."""
    if "/" not in text:
        return float(text)
    c = tuple(float(x) for x in text.split("/"))
    if any(not 0.0 <= x <= 1.0 for x in c) or any(b > a for a, b in zip(c, c[1:])):
        raise SystemExit(f"--oracle {text}: a profile is shares in [0, 1], non-increasing")
    return c


def _right(p, u: float, rng, j: int) -> bool:
    """Whether draft j (0-based) of a row is the target's token: p a float (its own draw) or a
    profile (the row's one draw u against c_j)."""
    if isinstance(p, tuple):
        return j < len(p) and u < p[j]
    return rng.random() < p


@contextlib.contextmanager
def oracle_drafts(p, plain_outputs: dict, seed: int = 0):
    """Each draft the speculator verifies becomes the target's own token there (plain_outputs:
    prompt ids -> the plain run's output ids) or else that token + 1, as parse_oracle's p says
    (a probability per position, or an acceptance profile): greedy acceptance set by hand,
    whatever the drafter proposed (its work is still done)."""
    original = speculative.Speculator._draft
    rng = np.random.default_rng(seed)

    def _draft(self, prog, seqs, units, t0, masks, draft_masks):
        drafts = original(self, prog, seqs, units, t0, masks, draft_masks)
        for r, d in drafts.items():
            seq = seqs[r]
            want = plain_outputs.get(tuple(prog.token_ids(seq, 0, seq.num_prompt_tokens)
                                           .tolist()))
            if want is None:                    # (the warm-up request)
                continue
            first = seq.num_tokens - seq.num_prompt_tokens     # d_1's index among the outputs
            new = d.copy()
            u = rng.random()
            for j in range(len(d)):
                if first + j < len(want):
                    t = int(want[first + j])
                    new[j] = t if _right(p, u, rng, j) else (t + 1) % prog.vocab_size
            prog.write_provisional(seq, new)
            drafts[r] = new
        return drafts
    speculative.Speculator._draft = _draft
    try:
        yield
    finally:
        speculative.Speculator._draft = original


def _clocked(clock, backend: str, kind: str = "mtp"):
    """The parts a run's time is split into, by the functions each backend runs them in."""
    stack = contextlib.ExitStack()
    if backend == "cuda":
        from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
        from ninfer.models.qwen3_5.cuda_model import CudaModel
        # (verify_tokens: the device-sampled verify, which plain greedy / seeded rows take)
        target = [(CudaModel, "verify_forward"), (CudaModel, "verify_tokens")]
        drafter = CudaDrafter
        # (a verify whose feed and next drafts ran behind it, in one call)
        stack.enter_context(clock.wrap(CudaModel, "verify_and_draft",
                                       "verify + feed + next drafts"))
    else:
        target = [(NumpyModel, "verify_forward"), (NumpyModel, "final_hidden"),
                  (NumpyModel, "forward")]
        drafter = MtpDrafter
    for owner, name in target:
        stack.enter_context(clock.wrap(owner, name, "target forward"))
    if kind == "dflash":
        from ninfer.models.qwen3_5.cuda.dflash import CudaDFlashDrafter
        from ninfer.models.qwen3_5.dflash import DFlashDrafter
        drafter = CudaDFlashDrafter if backend == "cuda" else DFlashDrafter
    stack.enter_context(clock.wrap(drafter, "draft" if kind == "dflash" else "draft_greedy",
                                   "draft"))
    stack.enter_context(clock.wrap(speculative.Speculator, "_catch_up", "drafter feed"))
    stack.enter_context(clock.wrap(speculative.Speculator, "_recompute", "State recompute"))
    return stack


@contextlib.contextmanager
def _plain_intervals(batch: int, out: list):
    """Time from each plain decode unit of `batch` rows committing to the next one's, where the
    two follow each other (Program.commit): what a plain step costs in this Engine, comparable
    between plain decoding and a speculative Engine's plain units (the draft policy's k = 0
    cost). Intervals go to `out`, in seconds."""
    from ninfer.models.qwen3_5.program.program import Program
    commit = Program.commit
    last = [None]

    def timed_commit(self, pending, decisions):
        commit(self, pending, decisions)
        now = time.perf_counter()
        plain = len(pending.rows) == batch and all(
            r.num_new_tokens == 1 and not r.is_speculative for r in pending.rows)
        if plain and last[0] is not None:
            out.append(now - last[0])
        last[0] = now if plain else None
    Program.commit = timed_commit
    try:
        yield
    finally:
        Program.commit = commit


def run(path, ids_list, k: int, max_tokens: int, policy: str = "fixed", backend: str = "numpy",
        dtype=None, batch: int = 1, drafter: str = "mtp", draft_vocab: int = None,
        draft_head: str = None,
        rounds: int = 1) -> dict:
    """The prompts in groups of `batch` submitted at once (max_concurrency = batch), `rounds`
    times over in one Engine: the first round starts from a fresh Engine (the draft policy's
    cold start and first explorations in it), the later ones run on what it measured
    (`later_wall_tok_s`: their tokens over their wall time; the tokens are the first round's)."""
    kw = {} if k == 0 else dict(speculative=drafter, num_draft_tokens=k, draft_policy=policy,
                                draft_vocab=draft_vocab,
                                **({} if draft_head is None else {"draft_head": draft_head}))
    if backend == "cuda":
        kw.update(backend="cuda", dtype=dtype)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    clock = CpuClock(time.perf_counter if backend == "cuda" else time.process_time)
    intervals = []
    with Engine(path, max_concurrency=batch, max_context=256, prefix_cache=False, **kw) as engine, \
            _clocked(clock, backend, drafter), _plain_intervals(batch, intervals):
        engine.generate(ids_list[0][:8], SamplingParams(max_tokens=4))      # warm the caches
        clock.seconds.clear()
        intervals.clear()
        base = engine.stats()
        tokens, wall, cpu, later_n, later_wall, later_differ = [], 0.0, 0.0, 0, 0.0, 0
        for rnd in range(rounds):
            for g in range(0, len(ids_list), batch):
                c, t = time.process_time(), time.perf_counter()
                handles = [engine.submit(ids, params) for ids in ids_list[g:g + batch]]
                results = [h.result() for h in handles]
                if rnd == 0:
                    cpu += time.process_time() - c
                    wall += time.perf_counter() - t
                    tokens += [r.token_ids for r in results]
                else:
                    later_wall += time.perf_counter() - t
                    later_n += sum(len(r.token_ids) for r in results)
                    # (bf16: another round's batches can tip a near-tie: the output leaves
                    # round 1's, and --oracle's replaced drafts are wrong from there on)
                    later_differ += sum(list(r.token_ids) != list(tokens[g + i])
                                        for i, r in enumerate(results))
            if rnd == 0:
                stats, parts = engine.stats(), dict(clock.seconds)
                plain_steps = list(intervals)
    n = sum(len(t) for t in tokens)
    out = dict(k=k, policy=policy if k else "plain", backend=backend, tokens=tokens, num_tokens=n, cpu_s=cpu, wall_s=wall,
               cpu_tok_s=n / cpu, wall_tok_s=n / wall, parts=parts,
               later_wall_tok_s=later_n / later_wall if later_wall else None,
               later_differ=later_differ,
               plain_step_ms=(1e3 * float(np.median(plain_steps)), len(plain_steps))
               if plain_steps else None)
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
                   units_by_k=units.tolist(), unit_costs=stats.get("spec_unit_costs", {}),
                   measuring=stats.get("spec_measuring_units", []),
                   untimed=(stats.get("spec_untimed_units", 0),
                            1e3 * stats.get("spec_untimed_seconds", 0.0)),
                   units_first_use=stats.get("spec_units_first_use", 0),
                   first_use_ms=1e3 * stats.get("spec_first_use_seconds", 0.0),
                   catch_up=(stats.get("spec_catch_up_feeds", 0),
                             stats.get("spec_catch_up_positions", 0),
                             stats.get("spec_catch_up_units", 0),
                             1e3 * stats.get("spec_catch_up_seconds", 0.0)))
    return out


def measure(path, ids_list, k: int, max_tokens: int, *, oracle=None, isolate: bool = False,
            **kw) -> dict:
    """run(), under oracle_drafts(*oracle) when given; isolate: in a Python process of its own.
    On the GPU the first Engine of a process decodes ~2% faster than any later one, whatever
    its kind (H100, 2026-12-07, bench_plain_units.py: the 9B at B = 8, 6.99 / 7.00 ms a step
    first, 7.14-7.15 after; B = 1 6.51 against 6.66), so runs made one after another in one
    process favoured the first, plain decoding; each in its own process is what a user's
    Engine meets."""
    if not isolate:
        with oracle_drafts(*oracle) if oracle is not None else contextlib.nullcontext():
            return run(path, ids_list, k, max_tokens, **kw)
    from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
    job = dict(path=str(path), ids_list=[np.asarray(ids).tolist() for ids in ids_list], k=k,
               max_tokens=max_tokens, oracle=oracle, kw=kw,
               drafts_behind=CudaDrafter.drafts_in_verify)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = pathlib.Path(tmp, "job.pkl"), pathlib.Path(tmp, "result.pkl")
        src.write_bytes(pickle.dumps(job))
        rc = run_child([os.path.abspath(__file__), "--child", str(src), str(dst)])
        if rc != 0:
            raise RuntimeError(f"bench_speculative: a run's process exited with {rc}")
        return pickle.loads(dst.read_bytes())


def _child(src: str, dst: str) -> None:
    """One measure(isolate=True) run: its job from src, its result to dst."""
    from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
    job = pickle.loads(pathlib.Path(src).read_bytes())
    CudaDrafter.drafts_in_verify = job["drafts_behind"]
    ids_list = [np.asarray(ids, np.int32) for ids in job["ids_list"]]
    r = measure(job["path"], ids_list, job["k"], job["max_tokens"], oracle=job["oracle"],
                **job["kw"])
    pathlib.Path(dst).write_bytes(pickle.dumps(r))


def speculative_rows(name, path, ids_list, plain, args, on, strict: bool = True,
                     oracle=None) -> list:
    """The fixed-k runs and the adaptive one; each one's tokens must equal plain decoding's
    (strict), or (random weights: bf16 near-ties a verify's multi-token GEMMs may round the
    other way than a decode step's GEMVs) the tokens that differ are counted."""
    runs = [(int(x), "fixed") for x in args.ks.split(",") if x]
    if args.adaptive:
        runs.append((args.adaptive, "adaptive"))
    rows = []
    for k, policy in runs:
        r = measure(path, ids_list, k, args.max_tokens, policy=policy, rounds=args.rounds,
                    oracle=oracle, isolate=args.isolate, **on)
        differ = sum(int(np.any(np.asarray(a) != np.asarray(b))) if len(a) == len(b) else 1
                     for a, b in zip(r["tokens"], plain["tokens"]))
        if differ and strict:
            raise SystemExit(f"{name} k={k} ({policy}): tokens differ from plain decoding")
        r["outputs_differing"] = differ
        rows.append(r)
    return rows


def table(title, rows, plain, args, figure: str) -> None:
    """The markdown table of one model's runs; the parts are shares of `figure` seconds (cpu on
    numpy, wall on cuda)."""
    differ = sum(r.get("outputs_differing", 0) for r in rows)
    print(f"\n{title}: {len(rows[0]['tokens'])} prompts x {args.max_tokens} greedy tokens, "
          f"{args.batch} at a time ({args.backend}; "
          + (f"outputs differing from plain decoding: {differ}" if differ else
             "tokens equal plain decoding at every k") + ")")
    print("| k | acceptance by draft position | tokens / verify | recompute (steps, tokens) "
          f"| tok/s CPU | speed-up CPU | tok/s wall | speed-up wall | {figure}: target / draft / "
          "feed / behind (verify + feed + next drafts, one call) / recompute / other |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        parts, total = r["parts"], r[f"{figure}_s"]
        known = sum(parts.values())
        split = " / ".join(f"{parts.get(p, 0.0) / total:.0%}" for p in
                           ("target forward", "draft", "drafter feed",
                            "verify + feed + next drafts", "State recompute"))
        split += f" / {(total - known) / total:.0%}"
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
        later = ""
        if r.get("later_wall_tok_s") and plain.get("later_wall_tok_s"):
            differ = f"; {r['later_differ']} outputs left round 1's" if r["later_differ"] else ""
            later = f" (rounds 2..: {r['later_wall_tok_s'] / plain['later_wall_tok_s']:.2f}x" \
                    f"{differ})"
        print(f"| {label} | {spec} | {r['cpu_tok_s']:.1f} | "
              f"{r['cpu_tok_s'] / plain['cpu_tok_s']:.2f}x | {r['wall_tok_s']:.1f} | "
              f"{r['wall_tok_s'] / plain['wall_tok_s']:.2f}x{later} | {split} |")
    steps = [r for r in rows if r.get("plain_step_ms")]
    if steps:           # (commit to commit, a plain unit of the full batch after another)
        print("  plain units of the full batch, median ms commit to commit (units): " + ", ".join(
            f"{r['policy'] + ' <= ' + str(r['k']) if r['k'] else 'plain'} "
            f"{r['plain_step_ms'][0]:.2f} ({r['plain_step_ms'][1]})" for r in steps))
    for r in rows:      # what the adaptive policy measured of each B x k, below the table
        if r["policy"] == "adaptive" and r.get("unit_costs"):
            feeds, fed, before, catch_ms = r["catch_up"]
            print(f"  adaptive <= {r['k']}: units timed per B x k (mean ms measured / policy's "
                  f"cost ms; {r['units_first_use']} paid a first use, {r['first_use_ms']:.1f} ms "
                  f"left out of their costs; {feeds} catch-up feeds of {fed} positions, "
                  f"{before} of them before a unit's drafts, {catch_ms:.1f} ms left out of "
                  f"their costs): "
                  + ", ".join(f"{key} {n}: {m:.2f}/{c:.2f}"
                              for key, (n, m, c) in r["unit_costs"].items()))
            if r.get("measuring"):
                print(f"  adaptive <= {r['k']}: cold-start and exploration units (unit:BxK): "
                      + " ".join(r["measuring"]))
            if r.get("untimed"):
                print(f"  adaptive <= {r['k']}: units not timed for the policy (prefill, Replay "
                      f"or control rows beside): {r['untimed'][0]}, {r['untimed'][1]:.1f} ms "
                      "commit to commit")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:            # (measure(isolate=True)'s process)
        _child(*sys.argv[2:4])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--drafter", choices=("mtp", "dflash"), default="mtp",
                    help="the speculative drafter: the MTP head, or the artifact's DFlash drafter "
                         "(the reference models ship one; numpy backend)")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--adaptive", type=int, default=4, metavar="K",
                    help="one more run with draft_policy='adaptive' up to K drafts (0: none)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--backend", choices=("numpy", "cuda"), default="numpy")
    ap.add_argument("--dtype", default=None, help="cuda: bfloat16 (default) or float32")
    ap.add_argument("--oracle", default="", metavar="P,...",
                    help="runs at these set acceptances (the fixed ks and the adaptive one): "
                         "p, each draft right with probability p, or c1/c2/..., position j "
                         "accepted in a share c_j of the verifies")
    ap.add_argument("--shapes", default="", metavar="NAME,...",
                    help="instead of the reference models: random-weight models of these "
                         "bench_engine.py shapes (9b, 27b, 35b-a3b, NAME@LAYERS) with an MTP head, "
                         "written to --workdir (a random head's drafts are rejected: read them "
                         "with --oracle)")
    ap.add_argument("--workdir", default="/tmp/ninfer-bench")
    ap.add_argument("--batch", type=int, default=1, help="requests at once (max_concurrency)")
    ap.add_argument("--dflash-layers", type=int, default=5,
                    help="--shapes with --drafter dflash: the random drafter's layers")
    ap.add_argument("--rounds", type=int, default=1,
                    help="submit the prompts this many times in one Engine; the table adds the "
                         "rounds after the first (the draft policy past its cold start)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="EngineOptions.draft_vocab: MTP drafts from the first N ids (default: "
                         "the Engine's)")
    ap.add_argument("--draft-head", choices=("int8", "bf16"), default=None,
                    help="EngineOptions.draft_head: the MTP drafts' head (default: the Engine's)")
    ap.add_argument("--no-drafts-behind", action="store_true",
                    help="cuda: the feed and the next drafts as their own calls before each "
                         "verify, not behind it (CudaDrafter.drafts_in_verify off)")
    ap.add_argument("--in-process", dest="isolate", action="store_false",
                    help="cuda: every run in this process, one Engine after another (by default "
                         "each run is a process of its own: a process's first Engine decodes "
                         "~2%% faster than its later ones)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.isolate &= args.backend == "cuda"
    if args.no_drafts_behind:
        from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
        CudaDrafter.drafts_in_verify = False
    on = dict(backend=args.backend, dtype=args.dtype, batch=args.batch, drafter=args.drafter,
              draft_vocab=args.draft_vocab, draft_head=args.draft_head)
    figure = "wall" if args.backend == "cuda" else "cpu"
    count = max(args.prompts, args.batch)
    if args.shapes:
        from bench_engine import make_artifact, prompt_ids
        # the random checkpoints' tokenizer is the tiny test one: ids below 90
        ids_list = [np.asarray(prompt_ids(args.prompt_tokens, seed), np.int32)
                    for seed in range(count)]
        kind = dict(mtp=True) if args.drafter == "mtp" else dict(dflash=args.dflash_layers)
        models = [(name, make_artifact(name, pathlib.Path(args.workdir), direct=True,
                                       **kind)[0]) for name in args.shapes.split(",")]
    else:
        ids_list = prompts(count, args.prompt_tokens)
        models = [(name, ensure_reference_artifact(name)) for name in args.models.split(",")]
    report = {}
    for name, path in models:
        plain = measure(path, ids_list, 0, args.max_tokens, rounds=args.rounds,
                        isolate=args.isolate, **on)
        outputs = {tuple(ids.tolist()): toks for ids, toks in zip(ids_list, plain["tokens"])}
        for p in [None] + [parse_oracle(x) for x in args.oracle.split(",") if x]:
            rows = [plain] + speculative_rows(name, path, ids_list, plain, args, on,
                                              strict=not args.shapes,
                                              oracle=None if p is None else (p, outputs))
            shown = "/".join(map(str, p)) if isinstance(p, tuple) else p
            title = f"{name}, {args.drafter}{'' if p is None else f', drafts replaced: acceptance {shown}'}"
            table(title, rows, plain, args, figure)
            report[title] = [{key: v for key, v in r.items() if key != "tokens"} for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
