"""Greedy MTP draft acceptance on the reference models' held-out text (issue 15), numpy backend.

    PYTHONPATH=.:bench python bench/mtp_acceptance.py [--models dense,moe] [--stride 2] [--k 4]
        [--max-tokens 1022] [--json out.json]

For the held-out text in windows of 512 tokens (<|endoftext|> first, as `ninfer eval` scores it),
at every `stride`-th position t of a window (the context is the real text x_0..x_t):

  1. the target, teacher-forced along the text, gives h_t and its greedy token y_1 = argmax;
  2. the MTP drafter (its KV holding the teacher-forced pairs (h_s, x_{s+1}), s < t) drafts
     d_1..d_k greedily from (h_t, y_1);
  3. one target verify forward over [y_1, d_1 .. d_{k-1}] from the context's State (a copy,
     restored after) gives the target's greedy tokens z_1..z_k; the accepted prefix is the longest
     i with d_j == z_j for all j <= i (the accepted-prefix rule of speculative decoding, greedy rows).

This is exactly what one greedy speculative step would accept at that context. Reported per draft
position i: P(accepted prefix >= i) and P(d_i accepted | d_1..d_{i-1} accepted); per k: the
expected tokens per verify step, 1 + E[min(accepted prefix, k)] (the bonus/corrected token counts).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ninfer import ops
from ninfer.artifact import Artifact
from ninfer.demo import ensure_reference_artifact
from ninfer.eval import DOC_SEPARATOR, dataset_path
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.frontend.tokenizer import Tokenizer
from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json
from ninfer.models.qwen3_5.model import NumpyModel
from ninfer.models.qwen3_5.mtp import MtpDrafter

CONTEXT = 512           # the reference models' training length and eval's default window
PAGE = 16


def windows(max_tokens: int) -> list:
    tok = Tokenizer(cached_qwen3_5_tokenizer_json())
    ids = np.asarray(tok.encode(dataset_path("heldout").read_text(encoding="utf-8")),
                     np.int32)[:max_tokens]
    sep = tok.token_id(DOC_SEPARATOR)
    step = CONTEXT - 1
    return [np.concatenate([[sep], ids[s:s + step]]).astype(np.int32)
            for s in range(0, ids.size, step)]


def accepted_prefixes(target: NumpyModel, drafter: MtpDrafter, ids: np.ndarray, k: int,
                      stride: int) -> list:
    """The accepted prefix length (0..k) at every stride-th position t of one window."""
    T = len(ids)
    pages = (T + k + PAGE) // PAGE + 1
    table = np.arange(pages, dtype=np.int32)
    kv, state = target.new_kv_pool(pages, PAGE), target.new_state_pool(1)
    dkv = drafter.new_kv_pool(pages, PAGE)
    lm_head = target._lm_head
    # teacher-forced pass: h_t of every position (KV/State then advance again below, per chunk)
    h_all = target.final_hidden(ForwardBatch.single(ids, 0, table), kv, state)
    drafter.forward(ForwardBatch.single(ids[1:], 0, table), h_all[:-1], dkv, with_logits=False)
    pristine = (dkv.k[0].copy(), dkv.v[0].copy())
    kv, state = target.new_kv_pool(pages, PAGE), target.new_state_pool(1)
    out, frontier = [], 0
    for t in range(1, T - 1, stride):
        # advance the target's KV / State over the real text up to and including x_t
        target.final_hidden(ForwardBatch.single(ids[frontier:t + 1], frontier, table), kv, state)
        frontier = t + 1
        y1 = int(np.argmax(ops.linear(h_all[t:t + 1], lm_head)))
        dkv.k[0][:], dkv.v[0][:] = pristine            # drafts of the last t wrote t'..t'+k-1
        drafts, _ = drafter.draft_greedy(dkv, h_all[t:t + 1], [y1], [t], table[None], k)
        saved = state.read(0)
        verify = np.concatenate([[y1], drafts[0, :k - 1]]).astype(np.int32)
        hv = target.final_hidden(ForwardBatch.single(verify, frontier, table), kv, state)
        state.write(0, saved)                          # KV past the frontier is rewritten later
        z = np.argmax(ops.linear(hv, lm_head), axis=1)
        agree = drafts[0] == z
        out.append(k if agree.all() else int(np.argmin(agree)))
    return out


def summarize(lengths: np.ndarray, k: int) -> dict:
    at_least = [float(np.mean(lengths >= i)) for i in range(1, k + 1)]
    conditional = [at_least[0]] + [at_least[i] / at_least[i - 1] if at_least[i - 1] else 0.0
                                   for i in range(1, k)]
    tokens = [1.0 + float(np.mean(np.minimum(lengths, kk))) for kk in range(1, k + 1)]
    return {"positions": int(lengths.size), "p_prefix_at_least": at_least,
            "p_accept_given_previous": conditional, "tokens_per_verify": tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--stride", type=int, default=2, help="draft at every N-th position")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (1..8)")
    ap.add_argument("--max-tokens", type=int, default=1022,
                    help="the first N held-out tokens (1022: the two windows the tests record)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    if not 1 <= args.k <= 8 or args.stride < 1 or args.max_tokens < 2:
        ap.error("--k must be 1..8, --stride >= 1 and --max-tokens >= 2")
    wins = windows(args.max_tokens)
    results = {}
    for name in args.models.split(","):
        t0 = time.time()
        with Artifact(ensure_reference_artifact(name)) as art:
            target = NumpyModel.from_artifact(art)
            drafter = MtpDrafter.from_artifact(art, target)
        lengths = np.concatenate([accepted_prefixes(target, drafter, w, args.k, args.stride)
                                  for w in wins])
        results[name] = summarize(lengths, args.k)
        results[name]["seconds"] = round(time.time() - t0, 1)
    print(f"held-out text, {sum(len(w) for w in wins)} tokens in {len(wins)} windows of <= "
          f"{CONTEXT}; a draft at every {args.stride}-th position; greedy")
    head = " ".join(f"{'i=' + str(i):>7}" for i in range(1, args.k + 1))
    for name, r in results.items():
        print(f"\n{name}: {r['positions']} draft steps ({r['seconds']} s)")
        print(f"  draft position                {head}")
        print("  P(accepted prefix >= i)       " +
              " ".join(f"{v:7.3f}" for v in r["p_prefix_at_least"]))
        print("  P(d_i accepted | d_<i)        " +
              " ".join(f"{v:7.3f}" for v in r["p_accept_given_previous"]))
        print("  tokens per verify step at k=i " +
              " ".join(f"{v:7.3f}" for v in r["tokens_per_verify"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stride": args.stride, "k": args.k, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
