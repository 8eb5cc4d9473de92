"""The EngineCore's request record: plain, slotted, mutated only by the worker thread.

    WAITING -> MATERIALIZING -> PREFILL -> DECODE -> FINISHED
                     |             |          |
                     +-> REPLAY ---+----------+--> PAUSED -> MATERIALIZING (resume)

MATERIALIZING: bound in the Program (slot held), no unit committed yet since the bind.
REPLAY: resumed by Replay, re-executing accepted history (publishes nothing).
Any state reaches FINISHED exactly once (stop, length, cancelled, error).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..api import SamplingParams


class RequestState(enum.IntEnum):
    WAITING = 0         # in the FIFO wait queue
    MATERIALIZING = 1   # just bound (fresh or resumed); no unit committed since
    PREFILL = 2         # prompt chunks in progress
    REPLAY = 3          # rebuilding accepted history after a Replay resume
    DECODE = 4          # one token per unit
    PAUSED = 5          # no Program resources; holds a ResumeState
    FINISHED = 6        # terminal; Finished event published


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    ticket: int                       # submission order: smaller is older
    params: SamplingParams
    prompt_ids: np.ndarray            # int32
    session: Any                      # the Frontend's OutputSession
    spec: Any                         # SamplingSpec (seed resolved)
    channel: Any                      # handle._Channel: events to the consumer, cancel flag
    submit_time: float
    deadline: Optional[float] = None          # timeout_s: whole request
    queue_deadline: Optional[float] = None    # queue_timeout_s: only while WAITING
    state: RequestState = RequestState.WAITING
    seq_id: Optional[int] = None              # Program sequence while resident
    resume_state: Any = None                  # ResumeState while paused
    token_ids: list = field(default_factory=list)      # accepted generated tokens
    logprobs: Optional[list] = None
    unpublished_logprobs: list = field(default_factory=list)
    last_chunk_cycle: int = -1
    admit_time: Optional[float] = None
    first_token_time: Optional[float] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_cancel_requested(self) -> bool:
        return self.channel.is_cancel_requested

    def deadline_passed(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def queue_deadline_passed(self, now: float) -> bool:
        return self.state == RequestState.WAITING and self.queue_deadline is not None \
            and now >= self.queue_deadline
