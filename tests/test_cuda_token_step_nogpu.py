"""CudaModel.launch_tokens -> TokenStep.collect on the fake device (tests/test_cuda_nogpu.py's
_FakeDevice: device memory as a byte array behind the driver's copy functions): the same ids as
decode_greedy / sample, collect waits on the step's event and never on the whole stream, and one
step at a time is in flight, or two when the second is launched after the first (its token ids
copied from the first's on the device: the pipelined decode)."""
import sys
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_cuda_nogpu import _FakeDevice, _decode_batch  # noqa: E402

from ninfer.contracts import ForwardBatch, SampleRow, SamplingSpec  # noqa: E402


def _row(**spec):
    empty = np.zeros(0, np.int32)
    return SampleRow(SamplingSpec(seed=1, temperature=0.8, **spec), 5, empty, empty)


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append("record")

    def synchronize(self):
        self.log.append("event sync")


def _model(monkeypatch, ids, sampled):
    """A CudaModel without kernels: the step (graph or eager) writes `ids` as the argmax into the
    device token buffer, the sampler overwrites them with `sampled`."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    dev, log = _FakeDevice(monkeypatch, 1 << 20), []

    def no_stream_sync():
        raise AssertionError("a token step must not synchronise the whole stream")
    m = CudaModel.__new__(CudaModel)
    m.stream = SimpleNamespace(synchronize=no_stream_sync)
    m.options, m.b_cap, m.lg_cap, m.checks_batches = SimpleNamespace(graphs=True), 4, 8, False
    m._current, m._in_flight, m._turn = (lambda: None), [], 0
    m.ws = SimpleNamespace(tokens=dev.arena.take((8,), np.int32, "tokens"),
                           logits=dev.arena.take((8,), np.float32, "logits"))
    tokens = dev._dev(m.ws.tokens.ptr, 32).view(np.int32)
    host = dev._pinned(64)                          # two id buffers of lg_cap ids
    host.view = lambda dtype, offset, count: \
        host.array[offset:].view(dtype)[:count]
    m.ids_host, m.step_events = host, (_Event(log), _Event(log))

    def step(kind):
        def run(batch, *a, **k):
            log.append(kind + (" chained" if k.get("chained") else ""))
            tokens[:batch.num_rows] = ids[:batch.num_rows] + 10 * bool(k.get("chained"))
        return run
    m._decode_launch, m._eager = step("graph"), step("eager")

    def sample(stream, logits, out, rows, ahead_turn=None):
        log.append("sampler" + ("" if ahead_turn is None else f" ahead {ahead_turn}"))
        tokens[:len(rows)] = sampled[:len(rows)]
    m.sampler = SimpleNamespace(layout=SimpleNamespace(rows_cap=8), launch=sample)
    return m, log


def test_launch_then_collect_equals_decode_greedy_and_sample(monkeypatch):
    m, log = _model(monkeypatch, np.array([5, 6, 7], np.int32), np.array([1, 2, 3], np.int32))
    batch = _decode_batch()
    step = m.launch_tokens(batch, None, None)
    assert log == ["graph", "record"]                  # launched; nothing waited on yet
    got = step.collect()
    assert log[-1] == "event sync" and got.dtype == np.int32
    assert got.tolist() == m.decode_greedy(batch, None, None).tolist() == [5, 6, 7]
    rows = [None, None, None]
    sampled = m.launch_tokens(batch, None, None, rows).collect()
    assert sampled.tolist() == m.sample(batch, None, None, rows).tolist() == [1, 2, 3]
    prefill = ForwardBatch.single([1, 2, 3], 0, [0])   # not decode-shaped: the eager path
    assert m.launch_tokens(prefill, None, None).collect().tolist() == [5]
    assert "eager" in log


def test_collect_returns_a_copy_that_the_next_step_does_not_change(monkeypatch):
    m, _ = _model(monkeypatch, np.array([5, 6, 7], np.int32), np.array([1, 2, 3], np.int32))
    first = m.launch_tokens(_decode_batch(), None, None)
    ids = first.collect()
    m.launch_tokens(_decode_batch(), None, None, [None] * 3).collect()
    assert ids.tolist() == [5, 6, 7] and first.collect().tolist() == [5, 6, 7]


def test_a_second_launch_before_collect_raises(monkeypatch):
    m, _ = _model(monkeypatch, np.array([5, 6, 7], np.int32), np.array([1, 2, 3], np.int32))
    step = m.launch_tokens(_decode_batch(), None, None)
    with pytest.raises(RuntimeError, match="not collected"):
        m.launch_tokens(_decode_batch(), None, None)
    with pytest.raises(RuntimeError, match="not collected"):
        m.decode_greedy(_decode_batch(), None, None)
    step.collect()
    assert m.launch_tokens(_decode_batch(), None, None).collect().tolist() == [5, 6, 7]


def test_sampling_rows_must_match_the_batch(monkeypatch):
    m, _ = _model(monkeypatch, np.array([5, 6, 7], np.int32), np.array([1, 2, 3], np.int32))
    with pytest.raises(ValueError, match="2 sampling rows for a batch of 3"):
        m.launch_tokens(_decode_batch(), None, None, [None, None])
    assert m._in_flight == []                          # a refused launch leaves nothing in flight


def test_a_step_launched_after_the_one_in_flight(monkeypatch):
    """after=the step in flight: two in flight, each collects its own ids from its own buffer
    and event; nothing else may launch meanwhile, and after= takes only that step and a greedy
    decode batch of its rows."""
    m, log = _model(monkeypatch, np.array([5, 6, 7], np.int32), np.array([1, 2, 3], np.int32))
    first = m.launch_tokens(_decode_batch(), None, None)
    second = m.launch_tokens(_decode_batch(), None, None, after=first)
    assert log == ["graph", "record", "graph chained", "record"]
    with pytest.raises(RuntimeError, match="not collected"):
        m.launch_tokens(_decode_batch(), None, None)
    with pytest.raises(RuntimeError, match="one step in flight"):
        m.launch_tokens(_decode_batch(), None, None, after=second)   # two in flight already
    assert first.collect().tolist() == [5, 6, 7]
    assert second.collect().tolist() == [15, 16, 17]
    third = m.launch_tokens(_decode_batch(), None, None)
    for bad in (dict(rows=[None, _row(presence_penalty=0.5), None]), dict(batch=_decode_batch(B=2)),
                dict(batch=ForwardBatch.single([1, 2, 3], 0, [0]))):
        with pytest.raises(RuntimeError, match="one step in flight"):
            m.launch_tokens(bad.get("batch", _decode_batch()), None, None, bad.get("rows"),
                            after=third)
    assert third.collect().tolist() == [5, 6, 7] and m._in_flight == []


def test_a_sampled_step_launched_after_the_one_in_flight(monkeypatch):
    """Sampled rows chain too when their tokens come from the logits, seed and position alone:
    the chained step's sampler parameters go through the staging of its turn, never the one the
    step in flight may still be copying from."""
    m, log = _model(monkeypatch, np.array([5, 6, 7], np.int32), np.array([1, 2, 3], np.int32))
    rows = [_row(), None, _row(top_p=0.9)]
    first = m.launch_tokens(_decode_batch(), None, None, rows)
    second = m.launch_tokens(_decode_batch(), None, None, rows, after=first)
    assert log == ["graph", "sampler", "record", "graph chained", "sampler ahead 1", "record"]
    assert first.collect().tolist() == second.collect().tolist() == [1, 2, 3]
    third = m.launch_tokens(_decode_batch(), None, None, rows)
    fourth = m.launch_tokens(_decode_batch(), None, None, rows, after=third)
    fifth_rows = [_row(), _row(), None]
    third.collect()
    fifth = m.launch_tokens(_decode_batch(), None, None, fifth_rows, after=fourth)
    # two chained launches in a row (fourth, then fifth after it): the stagings alternate
    assert [e for e in log if e.startswith("sampler ahead")][-2:] == ["sampler ahead 1",
                                                                      "sampler ahead 0"]
    fourth.collect(), fifth.collect()
    for spec in (dict(presence_penalty=0.1), dict(logit_bias=((3, 1.0),)), dict(logprobs=2)):
        step = m.launch_tokens(_decode_batch(), None, None, rows)
        with pytest.raises(RuntimeError, match="sampled from their logits alone"):
            m.launch_tokens(_decode_batch(), None, None, [_row(**spec), None, None], after=step)
        step.collect()
    assert m._in_flight == []


def test_a_chained_decode_launch_copies_the_ids_on_the_device(monkeypatch):
    """The real _decode_launch on the fake device: staged metadata goes to the device, then the
    previous step's ids (the workspace's token buffer) over its token field; the two stagings
    alternate."""
    from ninfer.core.cuda import driver as d
    from ninfer.models.qwen3_5.cuda.meta import DeviceMeta, MetaLayout
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    dev = _FakeDevice(monkeypatch, 1 << 16)
    monkeypatch.setattr(d, "copy_dtod_async",
                        lambda dst, src, n, stream: dev._dev(dst, n).__setitem__(
                            slice(None), dev._dev(src, n).copy()))
    m = CudaModel.__new__(CudaModel)
    m.stream, m._t_entry = None, 0.0
    m.eager_layout, m.decode_layout = MetaLayout(8, 8, 5), MetaLayout(4, 4, 5)
    meta = dev.arena.take((m.decode_layout.count,), np.int32, "meta")
    m.decode_meta = DeviceMeta(m.decode_layout, meta.ptr)
    m.staging = dev._pinned(m.eager_layout.nbytes + 2 * m.decode_layout.nbytes)
    m.staging.view = lambda dtype, offset, count: m.staging.array[offset:].view(dtype)[:count]
    launched = []
    m.graphs = SimpleNamespace(get=lambda B, kv, st: SimpleNamespace(
        launch=lambda: launched.append(B)))
    m.ws = SimpleNamespace(tokens=dev.arena.take((4,), np.int32, "tokens"))
    dev._dev(m.ws.tokens.ptr, 16).view(np.int32)[:] = [41, 42, 43, 44]
    token_field = dev._dev(m.decode_meta.token_ids, 12).view(np.int32)
    m._decode_launch(_decode_batch(), None, None, 0)
    assert token_field.tolist() == [7, 8, 9]              # the batch's own ids
    m._decode_launch(_decode_batch(), None, None, 1, chained=True)
    assert token_field.tolist() == [41, 42, 43]           # the step in flight's, on the device
    staged = [m.staging.array[m.eager_layout.nbytes + t * m.decode_layout.nbytes:].view(np.int32)[:3]
              for t in (0, 1)]
    assert staged[0].tolist() == staged[1].tolist() == [7, 8, 9] and launched == [3, 3]
