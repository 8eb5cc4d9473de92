"""The Qwen3.5 Program: paged KV, State slots, units, PendingBatch commit/abort, pause/resume."""
from .pending import PendingBatch, ProgramError, ResumeState, RowDecision, RowResult
from .program import Program
from .sampling import SamplingSpec, counter_uniform, sample_row

__all__ = ["Program", "PendingBatch", "ProgramError", "ResumeState", "RowDecision", "RowResult",
           "SamplingSpec", "counter_uniform", "sample_row"]
