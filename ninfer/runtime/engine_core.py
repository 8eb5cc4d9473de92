"""EngineCore: request lifecycle, the worker thread, and the commit -> publish order.

One worker thread is the only mutator of requests, Scheduler and Program. Other threads call
`submit()` (validate, prepare, enqueue) and read their handle. Each worker cycle:

    take inbox -> settle cancels/deadlines -> resume oldest paused -> admit fresh
      -> plan + reserve (pausing the youngest under pressure) -> run decode batch -> run one chunk
         (one unit, one forward, where the Program merges them: Program.merges_units)

Per unit: execute -> Frontend preview per row -> Program commit -> budget -> OutputSession commit
-> publish events. Any exception out of the Program (or a broken internal invariant) fails the
Engine: every request finishes with "error" and new submits raise EngineFailedError.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
import uuid
from collections import deque
from typing import Optional

from ..api import Finished, GenerationStart, SamplingParams, TextDelta
from ..errors import EngineFailedError, RequestError
from ..contracts import RowDecision, RowPlan, SamplingSpec, UnitPlan
from .handle import GenerationHandle, _Channel
from .outcome import decide, final_result
from .request import (Request, RequestState, check_output_room, checked_prompt_ids,
                      checked_submit_args)
from .context_cache import ContextCache
from .media_encoder import MediaEncoder
from .scheduler import ResidentView, Scheduler

log = logging.getLogger("ninfer.engine")
_DISCARDED = RowDecision(0, is_terminal=True, is_discarded=True)
_IDLE_WAIT_S = 0.01            # after a cycle that ran nothing, before trying again
_RATE_WINDOW_S = 10.0


@dataclasses.dataclass(slots=True, eq=False)
class _Cycle:
    """One cycle's plan: the units, and what was asked once for all of them."""
    decode: list                 # requests of the decode unit, reserved
    chunk: list                  # the one prefill / Replay chunk row, reserved, or empty
    views: dict                  # request -> ResidentView
    forced: dict                 # seq_id -> a control unit's tokens (OutputSession.forced_tokens)
    sampling: frozenset          # requests whose next unit samples (unless forced)


class EngineCore:
    def __init__(self, program, frontend, options):
        """`program`: the model's Program (the Engine builds it; the runtime never names a model
        family). It owns the model; this core owns the Program from here on."""
        self.options = options
        self.frontend = frontend
        self.vocab_size = int(program.vocab_size)
        self.program = program
        self.scheduler = Scheduler(max_bypass=options.max_concurrency)
        self.context_cache = ContextCache(self.program)
        self.media_encoder = MediaEncoder(self.program.encode_media, self._notify)
        # reentrant: a handle dropped (and closed) by GC inside a locked region re-enters _notify
        self._lock = threading.RLock()         # inbox, outstanding, health, stopping
        self._wake = threading.Condition(self._lock)
        self._inbox: deque = deque()
        self._outstanding = 0
        self._max_outstanding = options.max_concurrency + options.max_queue
        self._health = "ready"
        self._failure: Optional[str] = None
        self._is_stopping = False
        self._tickets = itertools.count()
        # worker-only state
        self._waiting: deque = deque()
        self._residents: list = []
        self._paused: list = []
        self._cycle_no = 0
        self._was_idle = False
        # the pipelined decode: (requests, InFlightUnit) of a decode step launched ahead of the
        # one this cycle completes, and the requests that ended on that one (they finish, and
        # their Program resources go back, once the step ahead is collected)
        self._ahead: Optional[tuple] = None
        self._ended: dict = {}               # request -> (reason, error)
        self._counters = dict(tokens_generated=0, requests_finished=0, pauses=0,
                              snapshot_pauses=0, snapshot_revocations=0, replay_resumes=0,
                              snapshot_resumes=0)
        # (time, tokens accepted) of the last _RATE_WINDOW_S, and their running total: publishing
        # costs the same in minute ten as in minute one (no sum over the window per cycle)
        self._rate_window: deque = deque()
        self._rate_tokens = 0
        self._start_time = time.monotonic()
        self._stats: dict = {}
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    # ---- any thread -----------------------------------------------------------------------------
    @property
    def health(self) -> str:
        return self._health

    def submit(self, prompt, params: SamplingParams, *, tools=None, enable_thinking=None,
               request_id=None, timeout_s=None, session: Optional[str] = None,
               share_prompt: bool = False) -> GenerationHandle:
        """session: a hint that requests with it continue one conversation (the context cache
        binds the session's newest checkpoint; OpenAI prompt_cache_key / user, Anthropic
        metadata.user_id map onto it). share_prompt: requests with this same prompt follow (the
        choices of OpenAI `n`): its prefill leaves a checkpoint one token short of the prompt's
        end, so theirs starts there."""
        self._check_available()
        params = checked_submit_args(params, enable_thinking, request_id, timeout_s, session)
        if enable_thinking is None:
            enable_thinking = self.options.default_enable_thinking
        prepared = self.frontend.prepare(prompt, tools=tools, enable_thinking=enable_thinking)
        prompt_ids = checked_prompt_ids(prepared.token_ids, self.options.max_context,
                                        self.vocab_size)
        check_output_room(params, len(prompt_ids), self.options.max_context)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request_id = request_id or uuid.uuid4().hex
        media = prepared.media
        if media and not self.program.accepts_media:
            raise RequestError("image and video input needs the vision tower, which this backend "
                               "does not run yet (the numpy backend does)")
        cache_session = session
        session = self.frontend.new_output_session(params, prepared, tools, request_id=request_id)
        channel = _Channel(request_id, self._notify, self._release_outstanding)
        # media tokens are placeholders (equal ids, different images): a media prompt reuses
        # only checkpoints keyed with the same media digest (all of its media, in order)
        digest = bytes(prepared.media_digest) if media else b""
        may_reuse = not media or bool(digest)
        reusable_at = int(prepared.num_reusable_tokens) if may_reuse else 0
        now = time.monotonic()
        queue_timeout = self.options.queue_timeout_s
        request = Request(request_id, 0, params, prompt_ids, session,
                          SamplingSpec.from_params(params, seed), channel, now,
                          deadline=None if timeout_s is None else now + timeout_s,
                          queue_deadline=None if queue_timeout is None else now + queue_timeout,
                          reusable_at=reusable_at, may_reuse=may_reuse,
                          media=(media, prepared.mrope_positions) if media else None,
                          cache_session=cache_session, media_digest=digest,
                          share_prompt=bool(share_prompt))
        with self._lock:
            self._check_available()
            if self._outstanding >= self._max_outstanding:
                raise RequestError(
                    f"engine overloaded: {self._outstanding} requests outstanding "
                    f"(max_concurrency {self.options.max_concurrency} + max_queue "
                    f"{self.options.max_queue})", status=429, code="overloaded")
            self._outstanding += 1
            request.ticket = next(self._tickets)
            self._inbox.append(request)
            self._wake.notify()
        return GenerationHandle(channel)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._stats)
            out["queue_depth"] = out.get("waiting", 0) + len(self._inbox)
            out["outstanding"] = self._outstanding
            out["health"] = self._health
        return out

    def shutdown(self, timeout: Optional[float] = 30.0) -> bool:
        """Stop the worker; unfinished requests finish as 'cancelled'. Returns whether the worker
        has stopped (False if it is still inside a unit after `timeout` seconds)."""
        with self._lock:
            self._is_stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _check_available(self) -> None:
        if self._health == "failed":
            raise EngineFailedError(f"the engine failed: {self._failure}")
        if self._is_stopping:
            raise EngineFailedError("the engine is shut down")

    def _notify(self) -> None:
        with self._lock:
            self._wake.notify()

    def _release_outstanding(self) -> None:
        with self._lock:
            self._outstanding -= 1

    # ---- worker: the spine ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                self._cycle()
            self._drain_ahead()
            self._finish_all("cancelled", "the engine was shut down")
        except BaseException as exc:  # noqa: BLE001 - any escape is an Engine failure
            self._fail(exc)
        finally:
            self.media_encoder.close()

    def _cycle(self) -> None:
        self._cycle_no += 1
        if self._ahead is not None:
            reqs, inflight = self._ahead
            if self._may_run_ahead(reqs, ()) and self._run_ahead(reqs, inflight):
                self._was_idle = False      # steady decode: step k+1 went, k completed
                self._publish_stats()
                return
            self._drain_ahead()
        self._take_inbox()
        self._settle_cancellations()
        self._resume_oldest_paused()
        self._admit_fresh()
        cycle = self._plan_and_reserve()
        if self.program.merges_units:           # one forward: decode rows ride on the chunk
            ran = self._run_unit(cycle.decode + cycle.chunk, cycle)
        else:
            ran = self._run_unit(cycle.decode, cycle) + self._run_unit(cycle.chunk, cycle)
        self._was_idle = ran == 0
        self._audit_when_empty()
        self._publish_stats()

    def _audit_when_empty(self) -> None:
        """With no request left, the Program must hold nothing: a leak is a broken invariant.
        The counts every time; the whole page ledger (ms on a large pool, paid by the next
        request) with the debug_checks option."""
        if not (self._waiting or self._residents or self._paused):
            self.program.assert_all_free(full=self.options.debug_checks)
            self.context_cache.check_invariants()

    def _wait_for_work(self) -> bool:
        if not (self._waiting or self._residents or self._paused or self._inbox):
            # nobody waits on the worker: the cache's demotions run now instead of on the next
            # request's path (they stop as soon as one arrives)
            self.context_cache.keep_headroom(idle=True, stop=lambda: bool(self._inbox))
        with self._lock:
            while not self._is_stopping:
                has_work = bool(self._waiting or self._residents or self._paused)
                if self._inbox or (has_work and not self._was_idle):
                    return True
                self._wake.wait(_IDLE_WAIT_S if has_work else None)
                self._was_idle = False
            return False

    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    # ---- worker: lifecycle steps ----------------------------------------------------------------
    def _settle_cancellations(self) -> None:
        now = time.monotonic()
        for req in list(self._waiting) + list(self._residents) + list(self._paused):
            if req.is_cancel_requested:
                self._finish(req, "cancelled")
            elif req.queue_deadline_passed(now):
                self._finish(req, "error", f"queue timeout: waited "
                                           f"{self.options.queue_timeout_s} s for admission")
            elif req.deadline_passed(now):
                self._finish(req, "cancelled", "deadline exceeded (timeout_s)")

    def _resume_oldest_paused(self) -> None:
        has_protected = self.program.has_protected()
        req = self.scheduler.resume_candidate(
            [ResidentView(r, r.ticket, False) for r in self._paused], has_protected)
        if req is None or len(self._residents) >= self.options.max_concurrency:
            return
        short = self.program.pages_short_to_resume(req.resume_state)
        if short:                                   # cache pages go before a request waits
            self.context_cache.reclaim(short)
        if not self.program.can_resume(req.resume_state):
            return
        kind = req.resume_state.kind
        req.seq_id = self.program.resume(req.resume_state)
        req.resume_state = None
        self._paused.remove(req)
        self._make_resident(req)
        self._counters["snapshot_resumes" if kind == "snapshot" else "replay_resumes"] += 1
        self.scheduler.note_resumed()

    def _admit_fresh(self) -> None:
        if self._waiting and self._waiting[0].media:
            self.media_encoder.ready(self._waiting[0])  # (starts it: ready when a lane frees)
        while self._waiting and len(self._residents) < self.options.max_concurrency:
            req = self._waiting[0]
            if not self.scheduler.may_admit_fresh(len(self._paused)) \
                    or not self.program.capacity().free_state_slots:
                return
            media = {}
            if req.media:               # encoded beside the cycles; the residents go on
                if not self.media_encoder.ready(req):
                    return
                try:
                    media = {"media": req.media, "encoded_media": self.media_encoder.take(req)}
                except (ValueError, RequestError) as exc:    # the tower refused these media
                    self._finish(req, "error", f"media: {exc}")
                    continue
            checkpoint, reused = self.context_cache.lookup(
                req.prompt_ids, req.media_digest, req.cache_session) if req.may_reuse \
                else (None, 0)
            if req.may_reuse and self.context_cache.wait_for_inflight(
                    req.prompt_ids, reused, [r.seq_id for r in self._residents]):
                return                              # a resident is prefilling our prefix
            short = self.program.pages_short_to_bind(req.num_prompt_tokens, reused, checkpoint)
            if short:                               # cache pages go before a request waits
                self.context_cache.reclaim(short,
                                           protect=() if checkpoint is None else (checkpoint,))
            if not self.program.can_bind(req.num_prompt_tokens, reused, checkpoint):
                checkpoint, reused = None, 0
                if not self.program.can_bind(req.num_prompt_tokens):
                    return
            # bind before leaving the queue: a failed bind must leave req where _finish_all sees it
            req.seq_id = self.program.bind(req.prompt_ids, req.spec, capture_at=req.reusable_at,
                                           checkpoint=checkpoint, **media)
            if req.may_reuse:
                self.context_cache.bound(req.seq_id, req.prompt_ids, checkpoint, reused)
                if req.share_prompt:    # (False when the cache gave that much already)
                    self.program.add_capture(req.seq_id, req.num_prompt_tokens - 1)
            req.num_cached_tokens = reused
            self._waiting.popleft()
            req.admit_time = time.monotonic()
            self._make_resident(req)
            self.scheduler.note_fresh_admitted(len(self._paused))
            req.channel.publish(GenerationStart(req.request_id, req.num_prompt_tokens,
                                                req.num_cached_tokens))

    def _make_resident(self, req: Request) -> None:
        req.state = RequestState.MATERIALIZING
        self._residents.append(req)
        self._residents.sort(key=lambda r: r.ticket)

    def _pause(self, req: Request) -> None:
        self._make_room_for_snapshot(req)
        rs = self.program.pause(req.seq_id, allow_snapshot=self.options.host_snapshot_bytes > 0)
        req.seq_id, req.resume_state = None, rs
        req.state = RequestState.PAUSED
        self._residents.remove(req)
        self._paused.append(req)
        self._paused.sort(key=lambda r: r.ticket)
        self._counters["pauses"] += 1
        self._counters["snapshot_pauses"] += rs.kind == "snapshot"

    def _make_room_for_snapshot(self, req: Request) -> None:
        """Paused requests resume oldest first, so the fast path belongs to the older ones:
        revoke Snapshots of younger paused requests (youngest first) when req's would not fit."""
        need = self.program.snapshot_cost(req.seq_id)
        if need > self.program.host_budget_bytes:
            return
        for other in reversed(self._paused):
            if self.program.host_bytes_free >= need or other.ticket < req.ticket:
                return
            if other.resume_state.kind == "snapshot":
                other.resume_state = self.program.revoke_snapshot(other.resume_state)
                self._counters["snapshot_revocations"] += 1

    def _finish(self, req: Request, reason: str, error: Optional[str] = None, *,
                touch_program: bool = True) -> None:
        """The single terminal transition: release Program resources, then publish Finished."""
        if touch_program and req.seq_id is not None:
            # a finished answer leaves its continuation (prompt + answer) in the context cache
            self.context_cache.settle_finished(
                req.seq_id, keep=req.may_reuse and reason not in ("cancelled", "error"),
                session=req.cache_session, order=req.ticket, media_digest=req.media_digest)
        if touch_program and req.resume_state is not None:
            self.context_cache.settle_paused(req.resume_state)
        was_admitted = req.state != RequestState.WAITING
        if not was_admitted:
            self.media_encoder.forget(req)      # (its media may still be encoding)
        req.seq_id = req.resume_state = None
        for queue in (self._waiting, self._residents, self._paused):
            if req in queue:
                queue.remove(req)
        if was_admitted:
            self._flush_output(req, reason)
        result = final_result(req, reason, error)
        req.state = RequestState.FINISHED
        self._counters["requests_finished"] += 1
        self._publish_stats()               # a consumer woken by Finished sees current stats
        req.channel.publish(Finished(result))

    # ---- worker: planning -----------------------------------------------------------------------
    def _plan_and_reserve(self) -> _Cycle:
        """This cycle's units, every row reserved. One Program question plans every resident."""
        rows = self.program.plan_view([r.seq_id for r in self._residents])
        views = {req: ResidentView(req, req.ticket, row.kind == "decode", row.is_protected,
                                   req.last_chunk_cycle)
                 for req, row in zip(self._residents, rows)}
        sampling = frozenset(req for req, row in zip(self._residents, rows) if row.is_sampling)
        plan = self.scheduler.plan(list(views.values()))
        forced = self._forced([views[r] for r in plan.members])
        granted = self._reserve(self.scheduler.reservation_order(
            [views[r] for r in plan.members]), views, forced)
        decode = [r for r in plan.decode if r in granted and r in self._residents]
        chunk = [plan.chunk] if plan.chunk in granted and plan.chunk in self._residents else []
        for req in chunk:
            req.last_chunk_cycle = self._cycle_no
        return _Cycle(decode, chunk, views, forced or {}, sampling)

    def _reserve(self, order: list, views: dict, forced) -> set:
        """Reserve the rows' next units in order: one Program call while pages last; a row that
        lacks them first takes cache pages, then pauses the youngest younger resident (itself
        when there is none), before the rows after it reserve."""
        granted = set()
        while order:
            order = [r for r in order if r in self._residents]
            if not order:
                break
            ok = self.program.reserve_units([r.seq_id for r in order], forced=forced,
                                            stop_at_short=True)
            num_granted = len(ok) - (not ok[-1])
            granted.update(order[:num_granted])
            if num_granted < len(order) and self._reserve_short(order[num_granted], views, forced):
                granted.add(order[num_granted])
            order = order[num_granted + 1:]
        return granted

    def _reserve_short(self, req: Request, views: dict, forced) -> bool:
        while True:
            if not self.context_cache.reclaim(1):   # cache pages go before any resident pauses
                victim = self.scheduler.choose_victim([views[r] for r in self._residents],
                                                      views[req])
                self._pause(victim)
                if victim is req:
                    return False
            if self.program.reserve_units([req.seq_id], forced=forced)[0]:
                return True

    def _forced(self, views: list):
        """Control units due now: seq_id -> the tokens its OutputSession forces (a spent thinking
        budget's `</think>` + separator), cut to the room max_tokens and max_context leave, for
        decode-ready rows only. None when no row has any. Asked once per cycle, before the
        reservation; the execution uses the same answer."""
        out = {}
        for view in views:
            if not view.is_decode:
                continue
            req = view.key
            tokens = req.session.forced_tokens()
            if not tokens:
                continue
            done = req.num_generated_tokens
            room = min(req.params.max_tokens - done,
                       self.options.max_context - req.num_prompt_tokens - done)
            if room >= 1:
                out[req.seq_id] = tuple(tokens[:room])
        return out or None

    # ---- worker: one unit -----------------------------------------------------------------------
    def _run_unit(self, reqs: list, cycle: _Cycle) -> int:
        """launch -> (the next decode step launched ahead, where it may be) -> collect ->
        Frontend preview per row -> Program commit -> captures -> budget, OutputSession commit,
        publish per row (docs/architecture.md "A decode step's path")."""
        if not reqs:
            return 0
        forced = cycle.forced
        rows = tuple(RowPlan(r.seq_id, forced.get(r.seq_id),
                             _mask(r) if r in cycle.sampling and r.seq_id not in forced else None)
                     for r in reqs)
        # no State backups: a cancelled row is released right after the commit, never resumed
        draft_masks = _draft_masks(reqs) if self.program.is_speculative else None
        inflight = self.program.launch(UnitPlan(rows, keep_rollback=False,
                                                draft_masks=draft_masks))
        if not (self._may_run_ahead(reqs, cycle.chunk or cycle.forced)
                and self._run_ahead(reqs, inflight)):
            self._complete_unit(reqs, inflight)
        return 1

    # ---- worker: the pipelined decode -----------------------------------------------------------
    def _may_run_ahead(self, reqs: list, others) -> bool:
        """Whether the decode step after reqs' current one may start before that one is
        collected (the Program then asks its own questions, in launch_ahead): nothing else to
        do this cycle or the next (no chunk or control unit, nobody waiting, paused, arriving
        or ending), every resident in the unit, no cancel or deadline due, and no session
        that may ask for a mask or a control unit on the next token."""
        # (reqs are residents, each once: the same count is every resident)
        if others or self._waiting or self._paused or self._ended \
                or len(reqs) != len(self._residents):
            return False
        with self._lock:
            if self._inbox or self._is_stopping:
                return False
        now = time.monotonic()
        return not any(r.is_cancel_requested or r.deadline_passed(now) or r.session.needs_mask
                       or r.session.may_force_tokens for r in reqs)

    def _run_ahead(self, reqs: list, inflight) -> bool:
        """Launch reqs' next decode step (the device feeds it this step's tokens), then collect,
        commit and publish this one while it runs: the host's work overlaps the GPU's. False
        (nothing done) where the Program does not launch it."""
        ahead = self.program.launch_ahead(inflight)
        if ahead is None:
            return False
        self._ahead = (reqs, ahead)
        self._complete_unit(reqs, inflight)
        return True

    def _drain_ahead(self) -> None:
        """Complete the step launched ahead (its rows whose requests ended accept nothing),
        then finish those requests: the Program holds no unit in flight after this."""
        if self._ahead is None:
            return
        reqs, inflight = self._ahead
        self._ahead = None
        self._complete_unit(reqs, inflight)
        ended, self._ended = self._ended, {}
        for req, (reason, error) in ended.items():
            if req.state != RequestState.FINISHED:
                self._finish(req, reason, error)

    def _complete_unit(self, reqs: list, inflight) -> None:
        """collect -> Frontend preview per row -> Program commit -> budget, OutputSession
        commit, publish per row -> captures -> the rows' requests that ended end. A request that
        ended on the step before (it ran ahead) accepts nothing of this one. The tokens are
        published before the context cache's captures (host work and State copies: 2-7 ms a
        9B turn on an H100), which no client waits for; a request ends after them, as its
        sequence must still hold the State a capture copies."""
        pending = self.program.collect(inflight)
        now = time.monotonic()
        verdicts = [(_DISCARDED, None, None) if req in self._ended
                    else decide(req, row, now, self.options.max_context)
                    for req, row in zip(reqs, pending.rows)]
        self.program.commit(pending, [d for d, _, _ in verdicts])
        ends = []
        for req, row, (decision, preview, error) in zip(reqs, pending.rows, verdicts):
            if not decision.is_discarded:
                end = self._settle_row(req, row, decision, preview, error)
                if end is not None:
                    ends.append((req, end))
        self.context_cache.capture_if_due([(req.seq_id, req.media_digest) for req, (decision, _, _)
                                           in zip(reqs, verdicts)
                                           if not (decision.is_cancelled or decision.is_discarded)])
        for req, (reason, error) in ends:
            self._end(req, reason, error)

    def _settle_row(self, req: Request, row, decision: RowDecision, preview, error):
        """After the Program commit: budget, OutputSession commit, events, the state of a row
        going on. Returns (reason, error) for a row whose request ends (the caller ends it),
        else None."""
        if decision.is_cancelled:
            return ("error" if error else "cancelled",
                    error or (None if req.is_cancel_requested else "deadline exceeded (timeout_s)"))
        if not row.produced:
            req.state = RequestState.REPLAY if row.is_replay else RequestState.PREFILL
            return None
        tokens = list(row.produced[:decision.accepted])
        self._account(req, tokens, row.logprobs[:decision.accepted])
        req.session.commit(preview)
        events = list(preview.events)
        reason = preview.finish_reason
        self._publish_events(req, events)
        if decision.is_terminal:
            return reason or "length", None
        req.state = RequestState.DECODE
        return None

    def _end(self, req: Request, reason: str, error: Optional[str] = None) -> None:
        """A row's request ended: it finishes now, or, when its next step is already in flight
        (run ahead), once that step is collected (_drain_ahead)."""
        if self._ahead is not None and req in self._ahead[0]:
            self._ended[req] = (reason, error)
        else:
            self._finish(req, reason, error)

    def _flush_output(self, req: Request, reason: str) -> None:
        """Publish text the session still holds back (a no-op once it finished itself)."""
        try:
            flush = req.session.preview_finish(reason)
            req.session.commit(flush)
        except Exception:  # noqa: BLE001 - the request is ending either way
            log.exception("request %s: output flush failed", req.request_id)
            return
        self._publish_events(req, list(flush.events))

    def _account(self, req: Request, tokens: list, logprobs: tuple) -> None:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_ids.extend(tokens)
        if req.params.logprobs is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.extend(logprobs)
            req.unpublished_logprobs.extend(logprobs)
        self._counters["tokens_generated"] += len(tokens)
        self._rate_window.append((now, len(tokens)))
        self._rate_tokens += len(tokens)

    def _publish_events(self, req: Request, events: list) -> None:
        for event in events:
            if isinstance(event, TextDelta) and req.unpublished_logprobs:
                event = dataclasses.replace(event, logprobs=tuple(req.unpublished_logprobs))
                req.unpublished_logprobs.clear()
            req.channel.publish(event)

    # ---- worker: failure and stop ---------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        log.error("engine failed: %r", exc, exc_info=exc)
        with self._lock:
            self._health = "failed"
            self._failure = f"{type(exc).__name__}: {exc}"
            self._is_stopping = True
        self._finish_all("error", f"engine failed: {self._failure}", touch_program=False)

    def _finish_all(self, reason: str, error: str, *, touch_program: bool = True) -> None:
        self._take_inbox()
        for req in list(self._waiting) + list(self._residents) + list(self._paused):
            if req.state == RequestState.FINISHED:
                continue
            try:
                self._finish(req, reason, error, touch_program=touch_program)
            except Exception:  # noqa: BLE001 - every other request must still be answered
                log.exception("request %s: could not be finished cleanly", req.request_id)
                if not req.channel.is_done:
                    req.channel.publish(Finished(final_result(req, "error", error)))
        self._publish_stats()

    def _expire_rate_window(self, now: float) -> None:
        window = self._rate_window
        while window and window[0][0] < now - _RATE_WINDOW_S:
            self._rate_tokens -= window.popleft()[1]

    def _publish_stats(self) -> None:
        """Once per cycle (and at each terminal transition): O(1) in the run's length."""
        now = time.monotonic()
        self._expire_rate_window(now)
        span = min(_RATE_WINDOW_S, now - self._start_time)
        rate = self._rate_tokens / span if span > 0 else 0.0
        try:
            program_stats = self.program.stats()
        except Exception:  # noqa: BLE001 - a failed Program may not answer; stats must
            program_stats = {}
        stats = dict(self._counters, waiting=len(self._waiting), residents=len(self._residents),
                     paused=len(self._paused), tokens_per_s=rate, **program_stats,
                     **self.context_cache.stats())
        with self._lock:
            self._stats = stats



def _draft_masks(reqs: list):
    """Speculative verification's masks: seq_id, draft tokens -> the masks of the positions after
    each draft prefix, as many as may be sampled (OutputSession.token_masks_along)."""
    sessions = {r.seq_id: r.session for r in reqs}
    return lambda seq_id, tokens: sessions[seq_id].token_masks_along(tokens)


def _mask(req: Request):
    """The OutputSession's mask for req's next sampled token (a grammar's, min_tokens' stop-token
    ban, a spent thinking budget's `</think>`), or None when anything goes."""
    if not req.session.needs_mask:
        return None
    try:
        return req.session.token_mask()
    except Exception:  # noqa: BLE001 - preview then rejects the free token: this request ends
        log.exception("grammar mask failed")
        return None
