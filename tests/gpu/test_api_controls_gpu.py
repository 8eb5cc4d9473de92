"""Issue 11's request controls on the CUDA backend (the demo artifact: real vocabulary, random
weights): a spent thinking budget's control unit (forced `</think>` + separator: a host-sampled
step on cuda) and min_tokens' EOS mask give the numpy Engine's tokens in float32; logit_bias and
min_tokens hold on the device sampler."""
import pytest

import ninfer
from ninfer import Engine

pytestmark = pytest.mark.gpu
USER = [{"role": "user", "content": "Tell me about the sea."}]
THINK_CLOSE, IM_END = 248069, 248046


@pytest.fixture(scope="module")
def demo():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


def _run(path, backend, fn):
    with Engine(path, backend=backend, dtype="float32", max_concurrency=2,
                max_context=256) as engine:
        return fn(engine)


def test_thinking_budget_and_min_tokens_equal_numpy(demo):
    def work(engine):
        out = []
        for budget in (0, 3):
            p = ninfer.SamplingParams(max_tokens=12, min_tokens=12, thinking_budget=budget)
            out.append(engine.generate(USER, p, enable_thinking=True).token_ids)
        eos = ninfer.SamplingParams(max_tokens=12, min_tokens=4, logit_bias={IM_END: 100.0})
        out.append(engine.generate("The sea", eos).token_ids)
        return out

    cuda, numpy = _run(demo, "cuda", work), _run(demo, "numpy", work)
    assert cuda == numpy
    assert cuda[0][0] == THINK_CLOSE and cuda[1][3] == THINK_CLOSE and len(cuda[1]) == 12
    assert cuda[2][-1] == IM_END and len(cuda[2]) == 5          # EOS held back 4 tokens


def test_logit_bias_on_the_device_sampler(demo):
    def work(engine):
        target = int(engine.tokenize(" sea")[0])
        forced = ninfer.SamplingParams(max_tokens=6, temperature=0.9, seed=3,
                                       logit_bias={target: 100.0})
        first = engine.generate("The", forced).token_ids
        free = engine.generate("The", ninfer.SamplingParams(max_tokens=6, temperature=0.9,
                                                             seed=3)).token_ids
        banned = ninfer.SamplingParams(max_tokens=6, temperature=0.9, seed=3,
                                       logit_bias={t: -100.0 for t in set(free)})
        return target, first, free, engine.generate("The", banned).token_ids

    target, first, free, avoided = _run(demo, "cuda", work)
    assert first == [target] * 6
    assert not set(avoided) & set(free)
