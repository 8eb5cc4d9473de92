"""The CUDA backend's MTP drafter (ninfer/models/qwen3_5/cuda/drafter.py) without a GPU: its
feed cut into calls of the tokens one device call takes (token_pieces), checked against the
layout rules and, with the numpy drafter standing in for CudaModel.mtp_forward, against one
uncut call of the numpy drafter (MTP hidden states and the KV it writes)."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact import Artifact
from ninfer.demo import ensure_reference_artifact
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter, token_pieces
from ninfer.models.qwen3_5.model import NumpyModel
from ninfer.models.qwen3_5.mtp import MtpDrafter

# the same float32 products over the same keys, in calls cut elsewhere (BLAS blocks differ)
CUT_TOL = 1e-5
PAGE = 4


def _batch(rng, lengths, vocab=1000):
    """Rows of these new-token counts after random contexts, each on pages of its own."""
    ctx = rng.integers(0, 9, len(lengths))
    per_row = -(-(ctx + np.asarray(lengths)).max() // PAGE)
    tables = np.arange(len(lengths) * per_row, dtype=np.int32).reshape(len(lengths), per_row)
    tables = tables[:, rng.permutation(per_row)]
    counts = np.asarray(lengths, np.int32)
    return ForwardBatch(rng.integers(0, vocab, int(counts.sum())).astype(np.int32),
                        ForwardBatch.text_positions(ctx, counts),
                        np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                        ctx.astype(np.int32), tables,
                        rng.permutation(len(lengths)).astype(np.int32))


@pytest.mark.parametrize("lengths, cap", [([7], 3), ([1, 9, 2, 5], 4), ([3, 3], 6),
                                          ([5, 1, 11], 1), ([2, 8], 100)])
def test_token_pieces_cover_the_batch_in_order_within_the_cap(lengths, cap):
    rng = np.random.default_rng(sum(lengths) + cap)
    batch = _batch(rng, lengths)
    pieces = token_pieces(batch, cap)
    assert np.array_equal(np.concatenate([idx for _, idx in pieces]),
                          np.arange(batch.num_tokens))
    assert len(pieces) == -(-batch.num_tokens // cap)
    qs = np.asarray(batch.query_start)
    row_of = np.repeat(np.arange(batch.num_rows), np.diff(qs))
    for sub, idx in pieces:
        sub.validate(PAGE)
        assert 0 < sub.num_tokens <= cap
        assert np.array_equal(sub.token_ids, batch.token_ids[idx])
        assert np.array_equal(sub.positions, batch.positions[:, idx])
        sq = np.asarray(sub.query_start)
        for j in range(sub.num_rows):
            first = idx[sq[j]]
            r = row_of[first]
            assert (row_of[idx[sq[j]:sq[j + 1]]] == r).all()
            # the segment continues its row: its context is the row's plus the tokens before it
            assert sub.context_lens[j] == batch.context_lens[r] + first - qs[r]
            assert np.array_equal(sub.block_tables[j], batch.block_tables[r])
            assert sub.state_slots[j] == batch.state_slots[r]
    with pytest.raises(ValueError, match="cap"):
        token_pieces(batch, 0)


class _DeviceStandIn:
    """What CudaDrafter asks of CudaModel, answered by the numpy drafter: a call of more than
    n_cap tokens is an error, as on the device."""

    def __init__(self, drafter, n_cap):
        self.mtp, self.text, self.n_cap, self.drafter = True, drafter.text, n_cap, drafter
        self.calls = []

    def mtp_forward(self, batch, hidden, kv, with_logits=True):
        assert batch.num_tokens <= self.n_cap
        self.calls.append(batch.num_tokens)
        return self.drafter.forward(batch, hidden, kv, with_logits=with_logits)

    def mtp_argmax(self, batch, hidden, kv, last_only=False):
        assert batch.num_tokens <= self.n_cap
        self.calls.append(batch.num_tokens)
        _, g = self.drafter.forward(batch, hidden, kv, with_logits=False)
        ends = np.asarray(batch.query_start[1:], np.int64) - 1
        return self.drafter.draft_argmax(g[ends]), g[ends] if last_only else g

    def head_logits(self, hidden):
        return self.drafter.logits(hidden)


def test_a_feed_cut_into_device_calls_equals_one_uncut_call():
    """A 3-row feed of 23 tokens through calls of at most 5: every MTP hidden state and the
    drafter layer's KV of every written position as one numpy call gives them."""
    with Artifact(ensure_reference_artifact("dense")) as art:
        target = NumpyModel.from_artifact(art)
        numpy_drafter = MtpDrafter.from_artifact(art, target)
    rng = np.random.default_rng(5)
    batch = _batch(rng, [9, 3, 11], vocab=target.text.vocab_size)
    hidden = rng.standard_normal((batch.num_tokens, target.text.hidden_size)).astype(np.float32)
    num_pages = int(batch.block_tables.max()) + 1
    kv_one = numpy_drafter.new_kv_pool(num_pages, PAGE)
    kv_cut = numpy_drafter.new_kv_pool(num_pages, PAGE)
    # the same random KV in both pools: the rows' contexts, and where the new tokens go (a
    # position the cut calls fail to write keeps it, and differs from the uncut call's)
    ctx_fill = rng.standard_normal(kv_one.k[0].shape).astype(np.float32)
    for a in kv_one.k + kv_one.v + kv_cut.k + kv_cut.v:
        a[:] = ctx_fill
    _, g_one = numpy_drafter.forward(batch, hidden, kv_one, with_logits=False)
    device = _DeviceStandIn(numpy_drafter, n_cap=5)
    drafter = CudaDrafter(device)
    logits, g_cut = drafter.forward(batch, hidden, kv_cut, with_logits=False)
    assert logits is None and device.calls == [5, 5, 5, 5, 3]
    scale = np.abs(g_one).max()
    assert np.abs(g_cut - g_one).max() / scale < CUT_TOL
    for a, b in zip(kv_cut.k + kv_cut.v, kv_one.k + kv_one.v):
        assert np.abs(a - b).max() / np.abs(b).max() < CUT_TOL
    # the head through the stand-in: the numpy drafter's logits
    assert np.array_equal(drafter.logits(g_cut[:4]), numpy_drafter.logits(g_cut[:4]))


def test_a_feed_cut_into_device_calls_gives_each_rows_next_draft():
    """forward_argmax over 3 rows of 23 tokens through calls of at most 5 (rows split across
    calls, one ending inside a call and one at a call's end): each row's id is the argmax of
    its last token's MTP hidden, as one uncut numpy call gives it; a feed within one call is
    one device call."""
    with Artifact(ensure_reference_artifact("dense")) as art:
        target = NumpyModel.from_artifact(art)
        numpy_drafter = MtpDrafter.from_artifact(art, target)
    rng = np.random.default_rng(6)
    for lengths, cap, calls in (([9, 3, 11], 5, [5, 5, 5, 5, 3]), ([2, 3], 5, [5])):
        batch = _batch(rng, lengths, vocab=target.text.vocab_size)
        hidden = rng.standard_normal((batch.num_tokens, target.text.hidden_size)).astype(
            np.float32)
        num_pages = int(batch.block_tables.max()) + 1
        kv_one = numpy_drafter.new_kv_pool(num_pages, PAGE)
        kv_cut = numpy_drafter.new_kv_pool(num_pages, PAGE)
        want_ids, want_g = numpy_drafter.forward_argmax(batch, hidden, kv_one)
        device = _DeviceStandIn(numpy_drafter, n_cap=cap)
        ids, g = CudaDrafter(device).forward_argmax(batch, hidden, kv_cut)
        assert device.calls == calls
        assert g.shape == want_g.shape == (len(lengths), target.text.hidden_size)
        assert np.abs(g - want_g).max() / np.abs(want_g).max() < CUT_TOL
        assert ids.tolist() == want_ids.tolist() == numpy_drafter.draft_argmax(g).tolist()


def test_a_model_without_its_mtp_head_is_refused():
    class _NoHead:
        mtp, text = False, None
    with pytest.raises(ValueError, match="mtp=True"):
        CudaDrafter(_NoHead())
