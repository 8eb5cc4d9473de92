"""Scheduler: execution membership and fairness, as pure decisions over small views.

It never sees pages or slots (the Program owns those) and never mutates requests (the EngineCore
does); it only orders and chooses:

    plan(residents)          -> decode rows (all decode-ready, the actual B) + one chunk row
    reservation_order(rows)  -> protected resume first, then oldest ticket first
    choose_victim(rows, r)   -> whom to pause when r lacks resources: the youngest resident younger
                                than r that is not in protected resume, else r itself
    may_admit_fresh(n)       -> fresh admission may bypass n waiting paused requests only
                                `max_bypass` times, then waits until the oldest paused resumes
    resume_candidate(paused) -> the oldest paused request (one protected resume at a time)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True, slots=True)
class ResidentView:
    key: Any                     # the EngineCore's handle on the request (opaque here)
    ticket: int                  # submission order: smaller is older
    is_decode: bool              # next unit is one decode token; else a prefill / Replay chunk
    is_protected: bool = False   # in protected resume (holds its resume permit)
    last_chunk_cycle: int = -1   # cycle of its last prefill / Replay chunk (-1: never)


@dataclass(frozen=True, slots=True)
class CyclePlan:
    decode: tuple                # keys, oldest first
    chunk: Optional[Any]         # at most one prefill / Replay chunk per cycle

    @property
    def members(self) -> tuple:
        return self.decode + (() if self.chunk is None else (self.chunk,))


class Scheduler:
    def __init__(self, max_bypass: int):
        if max_bypass < 0:
            raise ValueError(f"max_bypass={max_bypass} must be >= 0")
        self.max_bypass = max_bypass
        self.num_bypassed = 0    # fresh admissions since the oldest paused request began waiting

    def plan(self, residents: Sequence[ResidentView]) -> CyclePlan:
        decode = tuple(r.key for r in sorted(residents, key=lambda r: r.ticket) if r.is_decode)
        chunked = [r for r in residents if not r.is_decode]
        # protected resume first; then round robin: the row that waited longest for a chunk
        chunk = min(chunked, key=lambda r: (not r.is_protected, r.last_chunk_cycle, r.ticket),
                    default=None)
        return CyclePlan(decode, None if chunk is None else chunk.key)

    @staticmethod
    def reservation_order(residents: Sequence[ResidentView]) -> list:
        return [r.key for r in sorted(residents, key=lambda r: (not r.is_protected, r.ticket))]

    @staticmethod
    def choose_victim(residents: Sequence[ResidentView], needy: ResidentView) -> Any:
        younger = [r for r in residents
                   if r.ticket > needy.ticket and not r.is_protected and r.key is not needy.key]
        return max(younger, key=lambda r: r.ticket).key if younger else needy.key

    def may_admit_fresh(self, num_paused: int) -> bool:
        return num_paused == 0 or self.num_bypassed < self.max_bypass

    def note_fresh_admitted(self, num_paused: int) -> None:
        if num_paused:
            self.num_bypassed += 1

    def note_resumed(self) -> None:
        self.num_bypassed = 0

    @staticmethod
    def resume_candidate(paused: Sequence[ResidentView], has_protected: bool) -> Optional[Any]:
        if has_protected or not paused:
            return None
        return min(paused, key=lambda r: r.ticket).key
