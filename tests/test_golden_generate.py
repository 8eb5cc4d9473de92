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
                f"{name}: engine greedy {list(res.token_ids)} != transformers {cont.tokens.tolist()}"
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
