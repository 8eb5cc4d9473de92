"""The MTP drafter (ninfer/models/qwen3_5/mtp.py) against the MTP head the reference models were
trained with: tools/train_reference.py's torch module, run in float64 on the artifact's exact
(bfloat16-rounded) weights. Logits over the held-out text, prefill in chunks and single steps on
paged KV, and k = 1..4 autoregressive drafts on the drafter's own KV, two rows at once."""
from __future__ import annotations

import functools
import pathlib
import sys

import numpy as np
import pytest

from ninfer.artifact import Artifact
from ninfer.demo import ensure_reference_artifact
from ninfer.errors import ArtifactError
from ninfer.eval import dataset_path
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.frontend.tokenizer import Tokenizer
from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json
from ninfer.models.qwen3_5.model import NumpyModel
from ninfer.models.qwen3_5.mtp import MtpDrafter, read_mtp_params
from ninfer.reference_models import EMBED, CompactModel, model_path
from reference_records import NAMES

torch = pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import train_reference as tr  # noqa: E402

# float32 numpy vs float64 torch, |error| / max|logit| over every position and vocabulary id
MTP_LOGIT_TOL = 5e-6
HIDDEN_TOL = 1e-4       # target's final-normed hidden through 4-6 float32 layers, / max|h|
T = 80                  # held-out tokens per row (> 4 KV pages of 16)
PAGE = 16
K_MAX = 4               # draft tokens per step (issue 15: k = 1..4)


@pytest.fixture(scope="module", params=NAMES)
def setup(request, tmp_path_factory):
    name = request.param
    path = ensure_reference_artifact(name, tmp_path_factory.mktemp(f"mtp_{name}"))
    with Artifact(path) as art:
        target = NumpyModel.from_artifact(art)
        drafter = MtpDrafter.from_artifact(art, target)
    return name, target, drafter, _oracle(name)


class _Oracle:
    """The trained torch model (float64) with the artifact's weights; token ids in, numpy out."""

    def __init__(self, model, lut, emb):
        self.model, self.lut, self.emb = model, lut, emb

    def idx(self, ids):
        return torch.from_numpy(self.lut[np.asarray(ids, np.int64)])[None]

    def hidden(self, ids) -> np.ndarray:
        with torch.no_grad():
            h, _ = self.model(self.idx(ids), with_mtp=False)
        return h[0].numpy()

    def mtp(self, next_ids, hidden) -> np.ndarray:
        """MTP hidden of the pairs (hidden[t], next_ids[t]) at positions 0..n-1 (causal)."""
        m = self.model
        with torch.no_grad():
            g = m.mtp(m.embed(self.idx(next_ids)), torch.from_numpy(np.asarray(hidden))[None]
                      .double(), m.positions(len(next_ids), "cpu"))
        return g[0].numpy()

    def logits(self, g) -> np.ndarray:
        return np.asarray(g, np.float64) @ self.emb.T


def _oracle(name) -> _Oracle:
    cm = CompactModel(model_path(name))
    kept = cm.kept_ids
    model = tr.build_model(cm.config, kept.size)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            hf = "model.embed_tokens.weight" if pname == "embed_tokens" else \
                pname if pname.startswith("mtp.") else "model." + pname
            w = tr._bf16_rounded(cm.tensor(hf))
            p.copy_(torch.from_numpy(w[kept] if pname == "embed_tokens" else w))
    model = model.double().eval()
    lut = np.full(cm.config["vocab_size"], -1, np.int64)
    lut[kept] = np.arange(kept.size)
    return _Oracle(model, lut, tr._bf16_rounded(cm.tensor(EMBED)).astype(np.float64))


@functools.lru_cache(maxsize=1)
def _heldout_ids() -> np.ndarray:
    text = dataset_path("heldout").read_text(encoding="utf-8")
    return np.asarray(Tokenizer(cached_qwen3_5_tokenizer_json()).encode(text), np.int32)


def _heldout(n, skip=0) -> np.ndarray:
    return _heldout_ids()[skip:skip + n]


def _rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def _pages(rng, rows, per_row, total):
    """Disjoint, shuffled page ids: rows never share pages and page order != id order."""
    perm = rng.permutation(total)[:rows * per_row]
    return perm.reshape(rows, per_row).astype(np.int32)


def _row_batch(ids, start, table, slot=0) -> ForwardBatch:
    return ForwardBatch.single(ids, start, table, slot)


def test_drafter_logits_equal_the_trained_mtp_head(setup):
    name, target, drafter, oracle = setup
    ids = _heldout(T)
    h_ref = oracle.hidden(ids)                                             # [T, H]
    # the target's final-normed hidden (what the drafter reads) is the trained model's h
    kv, state = target.new_kv_pool(8, PAGE), target.new_state_pool(1)
    table = np.arange(8, dtype=np.int32)
    h = target.final_hidden(_row_batch(ids, 0, table), kv, state)
    assert h.shape == h_ref.shape and _rel(h, h_ref) < HIDDEN_TOL, (name, _rel(h, h_ref))
    want = oracle.logits(oracle.mtp(ids[1:], h_ref[:-1]))                  # [T-1, V]
    # the drafter over the same pairs: a prefill chunk, a second chunk, then single steps
    rng = np.random.default_rng(15)
    table = _pages(rng, 1, 8, 12)[0]
    dkv = drafter.new_kv_pool(12, PAGE)
    for a in (dkv.k[0], dkv.v[0]):
        a[:] = np.nan                                  # poisoned: any unwritten read shows
    h32 = h_ref.astype(np.float32)
    got = np.empty_like(want)
    cuts = [0, 37, T - 4, T - 3, T - 2, T - 1]        # 37: crosses a page boundary mid-chunk
    for s, e in zip(cuts[:-1], cuts[1:]):
        logits, g = drafter.forward(_row_batch(ids[s + 1:e + 1], s, table), h32[s:e], dkv)
        assert logits.shape == (e - s, target.text.vocab_size) and g.shape == (e - s, h.shape[1])
        got[s:e] = logits
    err = _rel(got, want)
    assert err < MTP_LOGIT_TOL, (name, err)
    # and it is a trained head: its greedy guess of x[t+2] is often right on held-out text
    hits = np.mean(np.argmax(got, axis=1)[:-1] == ids[2:])
    assert hits > 0.2, hits


def test_k_step_drafts_equal_the_oracle_chain(setup):
    """Two rows at different frontiers draft K_MAX tokens at once; each step's logits equal the
    oracle run causally over (target hidden, next token) pairs followed by the previous steps'
    (MTP hidden, drafted token) pairs. Drafting k = 1..K_MAX-1 on fresh KV gives the prefixes."""
    name, target, drafter, oracle = setup
    rng = np.random.default_rng(15)
    rows = [(_heldout(T, 0), 41), (_heldout(T, 200), 58)]        # (ids, t): draft after x[t+1]
    tables = _pages(rng, 2, 6, 16)
    hiddens, nexts, ctx, refs = [], [], [], []
    for ids, t in rows:
        h_ref = oracle.hidden(ids[:t + 1])                          # h_0 .. h_t
        refs.append(h_ref)
        hiddens.append(h_ref[t].astype(np.float32))
        nexts.append(ids[t + 1])
        ctx.append(t)

    def draft(k):
        dkv = drafter.new_kv_pool(16, PAGE)
        for a in (dkv.k[0], dkv.v[0]):
            a[:] = np.nan
        for r, (ids, t) in enumerate(rows):                         # drafter KV of 0..t-1
            none, _ = drafter.forward(_row_batch(ids[1:t + 1], 0, tables[r]),
                                      refs[r][:t].astype(np.float32), dkv, with_logits=False)
            assert none is None
        return drafter.draft_greedy(dkv, np.stack(hiddens), nexts, ctx, tables, k)

    drafts, logits = draft(K_MAX)
    assert drafts.shape == (2, K_MAX) and logits.shape == (2, K_MAX, target.text.vocab_size)
    for r, (ids, t) in enumerate(rows):
        seq_h, seq_x = list(refs[r]), list(ids[1:t + 2])            # pairs (h_s, x_{s+1})
        for i in range(K_MAX):
            g = oracle.mtp(np.asarray(seq_x), np.stack(seq_h))[-1]
            want = oracle.logits(g[None])[0]
            err = _rel(logits[r, i], want)
            assert err < MTP_LOGIT_TOL, (name, r, i, err)
            top2 = np.partition(want, -2)[-2:]
            if top2[1] - top2[0] > 10 * MTP_LOGIT_TOL * np.max(np.abs(want)):    # no near-tie
                assert drafts[r, i] == int(np.argmax(want)), (name, r, i)
            seq_h.append(g)
            seq_x.append(int(drafts[r, i]))
    for k in range(1, K_MAX):
        d, lg = draft(k)
        assert np.array_equal(d, drafts[:, :k]) and np.array_equal(lg, logits[:, :k]), k


def test_artifact_without_mtp_is_a_clear_error():
    class NoMtp:
        path = "x.ninfer"
    from ninfer.models.qwen3_5.config import TextConfig
    with pytest.raises(ArtifactError, match="x.ninfer: the model has no MTP head"):
        read_mtp_params(NoMtp(), TextConfig(layer_types=("full_attention",), num_hidden_layers=1))


def test_bad_inputs_are_refused(setup):
    name, target, drafter, _ = setup
    dkv = drafter.new_kv_pool(2, PAGE)
    H = target.text.hidden_size
    batch = ForwardBatch.single([1, 2, 3], 0, [0])
    with pytest.raises(ValueError, match="hidden shape"):
        drafter.forward(batch, np.zeros((2, H), np.float32), dkv)
    with pytest.raises(ValueError, match="token id out of range"):
        drafter.forward(ForwardBatch.single([target.text.vocab_size], 0, [0]),
                        np.zeros((1, H), np.float32), dkv)
    with pytest.raises(ValueError, match="page >= 2"):
        drafter.forward(ForwardBatch.single([1], 0, [5]), np.zeros((1, H), np.float32), dkv)
    with pytest.raises(ValueError, match="k must be >= 1"):
        drafter.draft_greedy(dkv, np.zeros((1, H), np.float32), [1], [0], [[0]], 0)
