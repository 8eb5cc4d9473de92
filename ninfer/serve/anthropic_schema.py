"""Anthropic request bodies (/v1/messages, /v1/messages/count_tokens) -> GenPlan.

Content blocks map onto the Hugging Face chat form:
  user text blocks        -> {"role": "user", "content"}
  user tool_result blocks -> {"role": "tool", "content", "tool_call_id"} (one message each, first)
  assistant text          -> content;  thinking -> reasoning_content;  tool_use -> tool_calls
Tools `{name, description, input_schema}` become OpenAI-style function tools for the template.
Thinking follows Anthropic's API: the model thinks only when `thinking: {type: "enabled"}` (or
"adaptive") is sent, and `budget_tokens` bounds the reasoning (enforced: `</think>` is forced when
it is spent; it must be below max_tokens). Without `thinking` the template's thinking is off.
Forced tool use (`tool_choice` any / tool) together with thinking is a 400, as Anthropic answers;
`tool_choice` any / tool is enforced by a tool-call grammar. An unknown top-level field is a 400
naming it (MESSAGES_FIELDS; `serve --lenient` ignores unknown fields).
"""
from __future__ import annotations

from ..api import StructuredOutput
from . import fields as F
from .errors import invalid
from .openai_schema import only_tool, sampling_params
from .plan import GenPlan

MESSAGES_FIELDS = frozenset((
    "model", "messages", "system", "tools", "tool_choice", "thinking", "max_tokens", "temperature",
    "top_p", "top_k", "stop_sequences", "stream", "metadata",
    # informational: the capacity tier ("auto" / "standard_only") cannot change the output
    "service_tier",
    # sampling extensions shared with the OpenAI routes (openai_schema.sampling_params)
    "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "logit_bias", "stop_token_ids", "ignore_eos"))
# a /v1/messages body may be counted as is: the fields that do not shape the prompt are ignored
COUNT_TOKENS_FIELDS = MESSAGES_FIELDS


def parse_messages(body, gateway) -> GenPlan:
    body = F.json_object(body, "messages")
    F.check_known(body, MESSAGES_FIELDS, gateway, "messages")
    F.get(body, "model", "str")
    # metadata.user_id: the context cache's session hint (a hint only: no effect on the answer)
    session = F.session_hint(F.get(body, "metadata", "dict", default={}), "user_id",
                             param="metadata.user_id")
    max_tokens = F.get(body, "max_tokens", "int", required=True, lo=1, hi=(1 << 31) - 1)
    messages = anthropic_messages(body)
    tools = _apply_tool_choice(body.get("tool_choice"), _tools(body))
    forced = _forced_tool_use(body, tools)
    thinking, budget = thinking_config(body)
    if thinking and forced is not None:
        raise invalid("thinking may not be enabled when 'tool_choice' forces tool use "
                      "(type 'any' or 'tool'); use 'auto' or disable thinking", "tool_choice")
    if budget is not None and budget >= max_tokens:
        raise invalid(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' "
                      f"({max_tokens})", "thinking.budget_tokens")
    params = sampling_params(body, gateway, max_tokens=max_tokens, stop_key="stop_sequences",
                             temperature_hi=1.0, structured=forced)
    params.thinking_budget = budget
    params.parallel_tool_calls = not _disables_parallel_calls(body.get("tool_choice"))
    stream = F.get(body, "stream", "bool", default=False)
    return GenPlan(prompt=messages, params=params, tools=tools, enable_thinking=thinking,
                   stream=stream, stop=tuple(params.stop), session=session)


def parse_count_tokens(body, gateway) -> tuple:
    """-> (messages, tools, enable_thinking) for the chat template; `tool_choice` picks the tools
    as it does for /v1/messages, so the count is that request's `input_tokens`."""
    body = F.json_object(body, "count_tokens")
    F.check_known(body, COUNT_TOKENS_FIELDS, gateway, "count_tokens")
    F.get(body, "model", "str")
    tools = _apply_tool_choice(body.get("tool_choice"), _tools(body))
    return anthropic_messages(body), tools, thinking_config(body)[0]


def thinking_config(body: dict) -> tuple:
    """(enable_thinking, budget_tokens or None). No `thinking` field: off (Anthropic's API gives
    thinking blocks only when asked)."""
    thinking = F.get(body, "thinking", "dict")
    if thinking is None:
        return False, None
    kind = thinking.get("type")
    if kind == "enabled":
        return True, F.get(thinking, "budget_tokens", "int", param="thinking.budget_tokens",
                           lo=1, required=True)
    if kind == "adaptive":
        return True, None
    if kind == "disabled":
        return False, None
    raise invalid(f"'thinking.type' must be 'enabled', 'adaptive' or 'disabled', got {kind!r}",
                  "thinking.type")


def anthropic_messages(body: dict) -> list:
    out = []
    system = body.get("system")
    if system is not None:
        text = _blocks_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    raw = F.get(body, "messages", "list", required=True)
    if not raw:
        raise invalid("'messages' must hold at least one message", "messages")
    for i, m in enumerate(raw):
        param = f"messages.{i}"
        if not isinstance(m, dict):
            raise invalid(f"'{param}' must be an object", param)
        role = m.get("role")
        if role == "user":
            out.extend(_user_message(m.get("content"), f"{param}.content"))
        elif role == "assistant":
            out.append(_assistant_message(m.get("content"), f"{param}.content"))
        else:
            raise invalid(f"'{param}.role' must be 'user' or 'assistant', got {role!r}",
                          f"{param}.role")
    if raw[-1].get("role") == "assistant":
        raise invalid("a final assistant message (prefill) is not supported; "
                      "the last message must be the user's", f"messages.{len(raw) - 1}.role")
    return out


def _blocks(content, param: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or an array of content blocks", param)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"'{param}.{j}' must be a content block object with a 'type'",
                          f"{param}.{j}")
    return content


def _block_text(block: dict, param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"'{param}.text' must be a string", f"{param}.text")
    return text


def _blocks_text(content, param: str) -> str:
    texts = []
    for j, block in enumerate(_blocks(content, param)):
        if block["type"] != "text":
            raise invalid(f"block type {block['type']!r} at '{param}.{j}' is not supported here "
                          "(text only)", f"{param}.{j}.type")
        texts.append(_block_text(block, f"{param}.{j}"))
    return "\n".join(texts)


def _user_message(content, param: str) -> list:
    tool_msgs, texts, images = [], [], []
    for j, block in enumerate(_blocks(content, param)):
        p = f"{param}.{j}"
        if block["type"] == "text":
            texts.append(_block_text(block, p))
        elif block["type"] == "image":        # the Frontend decodes (or fetches) and checks it
            src = block.get("source")
            if not isinstance(src, dict) or not (
                    (src.get("type") == "base64" and isinstance(src.get("data"), str))
                    or (src.get("type") == "url" and isinstance(src.get("url"), str))):
                raise invalid(f"'{p}.source' must be {{\"type\": \"base64\", \"media_type\": "
                              "..., \"data\": ...}} or {\"type\": \"url\", \"url\": ...} "
                              "(fetched from --allow-media-urls hosts only)", f"{p}.source")
            images.append(len(texts))
            texts.append({"type": "image", "source": block["source"]})
        elif block["type"] == "tool_result":
            use_id = F.get(block, "tool_use_id", "str", param=f"{p}.tool_use_id", required=True)
            inner = block.get("content", "")
            text = _blocks_text(inner, f"{p}.content") if inner else ""
            if block.get("is_error") is True:
                text = f"Error: {text}"
            tool_msgs.append({"role": "tool", "content": text, "tool_call_id": use_id})
        else:
            raise invalid(f"block type {block['type']!r} at '{p}' is not supported "
                          "(text, image and tool_result only)", f"{p}.type")
    out = tool_msgs
    if images:               # text and image parts in order
        out = out + [{"role": "user", "content": [
            t if isinstance(t, dict) else {"type": "text", "text": t} for t in texts]}]
    elif texts or not tool_msgs:
        out = out + [{"role": "user", "content": "\n".join(texts)}]
    return out


def _assistant_message(content, param: str) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(_blocks(content, param)):
        p = f"{param}.{j}"
        kind = block["type"]
        if kind == "text":
            texts.append(_block_text(block, p))
        elif kind == "thinking":
            thinking.append(F.get(block, "thinking", "str", param=f"{p}.thinking", default=""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            name = F.get(block, "name", "str", param=f"{p}.name", required=True)
            args = F.get(block, "input", "dict", param=f"{p}.input", default={})
            call = {"type": "function", "function": {"name": name, "arguments": args}}
            if isinstance(block.get("id"), str):
                call["id"] = block["id"]
            calls.append(call)
        else:
            raise invalid(f"block type {kind!r} at '{p}' is not supported", f"{p}.type")
    msg = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(body: dict):
    raw = F.get(body, "tools", "list")
    if not raw:
        return None
    tools = []
    for i, t in enumerate(raw):
        p = f"tools.{i}"
        if not isinstance(t, dict):
            raise invalid(f"'{p}' must be an object", p)
        if t.get("type", "custom") != "custom":
            raise invalid(f"server tool type {t.get('type')!r} at '{p}' is not supported "
                          "(custom tools only)", f"{p}.type")
        name = F.get(t, "name", "str", param=f"{p}.name", required=True)
        schema = F.get(t, "input_schema", "dict", param=f"{p}.input_schema", required=True)
        F.check_json_schema(schema, f"{p}.input_schema")
        fn = {"name": name, "parameters": schema}
        description = F.get(t, "description", "str", param=f"{p}.description")
        if description is not None:
            fn["description"] = description
        tools.append({"type": "function", "function": fn})
    return tools


def _forced_tool_use(body: dict, tools):
    """any -> one or more tool_use blocks (one when disable_parallel_tool_use); tool -> exactly
    one of the named tool. Called after _apply_tool_choice validated the choice."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") not in ("any", "tool"):
        return None
    if not tools:
        raise invalid(f"tool_choice {choice.get('type')!r} needs 'tools'", "tool_choice")
    single = _disables_parallel_calls(choice)
    if choice["type"] == "tool":
        return StructuredOutput("tool_call", tool_name=choice.get("name"),
                                parallel_tool_calls=False)
    return StructuredOutput("tool_call", parallel_tool_calls=not single)


def _disables_parallel_calls(choice) -> bool:
    """tool_choice.disable_parallel_tool_use (auto, any, tool): at most one tool_use block."""
    if not isinstance(choice, dict):
        return False
    return F.get(choice, "disable_parallel_tool_use", "bool",
                 param="tool_choice.disable_parallel_tool_use", default=False)


def _apply_tool_choice(choice, tools):
    """auto/any -> every tool; tool -> only the named one; none -> no tools. `any` and `tool`
    are also enforced by a grammar (_forced_tool_use)."""
    if choice is None:
        return tools
    if not isinstance(choice, dict):
        raise invalid("'tool_choice' must be an object", "tool_choice")
    kind = choice.get("type")
    if kind in ("auto", "any"):
        return tools
    if kind == "none":
        return None
    if kind == "tool":
        return only_tool(tools, choice.get("name"), "tool_choice.name", "tool")
    raise invalid("'tool_choice.type' must be auto, any, tool or none", "tool_choice.type")
