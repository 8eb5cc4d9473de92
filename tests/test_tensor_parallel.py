"""Tensor and expert parallel on CPU: the numpy model run as N simulated ranks (ninfer/parallel)
equals the single-rank numpy model.

What may differ, and why the tolerances are what they are. A rank computes each row-parallel
projection (o_proj, out_proj, down_proj, the MoE combine) over its K/N input channels and rounds
that partial to float32; LocalComm sums the N partials in float64 and rounds once, where the
single-rank model rounds one K-term dot product. A column-parallel projection computes the very
same dot products, but BLAS picks its blocking by the matrix shape, so a rank's [N, out/N] product
may round differently from the same columns of the [N, out] product (1 ulp). Nothing else
differs - the same terms enter every sum, only their grouping changes - and world size 1 is
bit-identical. Both tolerances are therefore "rounding noise" tolerances, judged per draw as
test_model.py judges two correct float32 evaluations:
  - one layer on a random input: max(TOL_LAYER, TP_NOISE_FACTOR x that layer's response to
    ulp-sized noise on its input). Measured over 1800 layers: at most 0.24 of it (Gated DeltaNet
    layers, whose per-head norms amplify an ulp most, are the worst);
  - logits after several layers: max(TOL_TP, TP_NOISE_FACTOR x the logits' response to ulp-sized
    noise on the embeddings), draws over MAX_TOL redrawn. Measured over 1190 draws: at most 0.47
    of it.
A wrong head, channel or expert assignment gives errors of O(1) (test_a_wrong_shard_assignment_
is_caught). MoE routing is discontinuous (test_model.py's RouterGaps): draws with a router
near-tie are redrawn, as there.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from ninfer import EngineOptions, ops
from ninfer.models.qwen3_5 import load_model
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.config import FULL_ATTENTION, LINEAR_ATTENTION
from ninfer.models.qwen3_5.layers import SparseMoE
from ninfer.parallel import (LocalComm, ShardingError, TensorParallelModel, attention_heads,
                             check_geometry, linear_heads, merge_layer, owned_experts, shard_layer)
from ninfer.parallel.tp_model import ExpertShardMoE, RankSum
from test_model import (MAX_TOL, ROUTER_GAP, FakeArtifact, RouterGaps, _batch,
                        embedding_noise_response, random_text_weights, rel_err,
                        tiny_config)

TOL_LAYER = 1e-6
TOL_TP = 1e-4
TP_NOISE_FACTOR = 30
L, F = LINEAR_ATTENTION, FULL_ATTENTION

# head counts divisible by 2 and 4 (test_model's "moe" has 6 experts: 8 here)
CASES = {
    # 4 query heads on 2 KV heads, 4 value heads on 2 key heads: at N=4 each rank holds a copy
    # of the one KV head / key head its heads read (the replicated geometry)
    "dense": dict(name="dense"),
    # 8 on 4 and 8 on 4: every head group split at N=2 and N=4
    "wide": dict(name="dense", layer_types=(L, F, L, F), num_attention_heads=8,
                 num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8),
    "moe": dict(name="moe", num_experts=8),
    # q/k/v/o biases: o_proj's bias belongs to rank 0 alone
    "bias": dict(name="dense", attention_bias=True),
}
WORLDS = (1, 2, 4)


def build(case: str, seed=None):
    over = dict(CASES[case])
    cfg = tiny_config(over.pop("name"), **over)
    seed = np.random.SeedSequence().entropy % (1 << 32) if seed is None else seed
    w = random_text_weights(cfg, seed)
    if cfg.text.attention_bias:
        r, t = np.random.default_rng(seed + 1), cfg.text
        for i in t.attention_layer_ids:
            a = f"text.layers.{i}.self_attn."
            for name, n in (("q_proj", 2 * t.num_attention_heads * t.head_dim),
                            ("k_proj", t.num_key_value_heads * t.head_dim),
                            ("v_proj", t.num_key_value_heads * t.head_dim),
                            ("o_proj", t.hidden_size)):
                bias = r.normal(size=n) * 0.5
                w[a + name + ".bias"] = bias.astype(w[a + "q_proj.weight"].dtype)
    return load_model(FakeArtifact(cfg, w), EngineOptions(backend="numpy"))


def layer_tolerance(layer, x, *pools) -> float:
    """max(TOL_LAYER, TP_NOISE_FACTOR x rel_err of layer(x) when x carries ulp-sized noise);
    `pools`: (plan, pool) of a mixer, run on copies."""
    def run(a):
        return layer(a, *(copy.deepcopy(p) for p in pools))
    noise = np.random.default_rng().choice(np.float32([-1, 1]), x.shape) * np.float32(2 ** -23)
    return max(TOL_LAYER, TP_NOISE_FACTOR * rel_err(run((x * (1 + noise)).astype(np.float32)),
                                                    run(x)))


def poison(pools) -> None:
    """NaN in every KV page and State slot: whatever the forward reads before writing shows."""
    for p in getattr(pools, "ranks", [pools]):
        for a in getattr(p, "k", []) + getattr(p, "v", []) + getattr(p, "conv", []) + \
                getattr(p, "recurrent", []):
            a[...] = np.nan


def greedy(model, prompt, steps, table, page_size):
    """Prefill `prompt` (all-token logits), then `steps` greedy decode steps from fresh poisoned
    pools: (prefill logits [T, V], decode logits [steps, V], tokens [steps], kv, state)."""
    kv, st = model.new_kv_pool(len(table), page_size), model.new_state_pool(3)
    poison(kv)
    poison(st)
    pre = model.forward(ForwardBatch.single(prompt, 0, table, state_slot=2), kv, st,
                        all_logits=True)
    tok, outs, toks = int(np.argmax(pre[-1])), [], []
    for t in range(steps):
        toks.append(tok)
        step = ForwardBatch.single([tok], len(prompt) + t, table, state_slot=2)
        out = model.forward(step, kv, st)
        outs.append(out[0])
        tok = int(np.argmax(out[0]))
    return pre, np.array(outs), np.array(toks), kv, st


def draw(model, size, steps=16, page_size=4, tries=20):
    """A fresh random prompt whose single-rank greedy run routes without near-ties, rounds with
    a usable tolerance and picks every greedy token by a margin the tolerance cannot close:
    (prompt, table, reference run, tolerance)."""
    V = model.config.text.vocab_size
    r = np.random.default_rng()
    for _ in range(tries):
        prompt = r.integers(0, V, size=size)
        table = r.permutation(-(-(size + steps) // page_size) + 2)     # pages out of order
        with RouterGaps() as gaps:
            ref = greedy(model, prompt, steps, table, page_size)
            tol = max(TOL_TP, TP_NOISE_FACTOR * embedding_noise_response(
                model, np.concatenate([prompt, ref[2]])))
        logits = np.concatenate([ref[0][-1:], ref[1]])
        top2 = -np.sort(-logits, axis=1)[:, :2]
        margin = float(np.min(top2[:, 0] - top2[:, 1]) / np.max(np.abs(logits)))
        if gaps.smallest > ROUTER_GAP and tol <= MAX_TOL and margin > 4 * tol:
            return prompt, table, ref, tol
    pytest.fail(f"{tries} draws: none without a router near-tie, argmax near-tie or a "
                f"tolerance over {MAX_TOL}")


# ---- LocalComm -----------------------------------------------------------------------------------

def test_local_comm_sums_in_rank_order_in_float64():
    comm = LocalComm(3)
    assert (comm.world_size, comm.ranks, comm.rank) == (3, (0, 1, 2), 0)
    # float32 in rank order loses the 1 (1e8 + 1 rounds to 1e8); float64 keeps it
    parts = [np.float32([1e8, 2.5]), np.float32([1.0, -0.5]), np.float32([-1e8, 0.25])]
    before = [p.copy() for p in parts]
    got = comm.all_reduce_sum(parts)
    assert got.dtype == np.float32 and got.tolist() == [1.0, 2.25]
    assert all(np.array_equal(a, b) for a, b in zip(parts, before))       # inputs untouched
    assert not any(np.shares_memory(got, p) for p in parts)
    x = np.random.default_rng().normal(size=(3, 5, 7)).astype(np.float32)
    np.testing.assert_array_equal(comm.all_reduce_sum(list(x)),
                                  x.astype(np.float64).sum(0).astype(np.float32))
    np.testing.assert_array_equal(comm.all_gather(list(x), axis=1),
                                  np.concatenate(list(x), axis=1))
    one = np.float32([3.0])
    assert LocalComm(1).all_reduce_sum([one]).tolist() == [3.0]
    with pytest.raises(ValueError, match="2 partials for 3 ranks"):
        comm.all_reduce_sum(parts[:2])
    with pytest.raises(ValueError, match="rank 1"):
        comm.all_reduce_sum([parts[0], np.float32([1.0]), parts[2]])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            LocalComm(bad)


# ---- sharding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(CASES))
def test_shard_round_trip_is_bit_exact(case, world):
    model = build(case)
    cfg = model.text
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, model._layers)):
        p = layer[1].p
        shards = [shard_layer(p, cfg, kind, r, world) for r in range(world)]
        back = merge_layer(shards, cfg, kind)
        assert sorted(back) == sorted(p), i
        for name in p:
            assert back[name].dtype == p[name].dtype and back[name].shape == p[name].shape
            assert np.array_equal(back[name], p[name]), (i, name)
        # replicated parameters are the very same arrays on every rank
        for name in ("input_norm", "post_norm", "q_norm", "k_norm", "gdn_norm", "router",
                     "shared_expert_gate"):
            if name in p:
                assert all(s[name] is p[name] for s in shards), name
        # independent of merge_layer: what rank r holds, computed from the head layout
        for r, s in enumerate(shards):
            if kind == FULL_ATTENTION:
                q, kv = attention_heads(cfg, r, world)
                hd = cfg.head_dim
                qg = p["q_proj"].reshape(cfg.num_attention_heads, 2 * hd, -1)
                assert np.array_equal(s["q_proj"], qg[q.start:q.stop].reshape(-1, cfg.hidden_size))
                k = p["k_proj"].reshape(cfg.num_key_value_heads, hd, -1)[kv.start:kv.stop]
                assert np.array_equal(s["k_proj"], k.reshape(-1, cfg.hidden_size))
                o = p["o_proj"].reshape(cfg.hidden_size, cfg.num_attention_heads, hd)
                assert np.array_equal(s["o_proj"],
                                      o[:, q.start:q.stop].reshape(cfg.hidden_size, -1))
                assert ("o_bias" in s) == (cfg.attention_bias and r == 0)
            else:
                v, k = linear_heads(cfg, r, world)
                assert np.array_equal(s["A_log"], p["A_log"][v.start:v.stop])
                dk, kd = cfg.linear_key_head_dim, cfg.linear_key_dim
                assert np.array_equal(s["conv_w"][:len(k) * dk],
                                      p["conv_w"][k.start * dk:k.stop * dk])
                assert np.array_equal(s["in_proj_qkv"][len(k) * dk:2 * len(k) * dk],
                                      p["in_proj_qkv"][kd + k.start * dk:kd + k.stop * dk])
    if world > 1 and cfg.num_key_value_heads % world:                    # replicated KV heads
        assert len(attention_heads(cfg, 0, world)[1]) == 1
        assert attention_heads(cfg, 0, world)[1] == attention_heads(cfg, 1, world)[1]


@pytest.mark.parametrize("world", WORLDS)
def test_each_expert_on_exactly_one_rank_and_the_moe_layer_equal(world):
    model = build("moe")
    cfg = model.text
    owners = np.concatenate([np.asarray(owned_experts(cfg, r, world)) for r in range(world)])
    assert sorted(owners.tolist()) == list(range(cfg.num_experts))        # each exactly once
    tp = TensorParallelModel(model, world)
    r = np.random.default_rng()
    for i, ((*_, mlp), (*_, tp_mlp)) in enumerate(zip(model._layers, tp._layers)):
        assert isinstance(mlp, SparseMoE) and isinstance(tp_mlp, RankSum)
        assert all(isinstance(m, ExpertShardMoE) for m in tp_mlp.shards)
        held = [m.p["experts_gate_up"] for m in tp_mlp.shards]
        assert sum(len(h) for h in held) == cfg.num_experts
        assert np.array_equal(np.concatenate(held), mlp.p["experts_gate_up"])
        x = r.normal(size=(37, cfg.hidden_size)).astype(np.float32)
        ref = mlp(x)
        # the routed experts alone: the ranks' shares add up to SparseMoE's, and a rank
        # contributes exactly nothing to a token none of whose experts it owns
        weights, ids = ops.route_topk(ops.linear(x, mlp.p["router"]), mlp.top_k, mlp.normalize)
        shares = [m.routed(x, ids, weights) for m in tp_mlp.shards]
        for m, share in zip(tp_mlp.shards, shares):
            assert not np.any(share[~np.any(m.local_index[ids] >= 0, axis=1)])
        assert rel_err(LocalComm(world).all_reduce_sum(shares), mlp.routed(x, ids, weights)) \
            < layer_tolerance(mlp, x)
        got = tp_mlp(x)
        assert got.dtype == np.float32 and got.shape == ref.shape
        if world == 1:
            assert np.array_equal(got, ref), i
        assert rel_err(got, ref) < layer_tolerance(mlp, x), i


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("case", list(CASES))
def test_each_layer_equals_its_rank_sum(case, world):
    """Layer by layer on the same random input: mixer (with its pools) and MLP of N ranks + one
    all-reduce == the single-rank layer, to that layer's rounding-noise tolerance."""
    model = build(case)
    tp = TensorParallelModel(model, world)
    r = np.random.default_rng()
    V, H = model.text.vocab_size, model.text.hidden_size
    b = _batch([r.integers(0, V, size=n) for n in (9, 1, 4)], [0, 0, 0], [[3, 1, 0], [2], [4]],
               [1, 0, 2])
    kv, st = model.new_kv_pool(5, 4), model.new_state_pool(3)
    tkv, tst = tp.new_kv_pool(5, 4), tp.new_state_pool(3)
    plan = model._plan(b, kv, st)
    for i, (one, many) in enumerate(zip(model._layers, tp._layers)):
        x = r.normal(size=(b.num_tokens, H)).astype(np.float32)
        pool = kv if one[1].reads_kv else st
        tol = layer_tolerance(one[1], x, plan, pool)
        ref = one[1](x, plan, pool)
        got = many[1](x, plan, tkv if many[1].reads_kv else tst)
        assert rel_err(got, ref) < tol, (i, "mixer")
        assert rel_err(many[3](x), one[3](x)) < layer_tolerance(one[3], x), (i, "mlp")


# ---- the whole model -----------------------------------------------------------------------------

def once(pieces: dict, head: int, values: np.ndarray) -> None:
    if head in pieces:                  # a replica: the same k_proj rows on the same input
        np.testing.assert_array_equal(values, pieces[head])
    pieces[head] = values


def merged_pools(tp, kv, st):
    """The single-rank layout of a TensorParallelModel's pools: KV heads / State channels and
    heads of every rank put back in global order; a replicated head (KV head or GDN key head
    held by several ranks) is taken once, after checking its copies are bit-identical."""
    cfg, N = tp.text, tp.world_size
    k, v = [], []
    kv_ranges = [attention_heads(cfg, r, N)[1] for r in range(N)] if cfg.attention_layer_ids else []
    for a in range(len(cfg.attention_layer_ids)):
        for out, name in ((k, "k"), (v, "v")):
            pieces = {}
            for rank, heads in zip(kv.ranks, kv_ranges):
                for j, h in enumerate(heads):
                    once(pieces, h, getattr(rank, name)[a][:, :, j])
            out.append(np.stack([pieces[h] for h in sorted(pieces)], axis=2))
    conv, rec = [], []
    if cfg.linear_layer_ids:
        shapes = [linear_heads(cfg, r, N) for r in range(N)]
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for l in range(len(cfg.linear_layer_ids)):
        rec.append(np.concatenate([rank.recurrent[l] for rank in st.ranks], axis=1))
        qs, ks, vs = {}, {}, {}
        for rank, (vh, kh) in zip(st.ranks, shapes):
            c = rank.conv[l]
            for j, h in enumerate(kh):
                once(qs, h, c[:, j * dk:(j + 1) * dk])
                once(ks, h, c[:, (len(kh) + j) * dk:(len(kh) + j + 1) * dk])
            vs.update({h: c[:, (2 * len(kh)) * dk + j * dv:(2 * len(kh)) * dk + (j + 1) * dv]
                       for j, h in enumerate(vh)})
        conv.append(np.concatenate([d[h] for d in (qs, ks, vs) for h in sorted(d)], axis=1))
    return k, v, conv, rec


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_greedy_decode_equal_the_single_rank_model(case, world):
    model = build(case)
    tp = TensorParallelModel(model, world)
    prompt, table, ref, tol = draw(model, 19)
    got = greedy(tp, prompt, 16, table, 4)
    assert got[0].shape == ref[0].shape and got[0].dtype == np.float32
    assert np.all(np.isfinite(got[0])) and np.all(np.isfinite(got[1]))    # no poison read
    np.testing.assert_array_equal(got[2], ref[2])                          # 16 greedy tokens
    if world == 1:                           # one rank: the same arithmetic, bit for bit
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])
    assert rel_err(got[0], ref[0]) < tol
    for t in range(16):
        assert rel_err(got[1][t], ref[1][t]) < tol, t
    # the pools: each rank holds its heads, which together are the single-rank pools
    kv, st = ref[3], ref[4]
    k, v, conv, rec = merged_pools(tp, got[3], got[4])
    assert len(k) == len(kv.k) and len(conv) == len(st.conv)
    written = len(prompt) + 16 - 1          # positions in the table's pages (the rest: poison)
    for a, b in zip(k + v, kv.k + kv.v):
        a, b = (x[table].reshape(-1, *x.shape[2:])[:written] for x in (a, b))
        assert a.shape == b.shape and rel_err(a, b) < tol
    for a, b in zip(conv + rec, st.conv + st.recurrent):
        assert a.shape == b.shape and rel_err(a[2], b[2]) < tol
    for r, (pool, state) in enumerate(zip(got[3].ranks, got[4].ranks)):   # rank r: its heads
        assert pool.k[0].shape[2] == len(attention_heads(model.text, r, world)[1])
        assert state.recurrent[0].shape[1] == len(linear_heads(model.text, r, world)[0])


@pytest.mark.parametrize("case", ["moe", "wide"])
def test_batched_rows_equal_the_single_rank_model(case):
    """Prefill, continued prefill and decode rows in one call, pools and slots out of order."""
    model = build(case)
    tp = TensorParallelModel(model, 2)
    V, ps = model.text.vocab_size, 4
    r = np.random.default_rng()
    shape = [(0, 9), (6, 1), (4, 5), (3, 1)]
    slots, tables = [3, 0, 2, 1], [[9, 2, 5], [0, 7], [4, 1, 8], [6]]
    for _ in range(20):
        seqs = [r.integers(0, V, size=c + n) for c, n in shape]
        tol = max(TOL_TP, TP_NOISE_FACTOR * embedding_noise_response(model, *seqs))
        outs = []
        with RouterGaps() as gaps:
            for m in (model, tp):
                kv, st = m.new_kv_pool(10, ps), m.new_state_pool(4)
                poison(kv)
                poison(st)
                for i, (c, n) in enumerate(shape):
                    if c:
                        m.forward(ForwardBatch.single(seqs[i][:c], 0, tables[i], slots[i]), kv, st)
                outs.append(m.forward(_batch([s[c:] for s, (c, _) in zip(seqs, shape)],
                                             [c for c, _ in shape], tables, slots), kv, st,
                                      all_logits=True))
        if gaps.smallest > ROUTER_GAP and tol <= MAX_TOL:
            break
    else:
        pytest.fail("20 draws: no input without a router near-tie")
    assert outs[1].shape == (sum(n for _, n in shape), V) and np.all(np.isfinite(outs[1]))
    assert rel_err(outs[1], outs[0]) < tol


def test_checkpoint_route_dense_and_moe(tmp_path):
    """The tiny random checkpoints of ckpt_helpers (TINY_TEXT: 4 query heads on 2 KV, 4 value on
    2 key heads, 4 experts), converted and loaded as users load them, at 2 and 4 ranks. Their
    unit-normal weights saturate the router's softmax (probabilities 1e-12 apart, which the
    near-tie guard cannot tell from a tie), so the MoE router is scaled by 1/sqrt(hidden)."""
    import ml_dtypes
    from ckpt_helpers import TINY_MOE, TINY_TEXT, write_checkpoint
    from ninfer.artifact import Artifact
    from ninfer.convert.convert import convert_checkpoint
    r = np.random.default_rng()
    H, n = TINY_TEXT["hidden_size"], TINY_TEXT["num_hidden_layers"]
    for arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
        E = TINY_MOE["num_experts"]
        router = {f"model.layers.{i}.mlp.gate.weight":
                  (r.normal(size=(E, H)) * 2 / np.sqrt(H)).astype(ml_dtypes.bfloat16)
                  for i in range(n)} if "Moe" in arch else {}
        ckpt = write_checkpoint(tmp_path / arch, arch, frontend=False, replace=router,
                                seed=int(r.integers(1 << 31)))
        out = convert_checkpoint(ckpt.path, tmp_path / f"{arch}.ninfer", progress=False)
        with Artifact(out) as art:
            model = load_model(art, EngineOptions(backend="numpy"))
        assert model.text.is_moe == ("Moe" in arch)
        prompt, table, ref, tol = draw(model, 11)
        for world in (2, 4):
            got = greedy(TensorParallelModel(model, world), prompt, 16, table, 4)
            np.testing.assert_array_equal(got[2], ref[2])
            assert rel_err(got[0], ref[0]) < tol and rel_err(got[1], ref[1]) < tol


# ---- the checks can fail -------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["o_proj", "out_proj", "down_proj", "experts"])
def test_a_wrong_shard_assignment_is_caught(what):
    """Swapping two ranks' pieces of one parameter (a wrong shard order) moves the logits far
    beyond the tolerance: the comparisons above can fail."""
    case = "moe" if what == "experts" else "wide"
    model = build(case)
    prompt, table, ref, tol = draw(model, 12, steps=1)
    tp = TensorParallelModel(model, 2)
    kinds = model.text.layer_types
    i = kinds.index(FULL_ATTENTION if what == "o_proj" else LINEAR_ATTENTION)
    if what in ("o_proj", "out_proj"):
        a, b = (m.p for m in tp._layers[i][1].shards)
        a[what], b[what] = b[what], a[what]
    elif what == "down_proj":
        a, b = (m.p for m in tp._layers[i][3].shards)
        a[what], b[what] = b[what], a[what]
    else:
        a, b = tp._layers[i][3].shards
        a.local_index, b.local_index = b.local_index, a.local_index
    got = greedy(tp, prompt, 1, table, 4)
    assert rel_err(got[0], ref[0]) > 100 * tol


# ---- geometries that cannot shard ----------------------------------------------------------------

@pytest.mark.parametrize("over, world, words", [
    (dict(name="dense"), 3, r"num_attention_heads=4 over world_size=3"),
    # 6 query heads on 3 KV heads over 2 ranks: rank 0's heads 0-2 read KV heads 0 and 1
    (dict(name="dense", num_attention_heads=6, num_key_value_heads=3), 2,
     r"num_key_value_heads=3 \(with num_attention_heads=6\) over world_size=2"),
    (dict(name="dense", linear_num_value_heads=6, linear_num_key_heads=3), 2,
     r"linear_num_key_heads=3 \(with linear_num_value_heads=6\) over world_size=2"),
    (dict(name="dense", linear_num_value_heads=2, linear_num_key_heads=2), 4,
     r"linear_num_value_heads=2 over world_size=4"),
    (dict(name="dense", intermediate_size=50), 4, r"intermediate_size=50 over world_size=4"),
    (dict(name="moe"), 4, r"num_experts=6 over world_size=4"),
    (dict(name="moe", num_experts=8, shared_expert_intermediate_size=18), 4,
     r"shared_expert_intermediate_size=18 over world_size=4"),
    (dict(name="dense"), 0, r"world_size must be a positive integer"),
])
def test_a_geometry_that_cannot_shard_raises_naming_it(over, world, words):
    over = dict(over)
    cfg = tiny_config(over.pop("name"), **over).text
    with pytest.raises(ShardingError, match=words):
        check_geometry(cfg, world)
    with pytest.raises(ShardingError, match=words):
        shard_layer({}, cfg, cfg.layer_types[0], 0, world)
    if world == 3:                     # and the model refuses, before building anything
        with pytest.raises(ShardingError, match=words):
            TensorParallelModel(build("dense"), world)
    from ninfer.errors import DeviceError, Error
    assert issubclass(ShardingError, DeviceError) and issubclass(ShardingError, Error)


def test_an_unknown_parameter_has_no_silent_rule():
    model = build("dense")
    p = dict(model._layers[0][1].p, mystery=np.zeros(3, np.float32))
    with pytest.raises(ShardingError, match="mystery"):
        shard_layer(p, model.text, model.text.layer_types[0], 0, 2)
    with pytest.raises(ShardingError, match=r"rank 2 is not in \[0, 2\)"):
        shard_layer(model._layers[0][1].p, model.text, model.text.layer_types[0], 2, 2)
