"""Snapshots: the host copies a paused sequence keeps of its KV pages and State image.

`SnapshotLedger` is the only host ledger of them (snapshot id -> bytes, against the host budget);
`capture_image` / `install_image` move the bytes out of and back into the pools. The ResumeState
carries the copies themselves; the ledger only counts them.
"""
from __future__ import annotations

import numpy as np

from ....contracts import ProgramError
from .page_ledger import pages_for


class SnapshotLedger:
    def __init__(self, budget_bytes: int, page_bytes: int, state_bytes: int, page_size: int):
        """page_bytes / state_bytes: host bytes of one KV page (every layer) / one State image."""
        self.budget_bytes = int(budget_bytes)
        self.page_bytes = int(page_bytes)
        self.state_bytes = int(state_bytes)
        self.page_size = int(page_size)
        self._bytes_by_id: dict = {}

    @property
    def bytes_used(self) -> int:
        return sum(self._bytes_by_id.values())

    @property
    def bytes_free(self) -> int:
        return self.budget_bytes - self.bytes_used

    def __len__(self) -> int:
        return len(self._bytes_by_id)

    def cost(self, frontier: int) -> int:
        """Host bytes a Snapshot of a sequence with this frontier holds."""
        return pages_for(frontier, self.page_size) * self.page_bytes + self.state_bytes

    def fits(self, num_bytes: int) -> bool:
        return self.bytes_used + num_bytes <= self.budget_bytes

    def hold(self, snapshot_id: int, num_bytes: int) -> None:
        self._bytes_by_id[snapshot_id] = int(num_bytes)

    def drop(self, snapshot_id: int) -> None:
        if self._bytes_by_id.pop(snapshot_id, None) is None:
            raise ProgramError(f"snapshot {snapshot_id} consumed twice")

    def check(self) -> None:
        if self.bytes_used > self.budget_bytes:
            raise ProgramError(f"host snapshots use {self.bytes_used} > budget")


def capture_image(kv, state, pages, slot: int) -> dict:
    """Host copies of the KV `pages` (the frontier's, in token order) and the State of `slot`:
    ResumeState's kv_pages and state_image."""
    return dict(kv_pages=kv.read_pages(pages), state_image=state.read(slot))


def install_image(kv, state, pages, slot: int, kv_pages, state_image) -> None:
    """Write a Snapshot's copies into freshly mapped `pages` and the State of `slot`."""
    kv.write_pages(pages, kv_pages)
    state.write(slot, state_image)


def host_bytes(arrays) -> int:
    """Bytes of a host image (a sequence of parts, each a sequence of arrays)."""
    total = 0
    for part in arrays:
        for a in part:
            total += int(np.asarray(a).nbytes)
    return total
