"""The MTP head's step on the GPU (CudaModel.mtp_forward, issue 25) against the numpy drafter of
the same tiny artifact: a fresh row, then a continuation that attends to its KV (the pool's extra
last layer). float32 within the whole-model fp32 tolerance and the same argmax; bf16 within the
bf16 model tolerance (the simulator measured 2e-7 / 3.5e-3: tests/gpu/sim_mtp.py)."""
import ml_dtypes
import numpy as np
import pytest

from gpu_harness import TOL_MODEL_BF16, TOL_MODEL_F32, rel_err
from tiny_model import mtp_artifact

from ninfer.models import model_config
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.model import NumpyModel
from ninfer.models.qwen3_5.mtp import MtpDrafter
from ninfer.options import EngineOptions

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_step_equals_the_numpy_drafter(kind, dtype):
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    art = mtp_artifact(kind)
    cpu = NumpyModel.from_artifact(art)
    drafter = MtpDrafter.from_artifact(art, cpu)
    opts = EngineOptions(backend="cuda", dtype=dtype, max_concurrency=2, max_context=128,
                         prefill_chunk=64, page_size=4, graphs=False)
    gpu = CudaModel(model_config(art), opts, artifact=art, mtp=True)
    try:
        kv_g, kv_c = gpu.new_kv_pool(40, 4), drafter.new_kv_pool(40, 4)
        assert len(kv_g.k) == len(cpu.text.attention_layer_ids) + 1
        r = np.random.default_rng(4)
        H, V = cpu.text.hidden_size, cpu.text.vocab_size
        pages = np.arange(32, dtype=np.int32)
        tol = TOL_MODEL_F32 if dtype == "float32" else TOL_MODEL_BF16
        for n, start in ((23, 0), (1, 23), (5, 24)):
            tokens = r.integers(0, V, n).astype(np.int32)
            h = r.standard_normal((n, H)).astype(np.float32)
            if dtype == "bfloat16":         # the device holds it in bf16: the oracle takes that
                h = h.astype(ml_dtypes.bfloat16).astype(np.float32)
            b = ForwardBatch.single(tokens, start, pages, 0)
            lg, gg = gpu.mtp_forward(b, h, kv_g)
            lc, gc = drafter.forward(b, h, kv_c)
            assert rel_err(lg, lc) < tol and rel_err(gg, gc) < tol, (n, start)
            if dtype == "float32":
                assert (lg.argmax(1) == lc.argmax(1)).all()
        kv_g.close()
    finally:
        gpu.close()


def test_a_model_without_mtp_refuses_the_step():
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from tiny_model import TinyArtifact, tiny_config
    art = TinyArtifact(tiny_config(), seed=3)
    gpu = CudaModel(model_config(art), EngineOptions(backend="cuda", max_concurrency=1,
                                                     max_context=64, graphs=False), artifact=art)
    try:
        with pytest.raises(RuntimeError, match="without its MTP head"):
            gpu.mtp_forward(ForwardBatch.single([1], 0, [0], 0), np.zeros((1, 64), np.float32),
                            gpu.new_kv_pool(4, 4))
    finally:
        gpu.close()


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_keeps_the_state_after_every_token(kind, dtype):
    """verify_forward over a row's last token and 3 drafts after a prefill: every token's logits
    and final-normed hidden (the drafter's feed) as the numpy model's, and snapshot slot 2 + i holding the State after the first i + 1 tokens
    (the numpy model run over that prefix from the pre-verify State); slot 1 untouched."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    art = mtp_artifact(kind)
    cpu = NumpyModel.from_artifact(art)
    opts = EngineOptions(backend="cuda", dtype=dtype, max_concurrency=2, max_context=128,
                         prefill_chunk=64, page_size=4, graphs=False)
    gpu = CudaModel(model_config(art), opts, artifact=art, mtp=True)
    tol = TOL_MODEL_F32 if dtype == "float32" else TOL_MODEL_BF16
    try:
        r = np.random.default_rng(8)
        V, k = cpu.text.vocab_size, 3
        pages = np.arange(32, dtype=np.int32)
        kv_g, st_g = gpu.new_kv_pool(40, 4), gpu.new_state_pool(2 + k + 1)
        kv_c, st_c = cpu.new_kv_pool(40, 4), cpu.new_state_pool(1)
        prompt = r.integers(0, V, 19).astype(np.int32)
        for model, kv, st in ((gpu, kv_g, st_g), (cpu, kv_c, st_c)):
            model.forward(ForwardBatch.single(prompt, 0, pages, 0), kv, st)
        pre = st_c.read(0)
        tokens = r.integers(0, V, k + 1).astype(np.int32)
        b = ForwardBatch.single(tokens, len(prompt), pages, 0)
        lg, hg = gpu.verify_forward(b, kv_g, st_g, np.arange(k + 1), snap_base=[2])
        lc, hc = cpu.verify_forward(b, kv_c, st_c, np.arange(k + 1))
        assert rel_err(lg, lc) < tol and rel_err(hg, hc) < tol
        for i in range(k + 1):
            st_c.write(0, pre)
            cpu.forward(ForwardBatch.single(tokens[:i + 1], len(prompt), pages, 0), kv_c, st_c)
            want, got = st_c.read(0), st_g.read(2 + i)
            for g, w in zip(got[0] + got[1], want[0] + want[1]):
                assert rel_err(g, w) < tol, i
        own = st_g.read(0)
        for g, w in zip(own[0] + own[1], want[0] + want[1]):
            assert rel_err(g, w) < tol
        assert all(not np.any(a) for a in st_g.read(1)[0] + st_g.read(1)[1])
        kv_g.close()
        st_g.close()
    finally:
        gpu.close()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_verify_through_its_graph_equals_the_eager_verify(kind):
    """A verify of 2 rows x 4 tokens runs through its captured graph (decode_graphs.verify)
    and gives the eager verify's logits, final-normed hidden, snapshot slots and row States bit
    for bit (the same launches); a verify whose rows differ in length runs eager."""
    import dataclasses

    from ninfer.models.qwen3_5.cuda_model import CudaModel
    art = mtp_artifact(kind)
    opts = EngineOptions(backend="cuda", max_concurrency=2, max_context=128, prefill_chunk=64,
                         page_size=4, num_draft_tokens=3)
    gpu = CudaModel(model_config(art), opts, artifact=art, mtp=True)
    try:
        r = np.random.default_rng(9)
        V, k = gpu.text.vocab_size, 3
        kv, st = gpu.new_kv_pool(40, 4), gpu.new_state_pool(2 + 2 * (k + 1))
        tables = np.arange(32, dtype=np.int32).reshape(2, 16)
        for row, n in ((0, 13), (1, 21)):
            gpu.forward(ForwardBatch.single(r.integers(0, V, n).astype(np.int32), 0,
                                            tables[row], row), kv, st)
        pre = [st.read(0), st.read(1)]
        tokens = r.integers(0, V, 2 * (k + 1)).astype(np.int32)
        b = ForwardBatch(tokens, np.stack([np.r_[13:17, 21:25]] * 3).astype(np.int32),
                         np.array([0, 4, 8], np.int32), np.array([13, 21], np.int32),
                         tables.copy(), np.array([0, 1], np.int32))
        out = np.arange(8, dtype=np.int32)
        results = []
        for graphs in (True, False):
            gpu.options = dataclasses.replace(opts, graphs=graphs)
            for slot in (0, 1):
                st.write(slot, pre[slot])
            captured = len(gpu.graphs)
            lg, hg = gpu.verify_forward(b, kv, st, out, snap_base=[2, 2 + k + 1])
            assert len(gpu.graphs) == captured + (1 if graphs else 0)
            states = [st.read(s) for s in range(2 + 2 * (k + 1))]
            results.append((lg, hg, states))
        (lg1, hg1, s1), (lg0, hg0, s0) = results
        assert np.array_equal(lg1, lg0) and np.array_equal(hg1, hg0)
        for a, z in zip(s1, s0):
            assert all(np.array_equal(x, y) for x, y in zip(a[0] + a[1], z[0] + z[1]))
        gpu.options = opts                  # rows of 4 and 3 tokens: no graph for it
        captured = len(gpu.graphs)
        gpu.verify_forward(ForwardBatch(tokens[:7], np.stack([np.r_[13:17, 21:24]] * 3).astype(
                                            np.int32), np.array([0, 4, 7], np.int32),
                                        np.array([13, 21], np.int32), tables.copy(),
                                        np.array([0, 1], np.int32)),
                           kv, st, np.arange(7, dtype=np.int32), snap_base=[2, 2 + k + 1])
        assert len(gpu.graphs) == captured
        kv.close()
        st.close()
    finally:
        gpu.close()


def _three_rows(gpu, r):
    """A batch of 3 rows of 5, 1 and 3 random tokens after 0, 7 and 2 context tokens (pages of
    4, 10 a row) and their random hidden states: (ForwardBatch, hidden [9, H])."""
    H, V = gpu.text.hidden_size, gpu.text.vocab_size
    tables = np.arange(30, dtype=np.int32).reshape(3, 10)
    lens = np.array([5, 1, 3])
    qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ctx = np.array([0, 7, 2], np.int32)
    b = ForwardBatch(r.integers(0, V, qs[-1]).astype(np.int32),
                     ForwardBatch.text_positions(ctx, lens), qs, ctx, tables,
                     np.arange(3, dtype=np.int32))
    return b, r.standard_normal((qs[-1], H)).astype(np.float32)


@pytest.mark.parametrize("kind, draft_vocab", [("dense", None), ("moe", None), ("dense", 161),
                                               ("moe", 97)])
def test_mtp_argmax_gives_each_rows_draft_of_the_step(kind, draft_vocab):
    """mtp_argmax (the feed's and each draft step's MTP call, issue 25): the MTP hidden of
    every token as mtp_forward gives it (last_only: each row's last token's), and per row the argmax of its last token's logits
    over the first draft_vocab ids (float32: the head's own argmax of the same rows; the
    fixtures' 320 ids are all below the default draft vocabulary)."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    art = mtp_artifact(kind)
    opts = EngineOptions(backend="cuda", dtype="float32", max_concurrency=3, max_context=128,
                         prefill_chunk=64, page_size=4, graphs=False, draft_vocab=draft_vocab)
    gpu = CudaModel(model_config(art), opts, artifact=art, mtp=True)
    try:
        V = gpu.text.vocab_size
        b, h = _three_rows(gpu, np.random.default_rng(10))
        qs = np.asarray(b.query_start)
        results = []
        for call in ("forward", "argmax", "last"):
            kv = gpu.new_kv_pool(30, 4)
            results.append(gpu.mtp_forward(b, h, kv) if call == "forward"
                           else gpu.mtp_argmax(b, h, kv, last_only=call == "last"))
            kv.close()
        (logits, g_f), (ids, g_a), (ids_l, g_l) = results
        assert np.array_equal(g_f, g_a) and logits.shape[1] == V
        # the feed's: the rows' last hidden states alone (rows ending at 4, 5: one copy; 8)
        assert ids_l.tolist() == ids.tolist() and np.array_equal(g_l, g_f[qs[1:] - 1])
        n = V if draft_vocab is None else draft_vocab
        assert ids.tolist() == logits[qs[1:] - 1, :n].argmax(1).tolist()
        if draft_vocab is not None:     # (the rows' argmax over every id lies past it somewhere)
            assert (logits[qs[1:] - 1].argmax(1) >= n).any()
    finally:
        gpu.close()


def _fed_pools(gpu, drafter, r):
    """The device drafter's pool and the numpy drafter's fed the same 3 rows (9, 4 and 14
    random tokens and hidden states from position 0): (device pool, numpy pool, block tables,
    row lengths, the device's MTP hidden of every token)."""
    H, V = gpu.text.hidden_size, gpu.text.vocab_size
    kv_g, kv_c = gpu.new_kv_pool(60, 4), drafter.new_kv_pool(60, 4)
    tables = np.arange(60, dtype=np.int32).reshape(3, 20)
    lens = np.array([9, 4, 14], np.int32)
    feed = ForwardBatch(r.integers(0, V, lens.sum()).astype(np.int32),
                        ForwardBatch.text_positions(np.zeros(3, np.int32), lens),
                        np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                        np.zeros(3, np.int32), tables, np.arange(3, dtype=np.int32))
    h = r.standard_normal((lens.sum(), H)).astype(np.float32)
    _, g = gpu.mtp_forward(feed, h, kv_g, with_logits=False)
    drafter.forward(feed, h, kv_c, with_logits=False)
    return kv_g, kv_c, tables, lens, g


@pytest.mark.parametrize("kind, draft_vocab", [("dense", None), ("moe", None), ("dense", 161)])
def test_the_draft_chain_in_its_graph_equals_the_drafts_step_by_step(kind, draft_vocab):
    """CudaModel.mtp_chain through its captured graph (decode_graphs.chain: k - 1 MTP steps,
    each step's argmaxes fed to the next on the device) gives the drafts and drafter KV of
    mtp.draft_greedy step by step (one host round trip per step) bit for bit, at B = 1 and 3
    and every step count; the numpy drafter agrees in float32 (both over the first draft_vocab
    ids where given); CudaDrafter.draft_greedy takes the chain where rows draft alike and steps
    otherwise."""
    from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from ninfer.models.qwen3_5.mtp import draft_greedy
    art = mtp_artifact(kind)
    cpu = NumpyModel.from_artifact(art)
    drafter = MtpDrafter.from_artifact(art, cpu, draft_vocab)
    opts = EngineOptions(backend="cuda", dtype="float32", max_concurrency=3, max_context=128,
                         prefill_chunk=64, page_size=4, num_draft_tokens=4,
                         draft_vocab=draft_vocab)
    gpu = CudaModel(model_config(art), opts, artifact=art, mtp=True)
    try:
        assert gpu.chain_steps == 3
        r = np.random.default_rng(12)
        V = cpu.text.vocab_size
        kv_g, kv_c, tables, lens, g = _fed_pools(gpu, drafter, r)
        ends = np.cumsum(lens) - 1
        cuda_drafter = CudaDrafter(gpu)
        for rows in ([0], [0, 1, 2]):
            for steps in (1, 2, 3):
                g1, first = g[ends[rows]], r.integers(0, V, len(rows)).astype(np.int32)
                captured = len(gpu.graphs)
                got, none = cuda_drafter.draft_greedy(kv_g, g1, first, lens[rows], tables[rows],
                                                      steps, with_logits=False)
                assert none is None and got.shape == (len(rows), steps)
                assert len(gpu.graphs) == captured + 1                 # the chain's graph
                kv_chain = kv_g.read_pages(tables[rows].reshape(-1))
                step, _ = draft_greedy(cuda_drafter, kv_g, g1, first, lens[rows], tables[rows],
                                       steps, with_logits=False)
                assert np.array_equal(got, step), (rows, steps)
                for a, b in zip(kv_chain, kv_g.read_pages(tables[rows].reshape(-1))):
                    assert all(np.array_equal(x, y) for x, y in zip(a, b))
                host, _ = draft_greedy(drafter, kv_c, g1, first, lens[rows], tables[rows],
                                       steps, with_logits=False)
                assert np.array_equal(got, host), (rows, steps)
                if draft_vocab is not None:
                    assert got.max() < draft_vocab
        # rows drafting unlike counts, or more steps than the chain holds: step by step
        captured = len(gpu.graphs)
        cuda_drafter.draft_greedy(kv_g, g[ends], np.zeros(3, np.int32), lens, tables, [1, 2, 3],
                                  with_logits=False)
        assert len(gpu.graphs) == captured
        with pytest.raises(ValueError, match="mtp_chain"):
            gpu.mtp_chain(g[ends], np.zeros(3, np.int32), lens, tables, 4, kv_g)
        kv_g.close()
    finally:
        gpu.close()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_drafts_behind_the_verify_equal_the_host_calls(kind):
    """CudaModel.verify_and_draft (issue 25: the verify, then on the device the drafter's feed
    over the verify's positions with its picks, d_1 and g_1 at each row's last produced
    position and the chained drafts after it; one wait) gives what mtp.verify_and_draft's host
    calls give over the same model (verify_tokens, the feed of the produced positions, the
    chain step by step): the same picks and next drafts, g_1 within the float32 model
    tolerance, with the verify and chain graphs and without; rows that produce 4, 2 and 1
    tokens; 0 to 2 chained steps."""
    import dataclasses

    from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from ninfer.models.qwen3_5.mtp import verify_and_draft
    art = mtp_artifact(kind)
    opts = EngineOptions(backend="cuda", dtype="float32", max_concurrency=3, max_context=128,
                         prefill_chunk=64, page_size=4, num_draft_tokens=3)
    gpu = CudaModel(model_config(art), opts, artifact=art, mtp=True)
    try:
        r = np.random.default_rng(21)
        V, k, B = gpu.text.vocab_size, 3, 3
        kv, st = gpu.new_kv_pool(60, 4), gpu.new_state_pool(B + B * (k + 1))
        tables = np.arange(48, dtype=np.int32).reshape(B, 16)
        ctx = np.array([13, 21, 6], np.int32)
        for row in range(B):
            gpu.forward(ForwardBatch.single(r.integers(0, V, ctx[row]).astype(np.int32), 0,
                                            tables[row], row), kv, st)
        pre = [st.read(s) for s in range(B)]
        snap = [B + s * (k + 1) for s in range(B)]
        x = r.integers(0, V, B).astype(np.int32)
        drafts = r.integers(0, V, (B, k)).astype(np.int32)

        def batch():
            tokens = np.concatenate([[x[i], *drafts[i]] for i in range(B)]).astype(np.int32)
            return ForwardBatch(tokens, ForwardBatch.text_positions(ctx, np.full(B, k + 1)),
                                np.arange(0, B * (k + 1) + 1, k + 1, dtype=np.int32), ctx,
                                tables.copy(), np.arange(B, dtype=np.int32))

        def restore():
            for s in range(B):
                st.write(s, pre[s])
        none = [None] * (B * (k + 1))
        # row 0 takes every draft (its drafts set to the picks one position at a time), row 1
        # its first, row 2 none (random drafts: the fixtures' picks are never those)
        for j in range(k):
            restore()
            picks, _ = gpu.verify_tokens(batch(), kv, st, np.arange(B * (k + 1), dtype=np.int32),
                                         none, snap_base=snap)
            picks = picks.reshape(B, k + 1)
            drafts[0, j] = picks[0, j]
            if j == 0:
                drafts[1, 0] = picks[1, 0]
                drafts[1, 1] = (picks[1, 1] + 1) % V
                drafts[2, 0] = (picks[2, 0] + 1) % V
        for steps in (0, 1, 2):
            restore()
            want = verify_and_draft(CudaDrafter(gpu), gpu, batch(), kv, st, none,
                                    snap_base=snap, steps=steps)
            for graphs in (True, False):
                gpu.options = dataclasses.replace(opts, graphs=graphs)
                restore()
                got = gpu.verify_and_draft(batch(), kv, st, none, snap_base=snap, steps=steps)
                assert np.array_equal(got[0], want[0]), (steps, graphs)
                produced = [1 + int(np.argmin(np.r_[got[0].reshape(B, k + 1)[i, :k]
                                                    == drafts[i], False])) for i in range(B)]
                assert produced == [4, 2, 1], produced
                assert got[1].shape == (B, 1 + steps) and np.array_equal(got[1], want[1]), \
                    (steps, graphs, got[1], want[1])
                assert rel_err(got[2], want[2]) < TOL_MODEL_F32, (steps, graphs)
        gpu.options = opts
        kv.close()
        st.close()
    finally:
        gpu.close()


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_int8_draft_head_drafts_what_the_numpy_drafters_does(kind, dtype):
    """EngineOptions.draft_head "int8" (the default; hidden 128 takes it): the codes and scales
    made at load are kv_quant's int8 rule of the lm_head's first draft_vocab rows, byte for
    byte; mtp_argmax's drafts (3 rows: the int8 head) are the argmax of model.DraftHead's int8
    values of the same MTP hidden (float32: the same ids; bf16: ids whose float64 logit is
    within the bf16 product's tolerance of the best), the draft chain's too (float32: the numpy
    drafter's drafts); with draft_head "bf16" no copy is made."""
    from ninfer.core.cuda import driver as _d
    from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    from ninfer.models.qwen3_5.model import DraftHead
    from ninfer.models.qwen3_5.mtp import draft_greedy
    from ninfer.ops.kv_quant import quantize
    art = mtp_artifact(kind, hidden=128)
    n_draft = 200
    base = dict(backend="cuda", dtype=dtype, max_concurrency=3, max_context=128,
                prefill_chunk=64, page_size=4, num_draft_tokens=3, draft_vocab=n_draft)
    plain = CudaModel(model_config(art), EngineOptions(**base, draft_head="bf16"), artifact=art,
                      mtp=True)
    try:
        assert plain.int8_head_rows == 0 and "draft_head" not in plain.weights
    finally:
        plain.close()
    gpu = CudaModel(model_config(art), EngineOptions(**base), artifact=art, mtp=True)
    cpu = NumpyModel.from_artifact(art)
    drafter = MtpDrafter.from_artifact(art, cpu, n_draft, int8_head=True)
    try:
        assert gpu.int8_head_rows == n_draft
        H, V = gpu.text.hidden_size, gpu.text.vocab_size
        seg = gpu.weights["draft_head"].segments[0]
        lm = np.asarray(art.tensor("text.lm_head.weight"), np.float32)[:n_draft]
        want_q, want_s = quantize(lm.reshape(n_draft, H // 128, 128), "int8")
        codes = _d.download(seg.w.ptr, (n_draft * H,), np.uint8, gpu.stream)
        scale = _d.download(seg.scale.ptr, (n_draft, H // 128), np.float32, gpu.stream)
        assert np.array_equal(codes, want_q.view(np.uint8).ravel())
        assert np.array_equal(scale, want_s)
        r = np.random.default_rng()
        head = DraftHead(np.asarray(art.tensor("text.lm_head.weight"), np.float32), n_draft,
                         int8=True)
        b, h = _three_rows(gpu, r)
        kv = gpu.new_kv_pool(30, 4)
        ids, g = gpu.mtp_argmax(b, h, kv, last_only=True)
        kv.close()
        assert ids.max() < n_draft
        if dtype == "float32":
            assert ids.tolist() == head.argmax(g).tolist()
        else:
            values = g.astype(ml_dtypes.bfloat16).astype(np.float64) @ \
                head._int8.astype(np.float64).T
            best = values.max(axis=1)
            got = values[np.arange(3), ids]
            assert np.all(best - got <= TOL_MODEL_BF16 * np.abs(values).max(axis=1)), (best, got)
        if dtype == "float32":
            kv_g, kv_c, tables, lens, g = _fed_pools(gpu, drafter, r)
            ends = np.cumsum(lens) - 1
            first = r.integers(0, V, 3).astype(np.int32)
            got, _ = CudaDrafter(gpu).draft_greedy(kv_g, g[ends], first, lens, tables, 3,
                                                   with_logits=False)
            host, _ = draft_greedy(drafter, kv_c, g[ends], first, lens, tables, 3,
                                   with_logits=False)
            assert np.array_equal(got, host)
            kv_g.close()
    finally:
        gpu.close()
