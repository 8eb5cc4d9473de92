"""A launched unit between `Program.launch` and `Program.collect`.

    launch(plan) -> InFlightUnit      validate, pack, start the backend's step
    (host work that needs no result of the step may run here; the EngineCore has none yet)
    collect(unit) -> PendingBatch     wait for the step's output, build the rows

`step` is the backend's handle: the CUDA model's TokenStep (kernels, sampler and the copy of the
ids queued; collect() waits on an event after that copy), or a `contracts.ReadyStep` for the
paths that compute synchronously (host-sampled logits, the test fakes). A speculative unit
finishes inside launch and carries its PendingBatch in `pending`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(slots=True, eq=False)
class InFlightUnit:
    seqs: list                  # the rows' Sequence records (sequences.py), in batch order
    units: list                 # their Unit
    masks: list                 # their token masks (None: anything goes)
    backups: list               # State backups (None: no rollback kept)
    path: str                   # "greedy" | "sample" (device token ids) | "logits" (host sampling)
    step: object = None         # .collect() -> token ids [B] or logits [B, V]
    pending: Optional[object] = None   # a unit that finished inside launch (speculative)
    # a speculative Program's plain decode step (k = 0): its step keeps every row's hidden state
    # (step.hidden(), Model.step_hidden) for the drafter's feed
    keeps_hidden: bool = False
