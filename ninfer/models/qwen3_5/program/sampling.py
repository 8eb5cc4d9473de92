"""The numpy sampling op: one next token per row from float32 logits [B, V].

Semantics (per row, in this order; all filter arithmetic in float64):

1. logprobs (when asked) come from the RAW model distribution, log_softmax(logits), before any
   penalty, temperature or filter (vLLM's default "raw logprobs"): the sampled token's logprob
   plus the top-n alternatives, best first, ties by lower token id.
2. repetition_penalty p (HF `RepetitionPenaltyLogitsProcessor`): for every distinct token of
   prompt + generated, logit > 0 -> logit / p, else logit * p.
3. presence / frequency penalties (OpenAI, vLLM): over GENERATED tokens only,
   logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0).
3a. logit_bias (OpenAI): logit[t] += bias[t] for each listed id (float64, after the penalties).
3b. a constrained row (structured output) gets its grammar's mask: every token it does not allow
   (and every id past the mask, e.g. embedding padding beyond the tokenizer) becomes -inf.
4. temperature == 0 -> greedy: argmax of the penalised logits (lowest id on ties); steps 5-7 skip.
5. z = logits / temperature; top_k > 0 keeps the k largest z (ties broken by lower id).
6. p = softmax over the survivors; top_p < 1 keeps the shortest best-first prefix whose
   cumulative probability reaches top_p (ties by lower id; at least one token).
7. min_p > 0 keeps the survivors with p >= min_p * max(p). (top-k, top-p and min-p each keep a
   best-first prefix, so min-p commutes with the others; top-p sees top-k's renormalised mass,
   as in HF and vLLM.)
8. Draw u = counter_uniform(seed, position) in [0, 1) and take the inverse CDF over the kept
   tokens in ascending id order. `position` is the sequence index of the token being produced
   (prompt length + number generated before it), so the draw depends only on (seed, position):
   never on batch composition, pauses or Replay.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ....api import TokenLogprob
from ....contracts import SampleRow, SamplingSpec  # noqa: F401 - defined there, used here

_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def counter_uniform(seed: int, position: int) -> float:
    """A uniform double in [0, 1) keyed by (seed, position): stateless, so nothing to roll back."""
    x = _splitmix64(_splitmix64(int(seed) & _M64) ^ (int(position) & _M64))
    return (x >> 11) * (1.0 / (1 << 53))


def apply_penalties(logits: np.ndarray, spec: SamplingSpec, prompt_ids: np.ndarray,
                    generated_ids: np.ndarray) -> np.ndarray:
    """Penalised and biased float64 copy of one row's logits [V] (steps 2-3a)."""
    out = logits.astype(np.float64)
    if spec.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([prompt_ids, generated_ids]).astype(np.int64))
        x = out[seen]
        out[seen] = np.where(x > 0, x / spec.repetition_penalty, x * spec.repetition_penalty)
    if (spec.presence_penalty or spec.frequency_penalty) and len(generated_ids):
        ids, counts = np.unique(np.asarray(generated_ids, np.int64), return_counts=True)
        out[ids] -= spec.frequency_penalty * counts + spec.presence_penalty
    if spec.logit_bias:
        ids, values = logit_bias_arrays(spec.logit_bias)
        out[ids] += values
    return out


def logit_bias_arrays(bias) -> tuple:
    """(ids int64, biases float64) of a spec's logit_bias ((id, bias) pairs, distinct ids)."""
    ids = np.fromiter((t for t, _ in bias), np.int64, len(bias))
    return ids, np.fromiter((b for _, b in bias), np.float64, len(bias))


_TOP_P_WINDOW = 1024      # top-p first looks at this many best tokens, then falls back to all


def filtered_probs(z: np.ndarray, spec: SamplingSpec) -> np.ndarray:
    """Steps 5-7 on penalised float64 logits [V]: normalised probabilities, 0 where filtered.

    Only the best-first prefix that top-k / top-p can keep is sorted (a real vocabulary has
    ~250k ids): top-k sorts its k, top-p a window that already holds top_p of the mass."""
    z = z / spec.temperature
    vocab = len(z)
    top_k = spec.top_k if 0 < spec.top_k < vocab else vocab
    if top_k == vocab and spec.top_p >= 1.0:            # no ordering needed
        p = np.exp(z - z.max())
        if spec.min_p > 0.0:
            p[p < spec.min_p * p.max()] = 0.0
        return p / p.sum()
    order = _best_first(z, top_k if top_k < vocab else min(vocab, _TOP_P_WINDOW))
    if top_k < vocab:                                   # mass renormalised over the top k
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
    else:                                               # mass over the whole vocabulary
        p_all = np.exp(z - z[order[0]])
        p_all /= p_all.sum()
        p = p_all[order]
        if len(order) < vocab and p.sum() < spec.top_p:  # the nucleus is wider than the window
            keep = _nucleus_mask(p_all, spec.top_p)
            if spec.min_p > 0.0:
                keep &= p_all >= spec.min_p * p_all[order[0]]
            probs = np.where(keep, p_all, 0.0)
            return probs / probs.sum()
    keep = len(order)
    if spec.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), spec.top_p, side="left")) + 1)
    if spec.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(p >= spec.min_p * p[0])))
    kept = p[:keep]
    probs = np.zeros(vocab, np.float64)
    probs[order[:keep]] = kept / kept.sum()
    return probs


_NUCLEUS_BUCKETS = 4096
_NUCLEUS_LOG_SPAN = 60.0    # log-prob range bucketed finely; everything below shares bucket 0


def _nucleus_mask(p: np.ndarray, top_p: float) -> np.ndarray:
    """Mask of the shortest best-first prefix of `p` (ties by lower id) whose mass reaches top_p,
    without sorting the vocabulary (a full sort of 248k ids costs ~30 ms; this ~3 ms).

    Tokens are bucketed by log-probability; the bucket index is monotone in p, so every token of a
    higher bucket precedes every token of a lower one in best-first order. Only the bucket where
    the mass counted from the top crosses top_p is sorted."""
    logp = np.log(np.maximum(p, np.finfo(np.float64).tiny))
    top = logp.max()
    scale = (_NUCLEUS_BUCKETS - 1) / _NUCLEUS_LOG_SPAN
    bucket = np.clip(((logp - (top - _NUCLEUS_LOG_SPAN)) * scale).astype(np.int64),
                     0, _NUCLEUS_BUCKETS - 1)
    mass_from = np.cumsum(np.bincount(bucket, weights=p, minlength=_NUCLEUS_BUCKETS)[::-1])[::-1]
    reached = np.flatnonzero(mass_from >= top_p)
    k = int(reached[-1]) if len(reached) else 0
    base = mass_from[k + 1] if k + 1 < _NUCLEUS_BUCKETS else 0.0
    members = np.flatnonzero(bucket == k)
    members = members[np.lexsort((members, -p[members]))]
    n = int(np.searchsorted(base + np.cumsum(p[members]), top_p, side="left")) + 1
    keep = bucket > k
    keep[members[:n]] = True
    return keep


def _best_first(z: np.ndarray, m: int) -> np.ndarray:
    """Ids of the m largest z, best first, ties by lower id (exact at the boundary)."""
    if m < len(z):
        threshold = np.partition(z, len(z) - m)[len(z) - m]
        cand = np.flatnonzero(z >= threshold)           # every id tied at the boundary too
    else:
        cand = np.arange(len(z))
    return cand[np.lexsort((cand, -z[cand]))][:m]


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse CDF in ascending token id order over the nonzero entries."""
    ids = np.flatnonzero(probs)
    cdf = np.cumsum(probs[ids])
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


def raw_logprobs(logits: np.ndarray, token_id: int, top_n: int) -> TokenLogprob:
    x = logits.astype(np.float64)
    m = x.max()
    lp = x - m - np.log(np.exp(x - m).sum())
    top = ()
    if top_n > 0:
        n = min(top_n, len(lp))
        cand = np.argpartition(-lp, n - 1)[:n] if n < len(lp) else np.arange(len(lp))
        # candidates may miss ties at the boundary; widen to every id tied with the n-th value
        cand = np.union1d(cand, np.flatnonzero(lp >= lp[cand].min()))
        best = cand[np.lexsort((cand, -lp[cand]))][:n]
        top = tuple((int(t), float(np.float32(lp[t]))) for t in best)
    return TokenLogprob(int(token_id), float(np.float32(lp[token_id])), top)


def apply_mask(z: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Step 3b in place on penalised float64 logits [V]: bool mask [n <= V], ids >= n masked."""
    m = np.asarray(mask, np.bool_)[:len(z)]
    if not m.any():
        raise ValueError("the grammar mask allows no token")
    np.copyto(z[:len(m)], -np.inf, where=~m)      # one pass, whether few or most are allowed
    z[len(m):] = -np.inf
    return z


def sample_row(logits: np.ndarray, spec: SamplingSpec, prompt_ids: np.ndarray,
               generated_ids: np.ndarray, position: int, mask: Optional[np.ndarray] = None):
    """One row: (token_id, TokenLogprob or None). `mask`: the grammar's allowed tokens (bool)."""
    z = apply_penalties(logits, spec, prompt_ids, generated_ids)
    if mask is not None:
        apply_mask(z, mask)
    if spec.is_greedy:
        token = int(np.argmax(z))
    else:
        token = draw(filtered_probs(z, spec), counter_uniform(spec.seed, position))
    lp = None if spec.logprobs is None else raw_logprobs(logits, token, spec.logprobs)
    return token, lp
