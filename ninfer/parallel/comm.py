"""Communicators: the collectives tensor / expert parallel needs, behind one small interface.

A rank computes a partial result (its heads' share of o_proj, its experts' share of the MoE
combine, ...); the communicator turns the partials of all ranks into the full result that every
rank then holds. The interface takes the partials of the ranks *this process drives*, in rank
order: LocalComm drives all N ranks in one process (the CPU proof: ninfer/parallel/tp_model.py);
a one-process-per-GPU backend (NCCL, not built yet) drives one rank and passes `[its partial]`.

Summation order (LocalComm): the partials are added in float64 in rank order 0, 1, ..., N-1 and
the sum is rounded to the partials' dtype once. A float64 sum of N float32 values carries ~29
spare bits, so the result is the float32 rounding of the exact sum for any N that matters here:
the only difference from a single-rank model is that each rank's partial sum was rounded to
float32 on its own (the test tolerance is set by that). A NCCL ring sums in its own order and
dtype and will not match LocalComm bit for bit.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Communicator(Protocol):
    """What a tensor-parallel model needs of its ranks' interconnect."""
    world_size: int
    ranks: tuple            # the ranks whose partials this process passes, ascending

    @property
    def rank(self) -> int:
        """The first rank this process drives (its only one on a one-process-per-rank backend)."""

    def all_reduce_sum(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """The elementwise sum over all world_size ranks of their partials (one per rank in
        `ranks`, same shape and dtype); a new array, the inputs are not modified."""

    def all_gather(self, parts: Sequence[np.ndarray], axis: int = -1) -> np.ndarray:
        """All ranks' arrays concatenated along `axis` in rank order."""


class LocalComm:
    """N simulated ranks in one process: every collective gets all N partials at once."""

    def __init__(self, world_size: int):
        if not isinstance(world_size, (int, np.integer)) or isinstance(world_size, bool) \
                or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.world_size = int(world_size)
        self.ranks = tuple(range(self.world_size))

    @property
    def rank(self) -> int:
        return 0

    def _check(self, parts, what: str) -> list:
        parts = list(parts)
        if len(parts) != self.world_size:
            raise ValueError(f"{what}: {len(parts)} partials for {self.world_size} ranks")
        return parts

    def all_reduce_sum(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        parts = self._check(parts, "all_reduce_sum")
        first = np.asarray(parts[0])
        for r, p in enumerate(parts[1:], 1):
            if np.shape(p) != first.shape or np.asarray(p).dtype != first.dtype:
                raise ValueError(f"all_reduce_sum: rank {r}'s partial is {np.shape(p)} "
                                 f"{np.asarray(p).dtype}, rank 0's {first.shape} {first.dtype}")
        acc = first.astype(np.float64, copy=True)
        for p in parts[1:]:                 # rank order 0, 1, ..., N-1
            acc += p
        return acc.astype(first.dtype, copy=False)

    def all_gather(self, parts: Sequence[np.ndarray], axis: int = -1) -> np.ndarray:
        return np.concatenate(self._check(parts, "all_gather"), axis=axis)
