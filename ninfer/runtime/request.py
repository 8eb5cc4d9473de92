"""The EngineCore's request record: plain, slotted, mutated only by the worker thread.

    WAITING -> MATERIALIZING -> PREFILL -> DECODE -> FINISHED
                     |             |          |
                     +-> REPLAY ---+----------+--> PAUSED -> MATERIALIZING (resume)

MATERIALIZING: bound in the Program (slot held), no unit committed yet since the bind.
REPLAY: resumed by Replay, re-executing accepted history (publishes nothing).
Any state reaches FINISHED exactly once (stop, length, cancelled, error).

The admission checks at the end run on the submitting thread, before a Request exists.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..api import MAX_SESSION_CHARS, SamplingParams
from ..errors import ContextLengthError, RequestError


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
    reusable_at: int = 0                      # prefix a later prompt may repeat (checkpoint)
    may_reuse: bool = True                    # text only: may start from a prefix checkpoint
    media: Any = None                         # (Frontend media, MRoPE positions [3, T]) or None
    cache_session: Optional[str] = None       # session hint of the context cache (submit's session=)
    media_digest: bytes = b""                 # identifies a prompt's media in cache keys
    num_cached_tokens: int = 0                # prompt tokens a cache hit supplied at bind
    # more requests with this exact prompt follow (OpenAI n): checkpoint it one token short of
    # its end, the longest prefix they can reuse (their last prompt token gives their logits)
    share_prompt: bool = False

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


# ---- admission checks (any thread, before a Request exists) -----------------------------------

def checked_submit_args(params, enable_thinking, request_id, timeout_s,
                        session=None) -> SamplingParams:
    """Validate submit()'s arguments (RequestError naming the bad one); a validated copy of params."""
    if session is not None and (not isinstance(session, str) or len(session) > MAX_SESSION_CHARS):
        raise RequestError(f"session={session!r:.80}: must be a string of at most "
                           f"{MAX_SESSION_CHARS} characters, or None")
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    if enable_thinking is not None and not isinstance(enable_thinking, (bool, np.bool_)):
        raise RequestError(f"enable_thinking={enable_thinking!r}: must be true, false or None")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"request_id={request_id!r}: must be a string")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float))
                                      and not isinstance(timeout_s, bool)
                                      and math.isfinite(timeout_s) and timeout_s > 0):
        raise RequestError(f"timeout_s={timeout_s!r}: must be a finite number > 0")
    return dataclasses.replace(params).validate()     # a copy: validate() normalises fields


def check_output_room(params, num_prompt_tokens: int, max_context: int) -> None:
    """prompt + max_tokens must fit max_context (OpenAI's and vLLM's rule: a request asking more
    than the context holds is refused before it runs, not cut short after minutes), unless the
    request asked for the clamp (`clamp_max_tokens`: the output then ends at the context)."""
    if not params.clamp_max_tokens and num_prompt_tokens + params.max_tokens > max_context:
        raise ContextLengthError(params.max_tokens, num_prompt_tokens, max_context)


def checked_prompt_ids(ids, max_context: int, vocab_size: int) -> np.ndarray:
    """The prepared prompt as int32 ids that fit: non-empty, < max_context, in the vocabulary."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or len(ids) == 0:
        raise RequestError(f"prompt must be a non-empty 1-D token sequence, got shape {ids.shape}")
    if len(ids) >= max_context:
        raise RequestError(
            f"prompt has {len(ids)} tokens; max_context={max_context} allows at most "
            f"{max_context - 1} prompt tokens (plus at least one generated)",
            code="context_length_exceeded")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})")
    return ids.astype(np.int32)
