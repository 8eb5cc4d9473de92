"""Physical bookkeeping of the Program: KV pages with block tables, and StateImage slots.

This is the only ledger of which page and slot belongs to whom; it never touches the pool
arrays themselves (the backend's KVPool / StatePool), so a device backend reuses it unchanged.

    block_tables [num_slots, max_pages_per_seq] int32    row = the sequence's State slot
        entries [0, num_mapped) are page ids in token order, the rest -1
    free_stack   [num_pages] int32                       free pages, top at num_free - 1
"""
from __future__ import annotations

import numpy as np

from .... import _hot
from .pending import ProgramError


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-int(num_tokens) // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_pages_per_seq: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.block_tables = np.full((num_slots, max_pages_per_seq), -1, np.int32)
        self.num_mapped = np.zeros(num_slots, np.int64)
        self._free_stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self.num_free = num_pages

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_grow(self, slot: int, num_tokens: int) -> int:
        """Pages slot needs to cover num_tokens, or -1 if more than its table can hold."""
        need = pages_for(num_tokens, self.page_size)
        if need > self.block_tables.shape[1]:
            return -1
        return max(0, need - int(self.num_mapped[slot]))

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Map pages so slot covers num_tokens; all or nothing."""
        extra = self.can_grow(slot, num_tokens)
        if extra < 0 or extra > self.num_free:
            return False
        start = int(self.num_mapped[slot])
        self.num_free = _hot.take_pages(self._free_stack, self.num_free,
                                        self.block_tables[slot], start, extra)
        self.num_mapped[slot] = start + extra
        return True

    def shrink(self, slot: int, num_tokens: int) -> None:
        """Unmap the pages of slot beyond those covering num_tokens."""
        keep = pages_for(num_tokens, self.page_size)
        mapped = int(self.num_mapped[slot])
        if keep < mapped:
            self.num_free = _hot.give_pages(self._free_stack, self.num_free,
                                            self.block_tables[slot], keep, mapped)
            self.num_mapped[slot] = keep

    def pages_of(self, slot: int) -> np.ndarray:
        return self.block_tables[slot, :int(self.num_mapped[slot])].copy()

    def check(self, live_slots) -> None:
        mapped = []
        for s in range(self.block_tables.shape[0]):
            row, n = self.block_tables[s], int(self.num_mapped[s])
            if s not in live_slots and n:
                raise ProgramError(f"slot {s} is free but maps {n} pages")
            if np.any(row[:n] < 0) or np.any(row[n:] != -1):
                raise ProgramError(f"slot {s}: block table {row} inconsistent with {n} pages")
            mapped.append(row[:n])
        free = self._free_stack[:self.num_free]
        every = np.concatenate(mapped + [free])
        if len(every) != self.num_pages or len(np.unique(every)) != self.num_pages \
                or every.min(initial=0) < 0 or every.max(initial=0) >= self.num_pages:
            raise ProgramError(f"page ledger broken: {self.num_free} free + "
                               f"{len(every) - self.num_free} mapped of {self.num_pages}, "
                               f"{len(np.unique(every))} distinct")


class SlotPool:
    """A fixed set of StateImage slots (one per resident sequence), lowest free id first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise ProgramError("no free StateImage slot (the caller must check first)")
        self._free.sort()
        return self._free.pop(0)

    def give(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ProgramError(f"StateImage slot {slot} returned twice or out of range")
        self._free.append(slot)

    def check(self, live_slots) -> None:
        if sorted(self._free + list(live_slots)) != list(range(self.num_slots)):
            raise ProgramError(f"slot ledger broken: free {sorted(self._free)}, "
                               f"live {sorted(live_slots)}")
