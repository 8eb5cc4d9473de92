"""Scheduler: pure decisions over views (no Program, no threads)."""
import pytest

from ninfer.runtime.scheduler import CyclePlan, ResidentView, Scheduler


def view(key, ticket, is_decode=False, is_protected=False, last=-1):
    return ResidentView(key, ticket, is_decode, is_protected, last)


def test_plan_decodes_every_decode_ready_row_in_ticket_order():
    rows = [view("c", 5, True), view("a", 1, True), view("p", 3), view("b", 2, True)]
    plan = Scheduler(2).plan(rows)
    assert plan.decode == ("a", "b", "c")        # the actual B, no padding
    assert plan.chunk == "p"
    assert plan.members == ("a", "b", "c", "p")


def test_plan_without_chunk_rows():
    assert Scheduler(2).plan([view("a", 1, True)]) == CyclePlan(("a",), None)
    assert Scheduler(2).plan([]) == CyclePlan((), None)


def test_one_chunk_per_cycle_rotates_among_prefill_rows():
    rows = {k: view(k, t) for k, t in (("x", 1), ("y", 2), ("z", 3))}
    sched, order = Scheduler(2), []
    for cycle in range(6):
        chunk = sched.plan(list(rows.values())).chunk
        order.append(chunk)
        rows[chunk] = view(chunk, rows[chunk].ticket, last=cycle)
    assert order == ["x", "y", "z", "x", "y", "z"]


def test_protected_resume_takes_the_chunk_first():
    rows = [view("old", 1), view("resumed", 7, is_protected=True, last=3)]
    assert Scheduler(2).plan(rows).chunk == "resumed"


def test_reservation_order_protected_then_oldest():
    rows = [view("c", 3), view("a", 1), view("r", 9, is_protected=True), view("b", 2)]
    assert Scheduler(2).reservation_order(rows) == ["r", "a", "b", "c"]


def test_victim_is_the_youngest_younger_unprotected_resident():
    rows = [view("a", 1), view("b", 2), view("c", 3, is_protected=True), view("d", 4)]
    s = Scheduler(2)
    assert s.choose_victim(rows, rows[0]) == "d"
    assert s.choose_victim(rows[:3], rows[0]) == "b"       # c is protected
    assert s.choose_victim(rows, rows[3]) == "d"           # youngest needs: itself
    assert s.choose_victim([rows[0], rows[2]], rows[0]) == "a"   # only protected younger: itself


def test_bounded_bypass_of_paused_requests():
    s = Scheduler(max_bypass=2)
    assert s.may_admit_fresh(num_paused=0)
    for _ in range(5):                                       # no paused: bypass is not counted
        s.note_fresh_admitted(0)
    assert s.may_admit_fresh(1)
    s.note_fresh_admitted(1)
    s.note_fresh_admitted(1)
    assert not s.may_admit_fresh(1)                          # the paused head now goes first
    assert s.may_admit_fresh(0)
    s.note_resumed()
    assert s.may_admit_fresh(1)


def test_zero_bypass_never_admits_past_paused():
    assert not Scheduler(0).may_admit_fresh(1)
    with pytest.raises(ValueError):
        Scheduler(-1)


def test_resume_candidate_is_oldest_and_waits_for_protected():
    paused = [view("q", 8), view("p", 4), view("r", 9)]
    assert Scheduler.resume_candidate(paused, has_protected=False) == "p"
    assert Scheduler.resume_candidate(paused, has_protected=True) is None
    assert Scheduler.resume_candidate([], has_protected=False) is None
