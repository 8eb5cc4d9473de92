"""Issue 23 item 4 through the official openai SDK against a real `python -m ninfer serve` (gunicorn,
the demo artifact: random weights, the real Qwen3.5 vocabulary; numpy backend, context cache on):
`n` choices (one prefill shared through the context cache, seed + i per choice, streamed chunks
naming their index, usage counting the prompt once, a client that leaves cancelling them all),
`echo` with the prompt tokens' logprobs, and /v1/embeddings (checked against the numpy model's
final hidden state computed here, independently of the server)."""
from __future__ import annotations

import base64
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from test_serve_support import ServerProcess

KEY = "k"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# longer than a KV page (16 tokens), so the choices can share its prefill
LONG = "Tell me a story about " + " and ".join(f"animal number {i}" for i in range(12))


@pytest.fixture(scope="module")
def demo():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module")
def server(demo):
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", demo, "--max-context", "1024",
                         "--api-key", KEY, "--log-level", "warning"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scorer(demo):
    """The offline scoring Engine: the reference for echo's prompt logprobs."""
    import ninfer
    with ninfer.Engine(demo, purpose="scoring") as engine:
        yield engine


def user(text):
    return [{"role": "user", "content": text}]


def _metric(server, name) -> float:
    return server.metrics({"authorization": f"Bearer {KEY}"}).get(name, 0.0)


# ---- n choices -------------------------------------------------------------------------------------

def test_chat_n_choices_seeded_per_choice(oai):
    kw = dict(model="m", messages=user("pick some words"), max_tokens=6, temperature=1.0,
              logprobs=True, extra_body=NO_THINK)
    out = oai.chat.completions.create(n=3, seed=1234, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    tokens = [[t.token for t in c.logprobs.content] for c in out.choices]
    assert len({tuple(t) for t in tokens}) > 1            # distinct draws, not one copied
    # choice i is the request with seed 1234 + i (vLLM's convention)
    for i, choice in enumerate(out.choices):
        single = oai.chat.completions.create(n=1, seed=1234 + i, **kw)
        assert single.choices[0].message.content == choice.message.content
        assert single.usage.prompt_tokens == out.usage.prompt_tokens     # the prompt, once
    assert out.usage.completion_tokens == sum(len(t) for t in tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_n_choices_share_one_prefill(server, oai):
    """The first choice leaves a checkpoint one token short of the prompt's end; the other two
    start there (the context cache supplies all but their last prompt token)."""
    before = _metric(server, "ninfer_prefix_cache_reused_tokens_total")
    out = oai.completions.create(model="m", prompt=LONG + " (n=3)", n=3, max_tokens=4,
                                 temperature=1.0, seed=5)
    reused = _metric(server, "ninfer_prefix_cache_reused_tokens_total") - before
    assert out.usage.prompt_tokens > 16
    assert reused >= 2 * (out.usage.prompt_tokens - 1), (reused, out.usage.prompt_tokens)


def test_chat_n_stream_equals_non_stream(oai):
    kw = dict(model="m", messages=user(LONG), max_tokens=8, temperature=1.0, seed=77, n=3,
              extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    text, finish, usage = {0: "", 1: "", 2: ""}, {}, []
    for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                             **kw):
        if chunk.usage is not None:
            usage.append(chunk.usage)
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    assert text == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert len(usage) == 1
    assert usage[0].prompt_tokens == full.usage.prompt_tokens
    assert usage[0].completion_tokens == full.usage.completion_tokens


def test_n_stream_client_leaving_cancels_every_choice(server, oai):
    stream = oai.completions.create(model="m", prompt="count: ", n=3, max_tokens=900,
                                    temperature=1.0, stream=True)
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        if len(seen) == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health", timeout=5).json()
        if health["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert health["in_flight"] == 0
    assert _metric(server, 'ninfer_generations_finished_total{reason="cancelled"}') >= 3


def test_n_limits_are_400_naming_them(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="m", messages=user("hi"), n=17, max_tokens=2)
    assert info.value.body["param"] == "n" and "<= 16" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="m", prompt="hi", n=2, best_of=4, max_tokens=2)
    assert info.value.body["param"] == "best_of" and "not supported" in info.value.body["message"]


# ---- echo ------------------------------------------------------------------------------------------

def test_echo_leads_with_the_prompt(oai):
    prompt = "The quick brown fox"
    out = oai.completions.create(model="m", prompt=prompt, echo=True, max_tokens=5,
                                 temperature=0, n=2)
    plain = oai.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0)
    for c in out.choices:
        assert c.text == prompt + plain.choices[0].text
    streamed = {0: "", 1: ""}
    for chunk in oai.completions.create(model="m", prompt=prompt, echo=True, max_tokens=5,
                                        temperature=0, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: out.choices[0].text, 1: out.choices[1].text}


def test_echo_with_logprobs_scores_the_prompt(oai, scorer):
    prompt = "A quick brown fox jumps over the lazy dog."
    ids = scorer.tokenize(prompt)
    out = oai.completions.create(model="m", prompt=prompt, echo=True, logprobs=3, max_tokens=4,
                                 temperature=0)
    lp = out.choices[0].logprobs
    P = len(ids)
    assert out.usage.prompt_tokens == P
    assert "".join(lp.tokens[:P]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing predicts it
    ref = scorer.score(ids, return_logits=True)
    np.testing.assert_allclose(lp.token_logprobs[1:P], ref.logprobs, atol=1e-4)
    # the top 3 at each prompt position, from the reference logits' own log-softmax
    logits = ref.logits.astype(np.float64)
    logsm = logits - logits.max(-1, keepdims=True)
    logsm -= np.log(np.exp(logsm).sum(-1, keepdims=True))
    for i in range(1, P):
        best = np.argsort(-logsm[i - 1])[:3]
        want = {scorer.detokenize([int(t)]): float(logsm[i - 1, t]) for t in best}
        got = lp.top_logprobs[i]
        assert set(got) == set(want)
        assert all(abs(got[k] - want[k]) < 1e-4 for k in want)
    assert lp.text_offset[:P] == [len("".join(lp.tokens[:i])) for i in range(P)]
    # the generated tokens follow, their offsets past the prompt
    assert len(lp.tokens) == P + out.usage.completion_tokens
    assert lp.text_offset[P] == len(prompt)
    assert out.choices[0].text.startswith(prompt)


def test_echo_logprobs_of_token_id_prompt(oai, scorer):
    ids = [int(t) for t in scorer.tokenize("hello there world")]
    out = oai.completions.create(model="m", prompt=ids, echo=True, logprobs=0, max_tokens=2,
                                 temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith("hello there world")
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], scorer.score(ids).logprobs,
                               atol=1e-4)
    with pytest.raises(openai.BadRequestError) as info:      # an id past the vocabulary
        oai.completions.create(model="m", prompt=[ids[0], 10 ** 9], echo=True, logprobs=0,
                               max_tokens=2)
    assert "vocabulary" in info.value.body["message"]


# ---- embeddings ------------------------------------------------------------------------------------

def _reference_embedding(demo, ids) -> np.ndarray:
    """The numpy model's final-normed hidden state at the last token, run here directly."""
    from ninfer.artifact import Artifact
    from ninfer.contracts import ForwardBatch
    from ninfer.models.qwen3_5 import load_model
    from ninfer.options import EngineOptions
    with Artifact(demo) as art:
        model = load_model(art, EngineOptions(purpose="scoring"))
        pages = -(-len(ids) // 16)
        kv, state = model.new_kv_pool(pages, 16), model.new_state_pool(1)
        hidden = model.final_hidden(ForwardBatch.single(ids, 0, np.arange(pages)), kv, state)
        model.close()
    return hidden[-1].astype(np.float64)


def test_embeddings_match_the_final_hidden_state(oai, scorer, demo):
    texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
    out = oai.embeddings.create(model="m", input=texts)          # the SDK asks for base64
    eot = scorer.frontend.token_id("<|endoftext|>")
    ids = [[int(t) for t in scorer.tokenize(t)] + [eot] for t in texts]
    assert [d.index for d in out.data] == [0, 1]
    assert out.usage.prompt_tokens == sum(len(x) for x in ids) == out.usage.total_tokens
    for d, x in zip(out.data, ids):
        ref = _reference_embedding(demo, x)
        ref /= np.linalg.norm(ref)
        np.testing.assert_allclose(d.embedding, ref, atol=1e-5)
    floats = oai.embeddings.create(model="m", input=texts, encoding_format="float")
    for a, b in zip(out.data, floats.data):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-7)


def test_embeddings_dimensions_truncate_and_renormalise(oai):
    full = oai.embeddings.create(model="m", input="matryoshka", encoding_format="float")
    short = oai.embeddings.create(model="m", input="matryoshka", dimensions=8,
                                  encoding_format="float")
    v = np.array(full.data[0].embedding[:8])
    np.testing.assert_allclose(short.data[0].embedding, v / np.linalg.norm(v), atol=1e-6)
    assert abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-5


def test_embeddings_of_token_ids_and_base64_wire_form(server, scorer, demo):
    ids = [int(t) for t in scorer.tokenize("token ids as given")]
    r = httpx.post(server.url + "/v1/embeddings", headers={"authorization": f"Bearer {KEY}"},
                   json={"input": [ids, "x"], "encoding_format": "base64"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    ref = _reference_embedding(demo, ids)               # ids taken as given: no end of text added
    np.testing.assert_allclose(vec, ref / np.linalg.norm(ref), atol=1e-5)
    assert body["usage"]["prompt_tokens"] == len(ids) + 2          # "x" + <|endoftext|>


def test_embeddings_bad_input_is_400_naming_it(oai, scorer):
    hidden = len(oai.embeddings.create(model="m", input="a", encoding_format="float")
                 .data[0].embedding)
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model="m", input="a", dimensions=hidden + 1)
    assert "dimensions" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model="m", input=[])
    assert info.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model="m", input=[[1, 10 ** 9]])
    assert "vocabulary" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model="m", input="word " * 2000)
    assert "longer than the context" in info.value.body["message"]
