"""Physical bookkeeping of the Program: KV pages with block tables, and StateImage slots.

This is the only ledger of which page and slot belongs to whom; it never touches the pool
arrays themselves (the backend's KVPool / StatePool), so a device backend reuses it unchanged.

    block_tables [num_slots, max_pages_per_seq] int32    row = the sequence's State slot
        entries [0, num_mapped) are page ids in token order, the rest -1
    free_stack   [num_pages] int32                       free pages, top at num_free - 1
    refcount     [num_pages] int32                       holders of each page: block-table
        entries mapping it + context-cache entries holding it (`hold`); 0 exactly when free

A page is shared only where nobody writes it: a sequence writes KV at positions >= its frontier,
and shared pages cover tokens below every holder's frontier (copy-on-write: the last, partly
filled page of a cache entry is a private copy, never shared; `Program.check_invariants`).
"""
from __future__ import annotations

import numpy as np

from .... import _hot
from ....contracts import ProgramError


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
        self.refcount = np.zeros(num_pages, np.int32)

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
        if extra == 0:                  # most decode steps: the last page has room
            return True
        start = int(self.num_mapped[slot])
        self.num_free = _hot.take_pages(self._free_stack, self.num_free,
                                        self.block_tables[slot], start, extra)
        self.refcount[self.block_tables[slot, start:start + extra]] = 1
        self.num_mapped[slot] = start + extra
        return True

    def shrink(self, slot: int, num_tokens: int) -> None:
        """Unmap the pages of slot beyond those covering num_tokens (a page held elsewhere too
        stays allocated)."""
        keep = pages_for(num_tokens, self.page_size)
        mapped = int(self.num_mapped[slot])
        if keep < mapped:
            self.num_free = _hot.release_pages(self._free_stack, self.num_free, self.refcount,
                                               self.block_tables[slot], keep, mapped)
            self.num_mapped[slot] = keep

    def map_shared(self, slot: int, pages) -> None:
        """Map pages (held by someone else: a cache entry) as the first entries of an empty
        slot's block table: one more reference each."""
        pages = np.asarray(pages, np.int32)
        if self.num_mapped[slot] or len(pages) > self.block_tables.shape[1] \
                or np.any(self.refcount[pages] < 1):
            raise ProgramError(f"map_shared: slot {slot} is not empty or pages {pages} are free")
        self.block_tables[slot, :len(pages)] = pages
        self.refcount[pages] += 1
        self.num_mapped[slot] = len(pages)

    def take(self, count: int) -> np.ndarray:
        """count free pages for a holder outside the block tables (a cache entry's private
        page), one reference each; the caller checked num_free."""
        if count > self.num_free:
            raise ProgramError(f"take: {count} pages wanted, {self.num_free} free")
        pages = self._free_stack[self.num_free - count:self.num_free][::-1].copy()
        self.num_free -= count
        self.refcount[pages] = 1
        return pages

    def hold(self, pages) -> None:
        """One more reference to each of pages (allocated, distinct)."""
        pages = np.asarray(pages, np.int32)
        if np.any(self.refcount[pages] < 1) or len(np.unique(pages)) != len(pages):
            raise ProgramError(f"hold: pages {pages} free or repeated")
        self.refcount[pages] += 1

    def drop(self, pages) -> None:
        """Give back one reference of each of pages; those nobody holds any more become free."""
        row = np.asarray(pages, np.int32).copy()
        self.num_free = _hot.release_pages(self._free_stack, self.num_free, self.refcount,
                                           row, 0, len(row))

    def num_sole(self, pages) -> int:
        """How many of pages only one holder has (what dropping that holder would free)."""
        return int(np.count_nonzero(self.refcount[np.asarray(pages, np.int32)] == 1))

    def pages_of(self, slot: int) -> np.ndarray:
        return self.block_tables[slot, :int(self.num_mapped[slot])].copy()

    def check(self, live_slots, held=()) -> None:
        """held: the page ids cache entries hold (one entry per reference). Every page's count
        equals its block-table mappings + holds; free pages are exactly those counted 0."""
        mapped = []
        for s in range(self.block_tables.shape[0]):
            row, n = self.block_tables[s], int(self.num_mapped[s])
            if s not in live_slots and n:
                raise ProgramError(f"slot {s} is free but maps {n} pages")
            if np.any(row[:n] < 0) or np.any(row[n:] != -1):
                raise ProgramError(f"slot {s}: block table {row} inconsistent with {n} pages")
            if len(np.unique(row[:n])) != n:
                raise ProgramError(f"slot {s} maps one page twice: {row[:n]}")
            mapped.append(row[:n])
        refs = np.concatenate(mapped + [np.asarray(held, np.int32).reshape(-1)])
        if refs.size and (refs.min() < 0 or refs.max() >= self.num_pages):
            raise ProgramError(f"page ids out of range in the ledger: {refs}")
        expected = np.bincount(refs, minlength=self.num_pages)
        if not np.array_equal(expected, self.refcount):
            bad = np.flatnonzero(expected != self.refcount)
            raise ProgramError(f"page reference counts broken at pages {bad[:8]}: counted "
                               f"{self.refcount[bad[:8]]}, held {expected[bad[:8]]}")
        free = self._free_stack[:self.num_free]
        if len(np.unique(free)) != self.num_free or \
                sorted(free.tolist()) != np.flatnonzero(expected == 0).tolist():
            raise ProgramError(f"page ledger broken: {self.num_free} free of {self.num_pages}, "
                               f"{int(np.count_nonzero(expected == 0))} unreferenced")


class SlotPool:
    """A fixed set of StateImage slots, lowest free id first: ids [first, first + num_slots)
    (sequences: from 0; the context cache's State checkpoints: the slots after them)."""

    def __init__(self, num_slots: int, first: int = 0):
        self.num_slots = num_slots
        self.first = first
        self._free = list(range(first, first + num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise ProgramError("no free StateImage slot (the caller must check first)")
        self._free.sort()
        return self._free.pop(0)

    def give(self, slot: int) -> None:
        if slot in self._free or not self.first <= slot < self.first + self.num_slots:
            raise ProgramError(f"StateImage slot {slot} returned twice or out of range")
        self._free.append(slot)

    def check(self, live_slots) -> None:
        if sorted(self._free + list(live_slots)) != \
                list(range(self.first, self.first + self.num_slots)):
            raise ProgramError(f"slot ledger broken: free {sorted(self._free)}, "
                               f"live {sorted(live_slots)}")
