"""Popular clients nobody here wrote, against the default server: `python -m ninfer serve` with no
model and no flags (the built-in trained demo model) on a loopback port, driven by langchain-openai,
litellm and instructor as their users call them. Protocol-level checks, not answer quality (the
demo model knows Python, not arithmetic): plain chat answers in `content`; a forced call comes back
as `tool_calls` with arguments that parse and no raw Qwen XML anywhere; `with_structured_output`
returns an object; instructor returns a validated model."""
from __future__ import annotations

import json
import os
import sys

import pytest

# litellm downloads its model price map at import unless told to use the copy it ships
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# pip install -e ".[dev]" has them; CI's lowest-direct pass installs ".[test]" (their own
# dependencies need newer core libraries than its lower bounds), so there they skip
_WHY = "the client libraries come with the [dev] extra"
instructor = pytest.importorskip("instructor", reason=_WHY)
litellm = pytest.importorskip("litellm", reason=_WHY)
ChatOpenAI = pytest.importorskip("langchain_openai", reason=_WHY).ChatOpenAI

import openai                                                  # noqa: E402
from pydantic import BaseModel, Field                          # noqa: E402

from test_serve_support import ServerProcess                   # noqa: E402

KEY = "client-key"
MAX_TOKENS = 96           # the demo model is tiny: answers are cut, which the clients must survive
RAW_XML = ("<tool_call>", "<function=", "<parameter=", "</tool_call>")


# Bounded integers: the tiny demo model, asked for an unbounded JSON integer, writes
# "10000000..." until the length limit (the grammar allows any number of digits), and its string
# values never close. The bounds make the grammar end the number, as a real model would itself.
class Add(BaseModel):
    """Add two integers."""
    a: int = Field(ge=-99, le=99)
    b: int = Field(ge=-99, le=99)


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                  "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "Add 2 and 3."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", "--api-key", KEY],
                        ready_timeout=180)
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def model_id(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    (model,) = client.models.list().data
    return model.id


def no_raw_xml(*texts):
    for text in texts:
        assert not any(tag in (text or "") for tag in RAW_XML), text


# ---- langchain-openai -------------------------------------------------------------------------

def chat_model(server, model_id, **kw):
    return ChatOpenAI(model=model_id, base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                      timeout=120, max_tokens=MAX_TOKENS, **kw)


def test_langchain_plain_chat_answers_in_content(server, model_id):
    msg = chat_model(server, model_id, temperature=0).invoke("def fibonacci(n):")
    assert isinstance(msg.content, str) and msg.content.strip(), msg
    assert "reasoning_content" not in (msg.additional_kwargs or {}) \
        or not msg.additional_kwargs["reasoning_content"]
    no_raw_xml(msg.content)


def test_langchain_streams_the_same_text(server, model_id):
    llm = chat_model(server, model_id, temperature=0)
    whole = llm.invoke("import os")
    streamed = "".join(chunk.content for chunk in llm.stream("import os"))
    assert streamed == whole.content and streamed


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output_returns_an_object(server, model_id, method):
    structured = chat_model(server, model_id).with_structured_output(Add, method=method)
    out = structured.invoke("Add 2 and 3.")
    assert isinstance(out, Add), out


def test_langchain_bind_tools_forced_call(server, model_id):
    llm = chat_model(server, model_id).bind_tools([Add], tool_choice="Add")
    msg = llm.invoke("Add 2 and 3.")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "Add", msg
    Add(**msg.tool_calls[0]["args"])
    no_raw_xml(msg.content if isinstance(msg.content, str) else json.dumps(msg.content))


# ---- litellm ----------------------------------------------------------------------------------

def litellm_call(server, model_id, **kw):
    return litellm.completion(model="openai/" + model_id, api_base=server.url + "/v1",
                              api_key=KEY, max_tokens=MAX_TOKENS, timeout=120, num_retries=0,
                              **kw)


def test_litellm_plain_chat(server, model_id):
    resp = litellm_call(server, model_id, messages=[{"role": "user", "content": "import sys"}])
    text = resp.choices[0].message.content
    assert isinstance(text, str) and text.strip(), resp
    assert resp.usage.prompt_tokens > 0 and resp.usage.completion_tokens > 0
    no_raw_xml(text)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "add"}}])
def test_litellm_forced_tool_call(server, model_id, tool_choice):
    resp = litellm_call(server, model_id, messages=ASK, tools=[ADD_TOOL],
                        tool_choice=tool_choice)
    choice = resp.choices[0]
    calls = choice.message.tool_calls
    assert calls, resp
    for call in calls:
        assert call.function.name == "add"
        Add(**json.loads(call.function.arguments))
    assert choice.finish_reason in ("tool_calls", "length"), choice
    no_raw_xml(choice.message.content)


def test_litellm_streamed_forced_call(server, model_id):
    chunks = list(litellm_call(server, model_id, messages=ASK, tools=[ADD_TOOL],
                               tool_choice="required", parallel_tool_calls=False, stream=True))
    args, names, text = {}, set(), ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.function.name:
                names.add(tc.function.name)
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert names == {"add"} and len(args) == 1, chunks
    Add(**json.loads(args[0]))
    no_raw_xml(text)


# ---- instructor -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_returns_a_model(server, model_id, mode):
    client = instructor.from_openai(
        openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120),
        mode=mode)
    out = client.chat.completions.create(model=model_id, response_model=Add, messages=ASK,
                                         max_tokens=MAX_TOKENS, max_retries=0)
    assert isinstance(out, Add), out
