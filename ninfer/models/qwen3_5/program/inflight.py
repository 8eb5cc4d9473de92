"""A launched unit between `Program.launch` and `Program.collect`.

    launch(plan) -> InFlightUnit      validate, pack, start the backend's step
    (the EngineCore does host work that needs no result of the step here)
    collect(unit) -> PendingBatch     wait for the step's output, build the rows

Today every backend call is synchronous, so `step` is a `Ready` value. A backend with a
non-blocking step (`launch_tokens(...) -> step; step.collect()`) plugs in where
`Program._start_step` builds it: `step` is then the backend's own handle and nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class Ready:
    """A step that already finished: collect() returns its output."""
    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def collect(self):
        return self._value


@dataclass(slots=True, eq=False)
class InFlightUnit:
    seqs: list                  # the rows' _Sequence records, in batch order
    units: list                 # their _Unit
    masks: list                 # their token masks (None: anything goes)
    backups: list               # State backups (None: no rollback kept)
    path: str                   # "greedy" | "sample" (device token ids) | "logits" (host sampling)
    step: object = None         # .collect() -> token ids [B] or logits [B, V]
    pending: Optional[object] = None   # a unit that finished inside launch (speculative)
