"""ContextCache: the one owner of the context cache's policy: the shared prefix index, session
hints, what to keep and what to reclaim, and what happens to a sequence's Program resources when
a request settles. The EngineCore's API is lookup -> bound -> capture_if_due -> reclaim (+
settle_finished / settle_paused), in the spirit of vLLM's KVCacheManager.

The index is logical: checkpoint id -> the exact prefix tokens it covers (+ the prompt's media
digest), found by a digest chained over page-sized blocks and confirmed token by token. The
Program's checkpoint store holds the checkpoints themselves (device pages by reference, State
slot copies, host copies: `program/checkpoint_store.py`) and their bytes, and is the only physical
ledger; this reads it through `program.checkpoints` (info / ids / usage / host_cost / demote /
drop: typed answers) and the Program's sequence-bound hooks (due_captures, capture_room,
capture_checkpoint, promote_checkpoint, continuation, release, prefill_progress, add_capture).
A Gated DeltaNet State is a running summary, valid only at the exact position it was captured,
so a checkpoint is one real execution's State + KV at one prefix length p, and a hit must match
the prompt token for token on [0, p).

Checkpoints are taken at the end of a prompt's reusable part, at the multiples of
`checkpoint_interval` before it (those at least an interval past the prefix it reused), and at the end of every finished request (its continuation: prompt + answer, up to
the last token it ran). Retention is by cost: the recompute a checkpoint saves per byte it holds
(tokens covered / bytes), times (1 + the hits it had), divided by (1 + its age in cache events
since its last use), doubled while a session's newest publication names it; a session's previous
publication goes when its newest extends it and nobody else used it (`_is_subsumed`). Under the
device budget the lowest-ranked device checkpoints are demoted to the host tier (dropped when the
host budget cannot take them); the EngineCore reclaims cache pages before it pauses any resident
request.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..contracts import ProgramError


MAX_SESSIONS = 4096      # session bindings remembered (least recently published forgotten first)
# Where demotions run beside the steps (store.reads_async), the device tier is kept this far
# from its limits by demoting ahead of need, so a capture finds room without a copy on its
# request's path: free cache State slots, and a share of the device page budget.
HEADROOM_SLOTS = 2
HEADROOM_PAGES = 0.125
# While the Engine has no request at all, demotions cost nobody a wait, synchronous ones too:
# the device tier is then kept a quarter of its page budget from its limit, so the next turn's
# captures find room instead of demoting on its request's path (measured on the H200: a turn
# that demoted seven 9B checkpoints first paid ~30 ms of copies before its prefill).
IDLE_HEADROOM_PAGES = 0.25


def _digest(token_ids: np.ndarray, prev: bytes = b"") -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(np.asarray(token_ids).astype("<i4", copy=False).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class _Entry:
    token_ids: np.ndarray
    key: bytes
    last_used: int
    media: bytes = b""           # the prompt's media digest (part of the key)
    hits: int = 0
    session_bound: int = 0       # sessions whose newest publication names this entry


class ContextCache:
    def __init__(self, program):
        self.program = program
        self.store = program.checkpoints
        self.block = int(program.page_size)
        self._entries: dict = {}         # checkpoint id -> _Entry
        self._keys: dict = {}            # key -> checkpoint ids (several only on a collision)
        self._lengths: dict = {}         # prefix length -> number of entries of that length
        self._blocks: dict = {}          # chained block digest -> entries whose tokens have it
        self._sessions: dict = {}        # session -> (publication order, checkpoint id or None)
        self._tick = 0
        self.hits = 0
        self.session_hits = 0
        self.lookups = 0
        self.tokens_reused = 0
        self.demotions = 0
        self.idle_demotions = 0          # of those, made while the Engine held no request
        self.promotions = 0
        self.evictions = 0
        self.subsumed = 0
        # wall seconds the commit and settle paths spent taking checkpoints (room made included:
        # a demotion on that path counts here and in the store's copy seconds)
        self.capture_seconds = 0.0

    # ---- settling -------------------------------------------------------------------------------
    def settle_finished(self, seq_id: int, *, keep: bool = False, session: Optional[str] = None,
                        order: int = 0, media_digest: bytes = b"") -> None:
        """A resident request reached its terminal state: its slot and pages go back. keep (a
        request that finished its answer): its continuation becomes a device checkpoint first,
        published to `session` with publication `order`, when room can be made for it."""
        cid = None
        if keep:
            t0 = time.perf_counter()
            cid = self._keep_continuation(seq_id, media_digest, session)
            self.capture_seconds += time.perf_counter() - t0
        if cid is None:
            self.program.release(seq_id)
        if session is not None and cid is not None:
            self.publish(session, order, cid)

    def settle_paused(self, resume_state) -> None:
        """A paused request ended: its Snapshot host memory (if any) goes back."""
        self.program.discard(resume_state)

    def _keep_continuation(self, seq_id: int, media_digest: bytes, session: Optional[str]
                           ) -> Optional[int]:
        """The continuation as a device checkpoint, or (a session will continue it) as host
        copies when the device has no room; None when kept nowhere."""
        tokens = self.program.continuation(seq_id)
        if not len(tokens):
            return None
        key = self._key(tokens, media_digest)
        known = self._find(key, tokens)
        if known is not None:
            self._touch(known)
            self.program.release(seq_id)
            return known
        if self._make_room(seq_id, len(tokens), at_release=True):
            cid = self.program.release(seq_id, keep_frontier=True)
        elif session is not None and self._make_host_room(
                self.store.host_cost(len(tokens)), self._rank_new(len(tokens)),
                succeeds=(tokens, media_digest, session)):
            cid = self.program.release(seq_id, keep_frontier=True, on_device=False)
        else:
            return None
        self._add(cid, tokens, key, media_digest)
        return cid

    # ---- sessions -------------------------------------------------------------------------------
    def publish(self, session: str, order: int, checkpoint: int) -> bool:
        """Bind session -> checkpoint unless a request of a later publication order already
        bound it (an older request finishing late never overwrites a newer binding). Returns
        whether it bound."""
        old = self._sessions.get(session)
        if old is not None and old[0] > order:
            return False
        self._sessions.pop(session, None)            # most recently published last
        self._sessions[session] = (order, checkpoint)
        self._entries[checkpoint].session_bound += 1
        if old is not None and old[1] in self._entries:
            self._entries[old[1]].session_bound -= 1
            if self._is_subsumed(old[1], checkpoint):
                self._remove(old[1])
                self.subsumed += 1
        while len(self._sessions) > MAX_SESSIONS:    # forget the least recently published
            name = next(iter(self._sessions))
            _, cid = self._sessions.pop(name)
            if cid in self._entries:
                self._entries[cid].session_bound -= 1
        return True

    def _is_subsumed(self, older: int, newer: int) -> bool:
        """A session's previous publication, once its newest is published: kept for nobody
        else (no other session names it, no hit but the turn that continued it) and covered
        by the newest (its exact prefix, same media). Only a prompt that leaves the
        conversation between the two ends (an edited later message) could still use it, so
        its State slot goes back now rather than being demoted later on a request's path."""
        if older == newer:
            return False
        new = self._entries[newer]
        return self._covered(older, new.token_ids, new.media, num_bound=0)

    def _covered(self, cid: int, tokens: np.ndarray, media: bytes, num_bound: int) -> bool:
        """Entry cid is an exact shorter prefix of tokens (same media), named by num_bound
        sessions and hit by at most the turn that continued it."""
        e = self._entries[cid]
        p = len(e.token_ids)
        return (e.session_bound == num_bound and e.hits <= 1 and e.media == media
                and p < len(tokens) and np.array_equal(tokens[:p], e.token_ids))

    def _succeeded_by(self, cid: int, succeeds) -> bool:
        """Whether a capture of (tokens, media, session) would subsume entry cid once published
        (`_is_subsumed`; session None: a capture no session names)."""
        tokens, media, session = succeeds
        bound = session is not None and self._sessions.get(session, (0, None))[1] == cid
        return self._covered(cid, tokens, media, num_bound=int(bound))

    # ---- prefix index ---------------------------------------------------------------------------
    def lookup(self, prompt_ids: np.ndarray, media_digest: bytes = b"",
               session: Optional[str] = None) -> tuple:
        """(checkpoint id, tokens reused) of the longest checkpoint that is a strict prefix of
        the prompt (one token must remain to prefill, for the first sampled token's logits);
        (None, 0) when none. The token ids are compared, never the digest alone. The session's
        newest checkpoint is tried first. `note_bind` counts the lookup that admission used."""
        prompt_ids = np.asarray(prompt_ids)
        n = len(prompt_ids)
        bound = self._sessions.get(session) if session is not None else None
        best = (None, 0)
        if bound is not None and bound[1] in self._entries:
            e = self._entries[bound[1]]
            p = len(e.token_ids)
            if p < n and e.key == self._key(prompt_ids[:p], media_digest) \
                    and np.array_equal(e.token_ids, prompt_ids[:p]):
                best = (bound[1], p)
                self.session_hits += 1
        lengths = sorted((p for p in self._lengths if best[1] < p < n), reverse=True)
        if not lengths:
            return best
        chain = self._chain(prompt_ids[:lengths[0]])
        for p in lengths:
            cid = self._find(self._key_from_chain(chain, prompt_ids, p, media_digest),
                             prompt_ids[:p])
            if cid is not None:
                return cid, p
        return best

    def wait_for_inflight(self, prompt_ids: np.ndarray, num_reused: int, seq_ids) -> bool:
        """Whether a prompt should wait for a resident sequence still prefilling the same
        tokens (8 sessions sent at once with one system prompt: one prefills it, the others
        bind its checkpoint). When that sequence has not reached where the prompt leaves its
        tokens (at least a page beyond what the cache gives now), it is asked for a checkpoint
        exactly there and the prompt waits; the wait ends when it lands, or when the sequence
        passes the point, pauses or ends."""
        n = len(prompt_ids)
        for sid in seq_ids:
            progress = self.program.prefill_progress(sid)
            if progress is None:
                continue
            frontier, tokens = progress
            m = min(n - 1, len(tokens))
            diff = np.flatnonzero(tokens[:m] != prompt_ids[:m])
            common = int(diff[0]) if diff.size else m
            if common - num_reused >= self.block and frontier < common \
                    and self.program.add_capture(sid, common):
                return True
        return False

    def divergence(self, prompt_ids: np.ndarray, num_reused: int) -> int:
        """Where the prompt leaves the longest run of full blocks it shares with any cached
        checkpoint (not a prefix of it: the State there was never computed), when that is at
        least a block beyond what it reuses; else 0. Checkpointing there lets the next prompt
        that shares the run (a third agent session after two with one system prompt) bind it."""
        chain = self._chain(np.asarray(prompt_ids)[:len(prompt_ids) - 1])
        k = len(chain) - 1
        while k > 0 and chain[k] not in self._blocks:
            k -= 1
        return k * self.block if k * self.block >= num_reused + self.block else 0

    def note_bind(self, checkpoint: Optional[int], num_reused: int,
                  seq_id: Optional[int] = None) -> None:
        """A bind used a lookup: with a checkpoint (a hit) that one is most recently used now,
        and a host-tier one moves back to the device from the bound sequence (seq_id) when room
        can be made."""
        self.lookups += 1
        if checkpoint is None:
            return
        self._touch(checkpoint)
        self._entries[checkpoint].hits += 1
        self.hits += 1
        self.tokens_reused += num_reused
        if seq_id is None:
            return
        info = self.store.info(checkpoint)
        if not info.on_device and self._make_room(seq_id, info.num_tokens, protect={checkpoint}):
            self.program.promote_checkpoint(checkpoint, seq_id)
            self.promotions += 1

    def bound(self, seq_id: int, prompt_ids: np.ndarray, checkpoint: Optional[int],
              num_reused: int) -> None:
        """Admission bound seq_id with what `lookup` gave (checkpoint None: a miss): count it,
        promote a host-tier hit, and ask the sequence for a checkpoint where its prompt leaves
        the cached ones (`divergence`)."""
        self.note_bind(checkpoint, num_reused, seq_id)
        split = self.divergence(prompt_ids, num_reused)
        if split:
            self.program.add_capture(seq_id, split)

    def capture_if_due(self, rows) -> None:
        """Right after a commit, for the unit's rows ((seq_id, media digest) pairs, one call per
        unit): each sequence whose frontier sits on a checkpoint position keeps it on the device
        (making room by the retention order), else on the host tier if it fits there, unless an
        equal checkpoint is cached already. One Program question finds the due ones."""
        rows = list(rows)
        due = self.program.due_captures([seq_id for seq_id, _ in rows])
        t0 = time.perf_counter()
        for seq_id, media_digest in rows:
            tokens = due.get(seq_id)
            if tokens is not None:
                self._capture(seq_id, tokens, media_digest)
        if due:
            self.capture_seconds += time.perf_counter() - t0
        self.keep_headroom()

    def keep_headroom(self, idle: bool = False, stop=None) -> None:
        """Finish the demotions whose copies are done; where they run beside the steps, start
        demoting the lowest-ranked device checkpoints while the device tier, counting what those
        under way give back, is within HEADROOM_SLOTS free slots or HEADROOM_PAGES of its page
        budget: only into free host bytes (nothing is dropped ahead of need, on either tier).
        idle (the Engine holds no request): synchronous demotions too, to IDLE_HEADROOM_PAGES,
        one at a time until stop() says a request came."""
        self.store.settle()
        if not (self.store.reads_async or idle):
            return
        share = IDLE_HEADROOM_PAGES if idle else HEADROOM_PAGES
        while not (stop is not None and stop()):
            u = self.store.usage()
            if not u.num_cache_slots or (
                    u.num_free_cache_slots + u.num_moving >= min(HEADROOM_SLOTS, u.num_cache_slots)
                    and u.device_pages_used - u.moving_pages_freed
                    <= (1 - share) * u.device_page_budget):
                return
            victims = [c for c in self._entries if self._is_leavable(c)]
            victim = min(victims, key=self._rank, default=None)
            if victim is None or u.host_bytes_used + self.store.host_cost(
                    self.store.info(victim).num_tokens) > u.host_budget_bytes:
                return
            self.store.start_demote(victim)
            self.demotions += 1
            self.idle_demotions += idle
            self.store.settle()          # (a synchronous demotion is done: its room is free)

    def _is_leavable(self, cid: int) -> bool:
        """On the device and not already on its way to the host."""
        info = self.store.info(cid)
        return info.on_device and not info.is_moving

    def _capture(self, seq_id: int, tokens: np.ndarray, media_digest: bytes) -> None:
        p = len(tokens)
        key = self._key(tokens, media_digest)
        known = self._find(key, tokens)
        if known is not None:
            self._touch(known)
            self.program.capture_checkpoint(seq_id, keep=False)
            return
        if self._make_room(seq_id, p):
            cid = self.program.capture_checkpoint(seq_id)
        elif self._make_host_room(self.store.host_cost(p), self._rank_new(p),
                                  succeeds=(tokens, media_digest, None)):
            cid = self.program.capture_checkpoint(seq_id, on_device=False)
        else:
            self.program.capture_checkpoint(seq_id, keep=False)
            return
        self._add(cid, tokens, key, media_digest)

    def reclaim(self, num_pages_short: int, protect=()) -> bool:
        """Free device pages held only by the cache until num_pages_short more pages than now
        are free (before any resident request is paused for pages, and before a bind or resume
        waits for them): lowest-ranked first, demoted to the host tier or dropped. Returns
        whether it got there."""
        num_pages = self.program.capacity().free_kv_pages + num_pages_short
        while self.program.capacity().free_kv_pages < num_pages:
            victims = [c for c in self._entries if c not in protect and self._is_leavable(c)
                       and self.store.info(c).device_pages_freed > 0]
            if not victims:
                if self.store.settle(wait=True):     # the demotions under way give theirs
                    continue
                return False
            self._evict_device(min(victims, key=self._rank), protect)
        return True

    def clear_prefix_cache(self) -> None:
        for cid in list(self._entries):
            self._remove(cid)
        self._sessions.clear()

    # ---- retention ------------------------------------------------------------------------------
    def _rank(self, cid: int) -> float:
        info = self.store.info(cid)
        e = self._entries[cid]
        held = info.host_bytes if not info.on_device else \
            self.store.host_cost(info.num_tokens)         # bytes of its whole coverage
        return info.num_tokens / held * (1 + e.hits) * (2.0 if e.session_bound else 1.0) \
            / (1 + self._tick - e.last_used)

    def _rank_new(self, num_tokens: int) -> float:
        return num_tokens / self.store.host_cost(num_tokens)

    def _make_room(self, seq_id: int, num_tokens: int, *, at_release: bool = False,
                   protect=()) -> bool:
        """Make the device tier able to take a capture of [0, num_tokens) of the sequence: a
        free cache slot, the free pages it takes, and device budget room for the pages it adds
        (asked again after each eviction: an evicted entry may have shared the sequence's
        pages, which the capture then adds)."""
        if not self.store.usage().num_cache_slots:
            return False
        while True:
            room = self.program.capture_room(seq_id, num_tokens, at_release=at_release)
            usage = self.store.usage()
            if room.is_slot_free and self.program.capacity().free_kv_pages >= room.num_pages_taken \
                    and usage.device_pages_used + room.num_pages_added <= usage.device_page_budget:
                return True
            victims = [c for c in self._entries if c not in protect and self._is_leavable(c)]
            if not victims:
                if self.store.settle(wait=True):     # the demotions under way give theirs
                    continue
                return False
            self._evict_device(min(victims, key=self._rank), protect)

    def _evict_device(self, cid: int, protect=()) -> None:
        """Demote to the host tier when it fits there (dropping lower-ranked host checkpoints,
        never a protected one, to make it fit), else drop."""
        tokens = self.store.info(cid).num_tokens
        if self._make_host_room(self.store.host_cost(tokens), self._rank(cid), protect):
            self.store.demote(cid)
            self.demotions += 1
        else:
            self._remove(cid)

    def _make_host_room(self, cost: int, rank: float, protect=(), succeeds=None) -> bool:
        """Free host bytes for a checkpoint of `rank` costing cost, dropping lower-ranked host
        checkpoints; with succeeds (a capture's (tokens, media, session)), the host checkpoints
        it would subsume go first whatever their rank: a chat's previous turn, a hit each
        turn, would otherwise outrank and so lock out every newer, longer turn."""
        budget = self.store.usage().host_budget_bytes
        if cost > budget:
            return False
        while self.store.usage().host_bytes_used + cost > budget:
            host = [c for c in self._entries
                    if c not in protect and not self.store.info(c).on_device]
            succeeded = [c for c in host if succeeds is not None
                         and self._succeeded_by(c, succeeds)]
            victim = min(succeeded or host, key=self._rank, default=None)
            if victim is None or (not succeeded and self._rank(victim) > rank):
                return False
            self._remove(victim)
            self.subsumed += bool(succeeded)
        return True

    # ---- index bookkeeping ----------------------------------------------------------------------
    def _chain(self, token_ids: np.ndarray) -> list:
        """chain[k] identifies token_ids[:k * block] (chained digests of full blocks)."""
        chain = [b""]
        for start in range(0, len(token_ids) - self.block + 1, self.block):
            chain.append(_digest(token_ids[start:start + self.block], chain[-1]))
        return chain

    def _key_from_chain(self, chain: list, token_ids: np.ndarray, p: int, media: bytes) -> bytes:
        full = p // self.block
        return _digest(token_ids[full * self.block:p], chain[full] + bytes(media))

    def _key(self, token_ids: np.ndarray, media_digest: bytes = b"") -> bytes:
        return self._key_from_chain(self._chain(token_ids), token_ids, len(token_ids),
                                    media_digest)

    def _find(self, key: bytes, token_ids: np.ndarray) -> Optional[int]:
        """The entry of exactly these tokens under key (equal digests of other tokens, a
        collision, are told apart by the comparison)."""
        for cid in self._keys.get(key, ()):
            if np.array_equal(self._entries[cid].token_ids, token_ids):
                return cid
        return None

    def _touch(self, cid: int) -> None:
        self._tick += 1
        self._entries[cid].last_used = self._tick

    def _add(self, cid: int, tokens: np.ndarray, key: bytes, media: bytes = b"") -> None:
        self._tick += 1
        self._entries[cid] = _Entry(np.array(tokens, np.int32), key, self._tick, bytes(media))
        for d in self._chain(tokens)[1:]:
            self._blocks[d] = self._blocks.get(d, 0) + 1
        self._keys.setdefault(key, []).append(cid)
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1

    def _remove(self, cid: int) -> None:
        e = self._entries.pop(cid)
        for d in self._chain(e.token_ids)[1:]:
            self._blocks[d] -= 1
            if not self._blocks[d]:
                del self._blocks[d]
        self._keys[e.key].remove(cid)
        if not self._keys[e.key]:
            del self._keys[e.key]
        p = len(e.token_ids)
        self._lengths[p] -= 1
        if not self._lengths[p]:
            del self._lengths[p]
        self.store.drop(cid)
        self.evictions += 1

    def check_invariants(self) -> None:
        """The index and the Program's checkpoints name the same entries, with the same
        coverage; keys, lengths and session bindings agree with the entries."""
        ids = sorted(self._entries)
        if ids != sorted(self.store.ids()):
            raise ProgramError(f"prefix index {ids} != program checkpoints "
                               f"{sorted(self.store.ids())}")
        lengths: dict = {}
        for cid, e in self._entries.items():
            if cid not in self._keys.get(e.key, ()) or \
                    self.store.info(cid).num_tokens != len(e.token_ids):
                raise ProgramError(f"checkpoint {cid}: index key or coverage out of step")
            lengths[len(e.token_ids)] = lengths.get(len(e.token_ids), 0) + 1
        bound: dict = {}
        for _, cid in self._sessions.values():
            if cid in self._entries:
                bound[cid] = bound.get(cid, 0) + 1
        if sum(self._blocks.values()) != sum(len(e.token_ids) // self.block
                                             for e in self._entries.values()):
            raise ProgramError("prefix index block digests out of step with the entries")
        if lengths != self._lengths or \
                sum(len(v) for v in self._keys.values()) != len(self._entries) or \
                any(e.session_bound != bound.get(c, 0) for c, e in self._entries.items()):
            raise ProgramError("prefix index lengths, keys or session bindings out of step")

    def stats(self) -> dict:
        return {"prefix_cache_hits": self.hits, "prefix_cache_lookups": self.lookups,
                "prefix_cache_tokens_reused": self.tokens_reused,
                "prefix_cache_demotions": self.demotions,
                "prefix_cache_idle_demotions": self.idle_demotions,
                "prefix_cache_promotions": self.promotions,
                "prefix_cache_evictions": self.evictions,
                "prefix_cache_subsumed": self.subsumed,
                "prefix_cache_capture_seconds": self.capture_seconds}
