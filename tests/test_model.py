"""The numpy Qwen3.5 model on tiny random configs: chunked prefill == whole prefill == token-by-token
decode; batched rows == per-row calls; binder errors. Golden logits against transformers live in the
fixture tests; the ops have their own float64-oracle tests (test_ops.py)."""
from __future__ import annotations

import copy
import math
import sys

import ml_dtypes
import numpy as np
import pytest

from ninfer import ArtifactError, DeviceError, EngineOptions
from ninfer.models.qwen3_5 import load_model
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.config import (FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig,
                                          TextConfig)
from ninfer.models.qwen3_5.fakes import TensorArtifact

# max |diff| / max |ref| between two float32 evaluations of the same logits that sum in different
# orders (chunked vs recurrent delta rule, one vs many matmuls). Op-level differences are ~1e-7;
# random layers amplify them, typically to ~1e-5. A wrong formula shows up as > 1e-2.
TOL_MODEL = 1e-4
# ... but how much the layers amplify depends on the draw of weights and ids: ulp-sized noise on
# the embeddings alone moves the logits by 1e-6 .. 1.6e-4 (80 draws measured), and two correct
# evaluations that round differently differed by up to 3.8x that draw's amplification. So each
# draw is judged against its own rounding noise: tolerance max(TOL_MODEL, NOISE_FACTOR x the
# amplification measured by `float32_tolerance`), and a draw too ill-conditioned to tell a wrong
# formula from rounding (tolerance over MAX_TOL) is redrawn.
NOISE_FACTOR = 10
MAX_TOL = 1e-3
L, F = LINEAR_ATTENTION, FULL_ATTENTION

CONFIGS = {
    "dense": dict(layer_types=(L, L, L, F)),
    "moe": dict(layer_types=(L, F, L, F), is_moe=True, num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=12, shared_expert_intermediate_size=20),
    "custom_layers": dict(layer_types=(F, L, F, F, L)),
    # 6 query heads on 2 KV heads, 3 value heads on 1 key head, dk != dv, kernel 2, rotary 12 of 16
    "odd_heads": dict(layer_types=(L, F, L), num_attention_heads=6, num_key_value_heads=2,
                      head_dim=16, partial_rotary_factor=0.75, mrope_section=(2, 2, 2),
                      linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=6,
                      linear_value_head_dim=10, linear_conv_kernel_dim=2),
}


def tiny_config(name="dense", **over) -> ModelConfig:
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                partial_rotary_factor=0.5, mrope_section=(1, 1, 0), mrope_interleaved=True,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4)
    base.update(CONFIGS[name])
    base.update(over)
    base["num_hidden_layers"] = len(base["layer_types"])
    text = TextConfig(**base)
    arch = "Qwen3_5MoeForCausalLM" if text.is_moe else "Qwen3_5ForCausalLM"
    return ModelConfig(architecture=arch, text=text)


def random_text_weights(cfg: ModelConfig, seed: int, tied: bool = False) -> dict:
    """Logical-name -> bf16 array, scaled so activations stay O(1) through the layers."""
    t, r = cfg.text, np.random.default_rng(seed)
    H = t.hidden_size

    def mat(*shape):
        return r.normal(size=shape) * (1.0 / math.sqrt(shape[-1]))

    w = {"text.embed_tokens.weight": r.normal(size=(t.vocab_size, H)),
         "text.norm.weight": r.normal(size=H) * 0.3}
    w["text.lm_head.weight"] = w["text.embed_tokens.weight"] if tied else mat(t.vocab_size, H)
    for i, kind in enumerate(t.layer_types):
        p = f"text.layers.{i}."
        w[p + "input_layernorm.weight"] = r.normal(size=H) * 0.3
        w[p + "post_attention_layernorm.weight"] = r.normal(size=H) * 0.3
        if kind == F:
            a = p + "self_attn."
            hd = t.head_dim
            w[a + "q_proj.weight"] = mat(2 * t.num_attention_heads * hd, H)
            w[a + "k_proj.weight"] = mat(t.num_key_value_heads * hd, H)
            w[a + "v_proj.weight"] = mat(t.num_key_value_heads * hd, H)
            w[a + "o_proj.weight"] = mat(H, t.num_attention_heads * hd)
            w[a + "q_norm.weight"] = r.normal(size=hd) * 0.3
            w[a + "k_norm.weight"] = r.normal(size=hd) * 0.3
        else:
            a = p + "linear_attn."
            nv = t.linear_num_value_heads
            w[a + "in_proj_qkv.weight"] = mat(t.linear_conv_dim, H)
            w[a + "in_proj_z.weight"] = mat(t.linear_value_dim, H)
            w[a + "in_proj_b.weight"] = mat(nv, H)
            w[a + "in_proj_a.weight"] = mat(nv, H)
            w[a + "conv1d.weight"] = r.normal(size=(t.linear_conv_dim, 1, t.linear_conv_kernel_dim)) * 0.5
            w[a + "dt_bias"] = r.normal(size=nv)
            w[a + "A_log"] = np.log(r.uniform(0.5, 8, size=nv))
            w[a + "norm.weight"] = 1 + r.normal(size=t.linear_value_head_dim) * 0.3
            w[a + "out_proj.weight"] = mat(H, t.linear_value_dim)
        m = p + "mlp."
        if t.is_moe:
            E, I, S = t.num_experts, t.moe_intermediate_size, t.shared_expert_intermediate_size
            w[m + "gate.weight"] = mat(E, H) * 2
            w[m + "experts.gate_up_proj"] = mat(E, 2 * I, H)
            w[m + "experts.down_proj"] = mat(E, H, I)
            w[m + "shared_expert.gate_proj.weight"] = mat(S, H)
            w[m + "shared_expert.up_proj.weight"] = mat(S, H)
            w[m + "shared_expert.down_proj.weight"] = mat(H, S)
            w[m + "shared_expert_gate.weight"] = mat(1, H)
        else:
            I = t.intermediate_size
            w[m + "gate_proj.weight"] = mat(I, H)
            w[m + "up_proj.weight"] = mat(I, H)
            w[m + "down_proj.weight"] = mat(H, I)
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in w.items()}
    if tied:      # one stored object behind both names, like a tied artifact binding
        bf["text.lm_head.weight"] = bf["text.embed_tokens.weight"]
    return bf


class FakeArtifact(TensorArtifact):
    """Weights built in memory, as the binder reads them from an artifact."""
    path = "<fake artifact>"


def tiny_model(name="dense", seed=None, tied=False, **over):
    cfg = tiny_config(name, **over)
    seed = np.random.SeedSequence().entropy % (1 << 32) if seed is None else seed
    return load_model(FakeArtifact(cfg, random_text_weights(cfg, seed, tied)),
                      EngineOptions(backend="numpy"))


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


# Top-k routing is discontinuous: two computations that agree to fp32 rounding (one-piece vs
# chunked prefill) pick different experts when the k-th and (k+1)-th router probabilities of some
# token are closer than that rounding, and their logits then differ by O(1). Comparisons of MoE
# models therefore draw fresh random inputs whose reference run has no such near-tie.
ROUTER_GAP = 1e-5         # ~100x the router-probability noise between the two computations


class RouterGaps:
    """Records the smallest gap between the k-th and (k+1)-th router probability of every token
    routed inside the `with` block (inf for dense models)."""

    def __enter__(self):
        import ninfer.ops as ops
        self.smallest = float("inf")
        self._ops, self._real = ops, ops.route_topk

        def recording(router_logits, top_k, normalize=True):
            x = router_logits.astype(np.float32)
            p = np.exp(x - x.max(axis=-1, keepdims=True))
            p = -np.sort(-(p / p.sum(axis=-1, keepdims=True)), axis=-1)
            if top_k < p.shape[-1]:
                self.smallest = min(self.smallest, float(np.min(p[:, top_k - 1] - p[:, top_k])))
            return self._real(router_logits, top_k, normalize)
        ops.route_topk = recording
        return self

    def __exit__(self, *exc):
        self._ops.route_topk = self._real


def float32_tolerance(model, *id_seqs) -> float:
    """The rel_err two correct float32 evaluations of `id_seqs` on `model` may show: TOL_MODEL, or
    NOISE_FACTOR x the logits' response to ulp-sized noise on the embeddings if that is larger."""
    return max(TOL_MODEL, NOISE_FACTOR * embedding_noise_response(model, *id_seqs))


def embedding_noise_response(model, *id_seqs) -> float:
    """The largest rel_err of the logits of `id_seqs` on `model` when its embeddings carry
    ulp-sized noise: how much this draw amplifies rounding."""
    amplification = 0.0
    emb = model._embed
    noise = np.random.default_rng().choice(np.float32([-1, 1]), emb.shape) * np.float32(2 ** -23)
    for ids in id_seqs:
        clean = run_in_chunks(model, ids, len(ids))[0]
        try:
            model._embed = (emb * (1 + noise)).astype(emb.dtype)
            noisy = run_in_chunks(model, ids, len(ids))[0]
        finally:
            model._embed = emb
        amplification = max(amplification, rel_err(noisy, clean))
    assert amplification > 0, "the embedding noise did not reach the logits: the guard is blind"
    return amplification


def draw_well_routed(model, size, reference, tries=20):
    """Fresh random ids whose `reference(ids)` run routes every token with a clear top-k margin and
    whose rounding noise leaves a wrong formula visible; returns (ids, reference result, tolerance)."""
    for _ in range(tries):
        ids = np.random.default_rng().integers(0, model.config.text.vocab_size, size=size)
        with RouterGaps() as gaps:
            ref = reference(ids)
            tol = float32_tolerance(model, ids)
        if gaps.smallest > ROUTER_GAP and tol <= MAX_TOL:
            return ids, ref, tol
    pytest.fail(f"no input of {tries} random draws routed without a near-tie (< {ROUTER_GAP}) "
                f"and rounded with a tolerance under {MAX_TOL}")


def unless_near_tie(check, tries=10):
    """Run `check()` (which draws its own fresh inputs); a failure is retried with new inputs only
    when some token of that draw was routed with a near-tie, so a real bug still fails."""
    for _ in range(tries):
        with RouterGaps() as gaps:
            try:
                return check()
            except AssertionError:
                if gaps.smallest > ROUTER_GAP:
                    raise
    pytest.fail(f"{tries} random draws all hit a router near-tie (< {ROUTER_GAP})")


def test_router_gap_guard_sees_near_ties():
    """The guard must record gaps, or the MoE comparisons above would be unguarded."""
    model = tiny_model("moe")
    with RouterGaps() as gaps:
        model.forward(ForwardBatch.single(np.arange(9), 0, np.arange(4)), model.new_kv_pool(4, 5),
                      model.new_state_pool(1))
    assert 0 <= gaps.smallest < 1.0
    import ninfer.ops as ops
    assert ops.route_topk.__name__ == "route_topk"        # restored


def run_in_chunks(model, ids, chunk, page_size=5):
    """All-token logits of `ids` fed `chunk` tokens per call; returns (logits [T, V], kv, state)."""
    T = len(ids)
    kv = model.new_kv_pool(-(-T // page_size) + 2, page_size)
    st = model.new_state_pool(2)
    table = np.arange(kv.num_pages)[::-1].copy()          # pages deliberately out of order
    outs = [model.forward(ForwardBatch.single(ids[s:s + chunk], s, table, state_slot=1), kv, st,
                          all_logits=True) for s in range(0, T, chunk)]
    return np.concatenate(outs), kv, st


# ---- chunking and decode continue the same State/KV -------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_chunks_and_decode_agree(name):
    model = tiny_model(name)
    ids, (ref, kv_ref, st_ref), tol = draw_well_routed(
        model, 75, lambda ids: run_in_chunks(model, ids, len(ids)))
    assert ref.shape == (75, model.config.text.vocab_size) and ref.dtype == np.float32
    assert np.all(np.isfinite(ref)) and ref.std() > 0.1          # not degenerate
    for chunk in (1, 7, 64):
        got, kv, st = run_in_chunks(model, ids, chunk)
        assert rel_err(got, ref) < tol, chunk
        for a, b in zip(st.conv + st.recurrent, st_ref.conv + st_ref.recurrent):
            assert rel_err(a[1], b[1]) < tol
        for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
            assert rel_err(a, b) < tol
    # last-token logits only (the decode path's output form): prefill 40, then decode one by one
    kv = model.new_kv_pool(20, 5)
    st = model.new_state_pool(1)
    table = np.arange(20)
    first = model.forward(ForwardBatch.single(ids[:40], 0, table), kv, st)
    assert first.shape == (1, model.config.text.vocab_size)
    assert rel_err(first[0], ref[39]) < tol
    for t in range(40, 75):
        out = model.forward(ForwardBatch.single(ids[t:t + 1], t, table), kv, st)
        assert rel_err(out[0], ref[t]) < tol, t


def test_tokens_influence_later_logits_only_causally():
    model = tiny_model("dense")
    ids = np.random.default_rng().integers(0, 61, size=20)
    a, _, _ = run_in_chunks(model, ids, 20)
    ids2 = ids.copy()
    ids2[12] = (ids2[12] + 1) % 61
    b, _, _ = run_in_chunks(model, ids2, 20)
    np.testing.assert_array_equal(a[:12], b[:12])
    assert rel_err(b[12:], a[12:]) > 1e-3


# ---- batched rows == per-row calls -------------------------------------------------------------

def _batch(rows, ctxs, tables, slots):
    ids = np.concatenate(rows).astype(np.int32)
    lengths = [len(r) for r in rows]
    P = max(len(t) for t in tables)
    bt = np.full((len(rows), P), -1, np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    return ForwardBatch(token_ids=ids, positions=ForwardBatch.text_positions(ctxs, lengths),
                        query_start=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                        context_lens=np.array(ctxs, np.int32), block_tables=bt,
                        state_slots=np.array(slots, np.int32))


@pytest.mark.parametrize("name", ["dense", "moe", "odd_heads"])
def test_batched_rows_equal_per_row(name):
    model = tiny_model(name)
    unless_near_tie(lambda: _check_batched_rows_equal_per_row(model))


def _check_batched_rows_equal_per_row(model):
    V, ps = model.config.text.vocab_size, 4
    r = np.random.default_rng()
    # (already in context, new tokens): fresh prefill, decodes, a continued prefill, page edges
    shape = [(0, 9), (6, 1), (4, 5), (3, 1), (7, 1), (0, 1)]
    for _ in range(20):     # inputs whose rounding noise leaves a wrong formula visible (as
        seqs = [r.integers(0, V, size=c + n) for c, n in shape]      # draw_well_routed)
        tol = float32_tolerance(model, *seqs)
        if tol <= MAX_TOL:
            break
    assert tol <= MAX_TOL, "20 draws: rounding noise too large to see a wrong formula"
    slots = [3, 0, 5, 2, 1, 4]
    free = list(r.permutation(40))
    tables = [[free.pop() for _ in range(-(-(c + n) // ps))] for c, n in shape]
    kv, st = model.new_kv_pool(40, ps), model.new_state_pool(6)
    st.conv[0][:] = 7.0                          # stale garbage: fresh rows must ignore it
    st.recurrent[0][:] = -3.0
    for i, (c, n) in enumerate(shape):           # bring each row to its frontier
        if c:
            model.forward(ForwardBatch.single(seqs[i][:c], 0, tables[i], slots[i]), kv, st)
    kv_b, st_b = copy.deepcopy(kv), copy.deepcopy(st)
    batched = model.forward(_batch([s[c:] for s, (c, _) in zip(seqs, shape)], [c for c, _ in shape],
                                   tables, slots), kv_b, st_b)
    assert batched.shape == (len(shape), V)
    for i, (c, n) in enumerate(shape):
        single = model.forward(ForwardBatch.single(seqs[i][c:], c, tables[i], slots[i]), kv, st)
        assert rel_err(batched[i], single[0]) < tol, i
        # and both equal a clean, isolated run of the whole sequence
        alone, _, _ = run_in_chunks(model, seqs[i], len(seqs[i]))
        assert rel_err(single[0], alone[-1]) < tol, i
        for a, b in zip(st_b.conv + st_b.recurrent, st.conv + st.recurrent):
            assert rel_err(a[slots[i]], b[slots[i]]) < tol
        for a, b in zip(kv_b.k + kv_b.v, kv.k + kv.v):
            assert rel_err(a[tables[i]], b[tables[i]]) < tol


def test_all_logits_batched_matches_last_token_form():
    model = tiny_model("moe")
    r = np.random.default_rng()
    rows = [r.integers(0, 61, size=n) for n in (3, 8, 1)]
    kv, st = model.new_kv_pool(12, 4), model.new_state_pool(3)
    b = _batch(rows, [0, 0, 0], [[0], [1, 2], [3]], [0, 1, 2])
    full = model.forward(b, copy.deepcopy(kv), copy.deepcopy(st), all_logits=True)
    last = model.forward(b, kv, st)
    assert full.shape == (12, 61)
    np.testing.assert_allclose(last, full[b.query_start[1:] - 1], rtol=1e-6, atol=1e-6)


# ---- binder and backend selection ---------------------------------------------------------------

def test_tied_lm_head_shares_one_float32_copy():
    model = tiny_model("dense", tied=True)
    assert np.shares_memory(model._embed, model._lm_head)
    assert model._embed.dtype == np.float32


def test_missing_or_misshaped_binding_names_the_tensor():
    cfg = tiny_config("moe")
    w = random_text_weights(cfg, 0)
    del w["text.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ArtifactError, match=r"text\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(FakeArtifact(cfg, w), EngineOptions())
    w = random_text_weights(cfg, 0)
    w["text.layers.0.mlp.experts.gate_up_proj"] = w["text.layers.0.mlp.experts.gate_up_proj"][:, :-1]
    with pytest.raises(ArtifactError, match=r"experts\.gate_up_proj.*shape"):
        load_model(FakeArtifact(cfg, w), EngineOptions())


def test_cuda_backend_without_cuda_model_is_a_device_error(monkeypatch):
    cfg = tiny_config("dense")
    monkeypatch.setitem(sys.modules, "ninfer.models.qwen3_5.cuda_model", None)   # import fails
    with pytest.raises(DeviceError, match="cuda"):
        load_model(FakeArtifact(cfg, random_text_weights(cfg, 0)), EngineOptions(backend="cuda"))


def test_bad_batches_are_rejected():
    model = tiny_model("dense")
    kv, st = model.new_kv_pool(4, 4), model.new_state_pool(2)
    with pytest.raises(ValueError, match="token id"):
        model.forward(ForwardBatch.single([1, 61], 0, [0]), kv, st)
    with pytest.raises(ValueError, match="state slots"):
        model.forward(_batch([[1], [2]], [0, 0], [[0], [1]], [1, 1]), kv, st)
    with pytest.raises(ValueError, match="same KV page slot"):
        model.forward(_batch([[1], [2]], [0, 0], [[0], [0]], [0, 1]), kv, st)
    with pytest.raises(ValueError, match="cover"):
        model.forward(ForwardBatch.single(list(range(9)), 0, [0, 1]), kv, st)
