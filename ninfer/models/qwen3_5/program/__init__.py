"""The Qwen3.5 Program: paged KV, State slots, units, PendingBatch commit/abort, pause/resume."""
# the plain data lives in ninfer/contracts.py; re-exported here for a short transition
from ....contracts import (PendingBatch, ProgramError, ResumeState, RowDecision, RowResult,
                           SamplingSpec)
from .program import Program
from .sampling import counter_uniform, sample_row

__all__ = ["Program", "PendingBatch", "ProgramError", "ResumeState", "RowDecision", "RowResult",
           "SamplingSpec", "counter_uniform", "sample_row"]
