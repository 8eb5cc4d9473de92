"""TokenStep: the token ids of one launched model step, not yet read.

    step = model.launch_tokens(batch, kv, state, rows)   # kernels, sampler, D2H copy, event
    ...                                                  # host work while the GPU runs
    ids = step.collect()                                 # int32 [B]: waits on the event only

The ids are copied into pinned host memory by the step's last operation on the stream and an
event is recorded after that copy; collect() waits on that event (not on the whole stream) and
returns a copy. At most two steps are in flight (the second launched ahead of the first,
`CudaModel.launch_tokens(after=)`); a pinned id buffer is reused only after its step's collect.
A step launched with keep_hidden also copies every row's final-normed hidden state down before
its event; collect reads it too (`hidden()`: the drafter's feed of a plain speculative step).
"""
from __future__ import annotations

import numpy as np


class TokenStep:
    __slots__ = ("_host_ids", "_event", "_on_collect", "_ids", "_read_hidden", "_hidden")

    def __init__(self, host_ids: np.ndarray, event, on_collect, read_hidden=None):
        self._host_ids = host_ids         # int32 [B] view of the pinned buffer the copy fills
        self._event = event
        self._on_collect = on_collect     # the model's in-flight slot is free again
        self._read_hidden = read_hidden   # () -> [B, H] from its pinned buffer, or None
        self._ids = self._hidden = None

    @property
    def num_rows(self) -> int:
        return len(self._host_ids)

    @property
    def is_collected(self) -> bool:
        return self._ids is not None

    def collect(self) -> np.ndarray:
        """int32 token ids [B]; waits for this step's copy once, then returns the same ids."""
        if self._ids is None:
            try:
                self._event.synchronize()
                self._ids = self._host_ids.copy()
                if self._read_hidden is not None:     # (its pinned buffer is reused after)
                    self._hidden = self._read_hidden()
            finally:
                self._on_collect(self)
        return self._ids

    def hidden(self) -> np.ndarray:
        """[B, H]: every row's final-normed hidden state (a step launched with keep_hidden),
        float32 or, in a bf16 model, bfloat16 as the device holds it; collects first."""
        if self._read_hidden is None:
            raise RuntimeError("TokenStep.hidden: the step was launched without keep_hidden")
        self.collect()
        return self._hidden
