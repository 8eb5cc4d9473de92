"""A sequence's record and the unit arithmetic: which unit a sequence runs next, derived from its
frontier and token counts alone (no pools, no model).

    token_buf[slot]  | prompt ........ | generated (accepted) |
                     0          num_prompt_tokens        num_tokens
    KV / State       [0, num_computed_tokens)  = the frontier; the next unit starts there

`UnitRules` holds the options' numbers the arithmetic needs; the Program owns one and asks it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ....contracts import ProgramError, ResumeState, RowDecision, RowResult, SamplingSpec


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    slot: int
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    spec: SamplingSpec
    replay_until: int = 0        # frontier of the run that was paused (Replay rebuilds to it)
    protected_tokens: int = 0    # KV coverage a resume permit holds until real new progress
    is_unusable: bool = False    # rolled back without a State backup: may only be released
    captures: list = None        # checkpoint positions still to capture, ascending (prefill
                                 # chunks end there; the ContextCache captures after commit)
    media: object = None         # vision.PromptMedia: MRoPE positions + embeddings, or None


@dataclass(frozen=True, slots=True)
class Unit:
    num_new_tokens: int
    is_sampling: bool
    is_replay: bool
    forced: tuple = ()           # control unit: the tokens it produces


@dataclass(frozen=True, slots=True)
class UnitRules:
    prefill_chunk: int
    max_context: int
    # batch_invariant: Replay re-runs history the way it first ran (the prompt in its own
    # chunks, each generated token as a one-token decode-shaped unit), so its numerics match
    replays_as_run: bool

    def unit_of(self, seq: Sequence, forced) -> Unit:
        """The next unit, or the control unit of the tokens `forced` maps the sequence to."""
        tokens = () if forced is None else tuple(int(t) for t in forced.get(seq.seq_id, ()))
        if not tokens:
            return self.next_unit(seq)
        if seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_tokens <= seq.num_prompt_tokens:
            raise ProgramError(f"control unit on sequence {seq.seq_id}, which is not decode-ready")
        if seq.num_tokens + len(tokens) > self.max_context:
            raise ProgramError(f"control unit of {len(tokens)} tokens overruns max_context")
        return Unit(len(tokens), False, False, tokens)

    def next_unit(self, seq: Sequence) -> Unit:
        done, total = seq.num_computed_tokens, seq.num_tokens
        if total > seq.num_prompt_tokens:              # has generated: replay to total-1, decode
            if done == total - 1:
                return Unit(1, True, False)
            if done < total - 1:
                return Unit(self.replay_length(seq), False, True)
        elif done < total:
            n = min(self.prefill_chunk, total - done)
            nxt = next((q for q in seq.captures or () if q > done), 0)
            if done < nxt < done + n:                  # end a chunk exactly at a checkpoint
                n = nxt - done
            return Unit(n, done + n == total, done < seq.replay_until)
        raise ProgramError(f"sequence {seq.seq_id}: no unit at frontier {done} of {total}")

    def replay_length(self, seq: Sequence) -> int:
        """Tokens of the next Replay unit of a sequence that has generated. replays_as_run: the
        prompt's chunk boundaries as its prefill had them (multiples of prefill_chunk, then the
        prompt's end), then one generated token per unit, as decode produced them."""
        done = seq.num_computed_tokens
        if not self.replays_as_run:
            return min(self.prefill_chunk, seq.num_tokens - 1 - done)
        if done < seq.num_prompt_tokens:
            return min(self.prefill_chunk, seq.num_prompt_tokens - done)
        return 1

    def resume_coverage(self, rs: ResumeState) -> int:
        """Old frontier + the first real new unit."""
        frontier = rs.num_computed_tokens
        if rs.num_tokens > rs.num_prompt_tokens:
            return rs.num_tokens
        return frontier + min(self.prefill_chunk, rs.num_tokens - frontier)


def row_kind(seq: Sequence, unit: Unit) -> str:
    """'prefill', 'replay' or 'decode': what kind of unit `unit` (the next one) is."""
    return "replay" if unit.is_replay else \
        "decode" if seq.num_tokens > seq.num_prompt_tokens else "prefill"


def capture_due(seq: Sequence) -> int:
    """The checkpoint position the frontier sits on exactly now, else 0; positions already
    passed without a capture (e.g. by a control unit) are dropped."""
    while seq.captures and seq.captures[0] < seq.num_computed_tokens:
        seq.captures.pop(0)
    if seq.captures and seq.captures[0] == seq.num_computed_tokens and not seq.is_unusable:
        return seq.captures[0]
    return 0


def capture_positions(interval: int, end: int, reused: int) -> list:
    """Where a fresh prompt's prefill chunks end for checkpoints: at the multiples of `interval`
    before `end` (its reusable boundary) that lie at least `interval` tokens past the `reused`
    prefix, and at `end`. (A multiple closer to the prefix than that saves a later prompt less
    than an interval's prefill but costs this one a chunk cut short: a chat turn's 1,024 new
    tokens after a 1,280-token prefix crossed 2,048 and ran as 3 calls instead of 2, 1.55x the
    new tokens' prefill alone on the H200.)"""
    return [q for q in range(interval, end, interval) if q >= reused + interval] + \
        ([end] if end > reused else [])


def check_decision(row: RowResult, d: RowDecision) -> None:
    """The accepted-prefix rule a commit's decision must keep for its row."""
    produced = len(row.produced)
    if d.is_discarded:
        ok = d.accepted == 0 and d.is_terminal and not d.is_cancelled
    elif d.is_cancelled:
        ok = d.accepted == 0
    elif produced == 0:
        ok = d.accepted == 0
    else:
        ok = 1 <= d.accepted <= produced and (d.is_terminal or d.accepted == produced)
    if not ok:
        raise ProgramError(f"decision {d} breaks the accepted-prefix rule for a row that "
                           f"produced {produced} token(s)")
