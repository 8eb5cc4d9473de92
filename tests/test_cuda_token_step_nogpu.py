"""CudaModel.launch_tokens -> TokenStep.collect on the fake device (tests/test_cuda_nogpu.py's
_FakeDevice: device memory as a byte array behind the driver's copy functions): the same ids as
decode_greedy / sample, collect waits on the step's event and never on the whole stream, and one
step at a time is in flight."""
import sys
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_cuda_nogpu import _FakeDevice, _decode_batch  # noqa: E402

from ninfer.contracts import ForwardBatch  # noqa: E402


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
    m._current, m._in_flight = (lambda: None), None
    m.ws = SimpleNamespace(tokens=dev.arena.take((8,), np.int32, "tokens"),
                           logits=dev.arena.take((8,), np.float32, "logits"))
    tokens = dev._dev(m.ws.tokens.ptr, 32).view(np.int32)
    host = dev._pinned(32)
    host.view = lambda dtype, offset, count: host.array.view(dtype)[offset: offset + count]
    m.ids_host, m.step_done = host, _Event(log)

    def step(kind):
        def run(batch, *a, **k):
            log.append(kind)
            tokens[:batch.num_rows] = ids[:batch.num_rows]
        return run
    m._decode_launch, m._eager = step("graph"), step("eager")

    def sample(stream, logits, out, rows):
        log.append("sampler")
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
    assert m._in_flight is None                        # a refused launch leaves nothing in flight
