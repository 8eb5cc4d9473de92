"""Plain data the Program hands to the Engine: unit results, decisions and resume states."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .sampling import SamplingSpec


class ProgramError(RuntimeError):
    """The Program's physical bookkeeping or a unit contract was broken: the Engine must fail."""


@dataclass(frozen=True, slots=True)
class RowResult:
    """One row of a PendingBatch: what the unit consumed and produced for one sequence."""

    seq_id: int
    num_new_tokens: int         # tokens this unit ran through the model (KV/State advance)
    produced: tuple             # sampled token ids (0 or 1), or a control unit's forced tokens
    logprobs: tuple             # TokenLogprob per produced token when asked for, else ()
    is_replay: bool             # rebuilding accepted history; nothing new is produced
    is_control: bool = False    # produced = the forced tokens (not sampled)


@dataclass(frozen=True, slots=True)
class RowDecision:
    """The Engine's verdict on one row. A cancelled row accepts 0; otherwise
    1 <= accepted <= produced when the row produced, and a nonterminal row accepts all."""

    accepted: int
    is_terminal: bool = False
    is_cancelled: bool = False


class PendingBatch:
    """The provisional outcome of one unit (move-only: consumed by exactly one commit or abort).

    Membership is frozen at execution; until consumed, the rows' KV beyond their frontier and
    their State slots are provisional (the Program keeps a backup of each State image)."""

    __slots__ = ("rows", "_backups", "_is_consumed", "_epoch")

    def __init__(self, rows: tuple, backups: list, epoch: int):
        self.rows = rows
        self._backups = backups
        self._is_consumed = False
        self._epoch = epoch

    @property
    def is_consumed(self) -> bool:
        return self._is_consumed

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"PendingBatch({len(self.rows)} rows, consumed={self._is_consumed})"


@dataclass(frozen=True, slots=True, eq=False)
class ResumeState:
    """What a paused request needs to continue (owned by the Engine while paused).

    `kind` is "replay" (re-execute the accepted history through prefill chunks) or "snapshot"
    (State and KV of the frontier copied to host memory; revocable back to replay).
    `token_ids` holds prompt + accepted generated tokens; `num_computed_tokens` is the frontier
    the sequence had reached when paused."""

    kind: str
    token_ids: np.ndarray
    num_prompt_tokens: int
    num_computed_tokens: int
    spec: SamplingSpec
    snapshot_id: Optional[int] = None
    state_image: Optional[tuple] = None
    kv_pages: Optional[tuple] = None
    host_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
