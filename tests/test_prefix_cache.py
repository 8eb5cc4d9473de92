"""Prefix reuse (continuation checkpoints): a hit installs one real execution's State + KV at the
exact checkpoint position and must give exactly the tokens of a cold run."""
import numpy as np
import pytest

from fixture_utils import convert_fixture
from ninfer.api import SamplingParams
from ninfer.errors import RequestError
from ninfer.models.qwen3_5.program import ProgramError
from ninfer.runtime import context_cache
from runtime_helpers import VOCAB, make_core, prompt, reference_tokens

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)


def _run(core, ids, params):
    res = core.submit(np.asarray(ids, np.int32), params).result(timeout=20)
    assert res.error is None, res.error
    return list(res.token_ids)


def _stats(core):
    return core.stats()      # published by the worker before each Finished


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_hit_equals_cold_run(params):
    core, _ = make_core(prefill_chunk=8, page_size=4)
    first = prompt(1, 13)                      # neither chunk- nor page-aligned
    second = np.concatenate([first, prompt(2, 9)])
    assert _run(core, first, params) == reference_tokens(first, params)
    assert _stats(core)["prefix_cache_entries"] == 2      # the prompt and its continuation
    res = core.submit(second, params, session="chat-1").result(timeout=20)
    assert list(res.token_ids) == reference_tokens(second, params)
    assert res.num_cached_tokens == 13
    stats = _stats(core)
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_tokens_reused"] == 13
    assert stats["prefix_cache_lookups"] == 2
    core.shutdown()
    core.program.assert_all_free()
    core.context_cache.check_invariants()


def test_prefix_differing_inside_checkpoint_gets_no_hit():
    core, _ = make_core()
    first = prompt(3, 12)
    _run(core, first, GREEDY)
    other = first.copy()
    other[5] = other[5] % (VOCAB - 1) + 1      # differs inside [0, 12)
    other = np.concatenate([other, prompt(4, 5)])
    assert _run(core, other, GREEDY) == reference_tokens(other, GREEDY)
    assert _stats(core)["prefix_cache_hits"] == 0
    # other was asked for a checkpoint at 4, where it leaves the full blocks it shares with
    # first's entries (page_size 4); the same prompt again binds that, never the whole prompt
    # (one token must remain to prefill), and is asked for one at 8; a third run binds it
    res = core.submit(first, GREEDY).result(timeout=20)
    assert res.token_ids == reference_tokens(first, GREEDY) and res.num_cached_tokens == 4
    assert core.submit(first, GREEDY).result(timeout=20).num_cached_tokens == 8
    with pytest.raises(RequestError, match="session"):
        core.submit(first, GREEDY, session=7)
    core.shutdown()


def test_digest_collision_never_gives_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(context_cache, "_digest", lambda ids, prev=b"": b"same")
    core, _ = make_core()
    a, b = prompt(5, 10), prompt(6, 10)
    _run(core, a, GREEDY)
    longer = np.concatenate([b, prompt(7, 4)])
    assert _run(core, longer, GREEDY) == reference_tokens(longer, GREEDY)
    assert _stats(core)["prefix_cache_hits"] == 0
    core.shutdown()


def test_lru_eviction_under_a_tiny_budget():
    """The host tier alone (no device share): one entry fits, the older goes."""
    probe, _ = make_core()
    one = probe.program.checkpoints.host_cost(10)
    probe.shutdown()
    core, _ = make_core(prefix_cache_bytes=one, prefix_cache_device_fraction=0)
    a, c = prompt(8, 10), prompt(9, 10)
    _run(core, a, GREEDY)
    _run(core, c, GREEDY)                      # evicts a's checkpoint
    stats = _stats(core)
    assert stats["prefix_cache_entries"] == 1 and stats["prefix_cache_bytes"] == one
    a2, c2 = np.concatenate([a, prompt(10, 3)]), np.concatenate([c, prompt(11, 3)])
    assert _run(core, a2, GREEDY) == reference_tokens(a2, GREEDY)
    assert _stats(core)["prefix_cache_hits"] == 0
    assert _run(core, c2, GREEDY) == reference_tokens(c2, GREEDY)
    assert _stats(core)["prefix_cache_hits"] == 1
    core.shutdown()
    core.context_cache.check_invariants()


def test_disabled_cache_captures_nothing():
    core, _ = make_core(prefix_cache=False)
    a = prompt(12, 10)
    _run(core, a, GREEDY)
    _run(core, np.concatenate([a, prompt(13, 3)]), GREEDY)
    stats = _stats(core)
    assert stats["prefix_cache_entries"] == 0 and stats["prefix_cache_hits"] == 0
    core.shutdown()


@pytest.mark.parametrize("snapshot_bytes", [0, 1 << 20], ids=["replay", "snapshot"])
def test_kv_pressure_with_pauses_stays_exact(snapshot_bytes):
    core, _ = make_core(max_concurrency=4, num_kv_pages=16, page_size=4, prefill_chunk=8,
                        host_snapshot_bytes=snapshot_bytes)
    base = prompt(14, 11)
    _run(core, base, GREEDY)
    prompts = [np.concatenate([base, prompt(20 + i, 3 + 2 * i)]) for i in range(6)]
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(6)]
    handles = [core.submit(p, q) for p, q in zip(prompts, params)]
    got = [list(h.result(timeout=30).token_ids) for h in handles]
    assert got == [reference_tokens(p, q) for p, q in zip(prompts, params)]
    stats = _stats(core)
    # an admission whose reused prefix does not fit the free pages binds cold instead
    assert stats["pauses"] > 0 and 1 <= stats["prefix_cache_hits"] <= 6
    core.shutdown()
    core.program.assert_all_free()
    core.context_cache.check_invariants()


def test_cancel_right_after_an_install_keeps_the_checkpoint():
    core, model = make_core(max_concurrency=1)
    base = prompt(15, 12)
    _run(core, base, GREEDY)
    longer = np.concatenate([base, prompt(16, 9)])
    handle = core.submit(longer, SamplingParams(max_tokens=30, ignore_eos=True))
    handle.cancel()
    assert handle.result(timeout=20).finish_reason == "cancelled"
    assert _run(core, longer, GREEDY) == reference_tokens(longer, GREEDY)
    stats = _stats(core)
    assert stats["prefix_cache_entries"] >= 1 and stats["prefix_cache_hits"] >= 1
    core.shutdown()
    core.program.assert_all_free()
    core.context_cache.check_invariants()


def test_clear_returns_everything_and_invariants_catch_a_lost_entry():
    core, _ = make_core()
    _run(core, prompt(17, 9), GREEDY)
    _run(core, prompt(18, 9), GREEDY)
    core.shutdown()
    assert core.program.stats()["prefix_cache_entries"] == 4     # 2 prompts, 2 continuations
    core.program.assert_all_free()                 # a cache is not a leak
    cid = core.program.checkpoints.ids()[0]
    core.program.checkpoints.drop(cid)              # behind the index's back
    with pytest.raises(ProgramError, match="prefix index"):
        core.context_cache.check_invariants()
    with pytest.raises(ProgramError, match="dropped twice"):
        core.program.checkpoints.drop(cid)


def test_clear_prefix_cache():
    core, _ = make_core()
    _run(core, prompt(19, 9), GREEDY)
    core.shutdown()
    core.context_cache.clear_prefix_cache()
    assert core.program.stats()["prefix_cache_entries"] == 0
    assert core.program.checkpoints.usage().host_bytes_used == 0
    core.context_cache.check_invariants()


# ---- the real numpy model (tiny converted fixture) ----------------------------------------------

@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return convert_fixture("dense", tmp_path_factory.mktemp("prefix_cache"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo artifact: random weights but the real Qwen vocabulary and chat template (the
    converted fixtures' tokenizer lacks <think>, so their reuse boundary is the whole prompt)."""
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact(tmp_path_factory.mktemp("prefix_cache_demo"))


def _chat(path, params, **options):
    from ninfer import Engine
    turn1 = [{"role": "system", "content": "You answer briefly. " * 8},
             {"role": "user", "content": "Hello there, how are you today?"}]
    with Engine(path, max_concurrency=2, prefill_chunk=16, page_size=8, **options) as engine:
        r1 = engine.generate(turn1, params, enable_thinking=False)
        turn2 = turn1 + [{"role": "assistant", "content": r1.text},
                         {"role": "user", "content": "And what about tomorrow?"}]
        r2 = engine.generate(turn2, params, enable_thinking=False)
        reusable = engine.frontend.prepare(turn1, enable_thinking=False).num_reusable_tokens
        return r1, r2, engine.stats(), reusable


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_real_model_chat_turn2_reuses_turn1(demo, kind):
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0) if kind == "greedy" \
        else SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.95, seed=3)
    cold = _chat(demo, params, prefix_cache=False)
    warm = _chat(demo, params)
    assert warm[0].error is None and warm[1].error is None
    assert warm[0].token_ids == cold[0].token_ids and warm[1].token_ids == cold[1].token_ids
    assert cold[2]["prefix_cache_hits"] == 0
    assert warm[2]["prefix_cache_hits"] == 1
    assert warm[2]["prefix_cache_tokens_reused"] == warm[3] > 0


def test_real_model_token_prompts_hit_equals_cold(dense):
    from ninfer import Engine
    rng = np.random.default_rng(4)
    base = rng.integers(3, 256, 21).astype(np.int32)
    longer = np.concatenate([base, rng.integers(3, 256, 10).astype(np.int32)])
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    with Engine(dense, max_concurrency=1, prefix_cache=False) as engine:
        cold = engine.generate(longer, params).token_ids
    with Engine(dense, max_concurrency=1, prefill_chunk=8, page_size=8) as engine:
        engine.generate(base, params)
        warm = engine.generate(longer, params).token_ids
        stats = engine.stats()
    assert warm == cold
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_tokens_reused"] == 21


def test_media_prompts_neither_capture_nor_reuse():
    import dataclasses
    core, _ = make_core()
    base = prompt(21, 10)
    _run(core, base, GREEDY)
    real_prepare = core.frontend.prepare

    @dataclasses.dataclass(frozen=True)
    class WithMedia:
        token_ids: np.ndarray
        text: str = ""
        num_reusable_tokens: int = 0
        media: tuple = ("image",)
        mrope_positions: object = None
        media_digest: bytes = b""          # no digest: a media prompt cannot be keyed

    # a vision model's encoder, reduced to text positions and no embeddings to place
    from ninfer.models.qwen3_5.vision_tower import PromptMedia
    core.program.model.encode_media = lambda ids, media, positions: PromptMedia(
        np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))), 0,
        np.zeros(0, np.int64), np.zeros((0, 1), np.float32))

    def prepare(p, **kw):
        got = real_prepare(p, **kw)
        return WithMedia(got.token_ids, got.text, got.num_reusable_tokens)
    core.frontend.prepare = prepare
    longer = np.concatenate([base, prompt(22, 4)])
    assert _run(core, longer, GREEDY) == reference_tokens(longer, GREEDY)
    stats = _stats(core)
    # base's prompt and continuation only: the media prompt kept nothing
    assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_entries"] == 2
    core.shutdown()


@pytest.mark.parametrize("seed", [11, 12])
def test_stress_shared_prefixes_cancels_tiny_pool_and_cache(seed):
    """Many concurrent prompts built from a few shared prefixes, on a tiny KV pool (pauses of
    both kinds) and a cache of about three entries (eviction), with cancels: every kept request
    equals its cold reference and nothing leaks."""
    import random
    max_context = 40
    probe, _ = make_core()
    budget = 3 * probe.program.checkpoints.host_cost(12)
    probe.shutdown()
    core, _ = make_core(max_concurrency=4, max_context=max_context, page_size=4, num_kv_pages=12,
                        prefill_chunk=5, max_queue=200, host_snapshot_bytes=3000,
                        # the host tier alone (tests/test_context_cache.py stresses the device
                        # tier): a cache of about three entries, whatever the timing
                        prefix_cache_bytes=budget, prefix_cache_device_fraction=0)
    rng = random.Random(seed)
    roots = [prompt(300 + k, 14) for k in range(4)]
    plans = []
    for i in range(80):
        # checkpoints sit at the end of the fake prompts: bare heads seed them, extensions hit
        head = roots[rng.randrange(4)][:rng.choice([6, 10, 14])]
        tail = prompt(400 + i, rng.choice([0, 0, 1, 4, 8]))
        p = np.concatenate([head, tail]).astype(np.int32)
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                **rng.choice([dict(), dict(temperature=1.0, seed=i)]))
        plans.append((p, params, rng.random() < 0.15))
    handles = []
    for p, params, cancel in plans:
        h = core.submit(p, params)
        if cancel:
            h.cancel()
        handles.append(h)
    for (p, params, cancel), h in zip(plans, handles):
        result = h.result(timeout=60)
        want = reference_tokens(p, params, max_context)
        assert result.token_ids == want[:len(result.token_ids)]
        if not cancel:
            assert result.token_ids == want
    stats = core.stats()
    assert stats["prefix_cache_hits"] > 0, stats
    assert stats["pauses"] > 0, stats
    assert stats["prefix_cache_bytes"] <= budget
    assert core.health == "ready"
    core.shutdown()
    core.program.assert_all_free()
    core.context_cache.check_invariants()
