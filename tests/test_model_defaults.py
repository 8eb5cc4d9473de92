"""Issue 23, item 1: an artifact carries its default `enable_thinking` (metadata.defaults), and
serve / run / chat / the Python API use it unless the request or a flag says otherwise. The trained
reference models carry "off" (their chats were trained with thinking off), so the default server
answers in `content` with the official SDK; an artifact without the field keeps thinking on."""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from ninfer import Engine, SamplingParams
from ninfer.artifact import Artifact, ArtifactWriter
from ninfer.demo import demo_config, ensure_demo_artifact, ensure_reference_artifact
from ninfer.errors import ArtifactError, RequestError

from test_serve_support import ServerProcess

USER = [{"role": "user", "content": "Write a Python function `add`: Return the sum of a and b."}]
NO_THINK_MARK = "<think>\n\n</think>"       # the template's empty block: thinking off


def _tiny(path, metadata):
    """An artifact with no weights (the container checks need none)."""
    with ArtifactWriter(path, demo_config(), name="tiny", metadata=metadata):
        pass
    return path


# ---- the container ------------------------------------------------------------------------------

def test_defaults_are_stored_read_and_checked(tmp_path):
    with Artifact(_tiny(tmp_path / "off.ninfer", {"defaults": {"enable_thinking": False}})) as a:
        assert a.defaults == {"enable_thinking": False}
    with Artifact(_tiny(tmp_path / "old.ninfer", None)) as a:       # written before the field
        assert a.defaults == {}
    with Artifact(_tiny(tmp_path / "more.ninfer", {"defaults": {"future_key": 1}})) as a:
        assert a.defaults == {}                                     # unknown keys: ignored
    for bad, words in (({"defaults": {"enable_thinking": "no"}}, "metadata.defaults.enable_thinking"),
                       ({"defaults": [1]}, "metadata.defaults is list")):
        with pytest.raises(ArtifactError, match=words):
            _tiny(tmp_path / "bad.ninfer", bad)
        assert not (tmp_path / "bad.ninfer").exists()


def test_convert_stores_the_default_asked_for(tmp_path):
    import ninfer.cli
    from ckpt_helpers import write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    for flag, stored in ((None, {}), ("off", {"enable_thinking": False}),
                         ("on", {"enable_thinking": True})):
        out = tmp_path / f"{flag}.ninfer"
        argv = ["convert", str(ckpt.path), str(out), "--quiet"]
        assert ninfer.cli.main(argv + (["--default-thinking", flag] if flag else [])) == 0
        with Artifact(out) as a:
            assert a.defaults == stored


def test_reference_artifacts_default_to_thinking_off():
    for name in ("dense", "moe"):
        with Artifact(ensure_reference_artifact(name)) as a:
            assert a.defaults == {"enable_thinking": False}
    with Artifact(ensure_demo_artifact()) as a:                     # the random demo: no field
        assert a.defaults == {}


# ---- the Python API -----------------------------------------------------------------------------

def test_engine_uses_the_models_default_unless_told():
    with Engine(ensure_reference_artifact(), max_concurrency=1, max_context=512) as e:
        assert e.options.default_enable_thinking is False
        assert e.apply_chat_template(USER).endswith(NO_THINK_MARK + "\n\n")
        assert e.apply_chat_template(USER, enable_thinking=True).endswith("<think>\n")
        res = e.generate(USER, SamplingParams(max_tokens=12))
        assert res.text and not res.reasoning_text
        assert res.num_prompt_tokens == e.count_prompt_tokens(USER)
        on = e.generate(USER, SamplingParams(max_tokens=12), enable_thinking=True)
        assert on.num_prompt_tokens == e.count_prompt_tokens(USER, enable_thinking=True) \
            < res.num_prompt_tokens                 # the empty think block is not there
    with Engine(ensure_reference_artifact(), max_concurrency=1, max_context=512,
                default_enable_thinking=True) as e:
        assert e.options.default_enable_thinking is True
        assert e.apply_chat_template(USER).endswith("<think>\n")
    with Engine(ensure_demo_artifact(), max_concurrency=1, max_context=512) as e:
        assert e.options.default_enable_thinking is True            # no field: on, as before
    with pytest.raises(RequestError, match="default_enable_thinking"):
        Engine(ensure_demo_artifact(), default_enable_thinking="yes")


# ---- run ----------------------------------------------------------------------------------------

def _run(*args):
    return subprocess.run([sys.executable, "-m", "ninfer", "run", *args], capture_output=True,
                          text=True, timeout=180)


def test_run_default_model_answers_and_the_flag_turns_thinking_on():
    off = _run("--prompt", USER[0]["content"], "--max-new", "8")
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() and "[reasoning]" not in off.stderr
    on = _run("--prompt", USER[0]["content"], "--max-new", "8", "--thinking")
    assert on.returncode == 0, on.stderr
    assert "[reasoning] " in on.stderr


# ---- serve, through the official SDK ------------------------------------------------------------

@pytest.fixture(scope="module")
def default_server():
    """`python -m ninfer serve` with no artifact and no thinking flag: the reference model."""
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", "--max-context", "1024",
                         "--log-level", "warning"])
    yield srv
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _reasoning(message):
    return (message.model_extra or {}).get("reasoning_content")


def test_default_server_answers_in_content(default_server):
    oai = _client(default_server)
    res = oai.chat.completions.create(model="m", messages=USER, max_tokens=24)
    msg = res.choices[0].message
    assert msg.content and not _reasoning(msg), msg
    # a streamed answer too
    parts, reasoning = [], []
    for chunk in oai.chat.completions.create(model="m", messages=USER, max_tokens=24,
                                             stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasoning.append(_reasoning(chunk.choices[0].delta) or "")
    assert "".join(parts) == msg.content and not "".join(reasoning)
    # the request's own switch still wins: thinking on, the model's tokens are reasoning
    on = oai.chat.completions.create(model="m", messages=USER, max_tokens=24, extra_body={
        "chat_template_kwargs": {"enable_thinking": True}})
    assert _reasoning(on.choices[0].message)
    # the prompt the model saw says the same (/tokenize renders as a request would)
    import httpx
    texts = {}
    for value in (None, True):
        body = {"messages": USER}
        if value is not None:
            body["chat_template_kwargs"] = {"enable_thinking": value}
        ids = httpx.post(default_server.url + "/tokenize", json=body, timeout=30).json()["tokens"]
        texts[value] = httpx.post(default_server.url + "/detokenize", json={"tokens": ids},
                                  timeout=30).json()["prompt"]
    assert texts[None].endswith(NO_THINK_MARK + "\n\n") and texts[True].endswith("<think>\n")


def test_serve_thinking_flag_overrides_the_models_default():
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", "--max-context", "1024",
                         "--log-level", "warning", "--thinking"])
    try:
        res = _client(srv).chat.completions.create(model="m", messages=USER, max_tokens=24)
        assert _reasoning(res.choices[0].message), res
        off = _client(srv).chat.completions.create(model="m", messages=USER, max_tokens=24,
                                                   extra_body={"chat_template_kwargs": {
                                                       "enable_thinking": False}})
        assert off.choices[0].message.content and not _reasoning(off.choices[0].message)
    finally:
        srv.stop()



def test_readme_serve_example_prints_an_answer(default_server, capsys):
    """The README's serve block: its client snippet, pointed at this server, prints content."""
    import pathlib
    import re
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
                 if "ninfer serve &" in b)
    snippet = re.search(r"python -c '(.*?)'\n", block, flags=re.S)[1]
    assert "http://127.0.0.1:8000/v1" in snippet
    exec(snippet.replace("http://127.0.0.1:8000/v1", default_server.url + "/v1"), {})
    assert capsys.readouterr().out.strip()
