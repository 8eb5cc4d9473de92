"""ResourceManager: what happens to a sequence's Program resources when a request settles, and
the shared prefix index (prefix reuse across requests, e.g. the turns of one chat).

The index is logical: checkpoint id -> the exact prefix tokens it covers, keyed by a digest of
those tokens, in LRU order. The Program holds the physical host copies and their bytes; this
never keeps a second physical ledger. A Gated DeltaNet State is a running summary, valid only at
the exact position it was captured, so a checkpoint is one real execution's State + KV at one
prefix length p, and a hit must match the prompt token for token on [0, p).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..contracts import ProgramError


def _digest(token_ids: np.ndarray) -> bytes:
    return hashlib.blake2b(np.asarray(token_ids).astype("<i4", copy=False).tobytes(),
                           digest_size=16).digest()


class ResourceManager:
    def __init__(self, program):
        self.program = program
        self._index: OrderedDict = OrderedDict()   # digest -> (checkpoint id, token ids); LRU first
        self.hits = 0
        self.lookups = 0
        self.tokens_reused = 0

    def settle_finished(self, seq_id: int) -> None:
        """A resident request reached its terminal state: its slot and pages go back (a prefix
        checkpoint it captured is an independent host copy and stays in the index)."""
        self.program.release(seq_id)

    def settle_paused(self, resume_state) -> None:
        """A paused request ended: its Snapshot host memory (if any) goes back."""
        self.program.discard(resume_state)

    # ---- prefix index ---------------------------------------------------------------------------
    def lookup(self, prompt_ids: np.ndarray) -> tuple:
        """(checkpoint id, tokens reused) of the longest checkpoint that is a strict prefix of
        the prompt (one token must remain to prefill, for the first sampled token's logits);
        (None, 0) when none. The token ids are compared, never the digest alone."""
        self.lookups += 1
        n = len(prompt_ids)
        lengths = sorted({len(t) for _, t in self._index.values() if len(t) < n}, reverse=True)
        for p in lengths:
            entry = self._index.get(_digest(prompt_ids[:p]))
            if entry is not None and len(entry[1]) == p \
                    and np.array_equal(entry[1], prompt_ids[:p]):
                return entry[0], p
        return None, 0

    def note_hit(self, prompt_ids: np.ndarray, num_reused: int) -> None:
        """A bind installed the checkpoint of prompt_ids[:num_reused]: most recently used now."""
        self._index.move_to_end(_digest(prompt_ids[:num_reused]))
        self.hits += 1
        self.tokens_reused += num_reused

    def capture_if_due(self, seq_id: int) -> None:
        """Right after a commit: if the sequence's frontier sits on its checkpoint position, copy
        it into the cache (evicting least recently used entries to fit), unless already cached."""
        p = self.program.capture_due(seq_id)
        if not p:
            return
        tokens = self.program.prefix_tokens(seq_id, p)
        key = _digest(tokens)
        cost = self.program.checkpoint_cost(p)
        entry = self._index.get(key)
        if entry is not None or cost > self.program.cache_budget_bytes:
            if entry is not None and np.array_equal(entry[1], tokens):
                self._index.move_to_end(key)
            self.program.capture_checkpoint(seq_id, keep=False)
            return
        while self._index and \
                self.program.cache_bytes_used + cost > self.program.cache_budget_bytes:
            self._evict_oldest()
        cid = self.program.capture_checkpoint(seq_id)
        self._index[key] = (cid, tokens)

    def clear_prefix_cache(self) -> None:
        while self._index:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, (cid, _) = self._index.popitem(last=False)
        self.program.drop_checkpoint(cid)

    def check_invariants(self) -> None:
        """The index and the Program's checkpoints name the same entries."""
        ids = sorted(cid for cid, _ in self._index.values())
        if ids != sorted(self.program.checkpoint_ids()):
            raise ProgramError(f"prefix index {ids} != program checkpoints "
                               f"{sorted(self.program.checkpoint_ids())}")

    def stats(self) -> dict:
        return {"prefix_cache_hits": self.hits, "prefix_cache_lookups": self.lookups,
                "prefix_cache_tokens_reused": self.tokens_reused,
                "prefix_cache_device_bytes": 0,
                "prefix_cache_host_bytes": self.program.cache_bytes_used}
