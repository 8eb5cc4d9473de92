"""Chat template: the built-in Qwen3.5 template against expected strings, and the HF conventions of the
sandboxed renderer.

Source of the expectations (OFFICIAL below): the official Qwen3.5 `chat_template.jinja` shipped with
the Qwen/Qwen3.5-* checkpoints, whose output is restated by independent public re-implementations
(Rust ports `render_qwen35` / `render_qwen_chat`, a Java port checking the template's fragments):
  - system turn: `<|im_start|>system\\n` + trimmed system text + `<|im_end|>\\n`;
  - tools: system turn = "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>" + one
    `tojson` line per tool + "\\n</tools>" + the XML-format instructions and <IMPORTANT> reminder, then
    "\\n\\n" + system text when there is one;
  - user turns trimmed; assistant turns: `<think>\\n{reasoning}\\n</think>\\n\\n` only after the last
    user query that is not a bundle of tool responses; reasoning from `reasoning_content` or split out
    of the content at `</think>`;
  - tool calls: "\\n\\n" before the first when the content is non-empty, "\\n" between calls,
    `<tool_call>\\n<function=NAME>\\n` + per argument `<parameter=K>\\n{V}\\n</parameter>\\n` (mappings and
    lists via tojson, other values via Jinja's `string`) + `</function>\\n</tool_call>`;
  - tool messages: consecutive ones grouped in one user turn of `\\n<tool_response>\\n...\\n</tool_response>`;
  - generation prompt: `<|im_start|>assistant\\n<think>\\n` (thinking on: the template opens the think
    block) or `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` (enable_thinking=False);
  - images / videos: `<|vision_start|><|image_pad|><|vision_end|>` / `<|video_pad|>`, with
    "Picture N: " / "Video N: " when add_vision_id.
"""
import pytest

from ninfer.errors import ArtifactError, RequestError
from ninfer.models.qwen3_5.frontend import ChatTemplate, builtin_template_source

TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> "
    "block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be "
    "specified\n- You may provide optional reasoning for your function call in natural language "
    "BEFORE the function call, but NOT after\n- If there is no function call available, answer the "
    "question like normal with your current knowledge and do not tell the user about function "
    "calls\n</IMPORTANT>")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo d'une ville",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
WEATHER_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": '
                '"Météo d\'une ville", "parameters": {"type": "object", "properties": {"city": '
                '{"type": "string"}}, "required": ["city"]}}}')

GEN_THINK = "<|im_start|>assistant\n<think>\n"
GEN_NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tpl():
    return ChatTemplate(builtin_template_source(), {"eos_token": "<|im_end|>"})


def user(text):
    return {"role": "user", "content": text}


def test_single_user_thinking_on(tpl):  # OFFICIAL: generation prompt opens <think>
    assert tpl.render([user("Hi")], enable_thinking=True) == \
        "<|im_start|>user\nHi<|im_end|>\n" + GEN_THINK


def test_thinking_defaults_on_when_flag_absent(tpl):  # OFFICIAL: `enable_thinking is false` test
    assert tpl.render([user("Hi")]) == "<|im_start|>user\nHi<|im_end|>\n" + GEN_THINK


def test_single_user_thinking_off(tpl):  # OFFICIAL: empty think block in the generation prompt
    assert tpl.render([user("Hi")], enable_thinking=False) == \
        "<|im_start|>user\nHi<|im_end|>\n" + GEN_NO_THINK


def test_no_generation_prompt(tpl):
    assert tpl.render([user("Hi")], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_system_and_user_are_trimmed(tpl):  # OFFICIAL: render_content(...)|trim
    got = tpl.render([{"role": "system", "content": "  Be brief.\n"}, user("\n Hi \n")])
    assert got == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                   "<|im_start|>user\nHi<|im_end|>\n" + GEN_THINK)


def test_history_reasoning_dropped_before_last_query(tpl):
    # OFFICIAL: an assistant turn before the last user query renders its content only; reasoning
    # given inline as <think>...</think> is split off the content.
    msgs = [user("Q1"),
            {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nA1"},
            user("Q2")]
    assert tpl.render(msgs) == ("<|im_start|>user\nQ1<|im_end|>\n"
                                "<|im_start|>assistant\nA1<|im_end|>\n"
                                "<|im_start|>user\nQ2<|im_end|>\n" + GEN_THINK)


def test_reasoning_kept_after_last_query(tpl):
    # OFFICIAL: assistant turns after the last user query keep <think>\n{reasoning|trim}\n</think>\n\n
    msgs = [user("Q"), {"role": "assistant", "content": "Answer.",
                        "reasoning_content": "\n\nstep 1\nstep 2\n"}]
    assert tpl.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nstep 1\nstep 2\n</think>\n\nAnswer.<|im_end|>\n")


def test_empty_reasoning_after_last_query_renders_empty_block(tpl):
    msgs = [user("Q"), {"role": "assistant", "content": "A"}]
    assert tpl.render(msgs, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n")


def test_tools_block_without_system(tpl):  # OFFICIAL: "# Tools" block, tojson keeps non-ASCII
    got = tpl.render([user("Weather?")], tools=[WEATHER])
    assert got == ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
                   "<tools>\n" + WEATHER_JSON + "\n</tools>" + TOOLS_INSTRUCTIONS + "<|im_end|>\n"
                   "<|im_start|>user\nWeather?<|im_end|>\n" + GEN_THINK)


def test_tools_block_with_system_and_two_tools(tpl):  # OFFICIAL: system text after the block
    other = {"type": "function", "function": {"name": "noop", "parameters": {}}}
    got = tpl.render([{"role": "system", "content": "Sys."}, user("Hi")], tools=[WEATHER, other])
    assert got.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following "
                          "functions:\n\n<tools>\n" + WEATHER_JSON + "\n"
                          '{"type": "function", "function": {"name": "noop", "parameters": {}}}'
                          "\n</tools>" + TOOLS_INSTRUCTIONS + "\n\nSys.<|im_end|>\n")


def test_tool_calls_and_grouped_tool_responses(tpl):
    # OFFICIAL: "\n\n" before the first call after content, "\n" between calls, XML parameters
    # (mapping/list -> tojson, bool -> Jinja string "True", numbers as written), string arguments
    # (OpenAI wire form) parsed first; tool responses grouped into one user turn.
    msgs = [
        user("Plan a trip"),
        {"role": "assistant", "content": "Checking.", "reasoning_content": "need data",
         "tool_calls": [
             {"id": "1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
             {"id": "2", "type": "function",
              "function": {"name": "book", "arguments": {"opts": {"seat": ["A", 1]},
                                                          "ok": True, "note": "two\nlines"}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "2", "content": "booked"},
    ]
    got = tpl.render(msgs)
    assert got == (
        "<|im_start|>user\nPlan a trip<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nneed data\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=book>\n<parameter=opts>\n{\"seat\": [\"A\", 1]}\n</parameter>\n"
        "<parameter=ok>\nTrue\n</parameter>\n<parameter=note>\ntwo\nlines\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nbooked\n</tool_response><|im_end|>\n" + GEN_THINK)


def test_tool_call_without_content_has_no_separator(tpl):  # OFFICIAL: content|trim is falsy
    msgs = [user("Q"), {"role": "assistant", "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert tpl.render(msgs, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>\n")


def test_tool_response_user_turn_is_not_the_last_query(tpl):
    # OFFICIAL: a user turn that only wraps tool responses does not move the last-query index, so
    # the assistant turn before it keeps its reasoning
    msgs = [user("Q"), {"role": "assistant", "content": "",
                        "reasoning_content": "think",
                        "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            user("<tool_response>\nR\n</tool_response>")]
    assert "<|im_start|>assistant\n<think>\nthink\n</think>\n\n<tool_call>" in tpl.render(msgs)


def test_image_and_video_placeholders(tpl):  # OFFICIAL: vision placeholders, add_vision_id
    content = [{"type": "image", "image": "a.png"}, {"type": "text", "text": "and"},
               {"type": "video", "video": "b.mp4"}, {"type": "image_url", "image_url": {"url": "x"}},
               {"type": "text", "text": " what?"}]
    assert tpl.render([user(content)], add_generation_prompt=False) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and"
        "<|vision_start|><|video_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
        " what?<|im_end|>\n")
    assert tpl.render([user(content)], add_generation_prompt=False, add_vision_id=True) == (
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>and"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|>"
        "Picture 2: <|vision_start|><|image_pad|><|vision_end|> what?<|im_end|>\n")


@pytest.mark.parametrize("msgs, match", [
    ([], "No messages"),
    ([user("a"), {"role": "system", "content": "late"}], "System message must be at the beginning"),
    ([{"role": "system", "content": "s"}], "No user query"),
    ([user("a"), {"role": "robot", "content": "x"}], "Unexpected message role"),
    ([{"role": "system", "content": [{"type": "image"}]}, user("a")], "cannot contain images"),
    ([user([{"type": "audio"}])], "Unexpected item type"),
])
def test_template_rejections_are_request_errors(tpl, msgs, match):  # OFFICIAL raise_exception texts
    with pytest.raises(RequestError, match=match):
        tpl.render(msgs)


def test_bad_message_shapes(tpl):
    with pytest.raises(RequestError, match="list"):
        tpl.render("hello")
    with pytest.raises(RequestError, match="role"):
        tpl.render([{"content": "no role"}])
    with pytest.raises(RequestError, match="arguments is not valid JSON"):
        tpl.render([user("q"), {"role": "assistant", "content": "",
                                "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}])


def test_caller_messages_are_not_mutated(tpl):
    call = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    msgs = [user("q"), {"role": "assistant", "content": "", "tool_calls": [call]}]
    tpl.render(msgs)
    assert call["function"]["arguments"] == '{"a": 1}'


# ---- HF conventions of the renderer (templates other than ours rely on them) -------------------

def test_hf_conventions():
    src = ("{%- for m in messages -%}{%- if loop.index0 == 2 %}{% break %}{% endif -%}"
           "{{ m.content }}|{%- endfor -%}"
           "{{ bos_token }}{{ eos_token }}{{ tools | tojson }}{{ {'k': [1]} | tojson(indent=2) }}"
           "{{ strftime_now('%Y') | length }}{{ enable_thinking }}")
    t = ChatTemplate(src, {"bos_token": "<s>", "eos_token": "</s>"})
    got = t.render([user("a"), user("b"), user("c")], tools=[{"name": "é"}], enable_thinking=False)
    assert got == 'a|b|<s></s>[{"name": "é"}]{\n  "k": [\n    1\n  ]\n}4False'


def test_trim_and_lstrip_blocks_like_hf():
    t = ChatTemplate("  {% if true %}\nx\n  {% endif %}\ny")
    assert t.render([user("a")]) == "x\ny"


def test_raise_exception_and_sandbox():
    with pytest.raises(RequestError, match="custom stop"):
        ChatTemplate("{{ raise_exception('custom stop') }}").render([user("a")])
    with pytest.raises(RequestError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([user("a")])
    with pytest.raises(RequestError):   # immutable sandbox: no mutation of inputs
        ChatTemplate("{{ messages.append(1) }}").render([user("a")])


def test_syntax_error_is_artifact_error():
    with pytest.raises(ArtifactError, match="syntax"):
        ChatTemplate("{% if %}")


def _nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("where", ["content", "tool call arguments", "tools"])
def test_deeply_nested_input_is_a_request_error(tpl, where):
    """JSON a gateway parses fine (~700 levels) overflowed deepcopy / tojson: RecursionError
    escaped instead of a RequestError (the client's fault, a 400)."""
    deep = _nested(700)
    messages = [{"role": "user", "content": "hi"}]
    tools = None
    if where == "content":
        messages = [{"role": "user", "content": deep}]
    elif where == "tools":
        tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    else:
        messages += [{"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "f", "arguments": {"a": deep}}}]}]
    with pytest.raises(RequestError, match="nested too deeply"):
        tpl.render(messages, tools)
