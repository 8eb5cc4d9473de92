"""The MTP drafts' int8 head (EngineOptions.draft_head, models/qwen3_5/model.py DraftHead): an
argmax of up to INT8_HEAD_ROWS rows reads int8 codes of the draft rows (a scale per row and 128
columns), more rows read the bf16 rows; the output is plain decoding's either way."""
import ml_dtypes
import numpy as np
import pytest

from ninfer import Engine, SamplingParams
from ninfer.demo import ensure_reference_artifact
from ninfer.models.qwen3_5.model import INT8_HEAD_ROWS, DraftHead

BF16 = ml_dtypes.bfloat16


def int8_oracle(head: np.ndarray) -> np.ndarray:
    """float64 values of the int8 codes of head [V, H]: per row and 128 columns, scale =
    amax / 127 (a float32, as stored), code = the nearest integer to value / scale (half to
    even) within [-127, 127]."""
    V, H = head.shape
    g = head.astype(np.float64).reshape(V, H // 128, 128)
    amax = np.abs(g).max(axis=2, keepdims=True)
    scale = np.where(amax > 0, (amax / 127.0).astype(np.float32), 1.0).astype(np.float64)
    # (value / scale in float32, as the device divides: then rounded half to even)
    q = (g.astype(np.float32) / scale.astype(np.float32)).astype(np.float64)
    return (np.clip(np.round(q), -127, 127) * scale).reshape(V, H)


def bf16(a):
    return np.asarray(a, np.float32).astype(BF16).astype(np.float32)


def swapped_pairs_head(rng, V: int, H: int):
    """A bf16 head of pairs (2i, 2i + 1) equal but for columns 0 and 1, where row 2i holds
    (0.49, 0.49) and row 2i + 1 (0.51, 0) of the pair's int8 step s (its first group's amax /
    127): with a hidden state large and positive there, the bf16 values prefer row 2i by
    0.47 s x the hidden, the int8 ones (0, 0) against (s, 0) prefer row 2i + 1 by s x the
    hidden. So the bf16 argmax is an even id and the int8 argmax an odd one, every time."""
    head = bf16(rng.standard_normal((V, H)))
    head[:, :2] = 0.0
    for i in range(0, V, 2):
        head[i + 1] = head[i]
        step = np.abs(head[i, :128]).max() / 127.0
        head[i, :2] = bf16([0.49 * step, 0.49 * step])
        head[i + 1, :2] = bf16([0.51 * step, 0.0])
    return head


def pair_hidden(rng, n: int, H: int) -> np.ndarray:
    """n hidden states, large and positive at the pairs' two columns."""
    hidden = rng.standard_normal((n, H)).astype(np.float32)
    hidden[:, :2] = 50.0
    return hidden


@pytest.mark.parametrize("vocab", [None, 96])
def test_up_to_eight_rows_argmax_the_int8_values_more_the_bf16_ones(vocab):
    rng = np.random.default_rng()
    V, H = 160, 256
    head = swapped_pairs_head(rng, V, H)
    n = V if vocab is None else vocab
    draft = DraftHead(head, vocab, int8=True)
    plain = DraftHead(head, vocab)
    hidden = pair_hidden(rng, INT8_HEAD_ROWS + 1, H)
    want_int8 = (hidden.astype(np.float64) @ int8_oracle(head[:n]).T).argmax(1)
    want_bf16 = (hidden.astype(np.float64) @ head[:n].astype(np.float64).T).argmax(1)
    assert (want_int8 % 2 == 1).all() and (want_bf16 % 2 == 0).all()
    assert draft.argmax(hidden[:INT8_HEAD_ROWS]).tolist() == want_int8[:INT8_HEAD_ROWS].tolist()
    assert draft.argmax(hidden).tolist() == want_bf16.tolist()       # 9 rows: the bf16 rows
    assert plain.argmax(hidden[:INT8_HEAD_ROWS]).tolist() == want_bf16[:INT8_HEAD_ROWS].tolist()
    assert np.array_equal(draft.logits(hidden), plain.logits(hidden))   # logits: every id, bf16


def test_a_width_without_whole_groups_keeps_the_bf16_rows():
    rng = np.random.default_rng()
    head = bf16(rng.standard_normal((64, 96)))
    hidden = rng.standard_normal((2, 96)).astype(np.float32)
    assert DraftHead(head, int8=True).argmax(hidden).tolist() == \
        DraftHead(head).argmax(hidden).tolist()


def test_zero_rows_of_the_reference_models_stay_zero_in_int8():
    """The reference models' unseen ids are zero rows (DraftHead searches the live rows and
    compares with 0): their int8 values are 0 too, and the argmax rule is the same."""
    rng = np.random.default_rng()
    head = bf16(rng.standard_normal((40, 128)))
    head[::3] = 0.0
    hidden = rng.standard_normal((6, 128)).astype(np.float32)
    hidden[0] = 0.0                                                  # every logit 0: id 0
    want = (hidden.astype(np.float64) @ int8_oracle(head).T).argmax(1)
    assert DraftHead(head, int8=True).argmax(hidden).tolist() == want.tolist()


@pytest.mark.parametrize("draft_head", ["int8", "bf16"])
def test_the_reference_models_output_is_plain_decodings_with_either_head(draft_head):
    """The dense reference model (hidden 128: the int8 head applies) at B = 1 and 3: the same
    tokens as plain decoding with either head; both heads' drafts are accepted."""
    path = ensure_reference_artifact("dense")
    ids = [[int(t) for t in np.random.default_rng(i).integers(100, 5000, 24)] for i in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with Engine(path, max_concurrency=3) as engine:
        want = [h.result(timeout=300).token_ids
                for h in [engine.submit(p, params) for p in ids]]
    with Engine(path, max_concurrency=3, speculative="mtp", num_draft_tokens=3,
                draft_policy="fixed", draft_head=draft_head) as engine:
        got = [h.result(timeout=300).token_ids
               for h in [engine.submit(p, params) for p in ids]]
        stats = engine.stats()
    assert got == want
    assert stats["spec_accepted_tokens"] > 0
