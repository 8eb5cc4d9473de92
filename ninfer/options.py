"""Engine start-up options: fixed for the Engine's life (DESIGN.md section 1)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, Optional

import numpy as np

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
    # host budget for prefix checkpoints (0 -> no reuse). None: 256 MiB on the numpy backend, 0 on
    # cuda, where a host checkpoint costs every request a device-to-host copy of its State and KV
    prefix_cache_bytes: Optional[int] = None
    queue_timeout_s: Optional[float] = None
    default_enable_thinking: bool = True
    device_id: int = 0
    graphs: bool = True                 # cuda: replay CUDA graphs for decode
    # compute dtype (like vLLM's --dtype). cuda: None / "bfloat16" -> bf16 weights, activations and
    # KV with fp32 accumulation; "float32" -> fp32 throughout (exact agreement with the numpy
    # backend, about 2x the memory). numpy: always float32 (None or "float32")
    dtype: Optional[str] = None
    # cuda: capture every decode graph (B = 1..max_concurrency) and run a warm-up step before the
    # Engine reports ready (False: capture lazily, on the first decode of each batch size)
    warmup: bool = True
    # re-check every batch inside the backend too (the Program validates each batch once, where
    # it builds it; backends trust those batches unless this is on)
    debug_checks: bool = False
    # a request's tokens independent of load: every row's logits bitwise the same whatever B and
    # the other rows are (cuda: one GEMM shape for all decode batches, fixed attention splits),
    # and Replay re-runs history the way it first ran (docs/architecture.md "Load invariance";
    # its cost: docs/performance.md)
    batch_invariant: bool = False

    @property
    def prefix_cache_budget_bytes(self) -> int:
        """The effective prefix-checkpoint budget (see prefix_cache_bytes)."""
        if self.prefix_cache_bytes is not None:
            return int(self.prefix_cache_bytes)
        return 256 << 20 if self.backend == "numpy" else 0

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
        if not _is_int(self.max_concurrency) or not 1 <= self.max_concurrency <= 8:
            bad("max_concurrency", "must be in 1..8")
        for name, least in _INT_MINIMA:
            if not _is_int(getattr(self, name)) or getattr(self, name) < least:
                bad(name, f"must be an integer >= {least}")
        if self.num_kv_pages is not None and (not _is_int(self.num_kv_pages)
                                              or self.num_kv_pages < 1):
            bad("num_kv_pages", "must be an integer >= 1 (or None: sized for max_context)")
        if self.prefix_cache_bytes is not None and (not _is_int(self.prefix_cache_bytes)
                                                    or self.prefix_cache_bytes < 0):
            bad("prefix_cache_bytes", "must be an integer >= 0 (or None: the backend's default)")
        if self.dtype not in (None, "bfloat16", "float32"):
            bad("dtype", "must be None, 'bfloat16' or 'float32'")
        if self.backend == "numpy" and self.dtype == "bfloat16":
            bad("dtype", "the numpy backend computes in float32 only (from the stored weights); "
                         "use None or 'float32', or backend='cuda' for bfloat16")
        timeout = self.queue_timeout_s
        if timeout is not None and not (_is_real(timeout) and math.isfinite(timeout)
                                        and timeout > 0):
            bad("queue_timeout_s", "must be a finite number of seconds > 0 (or None: no limit)")


# integer options and their least value (max_concurrency has its own range)
_INT_MINIMA = (("max_context", 2), ("max_queue", 0), ("prefill_chunk", 1), ("page_size", 1),
               ("host_snapshot_bytes", 0), ("device_id", 0))


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
