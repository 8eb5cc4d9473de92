"""Context cache (issue 12): with the cache on, every request gives exactly the tokens of a cold
run (FakeModel's logits depend on the whole history read back through the KV pages and the State
slot, so a wrong page, a shared page written twice or a wrong State copy changes tokens), alone
and with 8 concurrent sessions, through pauses (Snapshot and Replay) and cancellations; turn 2 of
a chat binds turn 1's continuation; the ledgers end empty."""
import random

import numpy as np
import pytest

from ninfer.api import SamplingParams
from ninfer.contracts import ProgramError
from runtime_helpers import make_core, prompt, reference_tokens

pytestmark = pytest.mark.timeout(300)
MAX_CONTEXT = 128


def _params(kind, i, max_tokens=6):
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=100 + i,
                          ignore_eos=True)


def _chat_rounds(core, num_sessions, turns, kind, *, cancel_rate=0.0, seed=0, sessions=True,
                 max_context=MAX_CONTEXT):
    """num_sessions chats of `turns` turns, each round submitted together: turn t's prompt is turn
    t-1's prompt + its answer + new user tokens. Checks every answer against the cold reference
    (a cancelled one: a prefix of it); returns the results by session."""
    rng = random.Random(seed)
    prompts = [prompt(1000 + s, 9 + s % 4) for s in range(num_sessions)]
    results = [[] for _ in range(num_sessions)]
    for t in range(turns):
        handles = []
        for s in range(num_sessions):
            params = _params(kind, 10 * s + t)
            h = core.submit(prompts[s], params, session=f"s{s}" if sessions else None)
            cancelled = rng.random() < cancel_rate
            if cancelled:
                h.cancel()
            handles.append((h, params, cancelled))
        for s, (h, params, cancelled) in enumerate(handles):
            res = h.result(timeout=60)
            want = reference_tokens(prompts[s], params, max_context)
            assert res.error is None, res.error
            if cancelled:
                assert res.token_ids == want[:len(res.token_ids)]
            else:
                assert res.token_ids == want, (s, t)
            results[s].append(res)
            prompts[s] = np.concatenate([prompts[s], np.asarray(res.token_ids, np.int32),
                                         prompt(2000 + 10 * s + t, 5)]).astype(np.int32)
    return results


def _finish_empty(core):
    """Shut down, audit, clear the cache: every page, slot and host byte is free."""
    core.shutdown()
    prog = core.program
    prog.check_invariants()
    core.context_cache.check_invariants()
    core.context_cache.clear_prefix_cache()
    prog.assert_all_free()      # its audit holds every page's count to its mappings + holds, so
    stats = prog.stats()        # with no page in use every count is 0
    assert prog.capacity().free_kv_pages == stats["kv_pages_total"] and stats["kv_pages_used"] == 0
    assert prog.checkpoints.slots.num_free == prog.checkpoints.usage().num_cache_slots
    assert prog.checkpoints.usage().host_bytes_used == 0 and prog.checkpoints.device_bytes_used == 0
    assert prog.host_bytes_used == 0


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_multi_turn_chat_binds_the_continuation(kind):
    core, _ = make_core(max_concurrency=1, max_context=MAX_CONTEXT)
    (turns,) = _chat_rounds(core, 1, 3, kind)
    first_prompt = turns[0].num_prompt_tokens
    assert turns[0].num_cached_tokens == 0
    # turn 2 resumes after turn 1's prompt + answer (all but the answer's last token, which
    # was sampled but never run through the model)
    assert turns[1].num_cached_tokens == first_prompt + 6 - 1 > first_prompt
    assert turns[2].num_cached_tokens == turns[1].num_prompt_tokens + 6 - 1
    stats = core.stats()
    assert stats["prefix_cache_hits"] == 2 and stats["prefix_cache_lookups"] == 3
    assert stats["prefix_cache_tokens_reused"] == turns[1].num_cached_tokens + \
        turns[2].num_cached_tokens
    assert stats["prefix_cache_device_bytes"] > 0
    _finish_empty(core)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_cache_on_equals_off_with_8_concurrent_sessions(kind):
    on, _ = make_core(max_concurrency=4, max_context=MAX_CONTEXT, max_queue=16)
    off, _ = make_core(max_concurrency=4, max_context=MAX_CONTEXT, max_queue=16,
                       prefix_cache=False)
    got_on = _chat_rounds(on, 8, 3, kind)
    got_off = _chat_rounds(off, 8, 3, kind)
    assert [[r.token_ids for r in s] for s in got_on] == [[r.token_ids for r in s] for s in got_off]
    assert all(r.num_cached_tokens == 0 for s in got_off for r in s)
    assert sum(r.num_cached_tokens > 0 for s in got_on for r in s[1:]) >= 8
    assert off.stats()["prefix_cache_entries"] == 0
    _finish_empty(on)
    _finish_empty(off)


@pytest.mark.parametrize("snapshot_bytes", [0, 1 << 20], ids=["replay", "snapshot"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_cache_through_pauses_and_cancellations(snapshot_bytes, kind):
    """A pool too small for the 4 residents: the cache's pages are reclaimed first, then the
    youngest pause (Snapshot or Replay); some requests are cancelled."""
    core, _ = make_core(max_concurrency=4, max_context=64, max_queue=16,
                        num_kv_pages=16, host_snapshot_bytes=snapshot_bytes)
    _chat_rounds(core, 8, 3, kind, cancel_rate=0.2, seed=3, max_context=64)
    stats = core.stats()
    assert stats["pauses"] > 0 and stats["prefix_cache_hits"] > 0
    assert (stats["snapshot_pauses"] > 0) == (snapshot_bytes > 0)
    _finish_empty(core)


def test_shared_system_prompt_is_prefilled_once_per_interval():
    """8 sessions sharing a long system prompt: the interval checkpoints inside it (every
    checkpoint_interval tokens) serve every later session, so they prefill little of it."""
    core, model = make_core(max_concurrency=4, max_context=MAX_CONTEXT, max_queue=16,
                            checkpoint_interval=16, prefill_chunk=64)
    system = prompt(7, 50)
    first = np.concatenate([system, prompt(8, 4)]).astype(np.int32)
    want = reference_tokens(first, _params("greedy", 0), MAX_CONTEXT)
    assert core.submit(first, _params("greedy", 0)).result(timeout=30).token_ids == want
    cached = []
    for s in range(8):
        p = np.concatenate([system, prompt(20 + s, 6)]).astype(np.int32)
        res = core.submit(p, _params("greedy", s)).result(timeout=30)
        assert res.token_ids == reference_tokens(p, _params("greedy", s), MAX_CONTEXT)
        cached.append(res.num_cached_tokens)
    assert cached == [48] * 8              # the last interval checkpoint inside the system prompt
    _finish_empty(core)


def test_cache_pages_are_reclaimed_before_any_resident_pauses():
    """The cache holds most of a small pool after one request; a long fresh prompt needs them:
    they are demoted to the host tier (or dropped), nobody pauses, and a later prompt extending
    the first promotes its checkpoint back to the device."""
    core, _ = make_core(max_concurrency=2, max_context=32, page_size=4, num_kv_pages=10,
                        prefill_chunk=8, prefix_cache_device_fraction=1.0)
    a = prompt(50, 18)
    want_a = reference_tokens(a, _params("greedy", 0, 4), 32)
    assert core.submit(a, _params("greedy", 0, 4)).result(timeout=20).token_ids == want_a
    held = core.stats()["kv_pages_used"]
    assert held >= 5                       # the continuation's pages (+ a partial-page copy)
    b = prompt(51, 28)
    res = core.submit(b, _params("greedy", 1, 3)).result(timeout=20)
    assert res.token_ids == reference_tokens(b, _params("greedy", 1, 3), 32)
    stats = core.stats()
    assert stats["pauses"] == 0 and stats["prefix_cache_demotions"] >= 1
    # the demotion's host copies are timed; nothing came back from the host yet
    assert stats["prefix_cache_copy_seconds_to_host"] > 0
    assert stats["prefix_cache_copy_seconds_to_device"] == 0
    assert stats["prefix_cache_pin_seconds"] == 0      # (numpy pools: nothing pinned)
    a2 = np.concatenate([a, np.asarray(want_a, np.int32), prompt(52, 2)]).astype(np.int32)
    res = core.submit(a2, _params("greedy", 2, 2)).result(timeout=20)
    assert res.token_ids == reference_tokens(a2, _params("greedy", 2, 2), 32)
    assert res.num_cached_tokens == len(a) + len(want_a) - 1
    assert core.stats()["prefix_cache_promotions"] >= 1
    assert core.stats()["prefix_cache_copy_seconds_to_device"] > 0     # the host bind's writes
    _finish_empty(core)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_concurrent_sessions_prefill_a_shared_system_prompt_once(kind):
    """8 prompts sent at once that share a 60-token system prompt: the first prefills it, the
    others wait for the checkpoint it is asked to take where they diverge, and bind it."""
    import threading
    core, model = make_core(max_concurrency=8, max_context=MAX_CONTEXT, max_queue=16,
                            prefill_chunk=8)
    gate = threading.Event()
    model.on_forward = lambda batch: gate.wait(30)     # all 8 are queued before anything runs
    system = prompt(60, 60)
    prompts = [np.concatenate([system, prompt(61 + s, 5 + s)]).astype(np.int32) for s in range(8)]
    params = [_params(kind, s) for s in range(8)]
    handles = [core.submit(p, q, session=f"agent{s}") for s, (p, q) in
               enumerate(zip(prompts, params))]
    gate.set()
    results = [h.result(timeout=60) for h in handles]
    for res, p, q in zip(results, prompts, params):
        assert res.token_ids == reference_tokens(p, q, MAX_CONTEXT)
    prefilled = sum(len(p) - r.num_cached_tokens for p, r in zip(prompts, results))
    unique = len(system) + sum(len(p) - len(system) for p in prompts)
    assert prefilled <= 1.1 * unique, (prefilled, unique)
    assert sorted(r.num_cached_tokens for r in results)[1:] == [60] * 7
    _finish_empty(core)


def test_one_after_another_sessions_checkpoint_where_they_diverge():
    """Sessions arriving one after another with one 60-token system prompt: the first keeps its
    prompt and continuation only; the second shares 56 tokens (3.5 blocks) of those with it, so
    it is asked for a checkpoint at 56 where it leaves them; every later one binds that."""
    core, _ = make_core(max_concurrency=2, max_context=MAX_CONTEXT, page_size=8)
    system = prompt(70, 60)
    cached = []
    for s in range(5):
        p = np.concatenate([system, prompt(71 + s, 6)]).astype(np.int32)
        res = core.submit(p, _params("greedy", s)).result(timeout=30)
        assert res.token_ids == reference_tokens(p, _params("greedy", s), MAX_CONTEXT)
        cached.append(res.num_cached_tokens)
    assert cached == [0, 0, 56, 56, 56]
    _finish_empty(core)


def test_session_publication_order_keeps_the_newest_binding():
    core, _ = make_core(max_concurrency=1, max_context=MAX_CONTEXT)
    rm = core.context_cache
    a = prompt(30, 10)
    core.submit(a, _params("greedy", 0), session="chat").result(timeout=20)
    b = prompt(31, 10)
    core.submit(b, _params("greedy", 1), session="other").result(timeout=20)
    core.shutdown()
    newest = rm._sessions["chat"]
    cid_other = rm._sessions["other"][1]
    assert not rm.publish("chat", newest[0] - 1, cid_other)     # older: ignored
    assert rm._sessions["chat"] == newest
    assert rm.publish("chat", newest[0] + 1, cid_other)         # newer: rebinds
    assert rm._sessions["chat"][1] == cid_other
    rm.check_invariants()
    from ninfer.runtime import context_cache
    context_cache.MAX_SESSIONS, keep = 2, context_cache.MAX_SESSIONS
    try:                                       # bounded: the least recently published goes
        rm.publish("third", 99, cid_other)
        assert list(rm._sessions) == ["chat", "third"]
        rm.check_invariants()
    finally:
        context_cache.MAX_SESSIONS = keep
    # the session's checkpoint is found for its next prompt (and by the shared index too)
    cont = core.program.checkpoints.entries[newest[1]].token_ids
    nxt = np.concatenate([cont, prompt(32, 3)]).astype(np.int32)
    assert rm.lookup(nxt)[1] == len(cont)
    assert rm.lookup(nxt, session="chat")[1] == len(cont)


def test_a_sessions_previous_continuation_goes_when_its_newest_extends_it():
    """Turn 2 binds turn 1's continuation and publishes its own: turn 1's is dropped (subsumed:
    a slot back without a demotion), turn 3 binds turn 2's with the cold run's tokens. A
    continuation another session also names stays."""
    core, _ = make_core(max_concurrency=1, max_context=MAX_CONTEXT)
    rm = core.context_cache
    assert core.stats()["prefix_cache_capture_seconds"] == 0.0
    prompt_ids, conts, covered = prompt(60, 10), [], 0
    for turn in range(3):
        params = _params("greedy", turn)
        res = core.submit(prompt_ids, params, session="chat").result(timeout=20)
        assert res.token_ids == reference_tokens(prompt_ids, params, MAX_CONTEXT)
        assert res.num_cached_tokens == covered         # the previous continuation, whole
        if turn:
            assert conts[-1] not in rm._entries and conts[-1] not in core.program.checkpoints.ids()
        conts.append(rm._sessions["chat"][1])
        covered = len(rm._entries[conts[-1]].token_ids)
        assert covered == len(prompt_ids) + len(res.token_ids) - 1
        prompt_ids = np.concatenate([prompt_ids, np.asarray(res.token_ids, np.int32),
                                     prompt(61 + turn, 5)]).astype(np.int32)
    assert rm.subsumed == 2 and core.stats()["prefix_cache_subsumed"] == 2
    # the captures were timed (prompt checkpoints at commits, continuations at settle)
    assert core.stats()["prefix_cache_capture_seconds"] > 0.0
    rm.check_invariants()
    # another session names the newest continuation: the next turn keeps it
    shared = conts[-1]
    assert rm.publish("other", 10 ** 6, shared)
    res = core.submit(prompt_ids, _params("greedy", 3), session="chat").result(timeout=20)
    assert res.num_cached_tokens == len(rm._entries[shared].token_ids)
    assert shared in rm._entries and rm.subsumed == 2
    _finish_empty(core)


def test_a_host_tier_chat_keeps_each_newest_turn():
    """No device tier, a host budget of the longest continuation but not two: each turn's
    continuation still takes the previous one's host bytes (it subsumes it once published).
    The previous one, hit every turn, outranked every newer, longer one, so the chat kept
    binding turn 1's continuation (measured on the H200: turn 8 reused 1,280 of 9,984 tokens)."""
    probe, _ = make_core(max_concurrency=1, max_context=MAX_CONTEXT)
    cost = probe.program.checkpoints.host_cost
    probe.shutdown()
    lengths = [10 + 11 * t + 5 for t in range(4)]          # the continuations: prompt + 6 - 1
    budget = cost(lengths[-1]) + cost(lengths[-2]) - 1
    assert cost(lengths[-1]) <= budget
    core, _ = make_core(max_concurrency=1, max_context=MAX_CONTEXT,
                        prefix_cache_device_fraction=0.0, prefix_cache_host_bytes=budget)
    rm = core.context_cache
    prompt_ids, covered = prompt(60, 10), 0
    for turn, length in enumerate(lengths):
        params = _params("greedy", turn)
        res = core.submit(prompt_ids, params, session="chat").result(timeout=20)
        assert res.token_ids == reference_tokens(prompt_ids, params, MAX_CONTEXT)
        assert res.num_cached_tokens == covered, turn      # the previous continuation, whole
        covered = len(rm._entries[rm._sessions["chat"][1]].token_ids)
        assert covered == length and not core.program.checkpoints.info(
            rm._sessions["chat"][1]).on_device
        assert core.program.checkpoints.usage().host_bytes_used <= budget
        prompt_ids = np.concatenate([prompt_ids, np.asarray(res.token_ids, np.int32),
                                     prompt(61 + turn, 5)]).astype(np.int32)
    assert rm.subsumed >= 3 and rm.demotions == 0
    rm.check_invariants()
    _finish_empty(core)


def test_invariants_catch_shared_writable_pages_and_lost_references():
    core, _ = make_core(max_concurrency=2, max_context=MAX_CONTEXT)
    core.submit(prompt(40, 13), _params("greedy", 0)).result(timeout=20)
    core.shutdown()
    prog = core.program
    prog.check_invariants()
    entry = next(c for c in prog.checkpoints.entries.values() if c.partial >= 0)
    prog.pages.refcount[entry.partial] += 1       # the partly filled page shared: COW broken
    with pytest.raises(ProgramError, match="reference counts|copy-on-write"):
        prog.check_invariants()
    prog.pages.refcount[entry.partial] -= 1
    prog.check_invariants()
    prog.checkpoints.slots._free.append(entry.slot)     # a held cache slot listed free as well
    with pytest.raises(ProgramError, match="slot ledger"):
        prog.check_invariants()
    prog.checkpoints.slots._free.pop()
    prog.check_invariants()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stress_sessions_cancels_pauses_evictions_end_empty(seed):
    """Random sessions continuing or branching, cancels, a tiny KV pool (pauses of both kinds),
    small device and host budgets (demotion, promotion, eviction): every kept answer equals its
    cold reference, the worker's audits pass, and everything is free at the end."""
    core = _stress_core(4)
    _stress_sessions(core, random.Random(seed))
    _finish_empty(core)


def _stress_core(host_entries: int, model_class=None):
    """The stress's core: a tiny KV pool (pauses of both kinds), a device share of 4 pages, a
    host tier of about host_entries 24-token checkpoints."""
    probe, _ = make_core()
    host = host_entries * probe.program.checkpoints.host_cost(24)
    probe.shutdown()
    return make_core(*(() if model_class is None else (model_class,)),
                     max_concurrency=4, max_context=64, num_kv_pages=18, page_size=4,
                     prefill_chunk=6, max_queue=400, host_snapshot_bytes=4000,
                     prefix_cache_host_bytes=host, prefix_cache_device_fraction=0.25,
                     checkpoint_interval=8)[0]


def _stress_sessions(core, rng) -> None:
    """70 requests of 6 sessions continuing or branching, 15 % cancelled, some awaited so later
    turns extend them: every kept answer equals its cold reference (a cancelled one: a prefix),
    and the cache hit and the pool paused."""
    histories = {f"s{k}": prompt(500 + k, rng.randint(3, 12)) for k in range(6)}
    plans = []
    for i in range(70):
        name = rng.choice(sorted(histories))
        base = histories[name]
        if rng.random() < 0.3:                  # branch from an earlier point of the session
            base = base[:rng.randint(1, len(base))]
        p = np.concatenate([base, prompt(600 + i, rng.randint(1, 6))]).astype(np.int32)[:40]
        params = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True,
                                **rng.choice([dict(), dict(temperature=1.0, seed=i)]))
        h = core.submit(p, params, session=name)
        cancel = rng.random() < 0.15
        if cancel:
            h.cancel()
        plans.append((p, params, cancel, h))
        if rng.random() < 0.3:                  # let some finish: later turns extend them
            res = h.result(timeout=60)
            histories[name] = np.concatenate([p, np.asarray(res.token_ids, np.int32)])[:40]
    for p, params, cancel, h in plans:
        res = h.result(timeout=60)
        want = reference_tokens(p, params, 64)
        assert res.token_ids == want[:len(res.token_ids)]
        if not cancel:
            assert res.token_ids == want
    stats = core.stats()
    assert core.health == "ready"
    assert stats["prefix_cache_hits"] > 0 and stats["pauses"] > 0


def test_interval_checkpoints_lie_an_interval_past_the_reused_prefix():
    """Multiples of the interval that a chunk must end at: none closer to the reused prefix than
    an interval (one call more for this prompt, to save a later one less than an interval), the
    reusable boundary always."""
    from ninfer.models.qwen3_5.program.sequences import capture_positions
    assert capture_positions(2048, 5000, 0) == [2048, 4096, 5000]
    assert capture_positions(2048, 2304, 1280) == [2304]            # 2048: 768 past the prefix
    assert capture_positions(2048, 9000, 1280) == [4096, 6144, 8192, 9000]
    assert capture_positions(2048, 9000, 2048) == [4096, 6144, 8192, 9000]
    assert capture_positions(2048, 1000, 1000) == []                # nothing new to capture


def test_idle_engine_demotes_to_headroom_and_answers_stay_exact():
    """Synchronous (numpy) pools: a chat whose checkpoints fill the device tier. Between turns the
    Engine holds no request, and its worker demotes the lowest-ranked checkpoints then (not on
    the next turn's path) until the device tier is IDLE_HEADROOM_PAGES from its page budget with
    HEADROOM_SLOTS free slots; every answer stays the cold run's, and later turns still bind."""
    import time
    from ninfer.runtime.context_cache import HEADROOM_SLOTS, IDLE_HEADROOM_PAGES
    core, _ = make_core(max_concurrency=1, max_context=MAX_CONTEXT, page_size=4,
                        num_kv_pages=40, checkpoint_interval=8,
                        prefix_cache_device_fraction=0.5)
    p = prompt(60, 10)
    seen_idle = 0
    for t in range(5):
        params = _params("greedy", t)
        res = core.submit(p, params, session="chat").result(timeout=30)
        assert res.error is None and res.token_ids == reference_tokens(p, params, MAX_CONTEXT)
        assert t == 0 or res.num_cached_tokens > 0
        deadline = time.monotonic() + 10
        while True:                       # the worker goes idle after delivering the result
            u = core.program.checkpoints.usage()
            roomy = u.device_pages_used <= (1 - IDLE_HEADROOM_PAGES) * u.device_page_budget \
                and u.num_free_cache_slots >= min(HEADROOM_SLOTS, u.num_cache_slots)
            if roomy or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert roomy, (t, u)
        seen_idle = core.stats()["prefix_cache_idle_demotions"]
        p = np.concatenate([p, np.asarray(res.token_ids, np.int32), prompt(70 + t, 6)]) \
            .astype(np.int32)
    assert seen_idle > 0
    _finish_empty(core)


def test_tokens_are_published_before_the_units_captures():
    """A unit's tokens reach their requests before the context cache's captures run (host work
    and State copies no client needs to wait for), and a request that ends on that unit ends
    after them, its sequence still holding what they copy: the prompt-end checkpoint of a
    one-token request is captured, and its answer and a later hit stay exact."""
    core, _ = make_core(max_concurrency=1, max_context=MAX_CONTEXT)
    cache = core.context_cache
    seen = []
    capture = cache.capture_if_due

    def watched(rows):
        rows = list(rows)
        due = core.program.due_captures([seq_id for seq_id, _ in rows])
        for req in list(core._residents):
            if req.seq_id in due:
                # the token this unit produced is published, the request not finished yet
                seen.append((len(req.token_ids), req.first_token_time is not None,
                             req.channel.is_done))
        capture(rows)
    cache.capture_if_due = watched
    p = prompt(3000, 12)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    res = core.submit(p, params).result(timeout=60)
    assert res.token_ids == reference_tokens(p, params, MAX_CONTEXT)
    assert seen and all(n >= 1 and first and not done for n, first, done in seen), seen
    again = core.submit(np.concatenate([p, prompt(3001, 3)]), params).result(timeout=60)
    assert again.num_cached_tokens >= len(p)
    assert again.token_ids == reference_tokens(np.concatenate([p, prompt(3001, 3)]), params,
                                               MAX_CONTEXT)
    _finish_empty(core)
