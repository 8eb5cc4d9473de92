"""The DFlash block drafter (models/qwen3_5/dflash.py): its math against a float64 oracle written
from the equations, the target's features, its config and conversion (convert --dflash), and
speculative='dflash' through the Engine: the tokens of plain decoding, greedy and seeded, alone
and batched (the rest of the contract, pauses, grammars, penalties, stop strings, thinking budgets
and context-cache checkpoints, runs for both drafters in tests/test_speculative.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_helpers import TINY_TEXT, write_checkpoint
from ninfer.artifact import Artifact
from ninfer.convert import convert_checkpoint
from ninfer.errors import ArtifactError, ConvertError, RequestError
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.config import DFlashConfig, parse_dflash_config, parse_hf_config
from ninfer.models.qwen3_5.dflash import DFlashDrafter, dflash_param_shapes, PREFIX
from ninfer.models.qwen3_5.model import NumpyModel

pytestmark = pytest.mark.timeout(600)

TEXT = parse_hf_config(dict(TINY_TEXT, architectures=["Qwen3_5ForCausalLM"])).text
# the drafter's geometry for the tiny target: GQA (4 heads over 2), its own head_dim
DRAFTER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, intermediate_size=40, rms_norm_eps=1e-6, rope_theta=10000.0,
               target_layer_ids=(0, 2, 3), block_size=5, mask_token_id=94)


def drafter_hf_config(**over) -> dict:
    """A z-lab style config.json of DRAFTER (dflash_config holds the DFlash fields)."""
    d = dict(DRAFTER, **over)
    extra = {k: d.pop(k) for k in ("target_layer_ids", "block_size", "mask_token_id")}
    extra["target_layer_ids"] = list(extra["target_layer_ids"])
    return dict(d, architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=96,
                hidden_act="silu", attention_bias=False, dflash_config=extra)


def random_drafter_tensors(cfg: DFlashConfig, seed: int = 0) -> dict:
    """{source name: float32} of a drafter with weights of a scale that keeps activations O(1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in dflash_param_shapes(cfg).items():
        if len(shape) == 1:
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name[len(PREFIX):]] = w.astype(np.float32)
    return out


def write_drafter_dir(path, cfg_over=None, *, seed=0, drop=(), extra=None):
    path.mkdir(parents=True, exist_ok=True)
    hf = drafter_hf_config(**(cfg_over or {}))
    (path / "config.json").write_text(json.dumps(hf))
    tensors = random_drafter_tensors(parse_dflash_config(hf, TEXT), seed)
    for name in drop:
        del tensors[name]
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(artifact path, drafter tensors): the tiny random target with a random drafter."""
    d = tmp_path_factory.mktemp("dflash")
    write_checkpoint(d / "ckpt", "Qwen3_5ForCausalLM", tied=True)
    tensors = write_drafter_dir(d / "drafter")
    out = d / "tiny.ninfer"
    convert_checkpoint(d / "ckpt", out, progress=False, dflash_dir=d / "drafter")
    return out, tensors


# ---- the float64 oracle ----------------------------------------------------------------------------

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """x [n, heads, hd] at positions pos [n]: rotate-half RoPE over the whole head, float64."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], 1))[:, None], np.sin(np.concatenate([ang, ang], 1))[:, None]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    return x * cos + rot * sin


def oracle_block(t: dict, cfg: DFlashConfig, embed, lm_head, features, anchor) -> np.ndarray:
    """float64 final-normed hidden of block positions 1 .. bs-1 of one row whose target features
    of positions 0 .. F-1 are `features` [F, n*H]: the equations of dflash.py, one head at a
    time, no pages."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, nh, nkv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    F, bs = len(features), cfg.block_size
    c = _rms(features.astype(np.float64) @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = embed.astype(np.float64)[[anchor] + [cfg.mask_token_id] * (bs - 1)]
    for i in range(cfg.num_hidden_layers):
        p = lambda n: t[f"layers.{i}.{n}"]                                # noqa: E731

        def kv(src, pos):
            k = _rms((src @ p("self_attn.k_proj.weight").T).reshape(-1, nkv, hd),
                     p("self_attn.k_norm.weight"), eps)
            return _rope(k, pos, cfg.rope_theta), (src @ p("self_attn.v_proj.weight").T).reshape(-1, nkv, hd)
        kc, vc = kv(c, np.arange(F))
        h = _rms(x, p("input_layernorm.weight"), eps)
        q = _rope(_rms((h @ p("self_attn.q_proj.weight").T).reshape(bs, nh, hd),
                       p("self_attn.q_norm.weight"), eps), F + np.arange(bs), cfg.rope_theta)
        kb, vb = kv(h, F + np.arange(bs))
        keys, vals = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        o = np.zeros((bs, nh, hd))
        for head in range(nh):
            j = head // (nh // nkv)
            s = q[:, head] @ keys[:, j].T / np.sqrt(hd)
            a = np.exp(s - s.max(1, keepdims=True))
            o[:, head] = (a / a.sum(1, keepdims=True)) @ vals[:, j]
        x = x + o.reshape(bs, -1) @ p("self_attn.o_proj.weight").T
        h2 = _rms(x, p("post_attention_layernorm.weight"), eps)
        gate = h2 @ p("mlp.gate_proj.weight").T
        x = x + ((gate / (1 + np.exp(-gate))) * (h2 @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return _rms(x, t["norm.weight"], eps)[1:]


def _feed_batch(starts, counts, tables) -> ForwardBatch:
    starts, counts = np.asarray(starts, np.int32), np.asarray(counts, np.int32)
    qs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return ForwardBatch(np.zeros(int(qs[-1]), np.int32), ForwardBatch.text_positions(starts, counts),
                        qs, starts, np.asarray(tables, np.int32), np.arange(len(starts), dtype=np.int32))


def test_block_drafts_equal_the_float64_oracle(tiny):
    """Two rows (contexts of 6 and 11 positions on shuffled pages, fed in two calls that split
    rows mid-page), the unused pool entries NaN: the block pass reads exactly the fed context."""
    path, tensors = tiny
    with Artifact(path) as art:
        model = NumpyModel.from_artifact(art)
        drafter = DFlashDrafter.from_artifact(art, model)
    cfg = drafter.cfg
    rng = np.random.default_rng(1)
    kv = drafter.new_kv_pool(num_pages=8, page_size=4)
    for a in kv.k + kv.v:
        a[:] = np.nan
    tables = np.array([[5, 2, 7], [0, 6, 3]], np.int32)
    lens = [6, 11]
    feats = [rng.standard_normal((n, 3 * cfg.hidden_size)).astype(np.float32) for n in lens]
    drafter.feed(_feed_batch([0, 0], [3, 5], tables), np.concatenate([feats[0][:3], feats[1][:5]]), kv)
    drafter.feed(_feed_batch([3, 5], [3, 6], tables), np.concatenate([feats[0][3:], feats[1][5:]]), kv)
    anchors = [7, 42]
    got = drafter.draft_hidden(kv, anchors, lens, tables)
    assert got.shape == (2, cfg.block_size - 1, cfg.hidden_size) and np.isfinite(got).all()
    for r in range(2):
        want = oracle_block(tensors, cfg, model._embed, model._lm_head, feats[r], anchors[r])
        np.testing.assert_allclose(got[r], want, rtol=0, atol=2e-4)
    # the drafts are the argmax of the target's lm_head over them
    logits = got.reshape(-1, cfg.hidden_size) @ model._lm_head.T
    assert drafter.draft_argmax(got.reshape(-1, cfg.hidden_size)).tolist() == \
        np.argmax(logits, axis=1).tolist()


def test_a_fresh_row_drafts_from_its_anchor_alone(tiny):
    """F = 0 (nothing fed): the block attends over its own keys only."""
    path, tensors = tiny
    with Artifact(path) as art:
        model = NumpyModel.from_artifact(art)
        drafter = DFlashDrafter.from_artifact(art, model)
    kv = drafter.new_kv_pool(num_pages=2, page_size=4)
    got = drafter.draft_hidden(kv, [3], [0], [[1, 0]])
    want = oracle_block(tensors, drafter.cfg, model._embed, model._lm_head,
                        np.zeros((0, 3 * drafter.cfg.hidden_size)), 3)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-4)


def test_verify_forward_hands_the_outputs_of_the_chosen_layers(tiny):
    """hidden_layers (2, 0): the residual stream after layers 2 and 0, in that order, against a
    copy of the model cut after each layer; the logits are the full model's."""
    path, _ = tiny
    with Artifact(path) as art:
        model = NumpyModel.from_artifact(art)
    tokens = np.array([5, 9, 13, 2, 77, 31, 8], np.int32)
    batch = ForwardBatch(tokens, ForwardBatch.text_positions([0], [7]), np.array([0, 7], np.int32),
                         np.array([0], np.int32), np.array([[0, 1]], np.int32),
                         np.array([0], np.int32))

    def fresh():
        return model.new_kv_pool(2, 4), model.new_state_pool(1)
    kv, st = fresh()
    logits, feats = model.verify_forward(batch, kv, st, [6], hidden_layers=(2, 0))
    kv, st = fresh()
    want_logits, _ = model.verify_forward(batch, kv, st, [6])
    np.testing.assert_array_equal(logits, want_logits)
    layers = model._layers
    try:
        for col, cut in enumerate((2, 0)):
            model._layers = layers[:cut + 1]
            kv, st = fresh()
            want = model._trunk(batch, kv, st, None)
            np.testing.assert_array_equal(feats[:, col * 32:(col + 1) * 32], want)
    finally:
        model._layers = layers
    with pytest.raises(ValueError, match="not layers of this model"):
        kv, st = fresh()
        model.verify_forward(batch, kv, st, [6], hidden_layers=(4,))


# ---- config and conversion --------------------------------------------------------------------------

def test_the_artifact_carries_the_drafter_as_converted(tiny):
    path, tensors = tiny
    with Artifact(path) as art:
        assert "dflash" in art.manifest["components"]
        model = NumpyModel.from_artifact(art)
        assert model.config.dflash == DFlashConfig(**DRAFTER)
        drafter = DFlashDrafter.from_artifact(art, model)
    assert drafter.hidden_layers == (0, 2, 3) and drafter.max_draft_tokens == 4
    np.testing.assert_array_equal(drafter.p["layers"][1]["k_norm"], tensors["layers.1.self_attn.k_norm.weight"])
    np.testing.assert_array_equal(drafter.p["fc"], tensors["fc.weight"])


@pytest.mark.parametrize("over, rule", [
    (dict(hidden_size=16), "hidden_size 16 != the target's 32"),
    (dict(target_layer_ids=(0, 4)), "target_layer_ids"),
    (dict(target_layer_ids=(1, 1)), "target_layer_ids"),
    (dict(block_size=1), "block_size 1"),
    (dict(mask_token_id=96), "mask_token_id 96"),
    (dict(num_attention_heads=3), "not a multiple"),
])
def test_a_drafter_that_does_not_fit_the_target_is_refused(over, rule):
    with pytest.raises(ArtifactError, match=rule):
        parse_dflash_config(drafter_hf_config(**over), TEXT)


def test_dflash2_and_missing_fields_are_refused():
    hf = drafter_hf_config()
    hf["dflash_config"]["selector_rank"] = 8
    with pytest.raises(ArtifactError, match="DFlash2"):
        parse_dflash_config(hf, TEXT)
    hf = drafter_hf_config()
    del hf["dflash_config"]["mask_token_id"]
    with pytest.raises(ArtifactError, match="mask_token_id is missing"):
        parse_dflash_config(hf, TEXT)
    # block_size and mask_token_id may sit at the top level (z-lab's older configs)
    hf = drafter_hf_config()
    hf.update(block_size=hf["dflash_config"].pop("block_size"),
              mask_token_id=hf["dflash_config"].pop("mask_token_id"))
    assert parse_dflash_config(hf, TEXT) == DFlashConfig(**DRAFTER)


@pytest.mark.parametrize("case", ["missing", "shape", "extra", "no_dir"])
def test_convert_refuses_a_drafter_that_is_not_the_config(tmp_path, case):
    write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", tied=True)
    d = tmp_path / "drafter"
    if case == "missing":
        write_drafter_dir(d, drop=["layers.1.mlp.up_proj.weight"])
        match = "missing drafter tensor 'layers.1.mlp.up_proj.weight'"
    elif case == "shape":
        write_drafter_dir(d, extra={"fc.weight": np.zeros((32, 64), np.float32)})
        match = r"'fc.weight': expected shape \[32, 96\]"
    elif case == "extra":
        write_drafter_dir(d, extra={"candidate_selector.hidden_projection.weight":
                                    np.zeros((8, 32), np.float32)})
        match = "unexpected drafter tensor"
    else:
        match = "does not exist"
    out = tmp_path / "x.ninfer"
    with pytest.raises(ConvertError, match=match):
        convert_checkpoint(tmp_path / "ckpt", out, progress=False, dflash_dir=d)
    assert not out.exists()


def test_an_artifact_without_a_drafter_refuses_dflash(tmp_path):
    from ninfer import Engine
    write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", tied=True)
    out = tmp_path / "plain.ninfer"
    convert_checkpoint(tmp_path / "ckpt", out, progress=False)
    with pytest.raises(ArtifactError, match="carries no DFlash drafter"):
        Engine(out, speculative="dflash")


# ---- speculative='dflash' through the Engine ------------------------------------------------------

from ninfer import Engine, SamplingParams                                      # noqa: E402
from test_speculative import (SEEDED, _generate, _id_prompts, _rolled_back,    # noqa: E402,F401
                              rollback)


def test_a_random_drafter_changes_nothing_greedy_and_seeded(tiny, rollback):
    """A drafter that almost never agrees (random weights, 96 ids): the tokens of plain decoding
    at B = 8, greedy and seeded, whichever way rejected drafts are rolled back; every decode unit
    verified a whole block's drafts."""
    path, _ = tiny
    for sampling in ({}, SEEDED):
        params = [SamplingParams(max_tokens=12, ignore_eos=True, **dict(sampling, seed=i))
                  if sampling else SamplingParams(max_tokens=12, ignore_eos=True)
                  for i in range(8)]
        want, _ = _generate(path, _id_prompts(), params, max_concurrency=1)
        got, stats = _generate(path, _id_prompts(), params, max_concurrency=8,
                               speculative="dflash", draft_policy="fixed")
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert stats["spec_num_draft_tokens"] == 4          # the default: block_size - 1
        assert stats["spec_draft_tokens"] >= 8 * 4 * 8
        assert _rolled_back(stats, rollback, mtp=False) > 0


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, ignore_eos=True),
                                    SamplingParams(max_tokens=40, ignore_eos=True, **SEEDED)],
                         ids=["greedy", "seeded"])
def test_plain_steps_feed_the_drafter_its_features_as_units_would(tiny, monkeypatch, params):
    """A k = 0 unit as a plain decode step (a backend whose token steps keep their rows' feed,
    CUDA's: launch_tokens(keep_hidden=True, hidden_layers=...) hands the DFlash features of
    the position each row ran): the random drafter's drafts after units at k = 0, 0, 2 in turn
    are the same as when those k = 0 units run through the speculator, and the tokens are
    plain decoding's (test_speculative.py's test, with this drafter)."""
    from test_speculative import plain_steps_against_units
    plain_steps_against_units(monkeypatch, tiny[0], "dflash", params)


def test_num_draft_tokens_is_checked_against_the_block(tiny):
    path, _ = tiny
    with pytest.raises(RequestError, match="block of 5 drafts at most 4"):
        Engine(path, speculative="dflash", num_draft_tokens=5)
    with Engine(path, speculative="dflash", num_draft_tokens=2, draft_policy="fixed") as engine:
        engine.generate(_id_prompts()[2], SamplingParams(max_tokens=6, ignore_eos=True))
        assert engine.stats()["spec_num_draft_tokens"] == 2
    with pytest.raises(RequestError, match=r"num_draft_tokens=16: must be an integer in 1..15"):
        Engine(path, speculative="dflash", num_draft_tokens=16)


# ---- the trained reference drafters ------------------------------------------------------------------

from ninfer.demo import ensure_reference_artifact                             # noqa: E402
from test_speculative import PROMPTS                                          # noqa: E402


@pytest.fixture(scope="module", params=["dense", "moe"])
def ref(request):
    return ensure_reference_artifact(request.param)


def test_the_reference_artifacts_carry_their_drafter(ref):
    with Artifact(ref) as art:
        assert "dflash" in art.manifest["components"]
        cfg = NumpyModel.from_artifact(art).config.dflash
    assert cfg.block_size == 8 and cfg.mask_token_id == 248045       # <|im_start|>


def test_every_draft_is_what_the_drafter_gives_from_the_whole_context(monkeypatch):
    """The speculator's feed and anchors against a direct run: each unit's drafts (recorded with
    its frontier F and the row's tokens) equal those of a fresh drafter fed the target's features
    of tokens 0 .. F-1 in one call, anchored at token F. Catches a feed at the wrong positions,
    from the wrong layers, a stale or missing feed (after the LAG_TOKENS queue, pauses), a wrong
    anchor: errors the exactness tests cannot see (they only cost acceptance)."""
    from ninfer.models.qwen3_5.program import speculative
    path = ensure_reference_artifact("dense")
    seen = []
    original = speculative._BlockProposer.propose

    def propose(self, prog, seqs, ks, guide):
        drafts = original(self, prog, seqs, ks, guide)
        for r, d in drafts.items():
            F = seqs[r].num_computed_tokens
            seen.append((prog.token_ids(seqs[r], 0, F + 1).copy(), d.copy()))
        return drafts
    monkeypatch.setattr(speculative._BlockProposer, "propose", propose)
    monkeypatch.setattr(speculative, "LAG_TOKENS", 5)       # queued feeds in several calls
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    _generate(path, PROMPTS[:3], params, max_concurrency=3, speculative="dflash",
              draft_policy="fixed", max_context=64, page_size=8, num_kv_pages=16,
              prefill_chunk=16)
    assert len(seen) > 20
    with Artifact(path) as art:
        model = NumpyModel.from_artifact(art)
        drafter = DFlashDrafter.from_artifact(art, model)
    for tokens, drafts in seen[::3]:
        F = len(tokens) - 1
        pages = -(-F // 8) + 1
        batch = ForwardBatch(tokens[:F].astype(np.int32), ForwardBatch.text_positions([0], [F]),
                             np.array([0, F], np.int32), np.array([0], np.int32),
                             np.arange(pages, dtype=np.int32)[None], np.array([0], np.int32))
        _, feats = model.verify_forward(batch, model.new_kv_pool(pages, 8),
                                        model.new_state_pool(1), [F - 1],
                                        hidden_layers=drafter.hidden_layers)
        kv = drafter.new_kv_pool(pages, 8)
        drafter.feed(batch, feats, kv)
        g = drafter.draft_hidden(kv, [tokens[F]], [F], batch.block_tables)
        assert drafter.draft_argmax(g[0, :len(drafts)]).tolist() == drafts.tolist()


def test_the_cli_runs_dflash_and_refuses_a_block_overrun_in_one_line(capsys):
    from ninfer.cli import main
    path = str(ensure_reference_artifact("dense"))
    assert main(["run", path, "--prompt", "def main():", "--max-new", "12",
                 "--speculative", "dflash", "--max-context", "128"]) == 0
    assert capsys.readouterr().out.strip()
    rc = main(["run", path, "--prompt", "x", "--max-context", "64", "--speculative", "dflash",
               "--draft-tokens", "9", "--backend", "numpy"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("ninfer: error:"), err
    assert "block of 8 drafts at most 7" in err[0]
