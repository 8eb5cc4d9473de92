"""CausalScoring: log p(t[i+1] | t[:i+1]) for a whole token sequence, outside the generation path.

Serial and self-contained: each call makes a temporary one-slot State and enough KV pages for the
whole input, prefills it in windows of `options.prefill_chunk` tokens (each window continues the
State/KV of the previous one), and drops both at the end. No scheduler, no cache.
"""
from __future__ import annotations

import numpy as np

from ..api import ScoreResult
from ..contracts import ForwardBatch
from ..errors import RequestError


class CausalScoreCore:
    def __init__(self, model, options):
        self.model = model
        self.window = int(options.prefill_chunk)
        self.page_size = int(options.page_size)
        self.vocab_size = int(model.config.text.vocab_size)

    def score(self, token_ids, return_logits: bool = False) -> ScoreResult:
        ids = self._check(token_ids)
        T = len(ids)
        num_pages = -(-T // self.page_size)
        kv = self.model.new_kv_pool(num_pages, self.page_size)
        state = self.model.new_state_pool(1)
        block_table = np.arange(num_pages, dtype=np.int32)
        logprobs = np.empty(T - 1, np.float32)
        logits_all = np.empty((T, self.vocab_size), np.float32) if return_logits else None
        for start in range(0, T, self.window):
            end = min(start + self.window, T)
            batch = ForwardBatch.single(ids[start:end], start, block_table, state_slot=0)
            logits = self.model.forward(batch, kv, state, all_logits=True)          # [n, V]
            if logits_all is not None:
                logits_all[start:end] = logits
            # position i predicts token i+1; the sequence's last position predicts nothing
            n_pred = min(end, T - 1) - start
            logprobs[start:start + n_pred] = _target_logprobs(logits[:n_pred],
                                                              ids[start + 1:start + 1 + n_pred])
        return ScoreResult(logprobs=logprobs, logits=logits_all)

    def _check(self, token_ids) -> np.ndarray:
        try:
            arr = np.asarray(token_ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise RequestError(f"score: token_ids is not an array of integers ({exc})") from exc
        if arr.ndim != 1:
            raise RequestError(f"score: token_ids must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise RequestError(f"score: token_ids must be integers, got dtype {arr.dtype}")
        if arr.size < 2:
            raise RequestError(f"score: need at least 2 tokens, got {arr.size}")
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
