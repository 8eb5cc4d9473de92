"""Shared helpers of tests/test_runtime*.py: an EngineCore on the fake model, and reference runs."""
import threading

import numpy as np

from ninfer.api import Finished, GenerationStart, TextDelta
from ninfer.models.qwen3_5.program import Program, RowDecision, SamplingSpec
from ninfer.options import EngineOptions
from ninfer.runtime.engine_core import EngineCore
from ninfer.models.qwen3_5.fakes import FakeFrontend, FakeModel

VOCAB = 64
EOS = 0


def make_core(model_class=FakeModel, **kw):
    # debug_checks: the whole page ledger is audited whenever the core runs empty
    options = EngineOptions(**{**dict(max_concurrency=4, max_context=64, page_size=4,
                                      prefill_chunk=8, debug_checks=True), **kw})
    model = model_class(VOCAB)
    return EngineCore(Program(model, options), FakeFrontend(VOCAB, (EOS,)), options), model


def prompt(seed, n):
    return np.random.default_rng(seed).integers(1, VOCAB, n).astype(np.int32)


def reference_tokens(prompt_ids, params, max_context=64):
    """The uninterrupted run: one sequence alone in a Program, stopping like the fake frontend."""
    prog = Program(FakeModel(VOCAB), EngineOptions(max_concurrency=1, max_context=max_context,
                                                   page_size=16, prefill_chunk=max_context))
    sid = prog.bind(np.asarray(prompt_ids, np.int32), SamplingSpec.from_params(params, params.seed or 0))
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    out = []
    while True:
        assert prog.reserve_units([sid]) == [True]
        pending = prog.execute([sid])
        prog.commit(pending, [RowDecision(len(r.produced)) for r in pending.rows])
        out += pending.rows[0].produced
        if out and (out[-1] in stops or len(out) >= params.max_tokens
                    or len(prompt_ids) + len(out) >= max_context):
            break
    prog.release(sid)
    prog.assert_all_free()
    return out


def drain(handle, timeout=20.0):
    """All events of a handle; checks the stream's shape. Returns (events, result)."""
    events = list(handle.events(timeout=timeout))
    assert isinstance(events[-1], Finished)
    assert sum(isinstance(e, Finished) for e in events) == 1
    starts = [i for i, e in enumerate(events) if isinstance(e, GenerationStart)]
    assert len(starts) <= 1 and (not starts or starts[0] == 0)
    result = events[-1].result
    streamed = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
    # nothing duplicated or lost: every accepted token is streamed exactly once, in order
    # (the stop token has no text, so it may be absent from the stream as its last token)
    assert streamed == result.token_ids or streamed == result.token_ids[:-1]
    return events, result


class Gate:
    """A model hook that blocks the worker inside forward until opened."""

    def __init__(self):
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, batch):
        self.entered.set()
        assert self.opened.wait(20), "gate never opened"
