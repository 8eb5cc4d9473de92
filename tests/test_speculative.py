"""Speculative decoding with the MTP head (issue 15; program/speculative.py), numpy backend; the
reference models' tests run with their DFlash drafter too (DRAFTERS; tests/test_dflash.py).

The contract: the tokens are the ones the Engine gives without speculation, for greedy and for
seeded sampling, alone and batched, through Snapshot and Replay pauses, with stop strings,
grammars and penalties; only the speed changes. On the trained reference models (a real MTP head,
acceptance 0.4-0.9) and on two constructed extremes of a tiny random model: an MTP head that never
agrees with the target (acceptance 0) and one that always does (acceptance 1). Seeded sampling:
the token distribution of a verified position against the exact one (chi-square)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time

import ml_dtypes
import numpy as np
import pytest

from ckpt_helpers import TINY_TEXT, write_checkpoint
from ninfer import Engine, SamplingParams
from ninfer.api import StructuredOutput
from ninfer.artifact import Artifact
from ninfer.demo import ensure_reference_artifact
from ninfer.errors import ArtifactError, RequestError
from ninfer.models.qwen3_5.model import NumpyModel, head_product
from ninfer.models.qwen3_5.mtp import MtpDrafter
from ninfer.models.qwen3_5.program import Program, RowDecision, SamplingSpec, speculative
from ninfer.models.qwen3_5.program.sampling import filtered_probs, sample_row
from ninfer.options import EngineOptions

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["import os\n\ndef main():\n", "class Parser:\n    def __init__(self", "# utils\n",
           "for i in range(", "def _check(x):\n    if not", "import sys\nimport re\n\n",
           "    return self.", "try:\n    import"]
SEEDED = dict(temperature=0.8, top_p=0.95, seed=11)
# the drafters the reference models carry: the MTP head, and the DFlash block drafter
# (tests/test_dflash.py holds DFlash's own math); the cycle and its contract are the same
DRAFTERS = ["mtp", "dflash"]


def _generate(path, prompts, params, **engine_kw):
    """Token ids (and the Engine's stats) of prompts submitted together."""
    with Engine(path, **engine_kw) as engine:
        handles = [engine.submit(p, params[i] if isinstance(params, list) else params,
                                 enable_thinking=False) for i, p in enumerate(prompts)]
        results = [h.result(timeout=300) for h in handles]
        return results, engine.stats()


# ---- the trained reference models --------------------------------------------------------------

@pytest.fixture(scope="module", params=["dense", "moe"])
def ref(request):
    return ensure_reference_artifact(request.param)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_equals_plain_decoding_alone_and_8_concurrent(ref, drafter):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want, _ = _generate(ref, PROMPTS, params, max_concurrency=8)
    got, stats = _generate(ref, PROMPTS, params, max_concurrency=8, speculative=drafter,
                           num_draft_tokens=3)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    for k in (1, 4):                                         # alone, the extreme draft lengths
        alone, stats = _generate(ref, PROMPTS[:1], params, max_concurrency=1,
                                 speculative=drafter, num_draft_tokens=k)
        assert [r.token_ids for r in alone] == [r.token_ids for r in want[:1]]
        assert len(stats["spec_acceptance_by_position"]) == k


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_seeded_equals_plain_sampling_at_batch_1_and_4(rollback, drafter):
    ref = ensure_reference_artifact("dense")
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **{**SEEDED, "seed": 50 + i})
              for i in range(4)]
    want, _ = _generate(ref, PROMPTS[:4], params, max_concurrency=1)
    for b in (1, 4):
        got, stats = _generate(ref, PROMPTS[:4], params, max_concurrency=b, speculative=drafter,
                               num_draft_tokens=3)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert stats["spec_verify_rows"] > 0
        if drafter == "mtp":
            assert (stats["spec_drafts_behind_verify"] > 0) == \
                (rollback == "drafts-behind-verify"), stats


def test_drafts_behind_the_verify_at_the_edge_of_pages_and_context(monkeypatch):
    """The chain behind a verify writes drafter KV up to F + k + steps: near max_context and
    with few free pages its steps shrink to what the rows' pages (taken then, returned by the
    trim) and the context allow, and the next unit drafts the rest itself; through pauses the
    drafts kept for a row are dropped with it. Tokens equal plain decoding's."""
    path = ensure_reference_artifact("dense")
    params = [SamplingParams(max_tokens=26, ignore_eos=True),
              SamplingParams(max_tokens=26, ignore_eos=True, **SEEDED)] * 2
    want, _ = _generate(path, PROMPTS[:4], params, max_concurrency=1, max_context=48)
    _device_steps(monkeypatch, plain=True)
    monkeypatch.setattr(MtpDrafter, "drafts_in_verify", True)
    tails, plan = [], speculative.Speculator._tail_plan

    def tail_plan(self, *args):
        steps = plan(self, *args)
        if steps is not None:
            tails.append((self._chosen - 1, steps))     # (steps wanted, steps taken)
        return steps
    monkeypatch.setattr(speculative.Speculator, "_tail_plan", tail_plan)
    got, stats = _generate(path, PROMPTS[:4], params, max_concurrency=4, max_context=48,
                           page_size=8, num_kv_pages=10, prefill_chunk=8,
                           speculative="mtp", num_draft_tokens=4, draft_policy="fixed")
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats["pauses"] > 0 and stats["spec_drafts_behind_verify"] > 0, stats
    assert any(taken < wanted for wanted, taken in tails), tails
    assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_drafts_made_behind_the_verify_are_the_drafts_made_before_it(monkeypatch, batch):
    """The drafts a verify makes behind itself for the next unit (mtp.verify_and_draft: the
    feed over the verify's positions with its picks, d_1 at the last produced one, the chain
    after it) are the ones the next unit would draft itself (feed, then chain): the same
    tokens, and the same acceptance at every draft position, on the dense reference model at
    fixed k = 3, greedy and seeded (the Engine cuts the last unit of each request short at
    max_tokens: the row's drafts are made again there)."""
    ref = ensure_reference_artifact("dense")
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **({} if i % 2 else SEEDED))
              for i in range(4)]
    _device_steps(monkeypatch, plain=True)
    runs = {}
    for behind in (False, True):
        monkeypatch.setattr(MtpDrafter, "drafts_in_verify", behind)
        runs[behind] = _generate(ref, PROMPTS[:4], params, max_concurrency=batch,
                                 speculative="mtp", num_draft_tokens=3, draft_policy="fixed")
    (before, s0), (behind, s1) = runs[False], runs[True]
    assert [r.token_ids for r in behind] == [r.token_ids for r in before]
    assert s0["spec_drafts_behind_verify"] == 0 and s1["spec_drafts_behind_verify"] > 10, s1
    assert s1["spec_accepted_tokens"] > 0
    for key in ("spec_drafted_by_position", "spec_accepted_by_position", "spec_verify_rows"):
        assert s1[key] == s0[key], (key, s0[key], s1[key])


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("snapshot_bytes", [0, 64 << 20], ids=["replay", "snapshot"])
def test_equal_through_pauses(snapshot_bytes, drafter):
    path = ensure_reference_artifact("dense")
    params = [SamplingParams(max_tokens=26, ignore_eos=True),
              SamplingParams(max_tokens=26, ignore_eos=True, **SEEDED)] * 2
    want, _ = _generate(path, PROMPTS[:4], params, max_concurrency=1)
    got, stats = _generate(path, PROMPTS[:4], params, max_concurrency=4, max_context=48,
                           page_size=8, num_kv_pages=10, prefill_chunk=8,
                           host_snapshot_bytes=snapshot_bytes, speculative=drafter,
                           num_draft_tokens=4)
    assert stats["pauses"] > 0 and stats["spec_accepted_tokens"] > 0
    assert (stats["snapshot_resumes"] > 0) == (snapshot_bytes > 0)
    assert (stats["replay_resumes"] > 0) == (snapshot_bytes == 0)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_penalties_bias_logprobs_and_max_tokens_apply_per_verified_position(rollback, drafter):
    path = ensure_reference_artifact("dense")
    cases = [SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.3, logprobs=2),
             SamplingParams(max_tokens=7, ignore_eos=True, logit_bias={220: 3.0}, **SEEDED),
             SamplingParams(max_tokens=14, min_tokens=10, logit_bias={248044: 8.0})]
    for params in cases:
        want, _ = _generate(path, PROMPTS[:1], params, max_concurrency=1)
        got, _ = _generate(path, PROMPTS[:1], params, max_concurrency=1, speculative=drafter,
                           num_draft_tokens=4)
        assert got[0].token_ids == want[0].token_ids and got[0].text == want[0].text
        assert got[0].finish_reason == want[0].finish_reason
        assert len(got[0].token_ids) <= params.max_tokens
        if params.logprobs:
            assert [(lp.token_id, round(lp.logprob, 4)) for lp in got[0].logprobs] == \
                [(lp.token_id, round(lp.logprob, 4)) for lp in want[0].logprobs]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_stop_string_ends_the_output_where_plain_decoding_does(drafter):
    path = ensure_reference_artifact("dense")
    free, _ = _generate(path, PROMPTS[:1], SamplingParams(max_tokens=20, ignore_eos=True),
                        max_concurrency=1)
    stop = free[0].text[12:15]
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop])
    want, _ = _generate(path, PROMPTS[:1], params, max_concurrency=1)
    got, _ = _generate(path, PROMPTS[:1], params, max_concurrency=1, speculative=drafter,
                       num_draft_tokens=4)
    assert want[0].finish_reason == "stop" and want[0].stop_sequence == stop
    assert (got[0].token_ids, got[0].text, got[0].finish_reason) == \
        (want[0].token_ids, want[0].text, want[0].finish_reason)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_thinking_budget_stops_verification_where_the_control_unit_takes_over(drafter):
    path = ensure_reference_artifact("dense")
    messages = [{"role": "user", "content": "def main():"}]
    params = SamplingParams(max_tokens=24, ignore_eos=True, thinking_budget=6)
    with Engine(path, max_concurrency=1) as engine:
        want = engine.generate(messages, params, enable_thinking=True)
    with Engine(path, max_concurrency=1, speculative=drafter, num_draft_tokens=4) as engine:
        got = engine.generate(messages, params, enable_thinking=True)
        assert engine.stats()["spec_verify_rows"] > 0
    assert "</think>" in engine.detokenize(want.token_ids)
    assert (got.token_ids, got.reasoning_text, got.text) == \
        (want.token_ids, want.reasoning_text, want.text)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z_]{1,10}$"}, "n": {"type": "integer"}},
    "required": ["name", "n"], "additionalProperties": False}


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_grammar_masks_apply_at_every_verified_position(sampling, rollback, drafter):
    path = ensure_reference_artifact("dense")
    params = SamplingParams(max_tokens=40, structured=StructuredOutput("json_schema", SCHEMA),
                            **sampling)
    want, _ = _generate(path, PROMPTS[:2], params, max_concurrency=2)
    got, stats = _generate(path, PROMPTS[:2], params, max_concurrency=2, speculative=drafter,
                           num_draft_tokens=3)
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        if g.finish_reason == "stop":
            assert set(json.loads(g.text)) == {"name", "n"}
    assert stats["spec_verify_rows"] > 0


# ---- refusals ----------------------------------------------------------------------------------

def test_bad_options_are_refused_with_a_clear_error(tmp_path):
    for kw, words in [(dict(speculative="eagle"), "'mtp'"),
                      (dict(speculative="mtp", num_draft_tokens=0), "1..4"),
                      (dict(speculative="mtp", num_draft_tokens=5), "1..4"),
                      (dict(speculative="mtp", draft_vocab=0), "draft_vocab"),
                      (dict(speculative="mtp", draft_vocab=2.5), "draft_vocab"),
                      (dict(speculative="mtp", draft_head="fp4"), "draft_head")]:
        with pytest.raises(RequestError, match=words):
            EngineOptions.from_kwargs(**kw)
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", mtp=False)
    art = _convert(ckpt.path, tmp_path / "nomtp.ninfer")
    with pytest.raises(ArtifactError, match="needs the checkpoint's MTP head"):
        Engine(art, speculative="mtp")


# ---- constructed extremes on a tiny random model -----------------------------------------------

H, V = TINY_TEXT["hidden_size"], TINY_TEXT["vocab_size"]
BF16 = ml_dtypes.bfloat16


def _convert(ckpt_dir, out):
    from ninfer.convert import convert_checkpoint
    convert_checkpoint(ckpt_dir, out, progress=False)
    return out


def _zeros(*shape):
    return np.zeros(shape, BF16)


def _never_agree(tmp_path):
    """MTP norm weight -1: its hidden is 0, every draft logit 0, the draft id 0; the target's
    lm_head row 0 is 0, so its logit 0 never is the argmax while another logit is positive."""
    rng = np.random.default_rng(3)
    lm_head = rng.standard_normal((V, H)).astype(BF16)
    lm_head[0] = 0
    ckpt = write_checkpoint(tmp_path / "never", "Qwen3_5ForCausalLM", mtp=True, replace={
        "lm_head.weight": lm_head, "mtp.norm.weight": np.full(H, -1.0, BF16)})
    return _convert(ckpt.path, tmp_path / "never.ninfer")


def _always_agree(tmp_path):
    """Every mixer and MLP writes 0, so the target's next token is f(x) = argmax(lm_head .
    norm(embed(x))). The MTP head passes norm(embed(x_{t+1})) through (fc = [I 0], its layer
    writing 0) to the same final norm: it predicts f of the token it reads, always right."""
    text = dict(TINY_TEXT, mtp_num_hidden_layers=1)
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(4)]
    norm = (np.random.default_rng(4).standard_normal(H) * 0.3).astype(BF16)
    replace = {"model.norm.weight": norm, "mtp.norm.weight": norm,
               "mtp.fc.weight": np.concatenate([np.eye(H), np.zeros((H, H))], 1).astype(BF16),
               "mtp.pre_fc_norm_embedding.weight": _zeros(H),
               "mtp.layers.0.self_attn.o_proj.weight": _zeros(H, text["num_attention_heads"]
                                                              * text["head_dim"]),
               "mtp.layers.0.mlp.down_proj.weight": _zeros(H, text["intermediate_size"])}
    for i, kind in enumerate(types):
        p = f"model.layers.{i}."
        replace[p + "mlp.down_proj.weight"] = _zeros(H, text["intermediate_size"])
        if kind == "full_attention":
            replace[p + "self_attn.o_proj.weight"] = _zeros(H, text["num_attention_heads"]
                                                             * text["head_dim"])
        else:
            replace[p + "linear_attn.out_proj.weight"] = _zeros(
                H, text["linear_num_value_heads"] * text["linear_value_head_dim"])
    ckpt = write_checkpoint(tmp_path / "always", "Qwen3_5ForCausalLM", mtp=True, replace=replace)
    return _convert(ckpt.path, tmp_path / "always.ninfer")


@pytest.fixture(scope="module")
def extremes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec_extremes")
    return {"never": _never_agree(tmp), "always": _always_agree(tmp), "random": _random(tmp)}


def _random(tmp_path):
    ckpt = write_checkpoint(tmp_path / "random", "Qwen3_5ForCausalLM", mtp=True, seed=9)
    return _convert(ckpt.path, tmp_path / "random.ninfer")


def _id_prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, V - 1, n).astype(np.int32) for n in (1, 5, 12, 30, 3, 17, 8, 2)]


# ---- rollback by State snapshot (the CUDA model's way) on the numpy model ----------------------

_numpy_verify = NumpyModel.verify_forward


def _verify_with_snapshots(self, batch, kv, state, out_rows, *, snap_base=None, media=None,
                           hidden_layers=None):
    """verify_forward as a model with verify_snapshots gives it (CUDA, cuda_model.py): the
    batch's logits and hidden states, and row r's State after each of its tokens i in slot
    snap_base[r] + i. Here: the batch as the numpy model runs it, then each snapshot row's
    tokens again one by one from its State before the batch (writing its slots), and its State
    after the batch put back."""
    if snap_base is None:
        return _numpy_verify(self, batch, kv, state, out_rows, media=media,
                             hidden_layers=hidden_layers)
    rows = [r for r, b in enumerate(snap_base) if b >= 0]
    slots = np.asarray(batch.state_slots)
    before = {r: state.read(int(slots[r])) for r in rows}
    out = _numpy_verify(self, batch, kv, state, out_rows, media=media, hidden_layers=hidden_layers)
    qs, ctx = np.asarray(batch.query_start), np.asarray(batch.context_lens)
    for r in rows:
        slot, after = int(slots[r]), state.read(int(slots[r]))
        state.write(slot, before[r])
        for i in range(qs[r + 1] - qs[r]):
            self.final_hidden(type(batch).single(batch.token_ids[qs[r] + i:qs[r] + i + 1],
                                                 int(ctx[r]) + i, batch.block_tables[r], slot),
                              kv, state)
            state.copy(slot, int(snap_base[r]) + i)
        state.write(slot, after)
    return out


def _verify_tokens(self, batch, kv, state, out_rows, rows, *, snap_base=None, media=None,
                   hidden_layers=None):
    """verify_tokens as a backend that samples on the device gives it (CUDA): each out row's
    token from its SampleRow (the host sampler's sample_row over the same arguments: what the
    device sampler matches), argmax where None."""
    logits, hidden = self.verify_forward(batch, kv, state, out_rows, snap_base=snap_base,
                                         media=media, hidden_layers=hidden_layers)
    tokens = [int(np.argmax(lg)) if row is None else
              sample_row(lg, row.spec, row.prompt_ids, row.generated_ids, position=row.position,
                         mask=row.mask)[0]
              for lg, row in zip(logits, rows)]
    return np.asarray(tokens, np.int32), hidden


class _DeviceSampler:
    """What packing.device_path reads of a backend with a device sampler."""
    greedy_on_device, samples_on_device = False, True


class _HiddenStep:
    """A token step done at launch that kept its rows' hidden states (CudaModel's TokenStep)."""

    def __init__(self, ids, hidden):
        self._ids, self._hidden = ids, hidden

    def collect(self):
        return self._ids

    def hidden(self):
        return self._hidden


def _launch_tokens(self, batch, kv, state, rows=None, *, after=None, keep_hidden=False,
                   hidden_layers=None):
    """launch_tokens as CUDA's device token paths give it (done at launch here): the ids of
    `after` fed as this batch's tokens (the pipelined decode), each row's token argmax or
    sampled from its SampleRow, and with keep_hidden the rows' final-normed hidden states (with
    hidden_layers, a DFlash drafter's features)."""
    if after is not None:
        batch.token_ids[:] = after.collect()
    ends = np.asarray(batch.query_start[1:], np.int64) - 1
    if hidden_layers is None:
        last = self.final_hidden(batch, kv, state)[ends]
        logits = head_product(last, self._lm_head)
    else:
        logits, features = _numpy_verify(self, batch, kv, state, ends.astype(np.int32),
                                         hidden_layers=hidden_layers)
        last = features[ends]
    rows = rows if rows is not None else [None] * len(last)
    ids = np.asarray([int(np.argmax(lg)) if row is None else
                      sample_row(lg, row.spec, row.prompt_ids, row.generated_ids,
                                 position=row.position, mask=row.mask)[0]
                      for lg, row in zip(logits, rows)], np.int32)
    return _HiddenStep(ids, last.copy() if keep_hidden else None)


def _device_steps(monkeypatch, plain: bool) -> None:
    """The numpy model as CUDA's: snapshot rollback, device sampling of every verify position,
    and (plain) device token steps that keep their hidden states, chained ahead."""
    monkeypatch.setattr(NumpyModel, "verify_snapshots", True)
    monkeypatch.setattr(NumpyModel, "verify_forward", _verify_with_snapshots)
    monkeypatch.setattr(NumpyModel, "verify_tokens", _verify_tokens, raising=False)
    monkeypatch.setattr(NumpyModel, "launch_tokens", _launch_tokens, raising=False)
    for flag in ("greedy_on_device", "samples_on_device", "chains_token_steps"):
        monkeypatch.setattr(NumpyModel, flag, True)
    monkeypatch.setattr(NumpyModel, "step_hidden", plain)


@pytest.fixture(params=["recompute", "snapshot", "snapshot-device-sampling", "plain-steps",
                        "drafts-behind-verify"])
def rollback(request, monkeypatch):
    """How a verify row that rejected a draft gets its State back: recompute (numpy's way) or
    the snapshot slot after its last accepted token (CUDA's way: a model with
    verify_snapshots; the speculator then takes no State backup and runs nothing again); and
    CUDA's whole way, each verify position sampled by the backend (verify_tokens) from the
    SampleRow the speculator builds for it; and with it the plain steps a k = 0 unit runs as
    (device token paths that keep the rows' hidden states, launched ahead: runs_plain), for
    plain decoding too."""
    if request.param != "recompute":
        monkeypatch.setattr(NumpyModel, "verify_snapshots", True)
        monkeypatch.setattr(NumpyModel, "verify_forward", _verify_with_snapshots)
    if request.param == "snapshot-device-sampling":
        from ninfer.models.qwen3_5.program import packing
        monkeypatch.setattr(NumpyModel, "verify_tokens", _verify_tokens, raising=False)
        monkeypatch.setattr(Program, "samples_on_device", lambda self, seqs, units, masks:
                            packing.device_path(_DeviceSampler, seqs, units, masks) is not None)
    if request.param in ("plain-steps", "drafts-behind-verify"):
        _device_steps(monkeypatch, plain=True)
    if request.param == "drafts-behind-verify":
        # CUDA's whole way: a unit whose every row drafted runs the drafter's feed and the
        # next unit's drafts behind its verify (mtp.verify_and_draft: the host calls the
        # device's one call stands for)
        monkeypatch.setattr(MtpDrafter, "drafts_in_verify", True)
    return request.param


def _rolled_back(stats, rollback, mtp: bool = True) -> int:
    """Verify rows whose State went back to an accepted prefix, the one way `rollback` allows
    (and with drafts-behind-verify, an MTP drafter took that way; a DFlash drafter never)."""
    assert (stats["spec_drafts_behind_verify"] > 0) == \
        (mtp and rollback == "drafts-behind-verify"), stats
    if rollback != "recompute":
        assert stats["spec_recompute_rows"] == 0, stats
        return stats["spec_snapshot_selects"]
    assert stats["spec_snapshot_selects"] == 0, stats
    return stats["spec_recompute_rows"]


def test_an_mtp_head_that_never_agrees_changes_nothing(extremes, rollback):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want, _ = _generate(extremes["never"], _id_prompts(), params, max_concurrency=8)
    got, stats = _generate(extremes["never"], _id_prompts(), params, max_concurrency=8,
                           speculative="mtp", num_draft_tokens=4, draft_policy="fixed")
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats["spec_draft_tokens"] >= 8 * 4 * 10       # every decode step verified 4 drafts
    assert stats["spec_accepted_tokens"] == 0
    assert stats["spec_acceptance_by_position"] == [0.0] * 4
    # each verify rolled back (the one whose request ended there too: its State is not read)
    assert _rolled_back(stats, rollback) == stats["spec_verify_rows"]


@pytest.mark.parametrize("plain_steps", [False, True], ids=["speculator", "plain-steps"])
def test_adaptive_k_stops_drafting_for_a_head_that_never_agrees(extremes, monkeypatch,
                                                                 plain_steps):
    # the default policy measures k = 0, 1, ... once (up to the first k that costs max_k + 1
    # plain steps: no deeper k could pay), then runs plain decoding (k = 0) but for a
    # neighbour every EXPLORE_EVERY units or more: numpy verifies cost ~k + 1 steps and nothing
    # is accepted. (The 8 rows enter decoding one unit after another: the cold start waits for
    # a B that stays, draft_policy.COLD_START_STREAK.) plain_steps: a backend
    # whose token steps keep their hidden states (Model.step_hidden: CUDA) runs the k = 0 units
    # as the Program's plain decode steps, launched ahead as without speculation (runs_plain,
    # runs_plain_ahead)
    if plain_steps:
        _device_steps(monkeypatch, plain=True)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    want, _ = _generate(extremes["never"], _id_prompts(), params, max_concurrency=8)
    got, stats = _generate(extremes["never"], _id_prompts(), params, max_concurrency=8,
                           speculative="mtp", num_draft_tokens=4)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    units = stats["spec_units_by_k"]
    assert stats["spec_adaptive"] and len(units) == 5 and units[1] >= 1     # k = 1 measured
    assert units[0] >= 3 * sum(units[1:]), units
    assert stats["spec_accepted_tokens"] == 0
    assert stats["spec_expected_tokens_by_k"][1] < 1.2
    if plain_steps:
        assert stats["spec_plain_steps"] >= units[0] // 2 and stats["spec_plain_ahead"] > 0
    else:
        assert stats["spec_plain_steps"] == 0


@pytest.mark.parametrize("k", [1, 3])
def test_an_mtp_head_that_always_agrees_is_accepted_in_full(extremes, k):
    # 1 token from prefill, then cycles of k + 1: max_tokens ends exactly on a cycle
    params = SamplingParams(max_tokens=1 + 5 * (k + 1), ignore_eos=True)
    want, _ = _generate(extremes["always"], _id_prompts(), params, max_concurrency=8)
    got, stats = _generate(extremes["always"], _id_prompts(), params, max_concurrency=8,
                           speculative="mtp", num_draft_tokens=k, draft_policy="fixed")
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats["spec_verify_rows"] == 8 * 5                 # k + 1 tokens per verify
    assert stats["spec_draft_tokens"] == stats["spec_accepted_tokens"] == 8 * 5 * k
    assert stats["spec_acceptance_by_position"] == [1.0] * k
    assert stats["spec_recompute_rows"] == 0


def test_drafts_come_from_the_first_draft_vocab_ids(extremes):
    """EngineOptions.draft_vocab = n: a head that always agrees with the target drafts the
    argmax over the first n ids only, so a target token past them is never a draft: the output
    is plain decoding's, and the accepted drafts are at most the output tokens below n (the
    whole vocabulary accepts every draft: the test above)."""
    params = SamplingParams(max_tokens=1 + 5 * 4, ignore_eos=True)
    want, _ = _generate(extremes["always"], _id_prompts(), params, max_concurrency=8)
    outs = [np.asarray(r.token_ids) for r in want]
    n = int(np.median(np.concatenate([o[1:] for o in outs])))    # about half the tokens past it
    got, stats = _generate(extremes["always"], _id_prompts(), params, max_concurrency=8,
                           speculative="mtp", num_draft_tokens=3, draft_policy="fixed",
                           draft_vocab=n)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    below = sum(int((o[1:] < n).sum()) for o in outs)
    assert 0 < stats["spec_accepted_tokens"] <= below < sum(len(o) - 1 for o in outs)
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_a_random_mtp_head_through_pauses_with_mixed_rows(extremes, rollback):
    """Partial acceptance, prefill chunks and Replay / Snapshot mixed with verify rows."""
    prompts = _id_prompts()
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **({} if i % 2 else SEEDED))
              for i in range(8)]
    want, _ = _generate(extremes["random"], prompts, params, max_concurrency=1)
    for snapshot_bytes in (0, 1 << 20):
        got, stats = _generate(extremes["random"], prompts, params, max_concurrency=8,
                               max_context=64, page_size=4, num_kv_pages=20, prefill_chunk=5,
                               host_snapshot_bytes=snapshot_bytes, speculative="mtp",
                               num_draft_tokens=2)
        assert stats["pauses"] > 0 and stats["spec_verify_rows"] > 0
        assert _rolled_back(stats, rollback) > 0
        assert [r.token_ids for r in got] == [r.token_ids for r in want]


# ---- the speculative-sampling rule: distribution of a verified position ------------------------

CHI2_ALPHA = 1e-3           # false-failure rate of the chi-square test at a fresh set of seeds
NUM_SAMPLES = 1200          # sequences sampled (8 per Program step), ~2 s on one core
SAMPLING = SamplingSpec(seed=0, temperature=1.0, top_k=3)


def _chi2_critical(df: int, alpha: float) -> float:
    """Upper alpha quantile of chi-square(df), Wilson-Hilferty (relative error < 1e-3 here)."""
    z = {1e-3: 3.090232}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _exact_pair_probs(model, prompt) -> dict:
    """{(t1, t2, t3): probability} of the first three sampled tokens, by enumeration through
    plain forwards (each history from scratch)."""
    def probs(ids):
        kv, state = model.new_kv_pool(8, 16), model.new_state_pool(1)
        from ninfer.models.qwen3_5.batch import ForwardBatch
        logits = model.forward(ForwardBatch.single(ids, 0, np.arange(8)), kv, state)[0]
        return filtered_probs(logits.astype(np.float64), SAMPLING)
    out = {}
    p1 = probs(prompt)
    for t1 in np.flatnonzero(p1):
        p2 = probs(np.append(prompt, t1))
        for t2 in np.flatnonzero(p2):
            p3 = probs(np.append(prompt, [t1, t2]))
            for t3 in np.flatnonzero(p3):
                out[(t1, t2, t3)] = p1[t1] * p2[t2] * p3[t3]
    return out


def _sample_triples(model, drafter, prompt, seeds) -> tuple:
    """The first three tokens of one seeded sequence per seed, 8 rows per Program."""
    triples, accepted = [], 0
    for i in range(0, len(seeds), 8):
        prog = Program(model, EngineOptions(max_concurrency=8, max_context=32,
                                            speculative="mtp", num_draft_tokens=2,
                                            draft_policy="fixed"),
                       drafter=drafter)
        sids = [prog.bind(prompt, dataclasses.replace(SAMPLING, seed=int(s)))
                for s in seeds[i:i + 8]]
        out = {s: [] for s in sids}
        while any(len(v) < 3 for v in out.values()):
            live = [s for s in sids if len(out[s]) < 3]
            assert prog.reserve_units(live) == [True] * len(live)
            pending = prog.execute(live)
            prog.commit(pending, [RowDecision(len(r.produced)) for r in pending.rows])
            for row in pending.rows:
                out[row.seq_id] += row.produced
        accepted += prog.stats()["spec_accepted_tokens"]
        triples += [tuple(int(t) for t in out[s][:3]) for s in sids]
        for s in sids:
            prog.release(s)
        prog.assert_all_free()
    return triples, accepted


def test_seeded_sampling_has_the_target_distribution(extremes):
    """Pearson chi-square of the (t1, t2, t3) counts against the exact target probabilities.
    t2 and t3 come out of verify rows (accepted drafts or their corrections), so a wrong
    acceptance rule or a misaligned verify position shows here. The 'always' model's drafts are
    the target's modes: accepted with probability p(mode) ~ 0.4-0.9, rejected otherwise."""
    with Artifact(extremes["always"]) as art:
        model = NumpyModel.from_artifact(art)
        drafter = MtpDrafter.from_artifact(art, model)
    prompt = np.array([5, 17, 42], np.int32)
    exact = _exact_pair_probs(model, prompt)
    triples, accepted = _sample_triples(model, drafter, prompt, np.arange(NUM_SAMPLES) + 1000)
    assert accepted > NUM_SAMPLES // 4           # the rule was exercised, not bypassed
    counts = {}
    for t in triples:
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(exact), "a triple the target cannot produce"
    # cells expected >= 5; the rest pooled into one
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * NUM_SAMPLES >= 5]
    rest_p = 1.0 - sum(exact[c] for c in big)
    observed = [counts.get(c, 0) for c in big] + [NUM_SAMPLES - sum(counts.get(c, 0) for c in big)]
    expected = [exact[c] * NUM_SAMPLES for c in big] + [rest_p * NUM_SAMPLES]
    if expected[-1] < 5:                         # too little pooled mass: fold it into the last
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    assert df >= 5
    assert stat < _chi2_critical(df, CHI2_ALPHA), (stat, df)


def test_metrics_report_drafts_and_acceptance_by_position(extremes):
    from falcon import testing
    from ninfer.serve import create_app
    with Engine(extremes["always"], max_concurrency=2, speculative="mtp",
                num_draft_tokens=2, draft_policy="fixed") as engine:
        engine.generate(_id_prompts()[2], SamplingParams(max_tokens=7, ignore_eos=True))
        stats = engine.stats()
        text = testing.TestClient(create_app(engine)).simulate_get("/metrics").text
    assert stats["spec_draft_tokens"] == stats["spec_accepted_tokens"] == 4    # 2 verifies
    lines = set(text.splitlines())
    assert "ninfer_spec_draft_tokens_total 4.0" in lines
    assert "ninfer_spec_accepted_tokens_total 4.0" in lines
    assert "ninfer_spec_emitted_tokens_total 6.0" in lines
    assert 'ninfer_spec_acceptance{position="1"} 1.0' in lines
    assert 'ninfer_spec_acceptance{position="2"} 1.0' in lines
    assert 'ninfer_spec_position_draft_tokens_total{position="2"} 2.0' in lines
    assert 'ninfer_spec_units_total{k="2"} 2.0' in lines                 # fixed: every unit k
    assert 'ninfer_spec_units_total{k="0"} 0.0' in lines


@pytest.mark.parametrize("flags, words", [
    (["--speculative", "mtp", "--draft-tokens", "9"], "num_draft_tokens=9: must be an integer in 1..4"),
    (["--speculative", "eagle"], "invalid choice: 'eagle'")])
def test_cli_refuses_bad_speculative_flags_in_one_line(flags, words, capsys):
    from ninfer.cli import main
    path = str(ensure_reference_artifact("dense"))
    with pytest.raises(SystemExit) if "eagle" in flags else contextlib.nullcontext():
        rc = main(["run", path, "--prompt", "x", "--max-context", "64", *flags])
        assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ninfer: error:") and words in err[0], err


@pytest.mark.parametrize("draft_vocab", [None, 41, V // 2])
def test_draft_argmax_equals_the_full_argmax(extremes, draft_vocab):
    """The reduced-vocabulary draft argmax (lm_head rows that are all zero skipped) against
    np.argmax of the logits of the first draft_vocab ids (EngineOptions.draft_vocab; None:
    every id): random hiddens, all live logits negative, ties at 0."""
    with Artifact(extremes["never"]) as art:
        model = NumpyModel.from_artifact(art)
        params = MtpDrafter.from_artifact(art, model).p
    rng = np.random.default_rng(0)
    u = rng.standard_normal(H).astype(np.float32)
    head = rng.standard_normal((V, H)).astype(np.float32)
    head[[0, 3, 40]] = 0
    negative = head.copy()
    negative[[i for i in range(V) if i not in (0, 3, 40)]] = -np.abs(rng.standard_normal(
        (V - 3, 1))).astype(np.float32) * u                 # every live logit -c * (h . u)
    n = V if draft_vocab is None else draft_vocab
    for lm_head in (head, negative):
        drafter = MtpDrafter(model.text, params, model._embed, lm_head, draft_vocab)
        assert drafter._head._ids is not None and len(drafter._head._ids) == n - 3
        hidden = np.concatenate([rng.standard_normal((40, H)), np.zeros((2, H)), u[None] * 2,
                                 (u - u @ u / (u @ u) * u)[None]]).astype(np.float32)
        want = np.argmax(hidden @ lm_head[:n].T, axis=1)
        assert drafter.draft_argmax(hidden).tolist() == want.tolist()
        assert drafter.logits(hidden).shape == (len(hidden), V)     # (logits: every id)
        if draft_vocab is not None and lm_head is head:    # (a draft past n was possible)
            assert (np.argmax(hidden @ lm_head.T, axis=1) >= n).any()


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_context_cache_checkpoints_carry_the_drafter_kv(drafter):
    """A second turn that starts from the first turn's checkpoint (its pages hold the MTP layer's
    KV too) drafts exactly what a cold start drafts: the same tokens and the same acceptance."""
    path = ensure_reference_artifact("dense")
    turn1 = [{"role": "user", "content": "import os\nimport sys\n\ndef main(argv):\n"}]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def two_turns(**kw):
        with Engine(path, max_concurrency=2, **kw) as engine:
            first = engine.generate(turn1, params, enable_thinking=False, session="s")
            turn2 = turn1 + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": "def f(x):"}]
            before = engine.stats()
            second = engine.generate(turn2, params, enable_thinking=False, session="s")
            after = engine.stats()
        accepted = np.subtract(after["spec_accepted_by_position"],
                               before["spec_accepted_by_position"]).tolist()
        return first.token_ids, second.token_ids, second.num_cached_tokens, accepted
    cold = two_turns(prefix_cache=False, speculative=drafter, num_draft_tokens=2,
                     draft_policy="fixed")
    warm = two_turns(speculative=drafter, num_draft_tokens=2, draft_policy="fixed")
    assert cold[2] == 0 and warm[2] > 0
    assert warm[:2] == cold[:2] and warm[3] == cold[3] and sum(warm[3]) > 0


@pytest.mark.parametrize("copy", ["snapshot", "continuation"])
def test_a_queued_drafter_feed_is_settled_before_the_pages_are_copied(monkeypatch, copy):
    """Plain steps (k = 0) queue the drafter's feed (speculative.LAG_TOKENS); a Snapshot pause or
    a kept continuation (a checkpoint) copies or keeps the row's pages with the MTP layer's KV
    complete: the values of a Program that fed the drafter after every step."""
    from ninfer.models.qwen3_5.program import speculative
    with Artifact(ensure_reference_artifact("dense")) as art:
        model = NumpyModel.from_artifact(art)
        drafter = MtpDrafter.from_artifact(art, model)
    prompt = np.asarray(np.arange(40, 60), np.int32)
    greedy = SamplingSpec.from_params(SamplingParams(max_tokens=100, ignore_eos=True), 0)

    def run(lag: int):
        monkeypatch.setattr(speculative, "LAG_TOKENS", lag)
        # pages of 4: the continuation's full pages [0, 28) cover decode positions 20..27
        prog = Program(model, EngineOptions(max_concurrency=1, max_context=64, page_size=4,
                                            speculative="mtp", num_draft_tokens=2),
                       drafter=drafter)
        prog.speculator.policy.choose = lambda rows, timed=True, row_ids=None: 0    # plain decoding only
        sid = prog.bind(prompt, greedy)
        for _ in range(12):                                     # the prefill, 11 plain steps
            assert prog.reserve_units([sid]) == [True]
            pending = prog.execute([sid])
            prog.commit(pending, [RowDecision(len(r.produced)) for r in pending.rows])
        frontier = prog.sequence(sid).num_computed_tokens
        queued = sum(len(c) for c in prog.speculator._lag.get(sid, (0, []))[1])
        if copy == "snapshot":
            kv = prog.pause(sid).kv_pages
        else:
            cid = prog.release(sid, keep_frontier=True)
            held = prog.checkpoints.entries[cid].pages
            assert len(held) * 4 > len(prompt)
            kv = prog.kv.read_pages(held)
        return frontier, queued, kv

    frontier, queued, eager = run(1)
    assert queued == 0 and frontier == len(prompt) + 11
    frontier_lazy, queued_lazy, lazy = run(1000)
    assert frontier_lazy == frontier and queued_lazy == frontier    # prefill and steps waited
    mtp_layer = -1                                              # the drafter's, joined last
    for got, want in zip(_kv_rows(lazy, mtp_layer, frontier), _kv_rows(eager, mtp_layer, frontier)):
        assert np.abs(want[len(prompt):]).max() > 0              # the decode positions written
        # float32 products of one row at a time against all at once round differently (BLAS
        # builds differ: up to 3e-6 absolute on values of ~3 seen); unsettled entries are 0
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _kv_rows(pages, layer, n):
    """The first n token positions of one layer's K and V in host page copies."""
    k, v = pages
    return (np.asarray(k[layer]).reshape(-1, *k[layer].shape[2:])[:n],
            np.asarray(v[layer]).reshape(-1, *v[layer].shape[2:])[:n])


def test_drafts_stay_within_each_rows_masks():
    """_Guide: a row without a mask takes the free argmax; a masked row the argmax within its mask
    (d_1 within the step's, d_j+1 within the one after d_1 .. d_j); its drafts stop where the
    masks end or allow nothing."""
    from types import SimpleNamespace
    from ninfer.models.qwen3_5.program.speculative import _Guide
    V = 10
    table = np.array([[9, 1, 2, 8, 0, 7, 3, 6, 5, 4]], np.float32)      # logits of any hidden

    def mask_of(*ids):
        m = np.zeros(V - 2, np.bool_)              # shorter than V: ids past it never allowed
        m[list(ids)] = True
        return m
    drafter = SimpleNamespace(logits=lambda g: np.repeat(table, len(g), 0))
    seqs = [SimpleNamespace(seq_id=s) for s in (10, 11, 12, 13)]
    later = {11: [mask_of(2, 6), mask_of(4, 6), mask_of(1)],   # after d_1, d_1 d_2, d_1..d_3
             12: [mask_of(1, 2)],                               # the output ends after d_2
             13: []}
    asked = []

    def draft_masks(seq_id, tokens):
        asked.append((seq_id, tokens))
        return later[seq_id][:len(tokens)]
    masks = [None, mask_of(5, 3), mask_of(0, 4), mask_of()]    # row 3: nothing allowed
    guide = _Guide(drafter, seqs, masks, draft_masks)
    g = np.zeros(4, np.float32)
    got = {r: [guide.pick(r, g, free=0) for _ in range(4)] for r in range(4)}
    assert got[0] == [0, 0, 0, 0]                  # no mask: the free argmax every time
    assert got[1] == [3, 6, 6, 1]                  # 3 (8 > 7), then 6, 6 and 1 within the masks
    assert guide.chosen[1] == [3, 6, 6, 1] and 1 not in guide.cut
    assert got[2][:2] == [0, 2] and guide.cut[2] == 2      # the masks end after two drafts
    assert guide.cut[3] == 0 and got[3] == [0] * 4
    assert (11, (3,)) in asked and (11, (3, 6, 6)) in asked


def test_drafts_within_the_grammar_are_accepted_far_more_often():
    """JSON-schema output on the dense reference model, greedy, k = 3: drafts picked within the
    grammar's masks were accepted at 0.54 / 0.42 / 0.29 by position when this landed (2.07 tokens
    per verify); unconstrained drafts, which the grammar then refused, at 0.14 / 0.04 / 0.00
    (1.18)."""
    path = ensure_reference_artifact("dense")
    params = SamplingParams(max_tokens=60, structured=StructuredOutput("json_schema", SCHEMA))
    want, _ = _generate(path, PROMPTS[:4], params, max_concurrency=4)
    got, stats = _generate(path, PROMPTS[:4], params, max_concurrency=4, speculative="mtp",
                           num_draft_tokens=3, draft_policy="fixed")
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert stats["spec_acceptance_by_position"][0] > 0.4
    assert stats["spec_emitted_tokens"] / stats["spec_verify_rows"] > 1.8


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, ignore_eos=True),
                                    SamplingParams(max_tokens=40, ignore_eos=True, **SEEDED)],
                         ids=["greedy", "seeded"])
def test_plain_steps_feed_the_drafter_what_speculative_units_would(extremes, monkeypatch,
                                                                  params):
    """The drafter fed through plain steps (after_plain: each row's hidden state of the
    position its step ran) drafts what it drafts when the same k = 0 units run through the
    speculator (execute: the hidden states of a verify-shaped forward): the policy here runs
    k = 0, 0, 2 in turn, and every draft of the random head, which reads its KV and the fed
    hidden states, is the same both ways (an off-by-one feed or a missed position changes
    them); the tokens are plain decoding's. (A DFlash drafter's features: test_dflash.py.)"""
    plain_steps_against_units(monkeypatch, extremes["random"], "mtp", params)


def plain_steps_against_units(monkeypatch, path, drafter: str, params) -> None:
    """The test above for `drafter` on the artifact at `path`. A DFlash drafter's block pass
    hidden states are compared too (a random drafter's argmax can be one token whatever it
    reads: the tiny one drafts its mask token)."""
    from ninfer.models.qwen3_5.dflash import DFlashDrafter
    from ninfer.models.qwen3_5.program.draft_policy import DraftPolicy
    turns = {}
    blocks = []
    block_pass = DFlashDrafter.draft

    def draft(self, *a, **kw):
        ids, g = block_pass(self, *a, with_hidden=True)
        blocks[-1].append(g.copy())
        return ids, g
    monkeypatch.setattr(DFlashDrafter, "draft", draft)

    def choose(self, rows, timed=True, row_ids=None):
        n = turns[id(self)] = turns.get(id(self), -1) + 1
        k = (0, 0, 2)[n % 3]
        self.units_by_k[k] += 1
        return k
    monkeypatch.setattr(DraftPolicy, "choose", choose)
    original = speculative.Speculator._draft
    drafted = []

    def _draft(self, *a):
        out = original(self, *a)
        drafted[-1].append({r: d.tolist() for r, d in out.items()})
        return out
    monkeypatch.setattr(speculative.Speculator, "_draft", _draft)
    runs = []
    for plain in (False, True):
        _device_steps(monkeypatch, plain)
        drafted.append([])
        blocks.append([])
        got, stats = _generate(path, _id_prompts()[:1], params, max_concurrency=1,
                               speculative=drafter, num_draft_tokens=2)
        runs.append(([r.token_ids for r in got], stats))
    (tokens0, stats0), (tokens1, stats1) = runs
    want, _ = _generate(path, _id_prompts()[:1], params, max_concurrency=1)
    assert tokens0 == tokens1 == [r.token_ids for r in want]
    assert stats0["spec_plain_steps"] == 0 and stats1["spec_plain_steps"] > 0
    assert stats1["spec_plain_ahead"] > 0
    real = [[d for d in unit if d] for unit in drafted]
    assert sum(len(u) for u in real[1]) >= 8 and real[0] == real[1]
    assert len(blocks[0]) == len(blocks[1]) == (len(real[1]) if drafter == "dflash" else 0)
    assert all(np.array_equal(a, b) for a, b in zip(*blocks))


def test_a_unit_costs_the_policy_the_time_between_two_commits():
    """Speculator._unit_seconds: a unit launched at t0 and committed at `now` costs the time
    since the last commit (the host's work before a speculative unit's launch is its cost too;
    a plain step launched ahead of the last commit overlapped it), unless the gap before its
    launch is longer than the unit itself (idle, paused, the first unit): then from t0."""
    spec = speculative.Speculator.__new__(speculative.Speculator)
    spec._last_commit = 10.0
    assert spec._unit_seconds(10.5, 12.0) == pytest.approx(2.0)     # 0.5 s of scheduling
    assert spec._unit_seconds(9.0, 12.0) == pytest.approx(2.0)      # launched ahead at 9
    assert spec._unit_seconds(15.0, 16.0) == pytest.approx(1.0)     # idle 5 s before it
    spec._last_commit = 0.0
    assert spec._unit_seconds(1e4, 1e4 + 0.25) == pytest.approx(0.25)   # the first unit


def test_a_units_one_off_work_is_not_its_cost(extremes, monkeypatch):
    """The one-off work done during a unit (Model.one_off_seconds grew: CUDA captured a graph or
    planned the GEMMs of a catch-up feed of a new length, seconds that are not the shape's cost)
    is taken out of the unit's time: the policy times every unit, and the cold start runs each k
    once (untimed, such units made it run a k up to three times, and an exploration after plain
    steps, whose catch-up feed is a new length, went untimed). Here every verify of a new
    (tokens, rows) shape sleeps ONE_OFF_S and counts that as one-off work; no cost the policy
    keeps may hold it. (The cold start's early stop is off: this head is never right, so the
    acceptance bound would end the cold start before k = 3 ran, and on numpy a verify of k + 1
    positions costs about k + 1 steps, so on a loaded host k = 2 could cost the max_k + 1 steps
    that end it too.)"""
    from ninfer.models.qwen3_5.program.draft_policy import DraftPolicy
    monkeypatch.setattr(DraftPolicy, "most_tokens", lambda self: float("inf"))
    ONE_OFF_S = 0.3
    seen, units = set(), []
    original = NumpyModel.verify_forward

    def verify_forward(self, batch, *a, **kw):
        shape = (int(batch.num_tokens), int(batch.num_rows))
        new = shape not in seen and batch.num_tokens > batch.num_rows      # a verify, drafts in
        seen.add(shape)
        if new:
            t0 = time.perf_counter()
            time.sleep(ONE_OFF_S)
            self.one_off_seconds = getattr(self, "one_off_seconds", 0.0) + \
                time.perf_counter() - t0
        units.append(new)
        return original(self, batch, *a, **kw)
    monkeypatch.setattr(NumpyModel, "verify_forward", verify_forward)
    timed = []
    observe = DraftPolicy.observe_unit
    monkeypatch.setattr(DraftPolicy, "observe_unit",
                        lambda self, rows, k, s, **kw: (timed.append((k, s)),
                                                        observe(self, rows, k, s, **kw)))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want, _ = _generate(extremes["never"], _id_prompts()[:1], params, max_concurrency=1)
    got, stats = _generate(extremes["never"], _id_prompts()[:1], params, max_concurrency=1,
                           speculative="mtp", num_draft_tokens=3)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    first_uses = sum(units)
    assert first_uses == 3                              # k = 3, 2, 1: one new shape each
    by_k = stats["spec_units_by_k"]
    assert len(timed) == sum(by_k), (timed, by_k)       # every unit timed
    assert sorted(set(k for k, _ in timed)) == [0, 1, 2, 3]
    # the cold start ran k = 2 and 3 once (with a head that is never right the best is k = 0,
    # whose explorations go to k = 1)
    assert by_k[2] == by_k[3] == 1, by_k
    assert stats["spec_units_first_use"] == first_uses
    assert stats["spec_first_use_seconds"] >= first_uses * ONE_OFF_S
    # no cost holds its unit's sleep (a numpy verify of the reference model: milliseconds)
    assert max(s for _, s in timed) < 0.8 * ONE_OFF_S, timed
    costs = stats["spec_unit_costs"]                    # what the policy saw, by B x k
    assert sum(n for n, _, _ in costs.values()) == len(timed)


def test_a_catch_up_feed_before_the_drafts_is_left_out_of_the_units_cost(extremes, monkeypatch):
    """The drafter's catch-up feed before a unit's drafts (the positions it missed: the prompt,
    plain units) is what switching to drafting costs once, not the unit's k: the unit's cost
    leaves it out and observe_unit's catch_up carries it to the measuring account (stats:
    spec_catch_up_units / _seconds). Here every catch-up feed sleeps CATCH_S."""
    from ninfer.models.qwen3_5.program.draft_policy import DraftPolicy
    monkeypatch.setattr(DraftPolicy, "most_tokens", lambda self: float("inf"))
    CATCH_S = 0.3
    feed = speculative._ChainProposer.feed

    def slow_feed(self, *a, **kw):
        time.sleep(CATCH_S)
        return feed(self, *a, **kw)
    monkeypatch.setattr(speculative._ChainProposer, "feed", slow_feed)
    observed = []
    observe = DraftPolicy.observe_unit

    def spy(self, rows, k, s, **kw):
        observed.append((k, s, kw.get("catch_up", 0.0)))
        observe(self, rows, k, s, **kw)
    monkeypatch.setattr(DraftPolicy, "observe_unit", spy)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want, _ = _generate(extremes["never"], _id_prompts()[:1], params, max_concurrency=1)
    got, stats = _generate(extremes["never"], _id_prompts()[:1], params, max_concurrency=1,
                           speculative="mtp", num_draft_tokens=3)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    caught = [c for _, _, c in observed if c > 0]
    assert caught and all(c >= CATCH_S for c in caught)
    assert stats["spec_catch_up_units"] == len(caught)
    assert stats["spec_catch_up_seconds"] >= len(caught) * CATCH_S
    # no unit's cost holds its catch-up's sleep (a numpy unit of the tiny model: milliseconds)
    assert max(s for _, s, _ in observed) < 0.8 * CATCH_S, observed


def test_units_with_other_rows_beside_are_counted_untimed(extremes, monkeypatch):
    """A unit the speculator runs with a prefill beside its decode rows is not timed for the
    policy (draft_policy: its time is not a k's cost), but its count and its seconds commit to
    commit are in the stats (spec_untimed_units / _seconds: where a speculative Engine's time
    outside the policy's units goes), and never a timed unit's."""
    from ninfer.models.qwen3_5.program.draft_policy import DraftPolicy
    timed = []
    observe = DraftPolicy.observe_unit

    def spy(self, rows, k, s, **kw):
        timed.append(s)
        observe(self, rows, k, s, **kw)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _id_prompts()[:4]
    monkeypatch.setattr(DraftPolicy, "observe_unit", spy)
    t0 = time.perf_counter()
    _, stats = _generate(extremes["never"], prompts, params, max_concurrency=4,
                         speculative="mtp", num_draft_tokens=2)
    wall = time.perf_counter() - t0
    # every prompt's prefill ran in an untimed unit (alone or beside decode rows)
    assert stats["spec_untimed_units"] >= 1
    assert 0.0 < stats["spec_untimed_seconds"] < wall
    assert stats["spec_untimed_seconds"] + sum(timed) < wall
