"""Program: paging, units, PendingBatch commit/abort, pause/resume (Replay and Snapshot).

FakeModel's logits depend on the whole history read back through KV pages and the State slot,
so any paging, rollback or restore mistake changes the tokens."""
import numpy as np
import pytest

from ninfer.errors import RequestError
from ninfer.models.qwen3_5.program import (Program, ProgramError, RowDecision, SamplingSpec)
from ninfer.options import EngineOptions
from ninfer.models.qwen3_5.fakes import FakeModel

GREEDY = SamplingSpec(seed=1)
SEEDED = SamplingSpec(seed=77, temperature=0.9, top_k=20, top_p=0.95)


def opts(**kw):
    base = dict(max_concurrency=4, max_context=64, page_size=4, prefill_chunk=5)
    base.update(kw)
    return EngineOptions(**base)


def prompt(seed, n):
    return np.random.default_rng(seed).integers(1, 64, n).astype(np.int32)


def step(prog, sids):
    """Reserve + execute + accept everything (nonterminal); returns produced per row."""
    assert prog.reserve_units(sids) == [True] * len(sids)
    pending = prog.execute(sids)
    prog.commit(pending, [RowDecision(len(r.produced)) for r in pending.rows])
    prog.check_invariants()
    return [list(r.produced) for r in pending.rows]


def generate(prog, sid, num_tokens):
    out = []
    while len(out) < num_tokens:
        out += step(prog, [sid])[0]
    return out


def pages_used(prog) -> int:
    return prog.stats()["kv_pages_used"]


def mapped_pages(prog, sid) -> np.ndarray:
    """The physical KV pages the sequence maps now, in token order (unmapped entries are -1)."""
    row = prog.block_tables([prog.sequence(sid)])[0]
    return row[row >= 0]


def run_alone(p, spec, num_tokens, **kw):
    prog = Program(FakeModel(), opts(**kw))
    sid = prog.bind(p, spec)
    out = generate(prog, sid, num_tokens)
    prog.release(sid)
    prog.assert_all_free()
    return out


@pytest.mark.parametrize("spec", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tokens_do_not_depend_on_page_size_or_chunking(spec):
    p = prompt(0, 23)
    want = run_alone(p, spec, 20)
    for page_size, chunk in [(1, 1), (3, 7), (16, 64), (4, 23)]:
        assert run_alone(p, spec, 20, page_size=page_size, prefill_chunk=chunk) == want


def test_pages_follow_the_frontier():
    prog = Program(FakeModel(), opts(page_size=4, prefill_chunk=5))
    sid = prog.bind(prompt(1, 11), GREEDY)
    for _ in range(8):
        step(prog, [sid])
        seq = prog.sequence(sid)
        assert pages_used(prog) == -(-seq.num_computed_tokens // 4)
    prog.release(sid)
    prog.assert_all_free()


@pytest.mark.parametrize("spec", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_rows_equal_rows_alone(spec):
    prompts = [prompt(s, n) for s, n in zip(range(4), (3, 17, 9, 30))]
    want = [run_alone(p, spec, 12) for p in prompts]
    prog = Program(FakeModel(), opts())
    sids = [prog.bind(p, spec) for p in prompts]
    got = {s: [] for s in sids}
    while any(len(v) < 12 for v in got.values()):
        live = [s for s in sids if len(got[s]) < 12]
        for s, produced in zip(live, step(prog, live)):     # prefill and decode rows mixed
            got[s] += produced
    assert [got[s][:12] for s in sids] == want


def test_reserve_is_atomic_per_row_and_rows_are_independent():
    # 16 pages of 4 tokens; max_context 64 needs all 16 for one sequence
    prog = Program(FakeModel(), opts(num_kv_pages=16, prefill_chunk=40))
    big = prog.bind(prompt(2, 40), GREEDY)       # first chunk: 10 pages
    small = prog.bind(prompt(3, 4), GREEDY)      # 1 page
    other = prog.bind(prompt(4, 30), GREEDY)     # 8 pages: cannot fit after big
    assert prog.reserve_units([big, other, small]) == [True, False, True]
    assert pages_used(prog) == 11             # the failed row took nothing
    prog.check_invariants()
    with pytest.raises(ProgramError):
        prog.execute([other])                    # not reserved
    pending = prog.execute([big, small])
    prog.commit(pending, [RowDecision(1), RowDecision(1)])
    for s in (big, small, other):
        prog.release(s)
    prog.assert_all_free()


def test_abort_pending_restores_state_and_frees_the_reservation():
    p = prompt(5, 9)
    want = run_alone(p, SEEDED, 10)
    prog = Program(FakeModel(), opts())
    sid = prog.bind(p, SEEDED)
    out = []
    while len(out) < 10:
        assert prog.reserve_units([sid]) == [True]
        used = pages_used(prog)
        prog.abort_pending(prog.execute([sid]))          # every unit runs twice
        # the unit's reservation went back: only the frontier's pages stay mapped
        assert pages_used(prog) == -(-prog.sequence(sid).num_computed_tokens // 4) <= used
        prog.check_invariants()
        out += step(prog, [sid])[0]
    assert out == want
    prog.release(sid)
    prog.assert_all_free()


def test_cancelled_row_rolls_back_while_others_commit():
    pa, pb = prompt(6, 12), prompt(7, 6)
    want_a = run_alone(pa, GREEDY, 8)
    prog = Program(FakeModel(), opts())
    a, b = prog.bind(pa, GREEDY), prog.bind(pb, GREEDY)
    out_a = []
    for i in range(12):
        assert prog.reserve_units([a, b]) == [True, True]
        pending = prog.execute([a, b])
        ra, rb = pending.rows
        # b is "cancelled" every time: it must never advance and a must be unaffected
        prog.commit(pending, [RowDecision(len(ra.produced)), RowDecision(0, is_cancelled=True)])
        out_a += ra.produced
        assert prog.sequence(b).num_computed_tokens == 0
        assert len(mapped_pages(prog, b)) == 0     # its reservation went back
        prog.check_invariants()
    assert out_a[:8] == want_a
    prog.release(a)
    prog.release(b)
    prog.assert_all_free()


def test_decisions_that_break_the_accepted_prefix_rule_raise():
    prog = Program(FakeModel(), opts())
    sid = prog.bind(prompt(8, 3), GREEDY)
    assert prog.reserve_units([sid]) == [True]
    pending = prog.execute([sid])                      # the whole prompt: produces 1 token
    for bad in ([RowDecision(0)], [RowDecision(2)], [RowDecision(1, is_cancelled=True)],
                [RowDecision(1), RowDecision(1)], []):
        with pytest.raises(ProgramError):
            prog.commit(pending, bad)
    with pytest.raises(ProgramError):
        prog.execute([sid])                            # the previous batch is unconsumed
    with pytest.raises(ProgramError):
        prog.pause(sid)
    prog.commit(pending, [RowDecision(1, is_terminal=True)])
    with pytest.raises(ProgramError):
        prog.commit(pending, [RowDecision(1)])         # consumed twice
    with pytest.raises(ProgramError):
        prog.abort_pending(pending)
    prog.release(sid)
    prog.assert_all_free()


def _pause_and_resume(prog, sid, allow_snapshot, revoke=False):
    """Pause, let another sequence take the freed pages and slot, resume elsewhere."""
    before = set(mapped_pages(prog, sid).tolist())
    rs = prog.pause(sid, allow_snapshot=allow_snapshot)
    prog.check_invariants()
    squatter = prog.bind(prompt(99, 8), GREEDY)
    assert prog.reserve_units([squatter]) == [True]
    if revoke and rs.kind == "snapshot":
        rs = prog.revoke_snapshot(rs)
        assert prog.host_bytes_used == 0
    assert prog.can_resume(rs)
    sid = prog.resume(rs)
    after = set(mapped_pages(prog, sid).tolist())
    assert not before or before != after           # restored into other physical pages
    prog.release(squatter)
    return rs, sid


@pytest.mark.parametrize("spec", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["replay", "snapshot", "revoked"])
def test_pause_resume_reproduces_the_uninterrupted_tokens(spec, mode):
    p = prompt(9, 13)
    want = run_alone(p, spec, 24, prefill_chunk=4)
    prog = Program(FakeModel(), opts(prefill_chunk=4))
    sid = prog.bind(p, spec)
    out, kinds = [], set()
    for i in range(400):
        if len(out) >= 24:
            break
        # pause mid-prefill and at decode boundaries; like the Engine, never a request that has
        # not made real progress since its last resume (it would only replay forever)
        if i % 3 == 1 and prog.unit_kind(sid) != "replay" and not prog.is_protected(sid):
            rs, sid = _pause_and_resume(prog, sid, mode != "replay", revoke=mode == "revoked")
            kinds.add(rs.kind)
        out += step(prog, [sid])[0]
    assert out[:24] == want
    assert kinds == {"snapshot" if mode == "snapshot" else "replay"}
    prog.release(sid)
    prog.assert_all_free()


def test_replay_units_rebuild_without_producing_and_keep_the_resume_permit():
    p = prompt(10, 6)
    prog = Program(FakeModel(), opts(prefill_chunk=4, page_size=4))
    sid = prog.bind(p, GREEDY)
    generate(prog, sid, 9)                              # 6 prompt + 9 accepted; frontier 14
    rs = prog.pause(sid, allow_snapshot=False)
    assert rs.kind == "replay" and rs.num_tokens == 15 and rs.num_computed_tokens == 14
    sid = prog.resume(rs)
    assert pages_used(prog) == 4                        # the permit: pages for all 15 tokens
    kinds = []
    while prog.unit_kind(sid) == "replay":
        kinds.append(prog.is_protected(sid))
        assert step(prog, [sid]) == [[]]                # replay chunks publish nothing
        assert pages_used(prog) == 4                    # reservation kept across chunks
    assert prog.unit_kind(sid) == "decode" and all(kinds) and len(kinds) == 4
    step(prog, [sid])                                   # the first real new unit
    assert not prog.is_protected(sid)
    prog.release(sid)
    prog.assert_all_free()


def test_snapshot_respects_the_host_budget_and_is_freed():
    model = FakeModel()
    p = prompt(11, 20)
    probe = Program(model, opts())
    cost = 5 * probe.snapshots.page_bytes + probe.snapshots.state_bytes   # 20 tokens: 5 pages
    prog = Program(model, opts(host_snapshot_bytes=cost))
    a, b = prog.bind(p, GREEDY), prog.bind(prompt(12, 20), GREEDY)
    step(prog, [a, b]); step(prog, [a, b]); step(prog, [a, b]); step(prog, [a, b])
    assert prog.snapshot_cost(a) == cost and prog.host_bytes_free == cost
    rs_a = prog.pause(a)
    assert prog.host_bytes_free == 0
    rs_b = prog.pause(b)
    assert (rs_a.kind, rs_b.kind) == ("snapshot", "replay")   # budget holds one snapshot
    assert prog.host_bytes_used == cost
    prog.discard(rs_a)
    with pytest.raises(ProgramError):
        prog.discard(rs_a)                                    # consumed twice
    prog.discard(rs_b)
    prog.assert_all_free()


def test_check_invariants_detects_a_double_mapped_page():
    prog = Program(FakeModel(), opts())
    a, b = prog.bind(prompt(13, 8), GREEDY), prog.bind(prompt(14, 8), GREEDY)
    step(prog, [a, b])
    slot_a, slot_b = prog.sequence(a).slot, prog.sequence(b).slot
    prog.pages.block_tables[slot_b, 0] = prog.pages.block_tables[slot_a, 0]
    with pytest.raises(ProgramError):
        prog.check_invariants()


def test_assert_all_free_reports_leaks():
    prog = Program(FakeModel(), opts())
    sid = prog.bind(prompt(15, 8), GREEDY)
    step(prog, [sid])
    with pytest.raises(ProgramError, match="still held"):
        prog.assert_all_free()


def test_pool_smaller_than_one_sequence_is_rejected_at_start():
    with pytest.raises(RequestError, match="num_kv_pages"):
        Program(FakeModel(), opts(num_kv_pages=15))          # 64 tokens / 4 = 16 needed


def test_bind_checks_prompt_length_and_slots():
    prog = Program(FakeModel(), opts(max_concurrency=1))
    with pytest.raises(ProgramError):
        prog.bind(np.zeros(64, np.int32), GREEDY)
    sid = prog.bind(prompt(16, 3), GREEDY)
    assert not prog.can_bind(3)
    with pytest.raises(ProgramError):
        prog.bind(prompt(16, 3), GREEDY)
    prog.release(sid)
    prog.assert_all_free()


def test_without_rollback_a_cancelled_row_may_only_be_released():
    pa, pb = prompt(17, 4), prompt(18, 5)          # both whole prompts in one chunk
    want_a = run_alone(pa, GREEDY, 6)
    prog = Program(FakeModel(), opts())
    a, b = prog.bind(pa, GREEDY), prog.bind(pb, GREEDY)
    assert prog.reserve_units([a, b]) == [True, True]
    pending = prog.execute([a, b], keep_rollback=False)
    assert pending._backups == [None, None]
    prog.commit(pending, [RowDecision(len(pending.rows[0].produced)),
                          RowDecision(0, is_cancelled=True)])
    assert prog.sequence(b).num_computed_tokens == 0
    with pytest.raises(ProgramError, match="State"):
        prog.execute([b])
    with pytest.raises(ProgramError, match="State"):
        prog.pause(b)
    prog.release(b)
    out = list(pending.rows[0].produced) + generate(prog, a, 5)
    assert out == want_a                         # the surviving row is unaffected
    prog.release(a)
    prog.assert_all_free()


def test_control_unit_forces_tokens_without_sampling():
    """Forced tokens F behave exactly as if they had been sampled: the history afterwards equals
    a run whose samples happened to be F, and the next sample is keyed by its position."""
    p = prompt(19, 6)
    prog = Program(FakeModel(), opts())
    sid = prog.bind(p, SEEDED)
    first = generate(prog, sid, 1)
    forced = (5, 9, 33)
    assert prog.reserve_units([sid], forced={sid: forced}) == [True]
    pending = prog.execute([sid], forced={sid: forced})
    row = pending.rows[0]
    assert row.is_control and row.produced == forced and row.logprobs == ()
    assert row.num_new_tokens == 3
    prog.commit(pending, [RowDecision(3)])
    after = generate(prog, sid, 4)
    prog.release(sid)
    # the same history fed as a prompt gives the same continuation (KV/State consistent)
    history = np.concatenate([p, first, forced]).astype(np.int32)
    ref = Program(FakeModel(), opts())
    rid = ref.bind(history, SEEDED)
    # positions of the samples are the same, so the seeded draws match too
    assert generate(ref, rid, 4) == after
    ref.release(rid)
    prog.assert_all_free()


def test_control_unit_rules():
    prog = Program(FakeModel(), opts())
    sid = prog.bind(prompt(20, 9), GREEDY)
    with pytest.raises(ProgramError, match="decode-ready"):
        prog.reserve_units([sid], forced={sid: (1, 2)})     # still in prefill
    generate(prog, sid, 1)
    assert prog.reserve_units([sid], forced={sid: (1, 2, 3)}) == [True]
    pending = prog.execute([sid], forced={sid: (1, 2, 3)})
    with pytest.raises(ProgramError):
        prog.commit(pending, [RowDecision(2)])               # nonterminal must accept all
    prog.commit(pending, [RowDecision(2, is_terminal=True)])  # a terminal prefix
    with pytest.raises(ProgramError, match="State"):
        prog.execute([sid])                                  # State ran one token ahead
    prog.release(sid)
    prog.assert_all_free()


def test_replay_of_a_paused_prefill_is_labelled_replay_up_to_the_old_frontier():
    prog = Program(FakeModel(), opts(prefill_chunk=4))
    sid = prog.bind(prompt(21, 15), GREEDY)
    step(prog, [sid])
    step(prog, [sid])                                   # frontier 8 of 15, nothing generated
    sid = prog.resume(prog.pause(sid, allow_snapshot=False))
    kinds = []
    while not prog.generated_tokens(sid).size:
        kinds.append(prog.unit_kind(sid))
        step(prog, [sid])
    assert kinds == ["replay", "replay", "prefill", "prefill"]
    prog.release(sid)
    prog.assert_all_free()


class DeviceGreedyModel(FakeModel):
    """A backend that can return argmax ids instead of logits (as the CUDA model does); its ids
    come from the same logits, so only the path differs. Counts which path each call took."""
    greedy_on_device = True

    def __init__(self):
        super().__init__()
        self.num_greedy_calls = 0

    def decode_greedy(self, batch, kv, state):
        self.num_greedy_calls += 1
        logits = self.forward(batch, kv, state)
        self.num_calls -= 1
        return np.argmax(logits, axis=-1).astype(np.int32)


@pytest.mark.parametrize("spec, on_device", [
    (GREEDY, True),
    (SamplingSpec(seed=1, logprobs=2), False),           # logprobs need the logits
    (SamplingSpec(seed=1, repetition_penalty=1.3), False),
    (SamplingSpec(seed=1, presence_penalty=0.5), False),
    (SEEDED, False),
], ids=["plain", "logprobs", "repetition", "presence", "seeded"])
def test_plain_greedy_rows_take_the_device_argmax_path(spec, on_device):
    p = prompt(3, 11)
    want = run_alone(p, spec, 12)
    model = DeviceGreedyModel()
    prog = Program(model, opts())
    sid = prog.bind(p, spec)
    assert generate(prog, sid, 12) == want
    prog.release(sid)
    prog.assert_all_free()
    # prefill chunks that sample nothing never need logits: they take the argmax path for every
    # spec; a sampling step needs host logits unless the row is plain greedy
    assert model.num_greedy_calls > 0
    assert (model.num_calls == 0) == on_device


def test_a_mixed_batch_falls_back_to_host_logits():
    model = DeviceGreedyModel()
    prog = Program(model, opts())
    a, b = prog.bind(prompt(4, 6), GREEDY), prog.bind(prompt(5, 6), SEEDED)
    for _ in range(4):
        step(prog, [a, b])
    assert model.num_greedy_calls == 1 and model.num_calls == 3   # one prefill chunk samples none


def test_device_argmax_ids_are_checked():
    model = DeviceGreedyModel()
    model.decode_greedy = lambda batch, kv, state: np.array([10 ** 6], np.int32)
    prog = Program(model, opts())
    sid = prog.bind(prompt(6, 5), GREEDY)
    assert prog.reserve_units([sid]) == [True]
    with pytest.raises(ProgramError, match="decode_greedy returned"):
        prog.execute([sid])
