"""Speculative decoding with the MTP head on the CUDA backend (issue 25; program/speculative.py
over cuda/drafter.py and CudaModel.verify_forward; the reference models' tests also with their
DFlash drafters, DRAFTERS: issue 30, cuda/dflash.py): in float32 the tokens are the ones the CUDA
Engine gives without speculation, for greedy and seeded sampling, alone and 8 at once, through
Snapshot and Replay pauses, with stop strings, grammars and thinking budgets; a rejected draft is
undone by a State snapshot slot, never by a recompute. The trained reference models (a real MTP
head: acceptance 0.4-0.9) and the tiny random model with a random head (acceptance ~0: every
verify rolls back)."""
import json
import pathlib
import sys

import numpy as np
import pytest

from ninfer import Engine, SamplingParams
from ninfer.api import StructuredOutput
from ninfer.demo import ensure_reference_artifact

pytestmark = pytest.mark.gpu

PROMPTS = ["import os\n\ndef main():\n", "class Parser:\n    def __init__(self", "# utils\n",
           "for i in range(", "def _check(x):\n    if not", "import sys\nimport re\n\n",
           "    return self.", "try:\n    import"]
SEEDED = dict(temperature=0.8, top_p=0.95, seed=11)
CUDA = dict(backend="cuda", dtype="float32")
# the reference models' drafters: the MTP head, and the DFlash block drafter (test_dflash_gpu.py
# holds its steps against the numpy drafter); the cycle and its contract are the same
DRAFTERS = ["mtp", "dflash"]


def _generate(path, prompts, params, **engine_kw):
    with Engine(path, **CUDA, **engine_kw) as engine:
        handles = [engine.submit(p, params[i] if isinstance(params, list) else params,
                                 enable_thinking=False) for i, p in enumerate(prompts)]
        return [h.result(timeout=300) for h in handles], engine.stats()


def _no_recompute(stats):
    assert stats["spec_recompute_rows"] == 0, stats
    assert stats["spec_verify_rows"] > 0, stats


@pytest.fixture(scope="module", params=["dense", "moe"])
def ref(request):
    return ensure_reference_artifact(request.param)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_equals_plain_decoding_alone_and_8_concurrent(ref, drafter):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want, _ = _generate(ref, PROMPTS, params, max_concurrency=8)
    for b in (1, 3, 8):
        got, stats = _generate(ref, PROMPTS, params, max_concurrency=b, speculative=drafter,
                               num_draft_tokens=3, draft_policy="fixed")
        assert [r.token_ids for r in got] == [r.token_ids for r in want], b
        _no_recompute(stats)
        assert stats["spec_accepted_tokens"] > 0 and stats["spec_snapshot_selects"] > 0
    for k in (1, 4):
        alone, stats = _generate(ref, PROMPTS[:1], params, max_concurrency=1,
                                 speculative=drafter, num_draft_tokens=k)
        assert [r.token_ids for r in alone] == [r.token_ids for r in want[:1]], k


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_seeded_equals_plain_sampling_at_batch_1_and_4(drafter):
    ref = ensure_reference_artifact("dense")
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **{**SEEDED, "seed": 50 + i})
              for i in range(4)]
    want, _ = _generate(ref, PROMPTS[:4], params, max_concurrency=1)
    for b in (1, 4):
        got, stats = _generate(ref, PROMPTS[:4], params, max_concurrency=b, speculative=drafter,
                               num_draft_tokens=3, draft_policy="fixed")
        assert [r.token_ids for r in got] == [r.token_ids for r in want], b
        _no_recompute(stats)


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
                           num_draft_tokens=4, draft_policy="fixed")
    assert stats["pauses"] > 0 and stats["spec_accepted_tokens"] > 0
    assert (stats["snapshot_resumes"] > 0) == (snapshot_bytes > 0)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    _no_recompute(stats)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_stop_strings_grammars_and_thinking_budgets_end_where_plain_decoding_does(drafter):
    path = ensure_reference_artifact("dense")
    free, _ = _generate(path, PROMPTS[:1], SamplingParams(max_tokens=20, ignore_eos=True),
                        max_concurrency=1)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z_]{1,10}$"}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}
    cases = [SamplingParams(max_tokens=20, ignore_eos=True, stop=[free[0].text[12:15]]),
             SamplingParams(max_tokens=40, structured=StructuredOutput("json_schema", schema)),
             SamplingParams(max_tokens=40, structured=StructuredOutput("json_schema", schema),
                            **SEEDED),
             SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                            logit_bias={220: 3.0}, logprobs=2)]
    for params in cases:
        want, _ = _generate(path, PROMPTS[:2], params, max_concurrency=2)
        got, stats = _generate(path, PROMPTS[:2], params, max_concurrency=2,
                               speculative=drafter, num_draft_tokens=3)
        for g, w in zip(got, want):
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text,
                                                              w.finish_reason), params
            if params.structured is not None and g.finish_reason == "stop":
                assert set(json.loads(g.text)) == {"name", "n"}
    messages = [{"role": "user", "content": "def main():"}]
    params = SamplingParams(max_tokens=24, ignore_eos=True, thinking_budget=6)
    with Engine(path, **CUDA, max_concurrency=1) as engine:
        want = engine.generate(messages, params, enable_thinking=True)
    with Engine(path, **CUDA, max_concurrency=1, speculative=drafter,
                num_draft_tokens=4) as engine:
        got = engine.generate(messages, params, enable_thinking=True)
        assert engine.stats()["spec_verify_rows"] > 0
    assert (got.token_ids, got.reasoning_text, got.text) == \
        (want.token_ids, want.reasoning_text, want.text)


# the tiny model at the CUDA kernels' sizes (tests/gpu/tiny_model.py's), with a random MTP head
GPU_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, head_dim=64,
                linear_key_head_dim=32, linear_value_head_dim=32, num_hidden_layers=6,
                full_attention_interval=3, eos_token_id=319,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                 "mrope_interleaved": True})
GPU_TINY_MOE = dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_random_head_rolls_back_every_verify_by_snapshot(kind, tmp_path):
    """A random MTP head: nearly every draft rejected, so nearly every verify row takes a
    snapshot slot; prefill chunks and pauses beside the verify rows, greedy and seeded rows."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from ckpt_helpers import write_checkpoint
    from ninfer.convert import convert_checkpoint
    arch = "Qwen3_5MoeForCausalLM" if kind == "moe" else "Qwen3_5ForCausalLM"
    ckpt = write_checkpoint(tmp_path / "ckpt", arch,
                            {**GPU_TINY, **(GPU_TINY_MOE if kind == "moe" else {})},
                            mtp=True, seed=9)
    path = tmp_path / f"tiny_{kind}.ninfer"
    convert_checkpoint(ckpt.path, path, progress=False)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 300, n).astype(np.int32) for n in (1, 5, 12, 30, 3, 17, 8, 2)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **({} if i % 2 else SEEDED))
              for i in range(8)]
    want, _ = _generate(path, prompts, params, max_concurrency=1)
    for snapshot_bytes in (0, 1 << 20):
        got, stats = _generate(path, prompts, params, max_concurrency=8, max_context=64,
                               page_size=4, num_kv_pages=20, prefill_chunk=5,
                               host_snapshot_bytes=snapshot_bytes, speculative="mtp",
                               num_draft_tokens=2, draft_policy="fixed")
        assert stats["pauses"] > 0
        assert [r.token_ids for r in got] == [r.token_ids for r in want], snapshot_bytes
        _no_recompute(stats)
        assert stats["spec_snapshot_selects"] > stats["spec_verify_rows"] // 2, stats
    # the adaptive policy soon stops drafting for this head: its k = 0 units run through the
    # decode graphs (verify_tokens of a decode batch), feeding the drafter all the same
    got, stats = _generate(path, prompts * 3, params * 3, max_concurrency=8, max_context=96,
                           page_size=4, speculative="mtp", num_draft_tokens=2)
    assert [r.token_ids for r in got] == [r.token_ids for r in want] * 3
    assert stats["spec_units_by_k"][0] > sum(stats["spec_units_by_k"][1:]), stats
