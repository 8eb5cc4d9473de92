"""The pipelined decode (Program.launch_ahead) through EngineCore, on a model that chains token
steps (fakes.ChainingModel: FakeModel's logits argmaxed on its "device"): every request's tokens
are the uninterrupted run's whatever ends it (max_tokens at different steps, EOS, a cancel, a
newcomer); a request ending on a step that ran ahead accepts nothing of the step after; the
context cache keeps the continuation that step covered, and the next turn binds it with the
cold run's tokens; every page, slot and unit is free at the end."""
import time

import numpy as np
import pytest

from ninfer.api import SamplingParams
from ninfer.models.qwen3_5.fakes import ChainingModel, FakeFrontend, FakeOutputSession
from ninfer.models.qwen3_5.program import Program
from ninfer.options import EngineOptions
from ninfer.runtime.engine_core import EngineCore
from runtime_helpers import EOS, VOCAB, Gate, drain, prompt, reference_tokens

pytestmark = pytest.mark.timeout(60)


def make_core(**kw):
    options = EngineOptions(**{**dict(max_concurrency=4, max_context=64, page_size=4,
                                      prefill_chunk=8, debug_checks=True), **kw})
    model = ChainingModel(VOCAB)
    program = Program(model, options)
    launched = []
    launch_ahead = program.launch_ahead

    def counted(inflight):                          # the steps really launched ahead
        ahead = launch_ahead(inflight)
        if ahead is not None:
            launched.append(len(ahead.seqs))
        return ahead
    program.launch_ahead = counted
    return EngineCore(program, FakeFrontend(VOCAB, (EOS,)), options), model, launched


def finish_clean(core):
    core.shutdown()
    assert not core._thread.is_alive()
    core.program.check_invariants()
    core.context_cache.clear_prefix_cache()
    core.program.assert_all_free()


def test_rows_ending_at_different_steps_keep_the_uninterrupted_tokens():
    prompts = [prompt(200 + i, n) for i, n in enumerate((5, 9, 3, 12))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (20, 7, 13, 30)]
    want = [reference_tokens(p, q) for p, q in zip(prompts, params)]
    core, model, launched = make_core()
    gate = Gate()
    model.on_forward = gate                       # all four admitted before the first step
    handles = [core.submit(p, q) for p, q in zip(prompts, params)]
    gate.opened.set()
    results = [drain(h)[1] for h in handles]
    assert [r.token_ids for r in results] == want
    assert all(r.finish_reason == "length" for r in results)
    assert len(launched) >= 10 and max(launched) == 4     # steps really ran ahead, 4 rows
    finish_clean(core)


def test_eos_and_a_cancel_while_a_step_runs_ahead():
    stop = SamplingParams(max_tokens=40, temperature=0.0)          # EOS may end it early
    a, b = prompt(210, 6), prompt(211, 4)
    want_a = reference_tokens(a, stop)
    core, model, launched = make_core(max_concurrency=2)
    gate = Gate()

    def paced(batch):                                # a step takes 2 ms: the cancel lands mid-run
        gate(batch)
        time.sleep(0.002)
    model.on_forward = paced
    ha = core.submit(a, stop)
    hb = core.submit(b, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    gate.opened.set()
    seen = 0
    for event in hb.events(timeout=20):              # cancel b once it streamed a few tokens
        seen += len(getattr(event, "token_ids", ()) or ())
        if seen >= 5:
            hb.cancel()
            break
    assert drain(ha)[1].token_ids == want_a
    res_b = hb.result(timeout=20)
    assert res_b.finish_reason == "cancelled" and 5 <= len(res_b.token_ids) < 40
    assert launched
    finish_clean(core)


def test_a_newcomer_drains_the_pipeline_and_joins():
    first = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    a, b = prompt(220, 5), prompt(221, 11)
    core, model, launched = make_core(max_concurrency=2)
    handles = {}

    def arrive(batch):                               # b arrives while a's steps run ahead
        if len(launched) >= 3 and "b" not in handles:
            handles["b"] = core.submit(b, first)
    model.on_forward = arrive
    ha = core.submit(a, first)
    for _ in range(2000):
        if "b" in handles:
            break
        time.sleep(0.005)
    hb = handles["b"]
    assert drain(ha)[1].token_ids == reference_tokens(a, first)
    assert drain(hb)[1].token_ids == reference_tokens(b, first)
    assert max(launched) == 2                        # later both rows ran ahead together
    finish_clean(core)


def test_the_continuation_covers_the_step_run_ahead_and_the_next_turn_binds_it():
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    turn1 = prompt(230, 10)
    core, model, launched = make_core(max_concurrency=1, max_context=128)
    res = core.submit(turn1, params, session="s").result(timeout=20)
    assert res.token_ids == reference_tokens(turn1, params, 128) and launched
    cid = core.context_cache._sessions["s"][1]
    covered = core.context_cache._entries[cid].token_ids
    # the step after the last ran that last token: prompt + the whole answer
    assert np.array_equal(covered, np.concatenate([turn1, res.token_ids]))
    turn2 = np.concatenate([turn1, res.token_ids, prompt(231, 5)]).astype(np.int32)
    res2 = core.submit(turn2, params, session="s").result(timeout=20)
    assert res2.num_cached_tokens == len(covered)
    assert res2.token_ids == reference_tokens(turn2, params, 128)
    finish_clean(core)


def test_no_step_runs_ahead_where_the_next_token_may_need_the_host(monkeypatch):
    """A session that may force tokens later (a thinking budget) keeps every step collected
    before the next is launched; the tokens are the same."""
    monkeypatch.setattr(FakeOutputSession, "may_force_tokens", True)
    core, model, launched = make_core(max_concurrency=2)
    p = prompt(240, 6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert drain(core.submit(p, params))[1].token_ids == reference_tokens(p, params)
    assert launched == []
    finish_clean(core)


@pytest.mark.parametrize("penalty", [0.0, 0.5], ids=["plain", "presence-penalty"])
def test_sampled_rows_run_ahead_when_their_token_needs_no_history(penalty):
    """Seeded sampled rows ((seed, position) draws on the device) run ahead like greedy ones and
    keep the uninterrupted run's tokens; a presence penalty reads the tokens generated so far,
    so its rows keep every step collected before the next (same tokens)."""
    prompts = [prompt(250 + i, n) for i, n in enumerate((5, 9, 3))]
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.9, seed=40 + i,
                             presence_penalty=penalty, ignore_eos=True)
              for i, m in enumerate((18, 7, 25))]
    want = [reference_tokens(p, q) for p, q in zip(prompts, params)]
    core, model, launched = make_core(max_concurrency=3)
    gate = Gate()
    model.on_forward = gate                       # all three admitted before the first step
    handles = [core.submit(p, q) for p, q in zip(prompts, params)]
    gate.opened.set()
    assert [drain(h)[1].token_ids for h in handles] == want
    if penalty:
        assert launched == []
    else:
        assert len(launched) >= 10 and max(launched) == 3
    finish_clean(core)
