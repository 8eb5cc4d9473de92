"""Greedy generation through the public Engine equals transformers' greedy continuation (issue 4,
"Done when", first bullet) for every oracle fixture.

The references are `generate(do_sample=False, max_new_tokens=16)` with EOS not honoured, hence
ignore_eos=True here; each step's top-1/top-2 logit gap is >= 0.05 (tests/fixtures/README.md).
"""
from __future__ import annotations

import numpy as np
import pytest

from fixture_utils import convert_fixture, fixture_names, load_reference

NAMES = fixture_names()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("golden_generate")
    return lambda name: convert_fixture(name, out_dir)


def _greedy(max_tokens):
    from ninfer import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(name, converted):
    from ninfer import Engine

    ref = load_reference(name)
    with Engine(converted(name), max_concurrency=1) as engine:
        for cont in ref.continuations:
            res = engine.generate(np.asarray(cont.prompt, np.int32), _greedy(len(cont.tokens)))
            assert res.error is None, f"{name}: generation failed: {res.error}"
            assert list(res.token_ids) == cont.tokens.tolist(), \
                f"{name}: engine greedy {list(res.token_ids)} != transformers " \
                f"{cont.tokens.tolist()}"
            assert res.finish_reason == "length"
            assert res.num_prompt_tokens == len(cont.prompt)


@pytest.mark.parametrize("name", ["dense", "moe", "odd_heads"])
def test_concurrent_greedy_generation_equals_transformers(name, converted):
    """The fixture prompts submitted together (one decode batch, small prefill chunks interleaved
    with decode) still give transformers' tokens."""
    from ninfer import Engine

    ref = load_reference(name)
    with Engine(converted(name), max_concurrency=4, prefill_chunk=7) as engine:
        handles = [engine.submit(np.asarray(c.prompt, np.int32), _greedy(len(c.tokens)))
                   for c in ref.continuations * 2]
        results = [h.result(timeout=120) for h in handles]
    for cont, res in zip(ref.continuations * 2, results):
        assert res.error is None, f"{name}: generation failed: {res.error}"
        assert list(res.token_ids) == cont.tokens.tolist(), \
            f"{name}: concurrent greedy {list(res.token_ids)} != transformers " \
            f"{cont.tokens.tolist()}"


@pytest.mark.parametrize("snapshot_bytes", [0, 64 << 20], ids=["replay", "snapshot"])
@pytest.mark.parametrize("name", ["dense", "moe_cond_gen", "odd_heads"])
def test_greedy_under_kv_pressure_equals_transformers(name, snapshot_bytes, converted):
    """A KV pool too small for all residents forces pauses (Replay only, or Snapshot when host
    memory allows); every request still produces transformers' greedy tokens."""
    from ninfer import Engine

    ref = load_reference(name)
    conts = ref.continuations * 2
    page = 8
    # one request needs at most ceil(48 / 8) = 6 pages; the four together need up to 20
    with Engine(converted(name), max_concurrency=4, max_context=48, page_size=page,
                num_kv_pages=7, prefill_chunk=8, host_snapshot_bytes=snapshot_bytes) as engine:
        handles = [engine.submit(np.asarray(c.prompt, np.int32), _greedy(len(c.tokens)))
                   for c in conts]
        results = [h.result(timeout=120) for h in handles]
        stats = engine.stats()
    for cont, res in zip(conts, results):
        assert res.error is None, f"{name}: generation failed: {res.error}"
        assert list(res.token_ids) == cont.tokens.tolist(), \
            f"{name}: greedy under pressure {list(res.token_ids)} != transformers " \
            f"{cont.tokens.tolist()}"
    assert stats.get("pauses", 0) > 0, f"{name}: the small KV pool never paused anyone: {stats}"
    if snapshot_bytes == 0:
        assert stats.get("snapshot_pauses", 0) == 0
    else:
        assert stats.get("snapshot_pauses", 0) > 0, f"{name}: no Snapshot pause: {stats}"
