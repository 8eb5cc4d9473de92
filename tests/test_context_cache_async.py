"""The context cache's demotions with host reads that run beside the steps (CUDA's copy stream;
here fakes.LateReadModel, whose reads copy the rows only when they finish, a few polls after they
start): a demotion under way keeps its pages and State slot held, and usable, until its copies
are done, and only then gives them back; dropping it waits for them; the ContextCache demotes
ahead of need and settles what is done every unit; under random sessions, cancels and pauses
(of both kinds) every answer equals its cold run and everything is free at the end."""
import random

import numpy as np
import pytest

from ninfer.contracts import RowDecision, SamplingSpec
from ninfer.models.qwen3_5.fakes import LateKVPool, LateReadModel, LateStatePool
from ninfer.models.qwen3_5.program import Program
from ninfer.options import EngineOptions
from runtime_helpers import VOCAB, prompt
from test_context_cache import _finish_empty, _stress_core, _stress_sessions

pytestmark = pytest.mark.timeout(300)


def _program_with_a_checkpoint(n=10):
    """A Program over late-reading pools holding one device checkpoint of a prompt's n tokens."""
    prog = Program(LateReadModel(VOCAB), EngineOptions(
        max_concurrency=2, max_context=64, page_size=4, prefill_chunk=64,
        prefix_cache_host_bytes=1 << 20, prefix_cache_device_fraction=0.5))
    sid = prog.bind(prompt(7, n), SamplingSpec(seed=0), capture_at=n)
    assert prog.reserve_units([sid]) == [True]
    pending = prog.execute([sid])
    prog.commit(pending, [RowDecision(1)])
    assert prog.due_captures([sid])
    cid = prog.capture_checkpoint(sid)
    prog.release(sid)
    return prog, cid


def test_a_demotion_under_way_holds_its_pages_and_slot_until_its_copies_are_done():
    prog, cid = _program_with_a_checkpoint()
    store = prog.checkpoints
    assert store.reads_async
    c = store.entries[cid]
    pages, slot = c.device_pages(), c.slot
    want_kv, want_state = prog.kv.read_pages(pages), prog.state.read(slot)
    free_pages, free_slots = prog.capacity().free_kv_pages, store.slots.num_free
    store.start_demote(cid)
    assert store.info(cid).on_device and store.info(cid).is_moving and store.num_moving == 1
    assert store.usage().host_bytes_used == store.host_cost(10)          # reserved at the start
    polls = 0
    while not store.settle():
        polls += 1
        # nothing given back while the copies run: the rows stay held (and readable)
        assert prog.capacity().free_kv_pages == free_pages and store.slots.num_free == free_slots
        prog.check_invariants()
    assert polls >= LateKVPool.polls
    assert not store.info(cid).on_device and store.num_moving == 0
    assert prog.capacity().free_kv_pages == free_pages + len(pages)
    assert store.slots.num_free == free_slots + 1
    for got, want in zip(c.host_kv + c.host_state, want_kv + want_state):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    prog.check_invariants()


@pytest.mark.parametrize("how", ["drop", "settle-wait", "demote"])
def test_a_demotion_under_way_ends_with_everything_accounted(how):
    prog, cid = _program_with_a_checkpoint(9)
    store = prog.checkpoints
    reads = None
    if how != "demote":
        store.start_demote(cid)
        reads = store.entries[cid].moving
    if how == "drop":
        store.drop(cid)                           # waits for the copies, then frees
        assert all(r.finished for r in reads) and not store.entries
    elif how == "settle-wait":
        assert store.settle(wait=True) == 1 and all(r.finished for r in reads)
        store.drop(cid)
    else:
        store.demote(cid)                         # the synchronous path: start, then wait
        assert not store.info(cid).on_device and store.num_moving == 0
        store.drop(cid)
    prog.check_invariants()
    prog.assert_all_free()
    assert store.usage().host_bytes_used == 0 and store.slots.num_free == store.slots.num_slots


@pytest.mark.parametrize("polls", [1, 40])
@pytest.mark.parametrize("seed", [1, 2])
def test_sessions_cancels_pauses_with_demotions_under_way(monkeypatch, seed, polls):
    """test_context_cache's stress (sessions continuing or branching, cancels, a tiny KV pool,
    small device and host budgets) with reads that take `polls` polls: the ContextCache demotes
    ahead of need, requests are cancelled and paused while copies run (a pause's reclaim waits
    for them), every kept answer is its cold run's and everything is free at the end."""
    monkeypatch.setattr(LateKVPool, "polls", polls)
    monkeypatch.setattr(LateStatePool, "polls", polls)
    core = _stress_core(6, LateReadModel)
    store = core.program.checkpoints
    started, most_moving = [], [0]
    start_demote, settle = store.start_demote, store.settle

    def counted_start(cid):
        started.append(cid)
        start_demote(cid)
        most_moving[0] = max(most_moving[0], store.num_moving)

    def counted_settle(wait=False):
        most_moving[0] = max(most_moving[0], store.num_moving)
        return settle(wait)
    monkeypatch.setattr(store, "start_demote", counted_start)
    monkeypatch.setattr(store, "settle", counted_settle)
    _stress_sessions(core, random.Random(seed))
    assert core.stats()["prefix_cache_demotions"] >= len(started) > 0 and most_moving[0] >= 1
    _finish_empty(core)
