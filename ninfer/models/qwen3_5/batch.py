"""ForwardBatch: the plain-data plan of one model call (the Program builds it, a backend runs it).

Rows are sequences; their new tokens are packed back to back:

    token_ids   [N]        all rows' new tokens, row r at query_start[r]:query_start[r+1]
    positions   [3, N]     MRoPE (t, h, w) positions; text-only prompts have t == h == w
    query_start [B+1]      prefix sums of the rows' new-token counts (query_start[0] == 0)
    context_lens[B]        tokens of each row already in KV / State before this call (its frontier)
    block_tables[B, P]     KV page ids of each row, in order; -1 pads; must cover
                           context_lens[r] + new tokens of row r
    state_slots [B]        StateImage slot of each row (GDN conv + recurrent state)

A row with context_lens[r] == 0 starts from a zero State (whatever its slot held is ignored and
overwritten). After the call the row's KV holds positions [0, context_lens[r] + n_r) and its State
has consumed every token in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    token_ids: np.ndarray
    positions: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    state_slots: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def row_lengths(self) -> np.ndarray:
        return np.diff(self.query_start)

    @staticmethod
    def text_positions(context_lens, lengths) -> np.ndarray:
        """[3, N] positions for text-only rows: context_len, context_len+1, ... per row."""
        pos = np.concatenate([np.arange(c, c + n, dtype=np.int32)
                              for c, n in zip(context_lens, lengths)]) if len(lengths) else \
            np.zeros(0, np.int32)
        return np.broadcast_to(pos, (3, len(pos))).copy()

    @classmethod
    def single(cls, token_ids, context_len: int, block_table, state_slot: int = 0) -> "ForwardBatch":
        """One text-only row (scoring, tests)."""
        ids = np.asarray(token_ids, dtype=np.int32)
        return cls(token_ids=ids,
                   positions=cls.text_positions([context_len], [len(ids)]),
                   query_start=np.array([0, len(ids)], dtype=np.int32),
                   context_lens=np.array([context_len], dtype=np.int32),
                   block_tables=np.asarray(block_table, dtype=np.int32).reshape(1, -1),
                   state_slots=np.array([state_slot], dtype=np.int32))

    def validate(self, page_size: int) -> None:
        """Check the plan's internal consistency (shapes, coverage); raises ValueError."""
        B, N = self.num_rows, self.num_tokens
        if self.query_start.shape != (B + 1,) or self.query_start[0] != 0 \
                or self.query_start[-1] != N or np.any(np.diff(self.query_start) < 0):
            raise ValueError(f"ForwardBatch: bad query_start {self.query_start} for {N} tokens")
        if self.positions.shape != (3, N):
            raise ValueError(f"ForwardBatch: positions shape {self.positions.shape} != (3, {N})")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != B or \
                self.state_slots.shape != (B,):
            raise ValueError("ForwardBatch: block_tables / state_slots do not match the rows")
        need = (self.context_lens + self.row_lengths() + page_size - 1) // page_size
        for r in range(B):
            if need[r] > self.block_tables.shape[1] or np.any(self.block_tables[r, :need[r]] < 0):
                raise ValueError(f"ForwardBatch: row {r} block table does not cover "
                                 f"{int(self.context_lens[r] + self.row_lengths()[r])} tokens")
