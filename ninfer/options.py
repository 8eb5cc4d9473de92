"""Engine start-up options: fixed for the Engine's life (DESIGN.md section 1)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Optional

from .errors import RequestError

Backend = Literal["numpy", "cuda"]
Purpose = Literal["generation", "scoring"]


@dataclass(frozen=True, slots=True)
class EngineOptions:
    backend: Backend = "numpy"
    purpose: Purpose = "generation"
    max_concurrency: int = 4            # resident requests, 1..8
    max_context: int = 4096             # prompt + generated tokens per request
    max_queue: int = 64                 # bounded FIFO wait queue; beyond it submit() -> 429
    prefill_chunk: int = 512            # tokens per prefill / Replay / scoring window
    page_size: int = 16                 # tokens per KV page
    num_kv_pages: Optional[int] = None  # None -> enough for max_concurrency * max_context
    host_snapshot_bytes: int = 256 << 20   # host budget for Snapshot pauses (0 -> Replay only)
    queue_timeout_s: Optional[float] = None
    default_enable_thinking: bool = True
    device_id: int = 0
    graphs: bool = True                 # cuda: replay CUDA graphs for decode

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Engine: unknown option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**kwargs)
        opts.validate()
        return opts

    def validate(self) -> None:
        def bad(name, rule):
            raise RequestError(f"Engine option {name}={getattr(self, name)!r}: {rule}")
        if self.backend not in ("numpy", "cuda"):
            bad("backend", "must be 'numpy' or 'cuda'")
        if self.purpose not in ("generation", "scoring"):
            bad("purpose", "must be 'generation' or 'scoring'")
        if not 1 <= self.max_concurrency <= 8:
            bad("max_concurrency", "must be in 1..8")
        if self.max_context < 2:
            bad("max_context", "must be >= 2")
        if self.max_queue < 0:
            bad("max_queue", "must be >= 0")
        if self.prefill_chunk < 1:
            bad("prefill_chunk", "must be >= 1")
        if self.page_size < 1:
            bad("page_size", "must be >= 1")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            bad("num_kv_pages", "must be >= 1")
