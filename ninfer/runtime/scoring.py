"""CausalScoring: log p(t[i+1] | t[:i+1]) for a whole token sequence, outside the generation path,
and the pooled embedding of one (the final-normed hidden state at its last token).

Serial and self-contained: each call makes a temporary one-slot State and enough KV pages for the
whole input, prefills it in windows of `options.prefill_chunk` tokens (each window continues the
State/KV of the previous one), and drops both at the end. No scheduler, no cache.

`SideScorer` runs the same next to a generation Engine's worker (OpenAI `echo` prompt logprobs,
`/v1/embeddings`): only where the model's pools are host memory apart from the Program's (the
numpy backend) and its parameters are read-only, so a call touches nothing the worker owns; calls
are serialized by a lock.
"""
from __future__ import annotations

import numpy as np

from ..api import ScoreResult
from ..contracts import ForwardBatch
from ..errors import NotSupportedError, RequestError


class CausalScoreCore:
    def __init__(self, model, options):
        self.model = model
        self.window = int(options.prefill_chunk)
        self.page_size = int(options.page_size)
        self.vocab_size = int(model.config.text.vocab_size)

    def score(self, token_ids, return_logits: bool = False, top_logprobs: int = 0) -> ScoreResult:
        """`top_logprobs` k > 0: also the k most likely tokens at each predicting position
        (ScoreResult.top), what OpenAI's `echo` + `logprobs` reports for prompt tokens."""
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer)) \
                or not 0 <= top_logprobs <= 20:
            raise RequestError(f"score: top_logprobs={top_logprobs!r} must be an integer in "
                               "[0, 20]")
        ids = self._check(token_ids)
        T = len(ids)
        logprobs = np.empty(T - 1, np.float32)
        logits_all = np.empty((T, self.vocab_size), np.float32) if return_logits else None
        top = []
        for start, end, logits in self._windows(ids, self.model.forward, all_logits=True):
            if logits_all is not None:
                logits_all[start:end] = logits                                      # [n, V]
            # position i predicts token i+1; the sequence's last position predicts nothing
            n_pred = min(end, T - 1) - start
            logprobs[start:start + n_pred] = _target_logprobs(logits[:n_pred],
                                                              ids[start + 1:start + 1 + n_pred])
            if top_logprobs:
                top += _top_logprobs(logits[:n_pred], int(top_logprobs))
        return ScoreResult(logprobs=logprobs, logits=logits_all,
                           top=tuple(top) if top_logprobs else None)

    def embed(self, token_ids) -> np.ndarray:
        """The final-normed hidden state at the last token, float32 [H], not normalised (last-
        token pooling, as Qwen3-Embedding pools). NotSupportedError on a model without
        `final_hidden` (the CUDA model keeps its hidden states on the device)."""
        final_hidden = self.model.final_hidden
        if final_hidden is None:
            raise NotSupportedError(f"embeddings need the final hidden states, which the "
                                    f"{self.model.backend} backend does not return yet (the "
                                    "numpy backend does)")
        ids = self._check(token_ids, min_len=1)
        last = None
        for _, _, hidden in self._windows(ids, final_hidden):
            last = hidden[-1]
        return np.asarray(last, np.float32).copy()

    def _windows(self, ids: np.ndarray, fn, **kwargs):
        """(start, end, fn(window)) for each prefill window, over temporary pools."""
        T = len(ids)
        num_pages = -(-T // self.page_size)
        kv = self.model.new_kv_pool(num_pages, self.page_size)
        state = self.model.new_state_pool(1)
        block_table = np.arange(num_pages, dtype=np.int32)
        for start in range(0, T, self.window):
            end = min(start + self.window, T)
            batch = ForwardBatch.single(ids[start:end], start, block_table, state_slot=0)
            yield start, end, fn(batch, kv, state, **kwargs)

    def _check(self, token_ids, min_len: int = 2) -> np.ndarray:
        try:
            arr = np.asarray(token_ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise RequestError(f"score: token_ids is not an array of integers ({exc})") from exc
        if arr.ndim != 1:
            raise RequestError(f"score: token_ids must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise RequestError(f"score: token_ids must be integers, got dtype {arr.dtype}")
        if arr.size < min_len:
            raise RequestError(f"score: need at least {min_len} token{'s' * (min_len > 1)}, "
                               f"got {arr.size}")
        bad = (arr < 0) | (arr >= self.vocab_size)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise RequestError(f"score: token id {int(arr[i])} at index {i} is outside the "
                               f"vocabulary [0, {self.vocab_size})")
        return arr.astype(np.int32)


def _target_logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log_softmax(logits)[i, targets[i]]: shifted by the row max (so exp <= 1) and summed in
    float64, which keeps the result accurate to float32 rounding for any vocabulary size."""
    m = logits.max(axis=-1, keepdims=True)
    shifted = logits - m
    lse = np.log(np.sum(np.exp(shifted), axis=-1, dtype=np.float64))
    picked = np.take_along_axis(shifted, targets[:, None].astype(np.int64), axis=-1)[:, 0]
    return (picked.astype(np.float64) - lse).astype(np.float32)


def _top_logprobs(logits: np.ndarray, k: int) -> list:
    """Per row, ((token id, logprob), ...) of the k most likely tokens, best first."""
    k = min(k, logits.shape[-1])
    out = []
    for row in logits:
        m = row.max()
        lse = m + np.log(np.sum(np.exp(row - m), dtype=np.float64))
        best = np.argpartition(-row, k - 1)[:k]
        best = best[np.argsort(-row[best], kind="stable")]
        out.append(tuple((int(t), float(row[t] - lse)) for t in best))
    return out


class SideScorer:
    """CausalScoreCore beside a generation Engine's worker: scoring and embeddings on the calling
    thread, one call at a time. Only a numpy model qualifies (host pools of its own, read-only
    parameters); another backend gets NotSupportedError naming why."""

    def __init__(self, model, options):
        import threading

        self._lock = threading.Lock()
        self._core = CausalScoreCore(model, options) if model.backend == "numpy" else None
        self._backend = model.backend

    def _checked(self) -> CausalScoreCore:
        if self._core is None:
            raise NotSupportedError(
                f"prompt scoring and embeddings beside generation run on the numpy backend "
                f"only: the {self._backend} backend's device memory all belongs to the running "
                "requests (start an Engine with purpose='scoring' to score there)")
        return self._core

    def score(self, token_ids, return_logits: bool = False, top_logprobs: int = 0) -> ScoreResult:
        core = self._checked()
        with self._lock:
            return core.score(token_ids, return_logits=return_logits, top_logprobs=top_logprobs)

    def embed(self, token_ids) -> np.ndarray:
        core = self._checked()
        with self._lock:
            return core.embed(token_ids)
