"""EngineCore on the fake model: events, concurrency, pressure (pause/resume), cancellation in
every state, capacity, deadlines, failures. Every test ends with all pages and slots free."""
import gc
import threading
import time

import numpy as np
import pytest

from ninfer.api import Finished, GenerationStart, SamplingParams, TextDelta
from ninfer.errors import ContextLengthError, EngineFailedError, RequestError
from ninfer.models.qwen3_5.program import Program, ProgramError
from ninfer.options import EngineOptions
from ninfer.models.qwen3_5.fakes import FakeModel
from ninfer.runtime.request import RequestState
from runtime_helpers import Gate, drain, make_core, prompt, reference_tokens

pytestmark = pytest.mark.timeout(60)

GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.8, top_k=30, top_p=0.9, seed=1234)


def finish_clean(core):
    """Shut down after every handle resolved: nothing may be left in the Program."""
    core.shutdown()
    assert not core._thread.is_alive()
    core.program.assert_all_free()


def test_events_order_and_result():
    core, _ = make_core()
    h = core.submit(prompt(0, 9), SamplingParams(max_tokens=12, ignore_eos=True), request_id="r1")
    events, result = drain(h)
    assert events[0] == GenerationStart("r1", 9)
    assert result.finish_reason == "length" and len(result.token_ids) == 12
    assert result.token_ids == reference_tokens(prompt(0, 9), SamplingParams(max_tokens=12,
                                                                             ignore_eos=True))
    assert result.text == "".join(e.text for e in events if isinstance(e, TextDelta))
    assert result.time_to_first_token is not None and result.num_prompt_tokens == 9
    assert h.done and h.result() is result
    finish_clean(core)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_eight_prompts_together_equal_one_at_a_time(sampling):
    prompts = [prompt(10 + i, n) for i, n in enumerate((3, 30, 9, 17, 1, 25, 12, 6))]
    params = [SamplingParams(max_tokens=20, **sampling) for _ in prompts]
    want = [reference_tokens(p, q) for p, q in zip(prompts, params)]
    core, model = make_core(max_concurrency=8)
    gate = Gate()
    model.on_forward = gate                        # hold the worker until all 8 are queued
    handles = [core.submit(p, q) for p, q in zip(prompts, params)]
    gate.opened.set()
    results = [drain(h)[1] for h in handles]
    assert [r.token_ids for r in results] == want
    assert max(model.batch_sizes) >= 5             # really batched: several rows per call
    finish_clean(core)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "two_units"])
def test_decode_rows_ride_on_a_prefill_chunk(merge):
    """A short prompt decodes while a long one prefills in chunks: with the model's
    mixed_batches the cycle's decode row and the chunk are one forward (rows of 1 and of 8
    tokens in one batch), without it two; the tokens are the uninterrupted runs' either way."""
    short, long = prompt(90, 3), prompt(91, 40)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [reference_tokens(short, params), reference_tokens(long, params)]
    core, model = make_core(max_concurrency=2, prefill_chunk=8)
    core.program.merges_units = merge
    rows, gate = [], Gate()

    def record(batch):
        gate(batch)
        rows.append(tuple(np.diff(batch.query_start)))
    model.on_forward = record
    handles = [core.submit(short, params), core.submit(long, params)]
    gate.opened.set()
    assert [drain(h)[1].token_ids for h in handles] == want
    mixed = [r for r in rows if 1 in r and max(r) > 1]
    if merge:
        assert len(mixed) >= 4                # the long prompt's chunks, each with a decode row
    else:
        assert not mixed and len(rows) > len(mixed) + 4
    finish_clean(core)


@pytest.mark.parametrize("budget", ["replay", "snapshot", "mixed"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_kv_pressure_pauses_and_resumes_without_changing_tokens(budget, sampling):
    # 4 residents, 48-token contexts (12 pages each) share 14 pages: constant pressure
    probe = Program(FakeModel(), EngineOptions(max_context=48, page_size=4))
    one_snapshot = 12 * probe.snapshots.page_bytes + probe.snapshots.state_bytes   # one at a time
    core, model = make_core(max_concurrency=4, max_context=48, num_kv_pages=14, prefill_chunk=4,
                            host_snapshot_bytes={"replay": 0, "snapshot": 1 << 30,
                                                 "mixed": one_snapshot}[budget])
    prompts = [prompt(30 + i, n) for i, n in enumerate((10, 14, 6, 20, 9))]
    params = [SamplingParams(max_tokens=26, ignore_eos=True, **sampling) for _ in prompts]
    want = [reference_tokens(p, q, max_context=48) for p, q in zip(prompts, params)]
    gate, num_protected = Gate(), []

    def hook(batch):
        gate(batch)                                # all queued first: a deterministic schedule
        num_protected.append(sum(core.program.is_protected(r.seq_id) for r in core._residents))
    model.on_forward = hook
    handles = [core.submit(p, q) for p, q in zip(prompts, params)]
    gate.opened.set()
    results = [drain(h)[1] for h in handles]
    assert [r.token_ids for r in results] == want
    assert max(num_protected) == 1                 # resumes happened, one protected at a time
    stats = core.stats()
    assert stats["pauses"] > 0
    if budget == "replay":
        assert stats["snapshot_pauses"] == 0 and stats["replay_resumes"] > 0
    elif budget == "snapshot":
        assert stats["snapshot_resumes"] > 0
    else:                                          # older victims take younger ones' room
        assert stats["snapshot_resumes"] > 0 and stats["replay_resumes"] > 0
        assert stats["snapshot_revocations"] > 0
    finish_clean(core)


CANCEL_STATES = [RequestState.WAITING, RequestState.MATERIALIZING, RequestState.PREFILL,
                 RequestState.DECODE, RequestState.PAUSED, RequestState.REPLAY]


@pytest.mark.parametrize("state", CANCEL_STATES, ids=lambda s: s.name.lower())
def test_cancel_in_every_state(state):
    core, model = make_core(max_concurrency=2, max_context=48, num_kv_pages=13, prefill_chunk=4,
                            host_snapshot_bytes=0)
    prompts = [prompt(50 + i, n) for i, n in enumerate((13, 22, 7, 18, 11, 15))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    handles, cancelled = {}, []
    gate = Gate()

    def hook(batch):                               # runs on the worker, inside a unit
        gate(batch)                                # all queued first: a deterministic schedule
        if cancelled:
            return
        for req in core._residents + core._paused + list(core._waiting):
            if req.state == state:
                cancelled.append(req.request_id)
                handles[req.request_id].cancel()
                return

    model.on_forward = hook
    for i, p in enumerate(prompts):
        handles[f"r{i}"] = core.submit(p, params, request_id=f"r{i}")
    gate.opened.set()
    results = {rid: drain(h)[1] for rid, h in handles.items()}
    assert cancelled, f"the scenario never reached {state.name}"
    for i, p in enumerate(prompts):
        r, want = results[f"r{i}"], reference_tokens(p, params, max_context=48)
        if f"r{i}" in cancelled:
            assert r.finish_reason == "cancelled" and r.error is None
            assert r.token_ids == want[:len(r.token_ids)]     # committed output never rolls back
        else:
            assert r.finish_reason == "length" and r.token_ids == want
    finish_clean(core)


def test_cancel_waiting_request_publishes_no_start():
    core, model = make_core(max_concurrency=1)
    gate = Gate()
    model.on_forward = gate
    first = core.submit(prompt(1, 5), SamplingParams(max_tokens=3))
    assert gate.entered.wait(10)
    second = core.submit(prompt(2, 5), SamplingParams(max_tokens=3))
    second.cancel()
    gate.opened.set()
    events, result = drain(second)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert not any(isinstance(e, GenerationStart) for e in events)
    assert drain(first)[1].finish_reason in ("length", "stop")
    finish_clean(core)


def test_cancel_after_finish_changes_nothing():
    core, _ = make_core()
    h = core.submit(prompt(3, 5), SamplingParams(max_tokens=4, ignore_eos=True))
    result = h.result(timeout=10)
    h.cancel()
    h.close()
    assert h.result() is result and result.finish_reason == "length"
    finish_clean(core)


def test_events_iterated_again_raise_at_once():
    """A second pass over a handle raises RequestError at once (it used to wait forever, later
    to yield nothing: a silent split of the events between two consumers); result() still works."""
    core, _ = make_core()
    handle = core.submit(prompt(5, 3), SamplingParams(max_tokens=2))
    events, _ = drain(handle)
    assert isinstance(events[-1], Finished)
    with pytest.raises(RequestError, match="read once"):
        handle.events(timeout=5)
    with pytest.raises(RequestError, match="read once"):
        list(handle)
    assert handle.result(timeout=5) == events[-1].result
    finish_clean(core)


def test_stop_token_finishes_with_stop():
    p = prompt(4, 6)
    free_run = reference_tokens(p, SamplingParams(max_tokens=20, ignore_eos=True))
    stop_at = free_run[5]
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    core, _ = make_core()
    result = core.submit(p, params).result(timeout=10)
    assert result.finish_reason == "stop"
    assert result.token_ids == free_run[:free_run.index(stop_at) + 1]
    finish_clean(core)


def test_max_context_ends_with_length():
    # clamp_max_tokens: max_tokens is only an upper bound (the server's default for a request
    # that names none); the output ends where the context does
    core, _ = make_core(max_context=20)
    result = core.submit(prompt(5, 15), SamplingParams(max_tokens=100, ignore_eos=True,
                                                       clamp_max_tokens=True)).result(10)
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    finish_clean(core)


def test_max_tokens_past_the_context_is_refused_naming_the_numbers():
    core, _ = make_core(max_context=20)
    with pytest.raises(ContextLengthError) as info:
        core.submit(prompt(5, 15), SamplingParams(max_tokens=6, ignore_eos=True))
    err = info.value
    assert isinstance(err, RequestError) and err.status == 400
    assert err.code == "context_length_exceeded"
    assert (err.max_tokens, err.num_prompt_tokens, err.max_context) == (6, 15, 20)
    assert str(err) == ("max_tokens=6 + 15 prompt tokens exceeds the context of 20 tokens "
                        "(at most 5 tokens fit after this prompt)")
    # exactly filling the context is fine, and nothing was queued by the refusal
    result = core.submit(prompt(5, 15), SamplingParams(max_tokens=5, ignore_eos=True)).result(10)
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    finish_clean(core)


def test_logprobs_ride_on_the_deltas():
    core, _ = make_core()
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, temperature=1.0, seed=3)
    events, result = drain(core.submit(prompt(6, 7), params))
    streamed = [lp for e in events if isinstance(e, TextDelta) for lp in e.logprobs]
    assert streamed == result.logprobs and len(result.logprobs) == 6
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    assert all(len(lp.top) == 3 for lp in result.logprobs)
    finish_clean(core)


def test_rejections_are_request_errors():
    core, _ = make_core(max_context=16)
    with pytest.raises(RequestError, match="16 tokens.*max_context=16") as err:
        core.submit(prompt(7, 16), SamplingParams())
    assert err.value.status == 400
    with pytest.raises(RequestError, match="temperature"):
        core.submit(prompt(7, 3), SamplingParams(temperature=-1))
    with pytest.raises(RequestError, match="timeout_s"):
        core.submit(prompt(7, 3), SamplingParams(), timeout_s=0)
    with pytest.raises(RequestError, match="token ids"):
        core.submit(np.array([1, 99], np.int32), SamplingParams())
    assert core.stats()["outstanding"] == 0
    finish_clean(core)


@pytest.mark.parametrize("params, words", [
    (SamplingParams(stop=None), "stop=None"),
    (SamplingParams(stop=5), "stop=5"),
    (SamplingParams(stop_token_ids=None), "stop_token_ids=None"),
    (SamplingParams(stop_token_ids=7), "stop_token_ids=7"),
    ({"max_tokens": 2}, "SamplingParams"),
])
def test_malformed_sampling_params_are_request_errors(params, words):
    core, _ = make_core()
    with pytest.raises(RequestError, match=words):
        core.submit(prompt(7, 3), params)
    assert core.stats()["outstanding"] == 0
    finish_clean(core)


@pytest.mark.parametrize("kwargs, words", [
    (dict(enable_thinking="no"), "enable_thinking"),
    (dict(request_id=5), "request_id"),
    (dict(timeout_s=True), "timeout_s"),
])
def test_malformed_submit_options_are_request_errors(kwargs, words):
    """No silent coercion: 'no' is truthy, and the request id must be the string events carry."""
    core, _ = make_core()
    with pytest.raises(RequestError, match=words):
        core.submit(prompt(7, 3), SamplingParams(), **kwargs)
    assert core.stats()["outstanding"] == 0
    finish_clean(core)


def test_stop_sequences_of_any_kind_are_accepted():
    core, _ = make_core()
    params = SamplingParams(max_tokens=2, stop=["zz"], stop_token_ids=np.array([5], np.int64))
    assert core.submit(prompt(7, 3), params).result(timeout=10).finish_reason in ("length", "stop")
    finish_clean(core)


def test_overload_is_429_and_capacity_is_released_exactly_once():
    core, model = make_core(max_concurrency=1, max_queue=1)
    gate = Gate()
    model.on_forward = gate
    a = core.submit(prompt(8, 4), SamplingParams(max_tokens=2, ignore_eos=True))
    b = core.submit(prompt(9, 4), SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(RequestError) as err:
        # a max_tokens that fits the 64-token context: prompt + max_tokens over it is a 400
        core.submit(prompt(10, 4), SamplingParams(max_tokens=8))
    assert err.value.status == 429
    gate.opened.set()
    a.result(timeout=10)
    b_result = b._channel.wait_result(10)           # finished, but its consumer still holds it
    assert b_result.finish_reason == "length"
    assert core.stats()["outstanding"] == 1         # response_done alone releases nothing
    b.close()
    b.close()
    assert core.stats()["outstanding"] == 0         # released once, never below zero
    del b
    gc.collect()
    assert core.stats()["outstanding"] == 0
    finish_clean(core)


def test_abandoned_handle_cancels_and_releases():
    core, model = make_core(max_concurrency=1)
    model.on_forward = lambda batch: time.sleep(0.002)
    h = core.submit(prompt(11, 4), SamplingParams(max_tokens=60, ignore_eos=True))
    channel = h._channel
    del h
    gc.collect()
    result = channel.wait_result(10)
    assert result.finish_reason == "cancelled"
    deadline = time.monotonic() + 5
    while core.stats()["outstanding"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.stats()["outstanding"] == 0
    finish_clean(core)


def test_queue_timeout_and_deadline():
    core, model = make_core(max_concurrency=1, queue_timeout_s=0.05)
    model.on_forward = lambda batch: time.sleep(0.01)
    running = core.submit(prompt(12, 4), SamplingParams(max_tokens=40, ignore_eos=True),
                          timeout_s=0.2)
    queued = core.submit(prompt(13, 4), SamplingParams(max_tokens=4))
    q = queued.result(timeout=10)
    assert q.finish_reason == "error" and "queue timeout" in q.error
    r = running.result(timeout=10)
    assert r.finish_reason == "cancelled" and "deadline" in r.error
    assert 0 < len(r.token_ids) < 40
    finish_clean(core)


def test_injected_program_failure_fails_the_engine_and_every_request():
    core, model = make_core(max_concurrency=2)
    model.fail_at_call = 6
    gate = Gate()
    model.on_forward = gate                        # all five are in before anything fails
    handles = [core.submit(prompt(20 + i, 10), SamplingParams(max_tokens=30, ignore_eos=True))
               for i in range(5)]
    gate.opened.set()
    results = [drain(h)[1] for h in handles]       # no hang: every handle resolves
    assert all(r.finish_reason == "error" and "injected" in r.error for r in results)
    assert core.health == "failed" and core.stats()["health"] == "failed"
    with pytest.raises(EngineFailedError, match="injected"):
        core.submit(prompt(1, 3), SamplingParams())
    core.shutdown()
    assert not core._thread.is_alive()


def test_program_commit_failure_fails_pending_requests():
    core, model = make_core(max_concurrency=1)
    gate = Gate()
    model.on_forward = gate
    running = core.submit(prompt(2, 5), SamplingParams(max_tokens=3))
    waiting = core.submit(prompt(3, 5), SamplingParams(max_tokens=3))
    assert gate.entered.wait(10)

    def broken_commit(pending, decisions):
        raise ProgramError("injected: KV frontier cannot be committed")
    core.program.commit = broken_commit
    gate.opened.set()
    for h in (running, waiting):
        r = h.result(timeout=10)
        assert r.finish_reason == "error" and "injected" in r.error
    assert core.health == "failed"
    core.shutdown()


def test_bind_failure_answers_the_request_being_admitted():
    """A request taken off the wait queue is answered even when its Program bind fails."""
    core, _ = make_core(max_concurrency=1)

    def broken_bind(prompt_ids, spec, **_):
        raise ProgramError("injected: bind lost its slot")
    core.program.bind = broken_bind
    result = core.submit(prompt(4, 5), SamplingParams(max_tokens=3)).result(timeout=10)
    assert result.finish_reason == "error" and "injected" in result.error
    assert core.health == "failed" and core.stats()["outstanding"] == 0
    core.shutdown()


def test_leak_found_by_the_idle_audit_fails_the_engine():
    core, model = make_core(max_concurrency=1)

    def leak(batch):                               # a page vanishes from the ledger
        if core.program.pages.num_free:
            core.program.pages.num_free -= 1
        model.on_forward = None
    model.on_forward = leak
    result = core.submit(prompt(2, 5), SamplingParams(max_tokens=3)).result(timeout=10)
    assert result.finish_reason in ("length", "stop")      # this request was already done
    deadline = time.monotonic() + 5
    while core.health != "failed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.health == "failed"
    with pytest.raises(EngineFailedError, match="ProgramError"):
        core.submit(prompt(1, 3), SamplingParams())
    core.shutdown()


def test_shutdown_cancels_pending_requests():
    core, model = make_core(max_concurrency=1)
    model.on_forward = lambda batch: time.sleep(0.002)
    handles = [core.submit(prompt(30 + i, 5), SamplingParams(max_tokens=50, ignore_eos=True))
               for i in range(3)]
    time.sleep(0.05)
    core.shutdown()
    reasons = [h.result(timeout=10).finish_reason for h in handles]
    assert all(r in ("cancelled", "length") for r in reasons) and "cancelled" in reasons
    core.program.assert_all_free()
    with pytest.raises(EngineFailedError, match="shut down"):
        core.submit(prompt(1, 3), SamplingParams())


def test_stats_report_queue_residents_pages_and_rate():
    core, model = make_core(max_concurrency=2, num_kv_pages=40)
    # deterministic under any load: no forward runs before all four are submitted, and the first
    # two-row forward waits until the test has read the stats (no request can finish before)
    submitted, observed = threading.Event(), threading.Event()

    def on_forward(batch):
        assert submitted.wait(10)
        if batch.num_rows == 2:
            assert observed.wait(10)
    model.on_forward = on_forward
    handles = [core.submit(prompt(40 + i, 9), SamplingParams(max_tokens=5, ignore_eos=True))
               for i in range(4)]
    submitted.set()
    deadline = time.monotonic() + 10
    while core.stats()["residents"] < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    s = core.stats()
    observed.set()
    assert s["residents"] == 2 and s["queue_depth"] == 2 and s["outstanding"] == 4
    assert s["kv_pages_total"] == 40 and s["kv_pages_used"] > 0 and s["state_slots_used"] == 2
    for h in handles:
        h.result(timeout=10)
    s = core.stats()
    assert s["tokens_generated"] == 20 and s["tokens_per_s"] > 0 and s["requests_finished"] == 4
    assert s["residents"] == s["paused"] == s["queue_depth"] == 0
    finish_clean(core)


def test_tokens_per_s_counts_the_whole_window():
    """Tokens over the window (or the engine's age while younger), not over the span since the
    oldest token in it: that span can be microseconds, which reported absurd rates."""
    core, model = make_core(max_concurrency=1)
    model.on_forward = lambda batch: time.sleep(0.1)
    core.submit(prompt(3, 4), SamplingParams(max_tokens=2, ignore_eos=True)).result(timeout=10)
    s = core.stats()
    assert s["tokens_generated"] == 2
    assert 0 < s["tokens_per_s"] <= 2 / 0.2         # two forwards of >= 0.1 s since the start
    finish_clean(core)


def test_submit_from_many_threads():
    core, _ = make_core(max_concurrency=4, max_queue=64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results, errors = {}, []

    def worker(k):
        try:
            for j in range(5):
                p = prompt(100 + 5 * k + j, 3 + j)
                results[(k, j)] = (p, core.submit(p, params).result(timeout=20))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 30
    for p, r in results.values():
        assert r.token_ids == reference_tokens(p, params)
    finish_clean(core)


def test_events_continue_after_a_timeout_or_an_early_exit():
    """An iteration that ended with a TimeoutError, or that the consumer left early, hands its
    claim back: a later events() continues with the next unread event (none lost, none twice);
    leaving the loop at Finished still releases capacity; a finished iteration stays final."""
    from ninfer.runtime.handle import GenerationHandle, _Channel
    released = []
    channel = _Channel("r", lambda: None, lambda: released.append(1))
    handle = GenerationHandle(channel)
    with pytest.raises(TimeoutError):
        next(handle.events(timeout=0.01))
    channel.publish(GenerationStart("r", 3))
    channel.publish(TextDelta("content", "a", (1,)))
    channel.publish(TextDelta("content", "b", (2,)))
    seen = []
    for event in handle.events(timeout=0.01):
        seen.append(event)
        if len(seen) == 2:
            break
    assert [type(e) for e in seen] == [GenerationStart, TextDelta]
    rest = handle.events(timeout=0.01)
    with pytest.raises(RequestError, match="read once"):   # one open iteration at a time
        handle.events()
    assert next(rest).text == "b"
    with pytest.raises(TimeoutError):
        next(rest)
    from ninfer.api import GenerationResult
    final = Finished(GenerationResult(**{f: None for f in GenerationResult.__dataclass_fields__}))
    channel.publish(final)
    for event in handle.events(timeout=1):
        assert event is final
        break                                   # left the loop at Finished
    assert released == [1]
    with pytest.raises(RequestError, match="read once"):
        handle.events()
