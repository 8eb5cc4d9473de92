"""The Program's checkpoint store: the physical side of prefix checkpoints (the runtime's
ContextCache, runtime/context_cache.py, keeps the logical index and decides what to keep; this
holds what is kept and is the only ledger of its pages, State slots and host bytes).

A checkpoint is one real execution's State and KV at one prefix length p (a Gated DeltaNet State
is valid only at the exact position it was computed). It lives in one of two tiers:

    device  full pages [0, p // page_size) held by reference (shared with the block tables of
            the sequences that bound it, `PagePool.refcount`); the last, partly filled page as a
            private copy (copy-on-write: each sequence binding the entry gets its own copy of it,
            since it writes its next tokens there); the State image in a cache slot of the
            StatePool (slots [num_slots, num_slots + num_cache_slots), after the sequences')
    host    host copies of the pages covering [0, p) and of the State image (`start_read_pages`
            / `start_read`: the pool's own bytes, bf16 bits on CUDA), within the host budget

Demote moves a device checkpoint to the host tier (its device pages and slot go back); promote
moves a host one back to the device, from the pages and slot of a sequence that just bound it.
Where the pools read asynchronously (`reads_async`: CUDA's copy stream), `start_demote` begins
the host copies and returns; the checkpoint stays on the device, usable, its host bytes
reserved, until `settle` finds its copies done (or waits for them) and only then gives its pages
and slot back, so nothing overwrites them while they are read.

The runtime sees this store only through `Program.checkpoints` and its narrow API: `info`, `ids`,
`usage`, `host_cost`, `demote`, `drop` (typed results: contracts.CheckpointInfo / StoreUsage).
Capture, install and promote need a sequence's pages and slot, so they go through the Program.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ....contracts import CheckpointInfo, ProgramError, StoreUsage
from .page_ledger import PagePool, SlotPool, pages_for


@dataclass(slots=True, eq=False)
class Checkpoint:
    token_ids: np.ndarray            # the exact prefix [0, p) the State and KV cover
    pages: np.ndarray                # device: the full pages held by reference (int32)
    partial: int = -1                # device: private copy of the partly filled page, or -1
    slot: int = -1                   # device: the cache State slot, else -1
    host_kv: Optional[tuple] = None  # host tier: the image of the pages covering [0, p)
    host_state: Optional[tuple] = None
    host_bytes: int = 0
    moving: Optional[tuple] = None   # a demotion under way: (KV HostRead, State HostRead)
    reserved: int = 0                # and the host bytes it will take

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def on_device(self) -> bool:
        return self.slot >= 0

    def device_pages(self) -> np.ndarray:
        return self.pages if self.partial < 0 else np.append(self.pages, np.int32(self.partial))


class CheckpointStore:
    def __init__(self, kv, state, pages: PagePool, cache_slots: SlotPool, *, page_bytes: int,
                 state_bytes: int, host_budget_bytes: int, device_page_budget: int):
        self.kv, self.state, self.pages, self.slots = kv, state, pages, cache_slots
        self.page_size = pages.page_size
        self.page_bytes, self.state_bytes = page_bytes, state_bytes
        self.host_budget_bytes = int(host_budget_bytes)
        self.device_page_budget = int(device_page_budget)
        self.entries: dict = {}          # checkpoint id -> Checkpoint
        self._moving: set = set()        # ids of the entries whose demotion is under way
        # (distinct device pages, host bytes) of the entries, or None after a change: the
        # Engine reads them every cycle (stats) and they change only at capture / drop / tiers
        self._usage: Optional[tuple] = None
        # wall seconds of the copies between tiers (host reads and writes: synchronous, on the
        # path of the request that caused them), for stats and /metrics
        self.copy_seconds = {"to_host": 0.0, "to_device": 0.0}

    # ---- the runtime's narrow API ---------------------------------------------------------------
    def info(self, cid: int) -> CheckpointInfo:
        c = self.entries[cid]
        freed = self.pages.num_sole(c.device_pages()) if c.on_device else 0
        return CheckpointInfo(c.num_tokens, c.on_device, freed, c.host_bytes,
                              c.moving is not None)

    def ids(self) -> list:
        return list(self.entries)

    def usage(self) -> StoreUsage:
        return StoreUsage(host_bytes_used=self.host_bytes_used,
                          host_budget_bytes=self.host_budget_bytes,
                          device_pages_used=self.device_pages_used,
                          device_page_budget=self.device_page_budget,
                          device_bytes_used=self.device_bytes_used,
                          num_cache_slots=self.slots.num_slots,
                          num_entries=len(self.entries),
                          num_free_cache_slots=self.slots.num_free,
                          num_moving=len(self._moving),
                          moving_pages_freed=self.pages.num_sole(np.concatenate(
                              [self.entries[cid].device_pages() for cid in self._moving]))
                          if self._moving else 0)

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_moving(self) -> int:
        """Demotions under way (their copies not yet settled)."""
        return len(self._moving)

    @property
    def reads_async(self) -> bool:
        return bool(self.kv.reads_async and self.state.reads_async)

    @property
    def is_enabled(self) -> bool:
        return self.slots.num_slots > 0 or self.host_budget_bytes > 0

    def host_cost(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size) * self.page_bytes + self.state_bytes

    def _usage_now(self) -> tuple:
        if self._usage is None:
            self._usage = (len(np.unique(self.held_pages())),
                           sum(c.host_bytes + c.reserved for c in self.entries.values()))
        return self._usage

    @property
    def host_bytes_used(self) -> int:
        return self._usage_now()[1]

    def held_pages(self) -> np.ndarray:
        """Every page reference the device entries hold (a page twice if two entries hold it)."""
        parts = [c.device_pages() for c in self.entries.values() if c.on_device]
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    @property
    def device_pages_used(self) -> int:
        return self._usage_now()[0]

    @property
    def device_bytes_used(self) -> int:
        return self.device_pages_used * self.page_bytes + \
            (self.slots.num_slots - self.slots.num_free) * self.state_bytes

    def device_bytes_freed_by(self, cid: int) -> int:
        """Device bytes dropping (or demoting) checkpoint cid would give back now."""
        c = self.entries[cid]
        if not c.on_device:
            return 0
        return self.pages.num_sole(c.device_pages()) * self.page_bytes + self.state_bytes

    def device_pages_needed(self, num_tokens: int, *, own_partial: bool = False) -> int:
        """Free pages a device capture at num_tokens takes (its partial page's copy), and
        whether a cache slot is free: -1 when none is."""
        if self.slots.num_free == 0:
            return -1
        return 0 if own_partial or num_tokens % self.page_size == 0 else 1

    # ---- capture --------------------------------------------------------------------------------
    def capture_device(self, cid: int, token_ids: np.ndarray, table_row: np.ndarray,
                       seq_slot: int, *, own_partial: bool = False) -> None:
        """Keep [0, p) of a sequence on the device: hold its full pages, copy (or, own_partial:
        take over, for a sequence about to be released) its partly filled page, copy its State
        into a cache slot. The caller checked `device_pages_needed`."""
        p = len(token_ids)
        full, rest = divmod(p, self.page_size)
        held = np.asarray(table_row[:full], np.int32).copy()
        self.pages.hold(held)
        partial = -1
        if rest:
            src = int(table_row[full])
            if own_partial:
                self.pages.hold([src])
                partial = src
            else:
                partial = int(self.pages.take(1)[0])
                self.kv.copy_pages([src], [partial])
        slot = self.slots.take()
        self.state.copy(seq_slot, slot)
        self.entries[cid] = Checkpoint(np.array(token_ids, np.int32), held, partial, slot)
        self._usage = None

    def capture_host(self, cid: int, token_ids: np.ndarray, table_row: np.ndarray,
                     seq_slot: int) -> None:
        p = len(token_ids)
        cost = self.host_cost(p)
        if self.host_bytes_used + cost > self.host_budget_bytes:
            raise ProgramError(f"capture: {cost} host bytes do not fit the cache's host budget")
        rows = table_row[:pages_for(p, self.page_size)]
        t0 = time.perf_counter()
        host_kv = self.kv.start_read_pages(rows).result()      # (the pool's own bytes)
        host_state = self.state.start_read(seq_slot).result()
        self.copy_seconds["to_host"] += time.perf_counter() - t0
        self.entries[cid] = Checkpoint(np.array(token_ids, np.int32), np.zeros(0, np.int32),
                                       host_kv=host_kv, host_state=host_state, host_bytes=cost)
        self._usage = None

    # ---- install into a fresh sequence ----------------------------------------------------------
    def bind_pages_needed(self, cid: int, num_tokens: int) -> int:
        """Free pages a sequence needs to cover num_tokens (>= the checkpoint's) after binding
        cid: the shared full pages come by reference."""
        c = self.entries[cid]
        shared = len(c.pages) if c.on_device else 0
        return pages_for(num_tokens, self.page_size) - shared

    def install(self, cid: int, slot: int) -> None:
        """Give an empty sequence slot the checkpoint's KV [0, p) and State (the caller checked
        `bind_pages_needed`)."""
        c = self.entries[cid]
        p = c.num_tokens
        if c.on_device:
            self.pages.map_shared(slot, c.pages)
            if not self.pages.grow(slot, p):
                raise ProgramError("bind: pages vanished between check and act")
            if c.partial >= 0:
                self.kv.copy_pages([c.partial], [int(self.pages.block_tables[slot, len(c.pages)])])
            self.state.copy(c.slot, slot)
        else:
            if not self.pages.grow(slot, p):
                raise ProgramError("bind: pages vanished between check and act")
            t0 = time.perf_counter()
            self.kv.write_pages(self.pages.pages_of(slot), c.host_kv)
            self.state.write(slot, c.host_state)
            self.copy_seconds["to_device"] += time.perf_counter() - t0

    # ---- tiers ----------------------------------------------------------------------------------
    def demote(self, cid: int) -> None:
        """Device -> host copies; the device pages and the cache slot go back (now: the
        copies are waited for)."""
        self.start_demote(cid)
        self._finish_move(cid)

    def start_demote(self, cid: int) -> None:
        """Begin the device -> host copies (the pools' start_read_*); `settle` ends it. The host
        bytes are reserved now; the pages and slot stay held (and usable) meanwhile."""
        c = self.entries[cid]
        cost = self.host_cost(c.num_tokens)
        if not c.on_device or c.moving is not None \
                or self.host_bytes_used + cost > self.host_budget_bytes:
            raise ProgramError(f"demote: checkpoint {cid} is not on the device, is moving "
                               f"already or does not fit")
        t0 = time.perf_counter()
        c.moving = (self.kv.start_read_pages(c.device_pages()), self.state.start_read(c.slot))
        c.reserved = cost
        self._moving.add(cid)
        self.copy_seconds["to_host"] += time.perf_counter() - t0
        self._usage = None

    def settle(self, wait: bool = False) -> int:
        """Finish the demotions whose copies are done (every one under way, with wait): the
        host tier takes the images, the device pages and slot go back. Returns how many."""
        done = [cid for cid in self._moving
                if wait or all(read.done() for read in self.entries[cid].moving)]
        for cid in done:
            self._finish_move(cid)
        return len(done)

    def _finish_move(self, cid: int) -> None:
        c = self.entries[cid]
        self._moving.discard(cid)
        t0 = time.perf_counter()
        kv, state = c.moving
        c.host_kv, c.host_state = kv.result(), state.result()
        self.copy_seconds["to_host"] += time.perf_counter() - t0
        c.host_bytes, c.reserved, c.moving = c.reserved, 0, None
        self._free_device(c)

    def promote(self, cid: int, table_row: np.ndarray, seq_slot: int) -> None:
        """Host -> device, from a sequence that installed cid just now (its frontier is p)."""
        c = self.entries[cid]
        if c.on_device:
            raise ProgramError(f"promote: checkpoint {cid} is on the device already")
        token_ids = c.token_ids
        del self.entries[cid]
        self.capture_device(cid, token_ids, table_row, seq_slot)      # (resets the usage)
        release_image(c.host_kv)             # (after install's copies from them: see _release)
        release_image(c.host_state)

    def drop(self, cid: int) -> None:
        c = self.entries.pop(cid, None)
        if c is None:
            raise ProgramError(f"checkpoint {cid} dropped twice or unknown")
        if c.moving is not None:         # its pages are read until the copies are done
            for read in c.moving:
                release_image(read.result())
            c.moving, c.reserved = None, 0
            self._moving.discard(cid)
        if c.on_device:
            self._free_device(c)
        release_image(c.host_kv)
        release_image(c.host_state)
        self._usage = None

    def _free_device(self, c: Checkpoint) -> None:
        self.pages.drop(c.device_pages())
        self.slots.give(c.slot)
        c.pages, c.partial, c.slot = np.zeros(0, np.int32), -1, -1
        self._usage = None              # (demote sets the host bytes first)

    # ---- audit ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Entry shapes, tiers, budgets and copy-on-write (a partial page is private)."""
        if self._usage is not None:
            held = self._usage
            self._usage = None
            if self._usage_now() != held:
                raise ProgramError(f"cache usage {held} out of step with the entries "
                                   f"{self._usage}")
        self.slots.check([c.slot for c in self.entries.values() if c.on_device])
        if self._moving != {cid for cid, c in self.entries.items() if c.moving is not None}:
            raise ProgramError(f"moving checkpoints {sorted(self._moving)} out of step")
        for cid, c in self.entries.items():
            p = c.num_tokens
            if not p:
                raise ProgramError(f"checkpoint {cid} covers no tokens")
            if (c.moving is not None) != (c.reserved > 0) or \
                    (c.moving is not None and (not c.on_device or c.reserved != self.host_cost(p))):
                raise ProgramError(f"checkpoint {cid}: a demotion under way must be on the "
                                   f"device with its host bytes reserved ({c.reserved})")
            if c.on_device:
                full, rest = divmod(p, self.page_size)
                if len(c.pages) != full or (rest > 0) != (c.partial >= 0) or c.host_bytes \
                        or c.host_kv is not None:
                    raise ProgramError(f"device checkpoint {cid}: {len(c.pages)} full pages, "
                                       f"partial {c.partial}, {c.host_bytes} host bytes for "
                                       f"{p} tokens")
                if c.partial >= 0 and self.pages.refcount[c.partial] != 1:
                    raise ProgramError(f"checkpoint {cid}: its partly filled page {c.partial} "
                                       f"is shared (copy-on-write broken)")
            elif c.host_bytes != self.host_cost(p) or c.host_kv is None or len(c.pages) \
                    or c.partial >= 0:
                raise ProgramError(f"host checkpoint {cid}: {c.host_bytes} bytes for {p} tokens")
        if self.host_bytes_used > self.host_budget_bytes:
            raise ProgramError(f"host checkpoints use {self.host_bytes_used} > budget "
                               f"{self.host_budget_bytes}")
        if self.device_pages_used > self.device_page_budget:
            raise ProgramError(f"device checkpoints hold {self.device_pages_used} pages > "
                               f"budget {self.device_page_budget}")


def release_image(image) -> None:
    """A host image that holds pool memory (CUDA's host_tier.TierImage) gives it back; its
    rows are reused only after the copies queued from them have run. numpy's images are plain
    arrays, freed with the entry."""
    release = getattr(image, "release", None)
    if release is not None:
        release()
