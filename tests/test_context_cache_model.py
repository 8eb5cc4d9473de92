"""The context cache on the real numpy model (tiny converted fixture) and the real chat template
(the demo artifact: Qwen's vocabulary and template):

* cache on == cache off, greedy and seeded, for multi-turn token chats through the device tier,
  interval checkpoints and the host tier (demote / promote);
* the continuation boundary: a finished answer's checkpoint covers prompt + answer up to its last
  token (the end-of-turn token, never run); the next turn's rendering starts with exactly those
  tokens when the template keeps the turn as generated (an agent's tool-call turn), and repeats
  only the prompt's reusable part when it rewrites the turn (a new user query drops the think
  block), where the prompt checkpoint serves instead.
"""
import numpy as np
import pytest

from fixture_utils import convert_fixture
from ninfer import Engine
from ninfer.api import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return convert_fixture("dense", tmp_path_factory.mktemp("context_cache"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact(tmp_path_factory.mktemp("context_cache_demo"))


def _token_chat(path, params, turns=3, **options):
    """A token-prompt chat: turn t = turn t-1's prompt + answer + new tokens; plus a prompt that
    shares only the first 20 tokens of turn 1 (an interval checkpoint serves it)."""
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 256, 26).astype(np.int32)
    out = []
    with Engine(path, max_concurrency=2, max_context=256, prefill_chunk=8, page_size=8,
                checkpoint_interval=8, debug_checks=True, **options) as engine:
        core = engine._generation()
        for t in range(turns):
            # a session: a continuation the device cannot hold goes to the host tier
            res = core.submit(ids, params, session="chat").result(timeout=120)
            assert res.error is None, res.error
            out.append((list(res.token_ids), res.num_cached_tokens))
            ids = np.concatenate([ids, np.asarray(res.token_ids, np.int32),
                                  rng.integers(3, 256, 7).astype(np.int32)])
        branch = np.concatenate([ids[:20], rng.integers(3, 256, 9).astype(np.int32)])
        res = engine.generate(branch, params)
        out.append((list(res.token_ids), res.num_cached_tokens))
        stats = engine.stats()
        assert engine.health == "ready"
    return out, stats


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_real_model_cache_on_equals_off(dense, kind, tier):
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0) if kind == "greedy" \
        else SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, top_p=0.95, seed=9)
    cold, cold_stats = _token_chat(dense, params, prefix_cache=False)
    # host: a device share of 4 of the 64 pages, so checkpoints are demoted and promoted back
    options = {} if tier == "device" else dict(prefix_cache_device_fraction=4 / 64)
    warm, stats = _token_chat(dense, params, **options)
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert [c for _, c in cold] == [0, 0, 0, 0] and cold_stats["prefix_cache_entries"] == 0
    # turns 2, 3: turn 1's / 2's continuation; the branch: the interval checkpoint at 16
    assert warm[1][1] == 26 + 5 - 1 and warm[2][1] == 26 + 5 + 7 + 5 - 1
    assert warm[3][1] == 16
    if tier == "host":
        assert stats["prefix_cache_demotions"] > 0
    else:
        assert stats["prefix_cache_device_bytes"] > 0


def _tool_turn(fe):
    """Turn 1 of an agent loop, the tokens the model generated for it (as one tokenization of
    the answer text + <|im_end|>), and the assistant message a client sends back."""
    turn1 = [{"role": "system", "content": "You call tools."},
             {"role": "user", "content": "What is the weather in Paris?"}]
    thought, answer = "The user wants the weather. I will call get_weather.", "Let me check."
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>")
    generated = np.concatenate([fe.tokenize(f"{thought}\n</think>\n\n{answer}\n\n{call}"),
                                [fe.token_id("<|im_end|>")]]).astype(np.int32)
    message = {"role": "assistant", "content": answer, "reasoning_content": thought,
               "tool_calls": [{"id": "1", "type": "function",
                               "function": {"name": "get_weather",
                                            "arguments": {"city": "Paris"}}}]}
    return turn1, generated, message


def test_continuation_boundary_with_the_real_template(demo):
    from ninfer.artifact import Artifact
    from ninfer.models.qwen3_5.frontend import Frontend
    with Artifact(demo) as art:
        fe = Frontend.from_artifact(art)
    turn1, generated, message = _tool_turn(fe)
    p1 = fe.prepare(turn1).token_ids                 # ends "<|im_start|>assistant\n<think>\n"
    continuation = np.concatenate([p1, generated[:-1]])   # what the Program keeps at finish
    # an agent loop: the tool result follows, the turn is kept with its think block
    tool_turn = turn1 + [message, {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    p2 = fe.prepare(tool_turn).token_ids
    assert len(p2) > len(continuation)
    np.testing.assert_array_equal(p2[:len(continuation)], continuation)
    assert p2[len(continuation)] == generated[-1]    # the template writes <|im_end|> itself
    # a new user query: history drops the turn's think block, so the next prompt repeats the
    # prompt only up to its reusable boundary (through "<|im_start|>assistant\n")
    chat_turn = turn1 + [message, {"role": "user", "content": "And tomorrow?"}]
    p3 = fe.prepare(chat_turn).token_ids
    reusable = fe.prepare(turn1).num_reusable_tokens
    np.testing.assert_array_equal(p3[:reusable], p1[:reusable])
    assert not np.array_equal(p3[:len(continuation)], continuation)


def test_agent_loop_turn_2_binds_the_continuation(demo):
    """Through the engine with the real template: turn 2 of a tool loop (the client sends back
    the generated turn) binds turn 1's continuation. The demo model's weights are random, so the
    answer is forced: max_tokens stops turn 1 where the generated ids are a known text."""
    with Engine(demo, max_concurrency=1, max_context=512, prefill_chunk=32) as engine:
        fe = engine.frontend
        turn1, generated, message = _tool_turn(fe)
        p1 = fe.prepare(turn1).token_ids
        # turn 1 "generated" the tool call: run prompt + answer as one prompt, so the cache
        # holds a continuation of exactly these tokens (what decode would have left)
        res1 = engine.generate(np.concatenate([p1, generated[:-1]]).astype(np.int32),
                               SamplingParams(max_tokens=1, temperature=0.0))
        tool_turn = turn1 + [message, {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
        res2 = engine.generate(tool_turn, SamplingParams(max_tokens=2, temperature=0.0))
    assert res1.error is None and res2.error is None
    assert res2.num_cached_tokens >= len(p1) + len(generated) - 1


def test_image_prompts_reuse_only_with_the_same_media(tmp_path_factory):
    """One image prompt three times: the second run is asked for a checkpoint where it leaves
    the full blocks it shares with the first's entries (keyed with the media digest), the third
    binds it and gives the cold run's tokens; the same token ids with another image never hit.
    (tests/gpu/test_context_cache_gpu.py runs it on CUDA.)"""
    image_prompts_reuse_only_with_the_same_media(tmp_path_factory)


def image_prompts_reuse_only_with_the_same_media(tmp_path_factory, **engine_options):
    import shutil
    from fixture_utils import FIXTURES_DIR, fixture_dir
    from ninfer.convert import convert_checkpoint
    vision = FIXTURES_DIR / "vision"
    src = tmp_path_factory.mktemp("cache_vision") / "cond_gen"
    shutil.copytree(fixture_dir("cond_gen"), src)
    for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(vision / f, src / f)
    path = src.parent / "cond_gen.ninfer"
    convert_checkpoint(src, path, progress=False)
    with np.load(vision / "reference.npz") as z:
        image = z["image_0"]
    other = image.copy()                     # the same placeholder ids, other pixels
    other.reshape(-1)[:64] = 255 - other.reshape(-1)[:64]

    def chat(img):
        return [{"role": "user", "content": [{"type": "text", "text": "qwen net"},
                                             {"type": "image", "image": img}]}]
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

    def run(**options):
        with Engine(path, max_concurrency=1, prefill_chunk=16, page_size=8, debug_checks=True,
                    **engine_options, **options) as engine:
            out = [engine.generate(chat(image), params) for _ in range(3)]
            out.append(engine.generate(chat(other), params))
            a, b = engine.frontend.prepare(chat(image)), engine.frontend.prepare(chat(other))
            assert np.array_equal(a.token_ids, b.token_ids) and a.media_digest != b.media_digest
            n = a.num_tokens
            assert engine.health == "ready"
            return out, n
    (cold, n), (warm, _) = run(prefix_cache=False), run()
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert [r.num_cached_tokens for r in warm] == [0, 0, (n - 1) // 8 * 8, 0]
