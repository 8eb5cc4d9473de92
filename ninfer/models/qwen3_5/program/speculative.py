"""Speculative decoding (issues 15, 25 and 30): draft, verify, commit, roll back, on either
backend, with either drafter: the checkpoint's MTP head (mtp.py; cuda/drafter.py on the GPU),
which drafts one token per drafter step from the target's final-normed hidden states, or a DFlash
block drafter (dflash.py; cuda/dflash.py on the GPU), which drafts a whole block in one pass from
the target's features (the outputs of some of its layers). The Program owns it; program.py calls in at
construction, `launch`, `commit`, `release` and `stats`; it calls back only through the Program's
documented speculation hooks (`sequence`, `token_ids`, `write_provisional`, `grow_pages`,
`block_tables`, `pack_rows`, `media_rows`, `sample_row`, `new_unit_id`) and its public `model`,
`kv`, `state`.

What it asks of the backend: the model's `verify_forward` (the logits of the picked tokens and
every token's drafter feed: its final-normed hidden state, or with `hidden_layers` the outputs of
those layers), `verify_snapshots`, and where the unit's rows may be sampled on the device
(Program.samples_on_device) its `verify_tokens` (the same forward, each picked position sampled
there as a decode step at that position would be). Of an MTP drafter: `forward`,
`forward_argmax`, `logits`, `draft_greedy` and `join_kv_pool` (_ChainProposer); of a DFlash
drafter (dflash.py; cuda/dflash.py on the GPU): `feed`, `draft`, `logits` and `join_kv_pool`
(_BlockProposer). Both name `hidden_layers` (None: MTP's feed), `max_draft_tokens` and
`pages_ahead` (positions past the frontier a draft pass writes KV at: the row must hold pages
there to draft; the CUDA DFlash drafter stores its block's K/V at F .. F + bs - 1).

One cycle of a decode-ready row (N tokens, frontier F = N - 1: x_{N-1} is sampled, not yet run):

    k        the unit's draft count: draft_policy.py picks 0..num_draft_tokens from the measured
             acceptance and unit costs ("fixed": always num_draft_tokens); 0 runs the row as a
             plain decode step (its commit still feeds the drafter, below). On a backend whose
             token steps keep their hidden states (Model.step_hidden: CUDA), a unit at k = 0
             is the Program's own decode step, launched ahead of the one in flight as without
             speculation (runs_plain, runs_plain_ahead); its commit queues the hidden states
             (after_plain), so an adaptive k = 0 costs what plain decoding costs
    draft    MTP: d_1 = argmax of the MTP hidden g_1, both kept by the last feed (below); the
             drafter (mtp.py) runs k - 1 more steps from (g_1, d_1) at positions F .. F+k-2,
             greedy. DFlash: one block pass over [x_{N-1}, mask ...] at F .. F+bs-1 gives
             d_1 .. d_k at once. A masked row's argmaxes are within its masks (_Guide). The
             drafts go into the token buffer after the committed tokens (provisional).
    verify   one target forward over [x_{N-1}, d_1 .. d_k] at positions F .. F+k, batched with
             the unit's other rows (prefill / Replay / control / plain decode rows run as usual).
             Position j samples t_j exactly as a decode step at that position would: penalties
             over the tokens before it (d_1 .. d_j included), logit_bias, the grammar mask after
             d_1 .. d_j (OutputSession.token_masks_along), the draw u(seed, N + j).
             Stop at the first t_j != d_{j+1}: produced = t_0 .. t_j (1 .. k+1 tokens).
    commit   the Engine accepts a <= produced tokens (stop, max_tokens, cancel: outcome.decide).
             Frontier F -> F + a. State: when a < k + 1, either the verify's snapshot of the
             State after token a - 1 is copied over the row's slot (a model with
             verify_snapshots: CUDA), or the pre-verify backup is restored and the a accepted
             tokens are run again (recompute: numpy); KV past the frontier is left for the next
             unit to overwrite. Then the feed: the target's hidden states (DFlash: features)
             of positions F .. F+a-1 are queued; when the row next drafts, is checkpointed or
             paused, or LAG_TOKENS are queued, one drafter call writes its KV of the queued
             positions (MTP: from them and the accepted tokens, and its last MTP hidden is kept
             for d_1; DFlash: its context KV from the features alone).
    behind   (MTP drafter with drafts_in_verify: CUDA) a unit whose every row drafted the same
             k, none masked, runs the feed and the next unit's drafts on the device behind its
             verify (drafter.verify_and_draft; _tail_plan picks the next k now): the feed over
             F .. F+k with the picks as the next tokens, d_1 and g_1 at each row's last produced
             position, the chain after d_1; one wait for the unit instead of three (verify,
             feed, chain). Commit keeps those drafts where the Engine took every produced
             token; else the feed covers what it took and the row's next draft is made again.

Sampling rule. The drafts are greedy, so the draft distribution q at position j is the point mass
on d_{j+1}. The standard speculative-sampling rule then reads: accept d with probability
min(1, p(d) / q(d)) = p(d); on rejection draw from normalize((p - q)+) = p conditioned on "not d".
We realize it with one draw per position: t = the sampler's token from p with the uniform
u(seed, position) (the same inverse-CDF draw a non-speculative step makes), accept iff t == d,
else emit t. P(t == d) = p(d), and t given t != d is distributed as p conditioned on "not d":
the rule exactly, and the emitted token is the one the non-speculative path would emit. So a
seeded request gives the same tokens with or without speculation, at any batch size, across
pauses; greedy (temperature 0) is the special case t = argmax.

The drafter's KV is one more layer (DFlash: its layers) of the target's KVPool (join_kv_pool): the
same
pages and block tables, so Snapshots and prefix checkpoints carry it. Invariant after every
commit: the drafter's KV covers the positions before the row's queued feed (the pairs
(h_t, x_{t+1}) of the target's hidden states), the queue covers the rest up to the frontier F,
positions >= F are provisional; whenever a unit drafts, or the row's pages are checkpointed,
kept as a continuation or copied for a Snapshot (`settle`), the queue is empty first.

Rollback choice. numpy: restore the pre-verify StateImage and recompute the accepted prefix (a
target forward over the accepted tokens of the rows that rejected a draft; bench_speculative.py
reports its share): per-token States would cost (k+1) State copies per verify row on the host.
CUDA (verify_snapshots): the verify's GDN layers write the State after each token of a row into
its k+1 snapshot slots (memory_plan.snapshot_slots: after the sequences' and the cache's), and a
rejection is one slot copy on the device; no host backup is taken for it.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np

from ....contracts import PendingBatch, ProgramError, RowResult
from ..batch import ForwardBatch
from ....options import DEFAULT_MTP_DRAFT_TOKENS
from .draft_policy import DraftPolicy
from .sampling import sample_row

# a row's committed positions wait, as the target's hidden states, until the drafter needs its
# KV (the row drafts, is checkpointed or paused) or this many pile up: then one drafter call
# feeds them all. Feeding every plain step costs a drafter layer per step, 7% of a step on the
# numpy reference models, which an adaptive k = 0 must not pay. (Plain steps launched ahead
# queue without this bound: a drafter call between two chained steps would overwrite the token
# ids the next one reads on the device; the policy's explorations, every <= 256 units, drain it)
LAG_TOKENS = 64
# a unit's cost less its one-off work is at least this (the one-off seconds are measured inside
# the unit's, so only clock granularity could take it lower; a cost of 0 would win every choice)
MIN_UNIT_SECONDS = 1e-6


class _Unit(NamedTuple):
    """The speculative unit in flight, for its commit to time it."""
    t0: float                   # its launch (perf_counter)
    rows: int                   # its rows that could draft
    k: int                      # the policy's k for it
    one_off: float              # Model.one_off_seconds at its launch
    timed: bool                 # the policy times it (no other rows beside its drafting ones)
    catch_up: float = 0.0       # seconds of its catch-up feed before the drafts (_draft)


@dataclass(slots=True, eq=False)
class _Row:
    """What commit needs of one row of the pending unit."""
    seq_id: int
    start: int                  # the row's frontier when the unit ran
    hidden: np.ndarray          # [n, H] the target's final-normed hidden of its new tokens
                                # (None: fed behind the verify, verify_and_draft)
    drafts: tuple = ()          # a verify row's drafts d_1 .. d_k (empty: not speculative)
    backup: object = None       # a verify row's StateImage before the verify (recompute)
    snap: int = -1              # its first snapshot slot: the State after token i in snap + i


class _Guide:
    """Drafts within a row's masks, for the rows of a unit whose step mask is not None (a grammar,
    min_tokens' stop-token ban, ...): the drafts each chose so far, and `cut`, row -> the drafts it
    keeps where its masks ended (the output ends or is forced there, or nothing is allowed)."""

    def __init__(self, drafter, seqs, masks, draft_masks):
        self.drafter, self.seqs, self.masks, self.draft_masks = drafter, seqs, masks, draft_masks
        self.rows = {r for r, m in enumerate(masks) if m is not None}
        self.chosen = {r: [] for r in self.rows}
        self.cut: dict = {}

    def pick(self, r: int, g: np.ndarray, free: int) -> int:
        """Row r's next draft from its MTP hidden g [H]; `free` is the unconstrained argmax (the
        answer for a row without masks, or where its mask allows anything). Past a cut the
        drafts are `free` too: they only feed the drafter's next step and are dropped."""
        if r not in self.rows or r in self.cut:
            return free
        chosen = self.chosen[r]
        if not chosen:
            ended, mask = False, self.masks[r]
        elif self.draft_masks is None:      # (no session to ask: the verify masks nothing either)
            ended, mask = False, None
        else:
            along = self.draft_masks(self.seqs[r].seq_id, tuple(chosen))
            ended = len(along) < len(chosen)
            mask = None if ended else along[len(chosen) - 1]
        token = free
        if mask is not None:
            logits = self.drafter.logits(g[None])[0]
            allowed = np.zeros(len(logits), np.bool_)
            n = min(len(mask), len(logits))
            allowed[:n] = np.asarray(mask, np.bool_)[:n]
            ended = ended or not allowed.any()
            if not ended:
                token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        if ended:
            self.cut[r] = len(chosen)
            return free
        chosen.append(token)
        return token


class _ChainProposer:
    """MTP's drafts: d_1 is the argmax of the MTP hidden g_1 that the feed leaving the row's queue
    empty kept; the drafter then runs k - 1 greedy steps from (g_1, d_1) at positions F .. F+k-2
    (mtp.draft_greedy), each within the row's masks (_Guide)."""

    def __init__(self, drafter):
        self.drafter = drafter
        # seq_id -> (g_1 [H], d_1): kept by the feed, for the next unit that drafts (g_1: a
        # masked d_1 and the next draft step)
        self.first: dict = {}
        # seq_id -> int32 [1 + steps] the next unit's drafts d_1 .. made behind the last verify
        # (verify_and_draft), for a row without masks drafting at most that many
        self.drafts: dict = {}

    def ready(self, seq_id: int) -> bool:
        return seq_id in self.first

    def forget(self, seq_id: int) -> None:
        self.first.pop(seq_id, None)
        self.drafts.pop(seq_id, None)

    def keep(self, seq_id: int, g1: np.ndarray, drafts: np.ndarray) -> None:
        """The drafts a verify made behind itself for the row's next unit (its feed covers the
        row's frontier): g_1 and d_1 as a feed keeps them, and the chained drafts after d_1."""
        self.first[seq_id] = (g1, int(drafts[0]))
        self.drafts[seq_id] = drafts

    def feed(self, prog, batch: ForwardBatch, hidden: np.ndarray, seqs) -> None:
        """The drafter's KV of the batch's positions from the pairs (h_t, x_{t+1}); each row's
        last MTP hidden and its argmax are kept."""
        ids, g = self.drafter.forward_argmax(batch, hidden, prog.kv)
        for i, seq in enumerate(seqs):
            self.first[seq.seq_id] = (g[i].copy(), int(ids[i]))
            self.drafts.pop(seq.seq_id, None)

    def propose(self, prog, seqs, ks: dict, guide: "_Guide") -> dict:
        """{row index: int32 drafts} of the rows in ks (row -> its k), each within its masks:
        the drafts the last verify made behind itself where a row has enough of them and no
        masks, else drafted now."""
        made = {r: self.drafts[seqs[r].seq_id][:k] for r, k in ks.items()
                if r not in guide.rows and len(self.drafts.get(seqs[r].seq_id, ())) >= k}
        rest = {r: k for r, k in ks.items() if r not in made}
        return {**made, **self._chain(prog, seqs, rest, guide)} if rest else made

    def _chain(self, prog, seqs, ks: dict, guide: "_Guide") -> dict:
        g1 = np.stack([self.first[seqs[r].seq_id][0] for r in ks])
        first = np.array([self.first[seqs[r].seq_id][1] for r in ks], np.int32)
        for i, r in enumerate(ks):
            first[i] = guide.pick(r, g1[i], int(first[i]))
        drafts = {r: first[i:i + 1].astype(np.int32) for i, r in enumerate(ks)}
        more = [r for r in ks if ks[r] > 1 and r not in guide.cut]
        if more:
            sel = [seqs[r] for r in more]

            def pick(step, live, g, tokens):
                for j, li in enumerate(live):
                    tokens[j] = guide.pick(more[li], g[j], int(tokens[j]))
                return tokens
            tail, _ = self.drafter.draft_greedy(
                prog.kv, np.stack([self.first[s.seq_id][0] for s in sel]),
                [int(drafts[r][0]) for r in more],
                [s.num_computed_tokens for s in sel],
                prog.block_tables(sel), [ks[r] - 1 for r in more],
                with_logits=False, pick=pick if guide.rows else None)
            for i, r in enumerate(more):
                drafts[r] = np.concatenate([drafts[r], tail[i, :ks[r] - 1]])
        return drafts


class _BlockProposer:
    """DFlash's drafts: one block pass of the drafter (dflash.py) per unit gives every row all its
    drafts at once, from its anchor x_F and the context the feed wrote; a masked row picks them
    in order within its masks (the block's inputs do not depend on the picks)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.fed: set = set()           # rows whose drafter KV covers their frontier

    def ready(self, seq_id: int) -> bool:
        return seq_id in self.fed

    def forget(self, seq_id: int) -> None:
        self.fed.discard(seq_id)

    def feed(self, prog, batch: ForwardBatch, hidden: np.ndarray, seqs) -> None:
        """The drafter's context KV of the batch's positions from the target's features."""
        self.drafter.feed(batch, hidden, prog.kv)
        self.fed.update(seq.seq_id for seq in seqs)

    def propose(self, prog, seqs, ks: dict, guide: "_Guide") -> dict:
        sel = [seqs[r] for r in ks]
        anchors = [int(prog.token_ids(s, s.num_computed_tokens, s.num_computed_tokens + 1)[0])
                   for s in sel]
        # [R, bs - 1], [R, bs - 1, H] (the hidden states only for rows drafting within masks)
        free, g = self.drafter.draft(prog.kv, anchors, [s.num_computed_tokens for s in sel],
                                     prog.block_tables(sel), with_hidden=bool(guide.rows))
        drafts = {}
        for i, (r, k) in enumerate(ks.items()):
            drafts[r] = np.array([guide.pick(r, g[i, j], int(free[i, j])) for j in range(k)],
                                 np.int32) if r in guide.rows else free[i, :k].copy()
        return drafts


class Speculator:
    def __init__(self, drafter, num_draft_tokens, kv, adaptive: bool = True,
                 snapshots: bool = False):
        """drafter: the MTP drafter (mtp.MtpDrafter, cuda/drafter.CudaDrafter) or the DFlash
        drafter (dflash.DFlashDrafter) over the Program's model; kv: the Program's KV pool (the
        drafter's layers join it here, before the Program sizes its host copies of a page).
        num_draft_tokens: k (None: MTP's default 3, DFlash's block_size - 1), or with `adaptive`
        the most a unit drafts (draft_policy.py picks 0..k per unit from measured acceptance and
        costs). snapshots: the model's verify_snapshots (rollback by snapshot slot, after
        `use_snapshot_slots`)."""
        most = drafter.max_draft_tokens
        if num_draft_tokens is None:
            num_draft_tokens = most if drafter.hidden_layers is not None \
                else min(DEFAULT_MTP_DRAFT_TOKENS, most)
        if not 1 <= num_draft_tokens <= most:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} outside 1..{most} (the "
                             "drafter's most)")
        drafter.join_kv_pool(kv)
        self.drafter = drafter
        # what the target's forward hands the feed: None, the final-normed hidden (MTP); else the
        # outputs of these target layers (DFlash's features)
        self.hidden_layers = drafter.hidden_layers
        self.proposer = _ChainProposer(drafter) if self.hidden_layers is None \
            else _BlockProposer(drafter)
        self.num_draft_tokens = int(num_draft_tokens)
        self.snapshots = bool(snapshots)
        self._snap_first = None       # the first snapshot slot (use_snapshot_slots)
        self.policy = DraftPolicy(self.num_draft_tokens, adaptive)
        # seq_id -> (first position, [hidden [n, H], ...]): the target's hidden states (or
        # features) of committed positions the drafter's KV does not cover yet (LAG_TOKENS)
        self._lag: dict = {}
        self._rows: dict = {}         # seq_id -> _Row of the pending unit
        self._epoch: Optional[int] = None
        self._unit: Optional[_Unit] = None          # the unit in flight
        self._chosen = None           # the policy's k for the next unit, taken ahead of it
        self._next: dict = {}         # seq_id -> (g_1, drafts) the pending verify made behind it
        self._plain_started = collections.deque()   # launch times of plain steps in flight
        self._last_commit = 0.0       # perf_counter at the end of the last commit
        k = self.num_draft_tokens
        self._drafted_at = np.zeros(k, np.int64)      # drafts proposed at position i (1-based)
        self._accepted_at = np.zeros(k, np.int64)     # ... of them the Engine accepted
        self._counts = dict(spec_verify_rows=0, spec_emitted_tokens=0, spec_recompute_rows=0,
                            spec_recompute_tokens=0, spec_snapshot_selects=0,
                            # plain decode steps at k = 0 (runs_plain), of them launched ahead
                            spec_plain_steps=0, spec_plain_ahead=0,
                            # timed units that paid a first use (a graph captured, a GEMM
                            # planned: Model.one_off_seconds), and those seconds: left out of
                            # the unit's cost
                            spec_units_first_use=0, spec_first_use_seconds=0.0,
                            # verifies whose drafter feed and next drafts ran behind them
                            spec_drafts_behind_verify=0,
                            # catch-up feeds (_catch_up) and the positions they fed
                            spec_catch_up_feeds=0, spec_catch_up_positions=0,
                            # ... of them, those before a unit's drafts and their seconds:
                            # left out of the unit's cost, in the policy's measuring account
                            spec_catch_up_units=0, spec_catch_up_seconds=0.0,
                            # units run here but not timed for the policy (prefill, Replay or
                            # control rows beside): how many, their seconds commit to commit
                            spec_untimed_units=0, spec_untimed_seconds=0.0)

    def use_snapshot_slots(self, first: int) -> None:
        """The snapshot slots (memory_plan.snapshot_slots, which the CUDA plan reserved) start
        at State slot `first`: sequence slot s owns first + s * (k+1) .. first + s * (k+1) + k."""
        self._snap_first = int(first)

    def _snap_base(self, seq) -> int:
        if self._snap_first is None:
            raise ProgramError("speculative: snapshot rollback without snapshot slots")
        return self._snap_first + seq.slot * (self.num_draft_tokens + 1)

    # ---- execute ---------------------------------------------------------------------------------
    def execute(self, prog, seqs, units, masks, keep_rollback: bool,
                draft_masks: Optional[Callable[[int, tuple], list]]) -> PendingBatch:
        """Run the unit: draft for the decode rows that can, one target forward over every row,
        sample (verify rows: position by position). Returns the Program's PendingBatch."""
        t0 = time.perf_counter()
        drafts = self._draft(prog, seqs, units, t0, masks, draft_masks)
        units = [dataclasses.replace(u, num_new_tokens=1 + len(drafts[r])) if r in drafts else u
                 for r, u in enumerate(units)]
        on_device = prog.samples_on_device(seqs, units, masks)
        tail = self._tail_plan(prog, seqs, masks, drafts) if on_device else None
        batch = prog.pack_rows(seqs, units)
        if tail:        # (the chain writes KV past the verify's tokens: the pages that hold it)
            reach = max(s.num_tokens for s in seqs) + len(drafts[0]) + tail
            width = max(batch.block_tables.shape[1], -(-reach // prog.kv.page_size))
            batch = dataclasses.replace(batch, block_tables=prog.block_tables(seqs)[:, :width])
        # the State before the unit: for the Engine's rollback, and (recompute) a verify row's
        recompute = not self.snapshots
        backups = [prog.state.read(s.slot) if keep_rollback or (recompute and r in drafts)
                   else None for r, s in enumerate(seqs)]
        snaps = [self._snap_base(s) if self.snapshots and r in drafts else -1
                 for r, s in enumerate(seqs)]
        media = prog.media_rows(seqs, units)
        starts = np.asarray(batch.query_start, np.int64)
        snap_base = snaps if self.snapshots and drafts else None
        if on_device:
            rows, hidden = self._sample_on_device(prog, seqs, units, masks, drafts, draft_masks,
                                                  batch, starts, snap_base, media, tail)
        else:
            # logits: every position of a verify row, the last token of the others
            picks = [np.arange(starts[r], starts[r + 1]) if r in drafts else [starts[r + 1] - 1]
                     for r in range(len(seqs))]
            logits, hidden = prog.model.verify_forward(
                batch, prog.kv, prog.state, np.concatenate(picks).astype(np.int32),
                snap_base=snap_base, media=media, **self.feed_kind())
            bounds = np.cumsum([0] + [len(p) for p in picks])
            rows = []
            for r, (seq, unit) in enumerate(zip(seqs, units)):
                row_logits = logits[bounds[r]:bounds[r + 1]]
                if r in drafts:
                    rows.append(self._verify_row(prog, seq, drafts[r], row_logits, masks[r],
                                                 draft_masks))
                else:
                    rows.append(prog.sample_row(seq, unit, row_logits[0], masks[r]))
        self._rows = {}
        for r, (seq, unit) in enumerate(zip(seqs, units)):
            self._rows[seq.seq_id] = _Row(seq.seq_id, seq.num_computed_tokens,
                                          None if hidden is None
                                          else hidden[starts[r]:starts[r + 1]].copy(),
                                          tuple(drafts.get(r, ())),
                                          backups[r] if r in drafts else None, snaps[r])
        pending = PendingBatch(tuple(rows), backups, prog.new_unit_id())
        self._epoch = pending._epoch
        return pending

    def feed_kind(self) -> dict:
        """The verify's (and a plain step's, launch_tokens(keep_hidden=True)) keyword for what
        it hands the feed: nothing for the final-normed hidden (MTP: every backend's default),
        hidden_layers for DFlash's features."""
        return {} if self.hidden_layers is None else {"hidden_layers": self.hidden_layers}

    def _can_draft(self, seq, unit) -> bool:
        """A decode unit of a text row whose d_1 is ready (its frontier's MTP hidden is kept)."""
        return unit.is_sampling and not unit.forced and not unit.is_replay \
            and seq.media is None and seq.num_tokens > seq.num_prompt_tokens \
            and (self.proposer.ready(seq.seq_id) or seq.seq_id in self._lag)

    def _draft_room(self, prog, seq, k: int) -> int:
        """Drafts this row verifies now, up to k: capped by max_context; the pages of positions
        F .. F+k taken now if free (returned by commit's trim), else what the row's pages
        already hold. A drafter whose pass writes KV past them (pages_ahead) drafts nothing
        where the row cannot hold F .. F + pages_ahead."""
        n = seq.num_tokens
        k = min(k, prog.max_context - n - 1)
        if k > 0:
            ahead = n + self.drafter.pages_ahead
            covered = prog.grow_pages(seq, max(n + k, ahead))
            k = min(k, covered - n) if covered >= ahead else 0
        return max(k, 0)

    def _draft(self, prog, seqs, units, t0: float, masks, draft_masks) -> dict:
        """{row index: int32 [k] drafts} of the rows that speculate; the drafts are written after
        the committed tokens, where packing reads them. The policy picks k for the rows that can
        draft; a unit whose every row can is timed for it (its cost at that k), one with other
        rows beside (prefill, Replay, control) is not. A row with a mask (a grammar, a stop-token
        ban, ...) drafts within its masks: d_1 within this step's, d_j+1 within the one after
        d_1 .. d_j (draft_masks), so the verify never rejects a draft the grammar refuses; its
        drafts end where the masks do (the output ends there, or nothing is allowed)."""
        able = [r for r, (seq, unit) in enumerate(zip(seqs, units)) if self._can_draft(seq, unit)]
        timed = bool(able) and len(able) == len(seqs)
        k = self._choice([seqs[r] for r in able], timed) if able else 0
        self._unit = _Unit(t0, len(able), k, prog.model.one_off_seconds, timed)
        ks = {r: self._draft_room(prog, seqs[r], k) for r in able} if k else {}
        ks = {r: n for r, n in ks.items() if n > 0}
        if not ks:
            return {}
        # the positions the drafter missed (plain units, the prompt) before the first drafts: a
        # one-off of switching to drafting, not what a unit at k costs (_Unit.catch_up)
        c0, once = time.perf_counter(), prog.model.one_off_seconds
        if self._catch_up(prog, [seqs[r] for r in ks]):
            # (less the one-off work in it, a GEMM plan of a new length: the unit's `once`)
            catch = max(time.perf_counter() - c0 - (prog.model.one_off_seconds - once), 0.0)
            self._unit = self._unit._replace(catch_up=catch)
            self._counts["spec_catch_up_units"] += 1
            self._counts["spec_catch_up_seconds"] += catch
        guide = _Guide(self.drafter, seqs, masks, draft_masks)
        drafts = self.proposer.propose(prog, seqs, ks, guide)
        drafts = {r: d[:guide.cut.get(r, len(d))] for r, d in drafts.items()}
        drafts = {r: d for r, d in drafts.items() if len(d)}
        for r, d in drafts.items():
            prog.write_provisional(seqs[r], d)
        return drafts

    def _tail_plan(self, prog, seqs, masks, drafts) -> Optional[int]:
        """The chained steps the next unit's drafts take behind this unit's verify
        (verify_and_draft: its drafter feed and those drafts run on the device behind the
        verify, one wait instead of three), or None where that does not apply. It applies to a
        unit sampled on the device (execute asks) with a drafter that drafts in its verify
        (CUDA's MTP) under snapshot rollback, every row drafting the same k and none masked.
        The policy's k for the next unit is chosen now (kept for it: _choice); steps is that
        k - 1, fewer where a row's pages cannot take the chain's KV writes (up to
        F + k + steps: its pages are taken now, commit's trim returns them)."""
        if not getattr(self.drafter, "drafts_in_verify", False) or not self.snapshots \
                or not drafts or len(drafts) != len(seqs) or any(m is not None for m in masks):
            return None
        k = len(drafts[0])
        if any(len(d) != k for d in drafts.values()):
            return None
        self._chosen = self._choice(seqs)
        steps = max(self._chosen - 1, 0)
        for seq in seqs:
            n = seq.num_tokens
            steps = max(0, min(steps, prog.max_context - n - k))
            if steps:
                steps = max(0, min(steps, prog.grow_pages(seq, n + k + steps) - n - k))
        if not self.drafter.verify_draft_fits(len(seqs) * (k + 1), len(seqs), steps):
            return None
        return steps

    def _sample_on_device(self, prog, seqs, units, masks, drafts, draft_masks, batch, starts,
                          snap_base, media, tail=None) -> tuple:
        """The unit's forward with every sampled position sampled on the device (verify_tokens):
        a verify row's positions 0 .. k (as many as its masks reach) each as the decode step
        there would sample it (history: the tokens before it, drafts included; the mask after
        the drafts before it; the draw at its position), the other rows' last token. Returns
        (RowResults, hidden); hidden is None where the drafter's feed and the next unit's drafts
        ran behind the verify (tail: their chained steps, _tail_plan), the drafts kept in
        self._next until commit."""
        picks, requests, spans = [], [], []
        for r, (seq, unit) in enumerate(zip(seqs, units)):
            n = seq.num_tokens
            if r in drafts:
                row_masks = [masks[r]] + self._later_masks(seq, drafts[r], draft_masks)
                picks += range(starts[r], starts[r] + len(row_masks))
                requests += [prog.sample_request(seq, n + j, m) for j, m in enumerate(row_masks)]
            else:
                row_masks = [masks[r]]
                picks.append(starts[r + 1] - 1)
                requests.append(prog.sample_request(seq, n, masks[r]) if unit.is_sampling
                                else None)
            spans.append(len(row_masks))
        if tail is not None and len(picks) == batch.num_tokens \
                and all(q is not None and q.mask is None for q in requests):
            tokens, nxt, g1 = self.drafter.verify_and_draft(prog.model, batch, prog.kv,
                                                            prog.state, requests,
                                                            snap_base=snap_base, steps=tail)
            self._next = {seq.seq_id: (g1[r].copy(), nxt[r].copy())
                          for r, seq in enumerate(seqs)}
            self._counts["spec_drafts_behind_verify"] += 1
            hidden = None
        else:
            tokens, hidden = prog.model.verify_tokens(batch, prog.kv, prog.state,
                                                      np.asarray(picks, np.int32), requests,
                                                      snap_base=snap_base, media=media,
                                                      **self.feed_kind())
        rows, at = [], 0
        for r, (seq, unit) in enumerate(zip(seqs, units)):
            got = [int(t) for t in tokens[at:at + spans[r]]]
            at += spans[r]
            if r in drafts:
                d = drafts[r]
                j = 0
                while j < len(got) - 1 and j < len(d) and got[j] == d[j]:
                    j += 1
                rows.append(RowResult(seq.seq_id, 1 + len(d), tuple(got[:j + 1]), (), False,
                                      is_speculative=True))
            else:
                rows.append(RowResult(seq.seq_id, unit.num_new_tokens,
                                      tuple(got) if unit.is_sampling else (), (), unit.is_replay,
                                      is_control=False))
        return rows, hidden

    @staticmethod
    def _later_masks(seq, drafts, draft_masks) -> list:
        """The masks of a verify row's positions 1 .. k: after d_1 .. d_j (fewer where its
        output ends within the drafts); None each without a session to ask."""
        k = len(drafts)
        if draft_masks is None:
            return [None] * k
        return list(draft_masks(seq.seq_id, tuple(int(d) for d in drafts)))[:k]

    def _verify_row(self, prog, seq, drafts, logits, mask0, draft_masks) -> RowResult:
        """Sample positions 0 .. k of a verify row as decode steps would, up to the first token
        that differs from the draft there."""
        k = len(drafts)
        later = self._later_masks(seq, drafts, draft_masks)
        num_prompt, n = seq.num_prompt_tokens, seq.num_tokens
        prompt = prog.token_ids(seq, 0, num_prompt)
        produced, logprobs = [], []
        for j, mask in enumerate([mask0] + later):
            token, lp = sample_row(logits[j], seq.spec, prompt,
                                   prog.token_ids(seq, num_prompt, n + j), position=n + j,
                                   mask=mask)
            produced.append(token)
            if lp is not None:
                logprobs.append(lp)
            if j == k or token != drafts[j]:
                break
        return RowResult(seq.seq_id, 1 + k, tuple(produced), tuple(logprobs), False,
                         is_speculative=True)

    # ---- commit ----------------------------------------------------------------------------------
    def after_commit(self, prog, pending: PendingBatch, decisions) -> None:
        """After the Program advanced the frontiers: fix the State of verify rows that rejected a
        draft (their snapshot after the last accepted token, or a recompute), then queue every
        row's newly committed positions for the drafter (fed at once where LAG_TOKENS are
        queued)."""
        if pending._epoch != self._epoch:
            raise ProgramError("speculative: commit of a unit it did not run")
        rows, self._rows, self._epoch = self._rows, {}, None
        made, self._next = self._next, {}
        unit, self._unit = self._unit, None
        recompute, feed, selects = [], [], 0
        for row, d in zip(pending.rows, decisions):
            seq = prog.sequence(row.seq_id)
            rec = rows[row.seq_id]
            if d.is_cancelled or seq is None or seq.is_unusable or seq.media is not None:
                self.forget(row.seq_id)
                continue
            advance = seq.num_computed_tokens - rec.start
            if row.is_speculative:
                self._count(rec, row, d.accepted)
                if advance < row.num_new_tokens:
                    if rec.snap < 0:
                        recompute.append((seq, rec, advance))
                    elif advance < 1:       # (outcome.decide accepts >= 1 of an uncancelled row)
                        raise ProgramError(f"speculative: sequence {seq.seq_id} accepted no "
                                           "token of its verify")
                    else:
                        prog.state.copy(rec.snap + advance - 1, seq.slot)
                        selects += 1
            if rec.hidden is None:
                # fed behind the verify (verify_and_draft): its KV covers what the Engine took;
                # the next drafts hold where it took every produced token, else made again
                if advance == len(row.produced) and row.seq_id in made:
                    self.proposer.keep(row.seq_id, *made[row.seq_id])
                else:
                    self.proposer.forget(row.seq_id)
            elif advance > 0:
                feed.append((seq, rec, advance))
        self._counts["spec_snapshot_selects"] += selects
        if recompute:
            self._recompute(prog, recompute)
        due = [seq for seq, rec, n in feed if self._queue(seq, rec.start, rec.hidden[:n])]
        self._catch_up(prog, due)
        now = time.perf_counter()
        if unit is not None and not unit.timed:
            self._counts["spec_untimed_units"] += 1
            self._counts["spec_untimed_seconds"] += self._unit_seconds(unit.t0, now)
        elif unit is not None:
            # (a graph captured or a GEMM planned during the unit is a first use, not its k's
            # cost: a catch-up feed of a length not fed before plans its GEMMs, and such units
            # left out entirely made the cold start run each k up to three times, and most
            # explorations after a run of plain steps go untimed. Its catch-up feed is not its
            # k's cost either, but the measuring account pays it: observe_unit's catch_up)
            once = prog.model.one_off_seconds - unit.one_off
            if once > 0:
                self._counts["spec_units_first_use"] += 1
                self._counts["spec_first_use_seconds"] += once
            seconds = self._unit_seconds(unit.t0, now) - once
            catch = min(unit.catch_up, max(seconds, 0.0))
            self.policy.observe_unit(unit.rows, unit.k, max(seconds - catch, MIN_UNIT_SECONDS),
                                     catch_up=catch)
        self._last_commit = now

    def _unit_seconds(self, t0: float, now: float) -> float:
        """A unit's cost for the policy, launched at t0 and committed at now: the time since the
        last commit, as what a unit costs the Engine is the time between two commits. That
        includes the host's work before the launch (the EngineCore's outcome, streaming and
        scheduling), which a speculative unit waits for and a plain step launched ahead runs
        under the one before it (its t0 is before the last commit); timing a speculative unit
        from its own launch alone made drafting look cheaper than it is (issue 25: at B = 8 the
        policy drafted where plain decoding was faster). A gap longer than the unit itself is
        not scheduling (the Engine was idle or paused, or this is the first unit): from t0."""
        since = self._last_commit
        return now - (since if t0 - since < now - t0 else t0)

    def _queue(self, seq, at: int, hidden: np.ndarray) -> bool:
        """Queue the target's hidden states of the row's positions at .. at + len(hidden) - 1
        for the drafter (they continue its queue); True when LAG_TOKENS are queued."""
        start, chunks = self._lag.setdefault(seq.seq_id, (at, []))
        if start + sum(len(c) for c in chunks) != at:
            raise ProgramError(f"speculative: sequence {seq.seq_id} committed from {at}, its "
                               f"drafter feed is queued from {start}")
        chunks.append(hidden)
        self.proposer.forget(seq.seq_id)
        return seq.num_computed_tokens - start >= LAG_TOKENS

    # ---- plain decode steps at k = 0 (the Program's own path, launched ahead) -----------------
    def runs_plain(self, prog, seqs, units, masks) -> bool:
        """Whether the Program runs this unit as a plain decode step of its own instead of
        `execute`: the model keeps a token step's hidden states (Model.step_hidden), the unit
        is sampled on the device, every row is a decode row that could draft, and the policy
        picks k = 0 for it. Such steps run as without speculation (device token path, the next
        one launched ahead: Program.launch_ahead asks `runs_plain_ahead`), and their commit
        queues the rows' hidden states (DFlash: features, `feed_kind`) for the drafter
        (`after_plain`), so an adaptive k = 0 costs what plain decoding does."""
        if not prog.model.step_hidden or not prog.samples_on_device(seqs, units, masks) \
                or not all(self._can_draft(s, u) for s, u in zip(seqs, units)):
            return False
        return self._plain_choice(seqs)

    def runs_plain_ahead(self, seqs) -> bool:
        """Whether the step after a plain one over the same rows (launched ahead of its
        collect) is plain too: the policy's pick for that unit, kept for it when not 0."""
        if not self._plain_choice(seqs):
            return False
        self._counts["spec_plain_ahead"] += 1
        return True

    def _plain_choice(self, seqs) -> bool:
        k = self._choice(seqs)
        if k:
            self._chosen = k            # the next unit drafts k (its _draft takes it)
            return False
        self._plain_started.append(time.perf_counter())
        return True

    def _choice(self, seqs, timed: bool = True) -> int:
        """The policy's k for the next unit of these rows that can draft (one taken ahead by
        _plain_choice or _tail_plan and not used yet, first; else from the rows' own
        acceptance); timed: the unit has no other rows."""
        k, self._chosen = self._chosen, None
        return k if k is not None else self.policy.choose(len(seqs), timed,
                                                          [s.seq_id for s in seqs])

    def after_plain(self, prog, pending: PendingBatch, decisions, hidden: np.ndarray) -> None:
        """After the Program committed a plain step (runs_plain): each row that took its token
        queues the step's hidden state of the position it ran for the drafter. Fed when the
        row next drafts or is settled, never here: the next step may be in flight, and a
        drafter call on the device now would overwrite the token ids it reads. The unit's
        cost for the policy: the time since the last commit, as every unit's (_unit_seconds)."""
        for r, (row, d) in enumerate(zip(pending.rows, decisions)):
            seq = prog.sequence(row.seq_id)
            if d.is_cancelled or d.is_discarded or seq is None or seq.is_unusable:
                self.forget(row.seq_id)
                continue
            self._queue(seq, seq.num_computed_tokens - 1, hidden[r:r + 1])
        self._counts["spec_plain_steps"] += 1
        now = time.perf_counter()
        if self._plain_started:
            t0 = self._plain_started.popleft()
            # (launched before the last commit: ahead of the step before, as plain decoding)
            self.policy.observe_unit(len(pending.rows), 0, self._unit_seconds(t0, now),
                                     pipelined=t0 < self._last_commit)
        self._last_commit = now

    def plain_aborted(self) -> None:
        """The Program dropped a plain step's PendingBatch: nothing to queue."""
        if self._plain_started:
            self._plain_started.popleft()

    def _count(self, rec: _Row, row: RowResult, accepted: int) -> None:
        k = len(rec.drafts)
        matched = 0
        while matched < min(k, len(row.produced)) and row.produced[matched] == rec.drafts[matched]:
            matched += 1
        kept = min(matched, accepted)
        self.policy.observe_row(k, matched, rec.seq_id)
        self._drafted_at[:k] += 1
        self._accepted_at[:kept] += 1
        self._counts["spec_verify_rows"] += 1
        self._counts["spec_emitted_tokens"] += accepted

    def _recompute(self, prog, items) -> None:
        """Restore the pre-verify State and run the accepted tokens again (their KV too)."""
        for seq, rec, _ in items:
            prog.state.write(seq.slot, rec.backup)
        batch = self._batch(prog, [(seq, rec.start, n) for seq, rec, n in items],
                            [prog.token_ids(seq, rec.start, rec.start + n)
                             for seq, rec, n in items])
        prog.model.final_hidden(batch, prog.kv, prog.state)
        self._counts["spec_recompute_rows"] += len(items)
        self._counts["spec_recompute_tokens"] += int(batch.num_tokens)

    def _catch_up(self, prog, seqs) -> bool:
        """Feed the drafter the queued positions of these rows, in one call: its KV of positions
        start .. F-1 from the pairs (h_t, x_{t+1}); the last pair's MTP hidden and its argmax
        (the row's next first draft) are kept. Whether there was anything to feed."""
        items = [(seq, *self._lag.pop(seq.seq_id)) for seq in seqs if seq.seq_id in self._lag]
        if not items:
            return False
        rows = [(seq, start, sum(len(c) for c in chunks)) for seq, start, chunks in items]
        batch = self._batch(prog, rows, [prog.token_ids(seq, start + 1, start + 1 + n)
                                         for seq, start, n in rows])
        self._counts["spec_catch_up_feeds"] += 1
        self._counts["spec_catch_up_positions"] += int(batch.num_tokens)
        hidden = np.concatenate([c for _, _, chunks in items for c in chunks])
        self.proposer.feed(prog, batch, hidden, [seq for seq, _, _ in rows])
        return True

    @staticmethod
    def _batch(prog, rows, tokens) -> ForwardBatch:
        """Text rows (seq, start, n) with the given tokens at positions start .. start+n-1."""
        starts = np.array([s for _, s, _ in rows], np.int32)
        counts = np.array([n for _, _, n in rows], np.int32)
        query_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        seqs = [seq for seq, _, _ in rows]
        slots = np.array([seq.slot for seq in seqs], np.int32)
        return ForwardBatch(np.concatenate(tokens).astype(np.int32),
                            ForwardBatch.text_positions(starts, counts), query_start, starts,
                            prog.block_tables(seqs), slots)

    # ---- lifetime and observation ----------------------------------------------------------------
    def settle(self, prog, seq) -> None:
        """The drafter's KV of this row covers its frontier: before its pages are copied or
        shared (a checkpoint, a Snapshot pause, a kept continuation), whoever reads them later
        must find the MTP layer's entries complete."""
        self._catch_up(prog, [seq])

    def forget(self, seq_id: int) -> None:
        """The sequence left the Program (released or paused): its next draft, queued feed and
        acceptance of its own go with it."""
        self.proposer.forget(seq_id)
        self._lag.pop(seq_id, None)
        self.policy.forget_row(seq_id)

    def stats(self) -> dict:
        drafted, accepted = int(self._drafted_at.sum()), int(self._accepted_at.sum())
        return dict(self._counts, **self.policy.stats(),
                    spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
                    spec_num_draft_tokens=self.num_draft_tokens,
                    spec_drafted_by_position=self._drafted_at.tolist(),
                    spec_accepted_by_position=self._accepted_at.tolist(),
                    spec_acceptance_by_position=[
                        float(a / d) if d else 0.0
                        for a, d in zip(self._accepted_at, self._drafted_at)])
