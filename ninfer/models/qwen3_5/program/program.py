"""The Program: physical truth of one resident model (KV pages, State slots, units, pause/resume).

Only the Engine worker calls it. A sequence's tokens and its committed frontier live here
(token_buf, its Sequence record: sequences.py); Units (`next unit` of a sequence, derived from
that arithmetic alone, in sequences.py):
    prefill  no token generated yet: the next <= prefill_chunk prompt tokens; the chunk that
             reaches the end of the prompt samples the first token
    replay   resumed after a pause: re-run accepted history in chunks up to num_tokens - 1
             (batch_invariant: the prompt in its prefill's chunks, then one unit per generated
             token, as decode ran them)
    decode   frontier == num_tokens - 1: run the last accepted token, sample one more
    control  a decode-ready row given forced tokens F by the caller (the Frontend): run the last
             accepted token + F[:-1], produce F without sampling (no RNG, no logprobs)

Every unit runs under a reservation (`reserve_units`) and yields a PendingBatch that must be
consumed whole by `commit(decisions)` or `abort_pending()`. Sampling randomness is keyed by
(seed, position), so there is no RNG state to roll back.

The Program keeps the public API and the pools; it delegates the unit arithmetic (sequences.py),
the host Snapshot ledger and images (snapshots.py), packing rows and reading results back
(packing.py), checkpoints (checkpoint_store.py) and speculative units (speculative.py).
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Optional

import numpy as np

from ....contracts import (Capacity, CaptureRoom, ForwardBatch, PendingBatch, ProgramError,
                           ResumeState, ReadyStep, RowPlan, RowResult, RowView, SampleRow,
                           SamplingSpec, UnitPlan)
from ..memory_plan import plan_cache_slots, plan_pools, snapshot_slots, state_slot_bytes
from . import packing
from .checkpoint_store import CheckpointStore, release_image
from .inflight import InFlightUnit
from .page_ledger import PagePool, SlotPool, pages_for
from .sequences import (Sequence, Unit, UnitRules, capture_due, capture_positions,
                        check_decision, row_kind)
from .snapshots import SnapshotLedger, capture_image, host_bytes, install_image
from .speculative import Speculator

# distinguishes Programs in the device sampler's prompt cache keys (it lives on the model, which
# may outlive a Program or serve several; sequence ids restart in each Program)
_PROGRAM_IDS = itertools.count(1)


class Program:
    def __init__(self, model, options, *, drafter=None):
        """drafter: a drafter of the same model to decode speculatively with (an MTP drafter, or
        a DFlash drafter; program/speculative.py)."""
        text = model.config.text
        self.model = model
        self.vocab_size = int(text.vocab_size)
        self.page_size = int(options.page_size)
        self.max_context = int(options.max_context)
        self.prefill_chunk = int(options.prefill_chunk)
        self.num_slots = int(options.max_concurrency)
        # pool sizes: memory_plan.py, the arithmetic the CUDA model and the CLI use too
        plan = plan_pools(options, held_kv_pages=model.max_kv_pages)
        self.max_pages_per_seq, num_pages = plan.max_pages_per_seq, plan.num_kv_pages
        # the one validation of a batch is here, where it is built: the backend trusts it
        # unless the debug option asks it to check again
        model.checks_batches = bool(options.debug_checks)
        self.kv = model.new_kv_pool(num_pages, self.page_size)
        # speculative decoding: the drafter's KV joins the pool as one more layer (so every page
        # copy carries it) before anything sizes a page; speculative.py runs the units
        self.speculator = None if drafter is None else \
            Speculator(drafter, options.num_draft_tokens, self.kv,
                       adaptive=options.draft_policy == "adaptive",
                       snapshots=bool(getattr(model, "verify_snapshots", False)))
        self.is_speculative = self.speculator is not None
        # decode rows and a prefill chunk as one unit (one forward: the chunk's weight reads
        # serve the decode rows too), where the backend takes such batches; not with drafts
        # (verify rows are their own unit) nor batch_invariant (a decode row's GEMM shape
        # would depend on whether a chunk runs beside it)
        self.merges_units = bool(model.mixed_batches) and not self.is_speculative \
            and not options.batch_invariant
        page_bytes = host_bytes(self.kv.read_pages([0]))
        # context cache: State checkpoints live in cache slots after the sequences' (as many
        # as the pool's bytes give it, within what the backend's memory holds), its pages within
        # a share of the pool (docs/architecture.md "Context cache")
        share = options.prefix_cache_device_share
        num_cache_slots = plan_cache_slots(
            options, num_pages, held_state_slots=model.max_state_slots, kv_page_bytes=page_bytes,
            state_bytes=state_slot_bytes(model.config.text))
        # a speculative verify's per-token State snapshots after those (CUDA; speculative.py)
        num_snap_slots = snapshot_slots(options) if self.is_speculative \
            and self.speculator.snapshots else 0
        self.state = model.new_state_pool(self.num_slots + num_cache_slots + num_snap_slots)
        if num_snap_slots:
            self.speculator.use_snapshot_slots(self.num_slots + num_cache_slots)
        self.pages = PagePool(num_pages, self.page_size, self.num_slots, self.max_pages_per_seq)
        self.slots = SlotPool(self.num_slots)
        self.checkpoint_interval = int(options.checkpoint_interval)
        self.token_buf = np.zeros((self.num_slots, self.max_context), np.int32)
        state_bytes = host_bytes(self.state.read(0))
        self.snapshots = SnapshotLedger(options.host_snapshot_bytes, page_bytes, state_bytes,
                                        self.page_size)
        # checkpoints: their own host budget, so a cache entry never blocks a pause; their host
        # images keep the pool's bytes (start_read_pages: bf16 bits on CUDA, half a Snapshot's)
        probe = self.kv.start_read_pages([0]).result()
        cache_page_bytes = host_bytes(probe)
        release_image(probe)                            # (CUDA's host tier rows)
        self.checkpoints = CheckpointStore(
            self.kv, self.state, self.pages, SlotPool(num_cache_slots, first=self.num_slots),
            page_bytes=cache_page_bytes, state_bytes=state_bytes,
            host_budget_bytes=options.prefix_cache_budget_bytes,
            device_page_budget=int(share * num_pages) if num_cache_slots else 0)
        self._seqs: dict = {}
        self._pending: Optional[PendingBatch] = None
        self._inflight: Optional[InFlightUnit] = None     # launched, not yet collected
        self._ahead: Optional[InFlightUnit] = None        # launched ahead of _inflight
        # the pending unit's rows' hidden states when it is a plain speculative step (collect
        # -> commit: the drafter's feed)
        self._step_hidden: Optional[np.ndarray] = None
        self._next_id = 0
        self._uid = next(_PROGRAM_IDS)
        self.rules = UnitRules(self.prefill_chunk, self.max_context,
                               replays_as_run=bool(options.batch_invariant))

    def warm_up(self) -> None:
        """Before serving: the backend builds what it would otherwise build on first use (CUDA:
        the decode graph of every B = 1..max_concurrency) and runs a step through each. The pools
        hold nothing yet, so what the steps write is overwritten before it is read."""
        self._no_pending("warm_up")
        t0 = time.perf_counter()
        self.model.warm_up(self.kv, self.state)
        self.warmup_seconds = time.perf_counter() - t0

    # ---- capacity queries (check / act pairs) ---------------------------------------------------
    @property
    def host_budget_bytes(self) -> int:
        return self.snapshots.budget_bytes

    @property
    def host_bytes_used(self) -> int:
        return self.snapshots.bytes_used

    @property
    def host_bytes_free(self) -> int:
        return self.snapshots.bytes_free

    def capacity(self) -> Capacity:
        return Capacity(self.pages.num_free, self.slots.num_free)

    def snapshot_cost(self, seq_id: int) -> int:
        """Host bytes a Snapshot pause of this sequence would hold now."""
        return self.snapshots.cost(self._seqs[seq_id].num_computed_tokens)

    def can_bind(self, num_prompt_tokens: int, num_reused: int = 0,
                 checkpoint: Optional[int] = None) -> bool:
        """A slot and the pages of the first prefill chunk (after a reused prefix) are free."""
        return self.slots.num_free > 0 and \
            self.pages_short_to_bind(num_prompt_tokens, num_reused, checkpoint) == 0

    def pages_short_to_bind(self, num_prompt_tokens: int, num_reused: int = 0,
                            checkpoint: Optional[int] = None) -> int:
        """Pages the first prefill chunk lacks (binding `checkpoint`, which covers num_reused
        tokens: its full pages on the device come shared, not from the free pool)."""
        first = num_reused + min(self.prefill_chunk, num_prompt_tokens - num_reused)
        need = pages_for(first, self.page_size) if checkpoint is None \
            else self.checkpoints.bind_pages_needed(checkpoint, first)
        return max(0, need - self.pages.num_free)

    def can_resume(self, rs: ResumeState) -> bool:
        return self.slots.num_free > 0 and self.pages_short_to_resume(rs) == 0

    def pages_short_to_resume(self, rs: ResumeState) -> int:
        return max(0, pages_for(self.rules.resume_coverage(rs), self.page_size)
                   - self.pages.num_free)

    # ---- sequence lifetime ----------------------------------------------------------------------
    def encode_media(self, prompt_ids: np.ndarray, media, positions):
        """The vision tower's output for a prompt's media, as `bind` takes it (encoded_media).
        Touches no Program state: the EngineCore runs it on a thread of its own
        (runtime/media_encoder.py) while the worker cycles."""
        return self.model.encode_media(prompt_ids, media, positions)

    @property
    def accepts_media(self) -> bool:
        """The model runs a vision tower: bind takes image / video prompts."""
        return self.model.encode_media is not None     # declared by every Model

    def bind(self, prompt_ids: np.ndarray, spec: SamplingSpec, *, capture_at: int = 0,
             checkpoint: Optional[int] = None, media=None, encoded_media=None) -> int:
        """A fresh sequence. capture_at > 0 (the prompt's reusable boundary): prefill chunks end
        exactly there and at every checkpoint_interval tokens before it, so the context cache
        can take a checkpoint at each (`capture_checkpoint`). checkpoint: install that one (its
        tokens a strict prefix of prompt_ids) and start prefill after it.
        media: (Frontend media, MRoPE positions [3, n]) of a vision prompt: encoded here, once,
        unless encoded_media (`encode_media`'s result for them, made beforehand) is given."""
        n = len(prompt_ids)
        if media is not None and not self.accepts_media:
            raise ProgramError("bind: media need a vision model")
        encoded = encoded_media if encoded_media is not None or media is None else \
            self.encode_media(prompt_ids, *media)
        if not 1 <= n < self.max_context:
            raise ProgramError(f"bind: prompt of {n} tokens outside [1, {self.max_context})")
        ckpt = None if checkpoint is None else self.checkpoints.entries[checkpoint]
        reused = 0 if ckpt is None else ckpt.num_tokens
        if ckpt is not None and not (reused < n and np.array_equal(ckpt.token_ids,
                                                                    prompt_ids[:reused])):
            raise ProgramError(f"bind: checkpoint {checkpoint} is not a strict prefix of the prompt")
        seq = self._new_sequence(n, n, reused, spec)
        seq.media = encoded
        self.token_buf[seq.slot, :n] = prompt_ids
        end = min(int(capture_at), n) if self.checkpoints.is_enabled else 0
        seq.captures = capture_positions(self.checkpoint_interval, end, reused)
        if ckpt is not None:
            self.checkpoints.install(checkpoint, seq.slot)
        return seq.seq_id

    # ---- context cache (runtime/context_cache.py keeps the index; `checkpoints` holds the copies)
    # `self.checkpoints` (CheckpointStore) answers info / ids / usage / host_cost / demote / drop;
    # what needs a sequence's pages and slot is here: due_captures, capture_room,
    # capture_checkpoint, promote_checkpoint, continuation, release(keep_frontier=True),
    # prefill_progress, add_capture.
    def due_captures(self, seq_ids) -> dict:
        """seq_id -> the tokens [0, p) of the checkpoint position p its frontier sits on exactly
        now, for the sequences that have one (`capture_checkpoint` takes it or clears it)."""
        due = {}
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            p = capture_due(seq)
            if p:
                due[seq_id] = self.token_buf[seq.slot, :p].copy()
        return due

    def capture_room(self, seq_id: int, num_tokens: int, *, at_release: bool = False
                     ) -> CaptureRoom:
        """What a device capture of [0, num_tokens) of this sequence needs now."""
        seq = self._seqs[seq_id]
        row = self.pages.block_tables[seq.slot, :pages_for(num_tokens, self.page_size)]
        held = set(self.checkpoints.held_pages().tolist())
        adds = sum(1 for q in row[:num_tokens // self.page_size] if int(q) not in held)
        partial = num_tokens % self.page_size != 0
        return CaptureRoom(self.checkpoints.slots.num_free > 0, int(partial and not at_release),
                           adds + partial)

    def prefill_progress(self, seq_id: int) -> tuple:
        """(frontier, the prompt's tokens) of a sequence still prefilling its prompt (no
        Replay), or None."""
        seq = self._seqs[seq_id]
        if seq.num_tokens > seq.num_prompt_tokens or seq.num_computed_tokens < seq.replay_until \
                or seq.is_unusable:
            return None
        return seq.num_computed_tokens, self.token_buf[seq.slot, :seq.num_prompt_tokens]

    def add_capture(self, seq_id: int, position: int) -> bool:
        """Ask a prefilling sequence for one more checkpoint position (where a waiting prompt
        leaves its prompt): a prefill chunk will end there. False when it is past it."""
        seq = self._seqs[seq_id]
        if not self.checkpoints.is_enabled or not \
                seq.num_computed_tokens < position <= seq.num_prompt_tokens:
            return False
        seq.captures = sorted(set(seq.captures or ()) | {int(position)})
        return True

    def capture_checkpoint(self, seq_id: int, *, keep: bool = True,
                           on_device: bool = True) -> Optional[int]:
        """Checkpoint [0, frontier) of the sequence: one real execution's exact coverage, on the
        device (pages by reference, State slot copy; the caller made room: `capture_room`) or
        as host copies. keep=False only clears the pending capture. Returns the checkpoint id."""
        self._no_pending("capture_checkpoint")
        seq = self._seqs[seq_id]
        p = capture_due(seq)
        if p:
            seq.captures.pop(0)
        if not p or not keep:
            return None
        cid = self._new_id()
        if self.speculator is not None:     # the drafter's KV layer complete in the copy
            self.speculator.settle(self, seq)
        capture = self.checkpoints.capture_device if on_device else self.checkpoints.capture_host
        capture(cid, self.token_buf[seq.slot, :p], self.pages.block_tables[seq.slot], seq.slot)
        return cid

    def continuation(self, seq_id: int) -> np.ndarray:
        """The tokens a finished sequence's State and KV cover: [0, frontier), i.e. prompt +
        accepted answer without its last token (sampled, never run: for a stop it is the
        end-of-turn token, which the next turn's rendering writes itself). Empty when the
        sequence cannot give a checkpoint."""
        seq = self._seqs[seq_id]
        if seq.is_unusable:
            return np.zeros(0, np.int32)
        return self.token_buf[seq.slot, :seq.num_computed_tokens].copy()

    def release(self, seq_id: int, *, keep_frontier: bool = False,
                on_device: bool = True) -> Optional[int]:
        """The sequence ends; its slot and pages go back. keep_frontier: first keep
        `continuation(seq_id)` as a checkpoint: on the device taking over its pages (no copy:
        nobody writes them any more) and copying its State to a cache slot, or (on_device=False)
        as host copies; returns its id."""
        self._no_pending("release")
        seq = self._seqs[seq_id]
        cid = None
        if self.speculator is not None:     # (a kept continuation: its drafter KV complete)
            if keep_frontier and not seq.is_unusable:
                self.speculator.settle(self, seq)
            self.speculator.forget(seq_id)
        if keep_frontier:
            tokens = self.continuation(seq_id)
            if not len(tokens) or (on_device and not self.checkpoints.slots.num_free):
                raise ProgramError(f"release: sequence {seq_id} cannot keep its continuation")
            cid = self._new_id()
            row = self.pages.block_tables[seq.slot]
            if on_device:
                self.checkpoints.capture_device(cid, tokens, row, seq.slot, own_partial=True)
            else:
                self.checkpoints.capture_host(cid, tokens, row, seq.slot)
        del self._seqs[seq_id]
        self.pages.shrink(seq.slot, 0)
        self.slots.give(seq.slot)
        return cid

    def promote_checkpoint(self, checkpoint: int, seq_id: int) -> None:
        """Move a host checkpoint to the device from the sequence that just installed it."""
        seq = self._seqs[seq_id]
        if seq.num_computed_tokens != self.checkpoints.entries[checkpoint].num_tokens:
            raise ProgramError(f"promote: sequence {seq_id} moved past checkpoint {checkpoint}")
        self.checkpoints.promote(checkpoint, self.pages.block_tables[seq.slot], seq.slot)

    def pause(self, seq_id: int, *, allow_snapshot: bool = True) -> ResumeState:
        """Pause at the committed boundary; frees the slot and pages. Snapshot when host budget
        allows (and there is something computed), else Replay."""
        self._no_pending("pause")
        seq = self._seqs[seq_id]
        if seq.is_unusable:
            raise ProgramError(f"pause: sequence {seq_id} lost its State in a rollback")
        tokens = self.token_buf[seq.slot, :seq.num_tokens].copy()
        frontier = seq.num_computed_tokens
        num_pages = pages_for(frontier, self.page_size)
        cost = self.snapshots.cost(frontier)
        common = dict(token_ids=tokens, num_prompt_tokens=seq.num_prompt_tokens,
                      num_computed_tokens=frontier, spec=seq.spec, media=seq.media)
        if allow_snapshot and frontier > 0 and self.snapshots.fits(cost):
            sid = self._new_id()
            if self.speculator is not None:
                self.speculator.settle(self, seq)
            image = capture_image(self.kv, self.state, self.pages.pages_of(seq.slot)[:num_pages],
                                  seq.slot)
            rs = ResumeState("snapshot", snapshot_id=sid, host_bytes=cost, **image, **common)
            self.snapshots.hold(sid, cost)
        else:
            rs = ResumeState("replay", **common)
        self.release(seq_id)
        return rs

    def revoke_snapshot(self, rs: ResumeState) -> ResumeState:
        """Give a Snapshot's host memory back; the request stays resumable by Replay."""
        self.discard(rs)
        return ResumeState("replay", token_ids=rs.token_ids, num_prompt_tokens=rs.num_prompt_tokens,
                           num_computed_tokens=rs.num_computed_tokens, spec=rs.spec,
                           media=rs.media)

    def discard(self, rs: ResumeState) -> None:
        """A paused request ends: drop what its ResumeState holds here."""
        if rs.kind == "snapshot":
            self.snapshots.drop(rs.snapshot_id)

    def resume(self, rs: ResumeState) -> int:
        """Bind a paused request again with the full resume permit: pages to rebuild its old
        frontier plus its first real new unit, held until that unit commits."""
        self._no_pending("resume")
        if not self.can_resume(rs):
            raise ProgramError("resume without capacity (the caller must check can_resume)")
        coverage = self.rules.resume_coverage(rs)
        is_snapshot = rs.kind == "snapshot"
        self.discard(rs)
        seq = self._new_sequence(rs.num_prompt_tokens, rs.num_tokens,
                                 rs.num_computed_tokens if is_snapshot else 0, rs.spec)
        self.token_buf[seq.slot, :rs.num_tokens] = rs.token_ids
        seq.media = rs.media
        seq.replay_until = 0 if is_snapshot else rs.num_computed_tokens
        seq.protected_tokens = coverage
        if not self.pages.grow(seq.slot, coverage):
            raise ProgramError("resume: pages vanished between check and act")
        if is_snapshot:
            n = pages_for(rs.num_computed_tokens, self.page_size)
            install_image(self.kv, self.state, self.pages.pages_of(seq.slot)[:n], seq.slot,
                          rs.kv_pages, rs.state_image)
        return seq.seq_id

    # ---- units ----------------------------------------------------------------------------------
    def plan_view(self, seq_ids) -> list:
        """One RowView per sequence: its next unit's kind, protection and whether it samples
        (the EngineCore's one planning question per cycle)."""
        views = []
        for sid in seq_ids:
            seq = self._seqs[sid]
            unit = self.rules.next_unit(seq)
            views.append(RowView(sid, row_kind(seq, unit), seq.protected_tokens > 0,
                                 unit.is_sampling))
        return views

    def unit_kind(self, seq_id: int) -> str:
        """'prefill', 'replay' or 'decode': what the sequence's next unit is."""
        return self.plan_view([seq_id])[0].kind

    def is_protected(self, seq_id: int) -> bool:
        return self._seqs[seq_id].protected_tokens > 0

    def has_protected(self) -> bool:
        """Some sequence is in protected resume (holds its resume permit)."""
        return any(seq.protected_tokens > 0 for seq in self._seqs.values())

    def reserve_units(self, seq_ids, *, forced: Optional[dict] = None,
                      stop_at_short: bool = False) -> list:
        """Grant each row the pages of its next unit, all or nothing per row; rows are independent
        (one lacking pages does not stop the others). Returns one bool per row. `forced` maps a
        decode-ready sequence to the tokens of a control unit. stop_at_short: stop at the first
        row that lacks pages (its False is the list's last entry), so the caller can make room
        for it before the rows after it reserve, as one call per row would."""
        granted = []
        for sid in seq_ids:
            seq = self._seqs[sid]
            unit = self.rules.unit_of(seq, forced)
            granted.append(self.pages.grow(seq.slot, seq.num_computed_tokens + unit.num_new_tokens))
            if stop_at_short and not granted[-1]:
                break
        return granted

    def execute(self, seq_ids, *, forced: Optional[dict] = None, keep_rollback: bool = True,
                masks: Optional[dict] = None,
                draft_masks: Optional[Callable[[int, tuple], list]] = None) -> PendingBatch:
        """collect(launch(plan)) of the plan these arguments spell: forced and masks map seq_id
        -> a control unit's tokens / the bool token mask of its next sampled token."""
        forced, masks = forced or {}, masks or {}
        rows = tuple(RowPlan(s, forced.get(s), masks.get(s)) for s in seq_ids)
        return self.collect(self.launch(UnitPlan(rows, keep_rollback, draft_masks)))

    def launch(self, plan: UnitPlan) -> InFlightUnit:
        """Start the next unit of every row as one model call; rows must hold their reservation.

        A row's mask (constrained decoding) applies to its next sampled token; a backend with
        `sample` applies it on the device, otherwise the host does (in `collect`). Speculative
        decoding runs the whole unit here (drafts, one verify forward, per-position sampling).

        keep_rollback=False skips the State backup (a host copy per row, costly on a device):
        a row then cancelled or aborted cannot continue and may only be released (the Engine
        releases every cancelled row at once). The unit must be collected before anything else
        is asked of the Program."""
        self._no_pending("launch")
        seqs = [self._seqs[s] for s in plan.seq_ids]
        if not seqs or len({s.slot for s in seqs}) != len(seqs):
            raise ProgramError(f"execute: bad membership {plan.seq_ids}")
        if any(s.is_unusable for s in seqs):
            raise ProgramError("execute: a row lost its State in a rollback without backup")
        forced = {r.seq_id: r.forced for r in plan.rows if r.forced}
        units = [self.rules.unit_of(s, forced) for s in seqs]
        for seq, unit in zip(seqs, units):
            if self.pages.can_grow(seq.slot, seq.num_computed_tokens + unit.num_new_tokens) != 0:
                raise ProgramError(f"execute: sequence {seq.seq_id} runs without its reservation")
            # F[:-1] goes after the committed tokens, where packing reads it (provisional)
            self.token_buf[seq.slot, seq.num_tokens:seq.num_tokens + len(unit.forced) - 1] = \
                unit.forced[:-1]
        masks = [row.mask if unit.is_sampling else None for row, unit in zip(plan.rows, units)]
        plain = self.speculator is not None and \
            self.speculator.runs_plain(self, seqs, units, masks)
        if self.speculator is not None and not plain:
            # drafts, one verify forward, per-position sampling
            pending = self.speculator.execute(self, seqs, units, masks, plan.keep_rollback,
                                              plan.draft_masks)
            self._inflight = InFlightUnit(seqs, units, masks, [], "speculative", pending=pending)
            return self._inflight
        backups = [self.state.read(s.slot) if plan.keep_rollback else None for s in seqs]
        self._inflight = self._start_step(seqs, units, masks, backups, keep_hidden=plain)
        return self._inflight

    def _keep_hidden(self) -> dict:
        """launch_tokens' keywords of a speculative plain step: its rows' drafter feed kept
        (the speculator's kind: final-normed hidden, or a DFlash drafter's features)."""
        return {"keep_hidden": True, **self.speculator.feed_kind()}

    def _start_step(self, seqs, units, masks, backups, keep_hidden: bool = False) -> InFlightUnit:
        """The one place a unit's backend call starts. The device token paths return at once
        (`launch_tokens`: the GPU runs while the EngineCore does host work, `collect` waits);
        host-sampled logits are computed here (`ReadyStep`). keep_hidden: a speculative
        Program's plain decode step (Speculator.runs_plain: a device token path), whose
        step keeps every row's hidden state for the drafter."""
        batch = self.pack_rows(seqs, units)
        media = packing.media_rows(seqs, units)
        # media rows replace embeddings: only forward takes them (not the device token paths)
        path = (None if media is not None else
                packing.device_path(self.model, seqs, units, masks)) or "logits"
        extra = self._keep_hidden() if keep_hidden else {}
        if keep_hidden and path == "logits":
            raise ProgramError("a plain speculative step on the host-sampling path")
        if path == "greedy":
            step = self.model.launch_tokens(batch, self.kv, self.state, **extra)
        elif path == "sample":
            step = self.model.launch_tokens(batch, self.kv, self.state,
                                            packing.sample_requests(self.token_buf, self._uid,
                                                                    seqs, units, masks),
                                            **extra)
        elif media is not None:
            step = ReadyStep(self.model.forward(batch, self.kv, self.state, media=media))
        else:
            step = ReadyStep(self.model.forward(batch, self.kv, self.state))
        return InFlightUnit(seqs, units, masks, backups, path, step, keeps_hidden=keep_hidden)

    # ---- a decode step launched before the one in flight is collected (the pipelined decode) ---
    def _can_run_ahead(self, inflight: InFlightUnit) -> bool:
        """Whether inflight's rows' next decode step may start now: the backend chains token
        steps on its device (`Model.chains_token_steps`), the unit is the one in flight with
        nothing ahead of it, on a device token path, and every row is a decode row whose token
        comes from its logits, seed and position alone (greedy or sampled; no mask, penalty,
        bias or logprobs, no forced tokens, no checkpoint position due) with room for one more
        token in max_context and its pages."""
        if not self.model.chains_token_steps or inflight is not self._inflight \
                or self._ahead is not None or self._pending is not None \
                or inflight.path not in ("greedy", "sample") \
                or (self.speculator is not None and not inflight.keeps_hidden):
            return False
        need = 0
        for seq, unit, mask in zip(inflight.seqs, inflight.units, inflight.masks):
            if unit.forced or unit.is_replay or not unit.is_sampling or mask is not None \
                    or unit.num_new_tokens != 1 or seq.num_computed_tokens != seq.num_tokens - 1 \
                    or not seq.spec.samples_from_logits_alone or seq.captures \
                    or seq.num_tokens + 1 >= self.max_context:
                return False
            extra = self.pages.can_grow(seq.slot, seq.num_computed_tokens + 2)
            if extra < 0:
                return False
            need += extra
        # (last: a speculative Program's policy spends its choice of k for the next unit here)
        return need <= self.pages.num_free and (
            self.speculator is None or self.speculator.runs_plain_ahead(inflight.seqs))

    def launch_ahead(self, inflight: InFlightUnit) -> Optional[InFlightUnit]:
        """Start the next decode step of inflight's rows (the same rows, in order) before
        inflight is collected, each row as if it accepted the one token inflight samples: the
        backend feeds those tokens to this step on its device (`launch_tokens(after=...)`),
        and its pages are mapped here. None (nothing launched) where a row or the backend
        does not allow it (`_can_run_ahead`). The EngineCore then collects and commits
        inflight; a row whose request ends there accepts nothing of this step
        (RowDecision.is_discarded: its frontier moves past the token the step ran)."""
        if not self._can_run_ahead(inflight):
            return None
        seqs = inflight.seqs
        for seq in seqs:
            if not self.pages.grow(seq.slot, seq.num_computed_tokens + 2):
                raise ProgramError("launch_ahead: pages vanished between check and act")
        batch = packing.pack_rows(self.token_buf, self.pages.block_tables, self.page_size, seqs,
                                  inflight.units, ahead=1)
        none = [None] * len(seqs)
        rows = None if inflight.path == "greedy" else packing.sample_requests(
            self.token_buf, self._uid, seqs, inflight.units, none, ahead=1)
        extra = self._keep_hidden() if inflight.keeps_hidden else {}
        step = self.model.launch_tokens(batch, self.kv, self.state, rows, after=inflight.step,
                                        **extra)
        self._ahead = InFlightUnit(seqs, inflight.units, none, none, inflight.path, step,
                                   keeps_hidden=inflight.keeps_hidden)
        return self._ahead

    def collect(self, inflight: InFlightUnit) -> PendingBatch:
        """The launched unit's PendingBatch (to be consumed whole by commit or abort_pending)."""
        if inflight is not self._inflight:
            raise ProgramError("collect: not the unit in flight")
        # a unit launched ahead of this one (launch_ahead) is the one in flight now
        self._inflight, self._ahead = self._ahead, None
        if inflight.pending is not None:
            self._pending = inflight.pending
            return self._pending
        seqs, units, masks = inflight.seqs, inflight.units, inflight.masks
        out = inflight.step.collect()
        if inflight.path == "greedy":
            rows = packing.token_rows(seqs, units, out, self.vocab_size, "decode_greedy")
        elif inflight.path == "sample":
            rows = packing.token_rows(seqs, units, out, self.vocab_size, "sample")
        else:
            if out.shape != (len(seqs), self.vocab_size):
                raise ProgramError(f"model.forward returned {out.shape}, "
                                   f"expected {(len(seqs), self.vocab_size)}")
            rows = tuple(self.sample_row(seq, unit, out[r], masks[r])
                         for r, (seq, unit) in enumerate(zip(seqs, units)))
        self._pending = PendingBatch(rows, inflight.backups, self._new_id())
        # a plain speculative step: its rows' hidden states, for the drafter at commit
        self._step_hidden = inflight.step.hidden() if inflight.keeps_hidden else None
        return self._pending

    def commit(self, pending: PendingBatch, decisions) -> None:
        """Accept each row's decided prefix: advance frontier, append accepted tokens; cancelled
        rows roll back to their committed boundary. Consumes the batch."""
        self._check_current(pending)
        decisions = list(decisions)
        if len(decisions) != len(pending.rows):
            raise ProgramError(f"commit: {len(decisions)} decisions for {len(pending.rows)} rows")
        for row, d in zip(pending.rows, decisions):
            check_decision(row, d)
        self._take_pending(pending)
        running = {s.seq_id for s in self._inflight.seqs} if self._inflight is not None else ()
        for row, d, backup in zip(pending.rows, decisions, pending._backups):
            seq = self._seqs[row.seq_id]
            if d.is_cancelled:
                self._restore(seq, backup)
            else:
                # a control row's accepted prefix fixes how much of what it ran is history;
                # State consumed all of it, so a shorter prefix leaves the row release-only
                is_prefix = row.is_control or row.is_speculative
                seq.num_computed_tokens += d.accepted if is_prefix else row.num_new_tokens
                seq.is_unusable |= row.is_control and d.accepted < row.num_new_tokens
                self._append(seq, row.produced[:d.accepted])
                if seq.num_computed_tokens >= seq.protected_tokens:
                    seq.protected_tokens = 0
            if row.seq_id not in running:   # (its unit ahead holds the page after the frontier)
                self._trim(seq)
        hidden, self._step_hidden = self._step_hidden, None
        if self.speculator is not None and hidden is not None:   # a plain step: the feed
            self.speculator.after_plain(self, pending, decisions, hidden)
        elif self.speculator is not None:   # State of rejected drafts, the drafter's KV
            self.speculator.after_commit(self, pending, decisions)

    def abort_pending(self, pending: PendingBatch) -> None:
        """Drop the whole unit: State restored, frontiers unchanged, unused pages returned."""
        self._take_pending(pending)
        if self._step_hidden is not None:   # a plain speculative step: nothing to feed
            self._step_hidden = None
            self.speculator.plain_aborted()
        for row, backup in zip(pending.rows, pending._backups):
            seq = self._seqs[row.seq_id]
            self._restore(seq, backup)
            self._trim(seq)

    # ---- speculation hooks (program/speculative.py uses these and nothing private) ---------------
    # `seq` / `unit` are the records launch hands the speculator (Sequence: slot, frontier
    # num_computed_tokens, num_tokens, num_prompt_tokens, spec, media, is_unusable; Unit:
    # num_new_tokens, is_sampling, is_replay, forced); they are read, never written, outside.
    def sequence(self, seq_id: int) -> Optional[Sequence]:
        """The live sequence's record, or None once released."""
        return self._seqs.get(seq_id)

    def token_ids(self, seq: Sequence, start: int, stop: int) -> np.ndarray:
        """The sequence's token ids [start, stop) (a view: read it before the next write)."""
        return self.token_buf[seq.slot, start:stop]

    def write_provisional(self, seq: Sequence, tokens) -> None:
        """Tokens after the committed ones, where packing reads them (drafts); commit overwrites
        what is not accepted."""
        n = seq.num_tokens
        if n + len(tokens) > self.max_context:
            raise ProgramError(f"sequence {seq.seq_id}: provisional tokens overrun max_context")
        self.token_buf[seq.slot, n:n + len(tokens)] = tokens

    def grow_pages(self, seq: Sequence, num_tokens: int) -> int:
        """Map pages so the sequence covers num_tokens if free pages allow (commit's trim returns
        what stays unused); returns the tokens its pages cover now."""
        self.pages.grow(seq.slot, num_tokens)
        return int(self.pages.num_mapped[seq.slot]) * self.page_size

    def block_tables(self, seqs) -> np.ndarray:
        """[len(seqs), max_pages_per_seq] int32 page tables of the sequences (a copy)."""
        return self.pages.block_tables[[s.slot for s in seqs]]

    def new_unit_id(self) -> int:
        """An id for a PendingBatch the speculator builds (its epoch)."""
        return self._new_id()

    def pack_rows(self, seqs, units) -> ForwardBatch:
        return packing.pack_rows(self.token_buf, self.pages.block_tables, self.page_size, seqs,
                                 units)

    def media_rows(self, seqs, units):
        """(batch rows, embeddings) of the media placeholders this batch computes, or None."""
        return packing.media_rows(seqs, units)

    def sample_row(self, seq: Sequence, unit: Unit, logits: np.ndarray,
                   mask: Optional[np.ndarray] = None) -> RowResult:
        return packing.sample_row(self.token_buf, seq, unit, logits, mask)

    def samples_on_device(self, seqs, units, masks) -> bool:
        """Whether the backend samples this unit's rows (packing.device_path: no control unit,
        no logprobs, and a backend with a device sampler)."""
        return packing.device_path(self.model, seqs, units, masks) is not None

    def sample_request(self, seq: Sequence, position: int, mask=None) -> SampleRow:
        """The device sampler's row for the token at `position` (> the frontier: the tokens
        before it, drafts included, are its history), as a decode step there would send it."""
        return packing.sample_request(self.token_buf, self._uid, seq, position, mask)

    # ---- observation ----------------------------------------------------------------------------
    def generated_tokens(self, seq_id: int) -> np.ndarray:
        seq = self._seqs[seq_id]
        return self.token_buf[seq.slot, seq.num_prompt_tokens:seq.num_tokens].copy()

    def stats(self) -> dict:
        return {"kv_pages_total": self.pages.num_pages, "kv_pages_used": self.pages.num_used,
                "state_slots_total": self.num_slots, "state_slots_used": len(self._seqs),
                "host_snapshot_bytes_used": self.host_bytes_used,
                "prefix_cache_entries": len(self.checkpoints.entries),
                "prefix_cache_bytes": self.checkpoints.host_bytes_used,
                "prefix_cache_host_bytes": self.checkpoints.host_bytes_used,
                "prefix_cache_device_bytes": self.checkpoints.device_bytes_used,
                "prefix_cache_kv_pages": self.checkpoints.device_pages_used,   # of kv_pages_used
                "prefix_cache_slots_total": self.checkpoints.slots.num_slots,
                "prefix_cache_demotions_in_flight": self.checkpoints.num_moving,
                "prefix_cache_copy_seconds_to_host": self.checkpoints.copy_seconds["to_host"],
                "prefix_cache_copy_seconds_to_device": self.checkpoints.copy_seconds["to_device"],
                # of the copies' time: pinning host memory for the tier (CUDA's pools; 0 else)
                "prefix_cache_pin_seconds": sum(getattr(pool, "host_pin_seconds", 0.0)
                                                for pool in (self.kv, self.state)),
                **(self.speculator.stats() if self.speculator is not None else {})}

    def check_invariants(self) -> None:
        """Raise ProgramError if the physical ledgers disagree (leaks, double maps, bad frontiers)."""
        live = {s.slot for s in self._seqs.values()}
        if len(live) != len(self._seqs):
            raise ProgramError("two sequences share a StateImage slot")
        self.slots.check(live)
        self.pages.check(live, held=self.checkpoints.held_pages())
        self.checkpoints.check()
        for seq in self._seqs.values():
            if not 0 <= seq.num_computed_tokens <= seq.num_tokens <= self.max_context:
                raise ProgramError(f"sequence {seq.seq_id}: frontier {seq.num_computed_tokens} / "
                                   f"{seq.num_tokens} tokens out of order")
            if self.pages.can_grow(seq.slot, seq.num_computed_tokens) != 0:
                raise ProgramError(f"sequence {seq.seq_id}: KV frontier not covered by pages")
            # copy-on-write: the pages a sequence still writes (from its frontier's page on)
            # are its own; only pages wholly below its frontier may be shared
            writable = self.pages.block_tables[seq.slot, seq.num_computed_tokens // self.page_size:
                                               int(self.pages.num_mapped[seq.slot])]
            if np.any(self.pages.refcount[writable] != 1):
                raise ProgramError(f"sequence {seq.seq_id}: a page it writes is shared")
        self.snapshots.check()

    def assert_all_free(self, *, full: bool = True) -> None:
        """Everything returned: no sequence, page, slot, snapshot or pending unit is held.
        Checkpoints may stay (a cache, not a loan), with the pages and cache slots they hold;
        `checkpoints.drop` returns them.
        full=False: the counts only (the whole-ledger walk costs ms on a large pool)."""
        if full:
            self.check_invariants()
        held = dict(sequences=len(self._seqs),
                    pages=self.pages.num_used - self.checkpoints.device_pages_used,
                    slots=self.num_slots - self.slots.num_free, snapshots=len(self.snapshots),
                    pending=int(self._pending is not None or self._inflight is not None))
        if any(held.values()):
            raise ProgramError(f"resources still held: {held}")

    # ---- internals ------------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _new_sequence(self, num_prompt, num_tokens, num_computed, spec) -> Sequence:
        seq = Sequence(self._new_id(), self.slots.take(), num_prompt, num_tokens, num_computed,
                        spec)
        self._seqs[seq.seq_id] = seq
        return seq

    def _append(self, seq: Sequence, token_ids) -> None:
        n = len(token_ids)
        if seq.num_tokens + n > self.max_context:
            raise ProgramError(f"sequence {seq.seq_id}: {seq.num_tokens + n} tokens exceed "
                               f"max_context {self.max_context}")
        self.token_buf[seq.slot, seq.num_tokens:seq.num_tokens + n] = token_ids
        seq.num_tokens += n

    def _restore(self, seq: Sequence, backup) -> None:
        if backup is None:
            seq.is_unusable = True          # State ran ahead of the frontier: release only
        else:
            self.state.write(seq.slot, backup)

    def _trim(self, seq: Sequence) -> None:
        """Return pages beyond the frontier unless a resume permit still holds them."""
        self.pages.shrink(seq.slot, max(seq.num_computed_tokens, seq.protected_tokens))

    def _no_pending(self, what: str) -> None:
        if self._pending is not None or self._inflight is not None:
            raise ProgramError(f"{what} while a PendingBatch is unconsumed")

    def _check_current(self, pending: PendingBatch) -> None:
        if pending is not self._pending or pending.is_consumed:
            raise ProgramError("PendingBatch consumed twice or not the current one")

    def _take_pending(self, pending: PendingBatch) -> None:
        self._check_current(pending)
        pending._is_consumed = True
        self._pending = None
