"""The trained reference models (docs/models.md) on the CUDA backend in float32: prefill logits
against the numpy backend, the recorded greedy continuations and the recorded held-out perplexity
through `ninfer eval`'s code path."""
import numpy as np
import pytest

from gpu_harness import TOL_MODEL_F32, rel_err
from reference_records import GREEDY, HELDOUT_PPL, HELDOUT_TOKENS, NAMES, PROMPT

from ninfer import Engine, SamplingParams
from ninfer.demo import ensure_reference_artifact
from ninfer.eval import dataset_path, evaluate

pytestmark = pytest.mark.gpu
# float32 on both sides: summation order alone separates them (TOL_MODEL_F32 is relative L2)
PPL_F32_REL = 1e-4


@pytest.fixture(scope="module")
def heldout():
    return dataset_path("heldout").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", NAMES)
def test_reference_model_numpy_and_cuda_float32_agree(name, heldout, tmp_path_factory):
    path = ensure_reference_artifact(name, tmp_path_factory.mktemp(f"ref_gpu_{name}"))
    with Engine(path, purpose="scoring", prefill_chunk=512) as cpu:
        ids = cpu.tokenize(heldout)[:300]
        ref = cpu.score(ids, return_logits=True)
    with Engine(path, backend="cuda", dtype="float32", purpose="scoring",
                prefill_chunk=512) as gpu:
        got = gpu.score(ids, return_logits=True)
        assert rel_err(got.logits, ref.logits) < TOL_MODEL_F32
        assert np.max(np.abs(got.logprobs - ref.logprobs)) < 1e-3
        res = evaluate(gpu, heldout, context=512, max_tokens=HELDOUT_TOKENS)
    assert abs(res.perplexity / HELDOUT_PPL[name] - 1) < PPL_F32_REL, res.perplexity
    with Engine(path, backend="cuda", dtype="float32", max_concurrency=1,
                max_context=512) as gpu:
        out = gpu.generate([{"role": "user", "content": PROMPT}], SamplingParams(max_tokens=24),
                           enable_thinking=False)
    assert out.token_ids == GREEDY[name], out.text
