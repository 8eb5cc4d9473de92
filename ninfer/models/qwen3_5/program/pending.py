"""Transition shim: the Program's plain data now lives in ninfer/contracts.py (import it from
there); these names stay importable from here until the callers outside ninfer/ have moved."""
from ....contracts import PendingBatch, ProgramError, ResumeState, RowDecision, RowResult

__all__ = ["PendingBatch", "ProgramError", "ResumeState", "RowDecision", "RowResult"]
