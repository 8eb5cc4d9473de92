"""ForwardBatch lives in ninfer/contracts.py (with its one check(limits)); this module re-exports
it for the many callers that import it from the model family."""
from __future__ import annotations

from ...contracts import BatchLimits, ForwardBatch

__all__ = ["BatchLimits", "ForwardBatch"]
