"""Anthropic request bodies (/v1/messages, /v1/messages/count_tokens) -> GenPlan.

Content blocks map onto the Hugging Face chat form:
  user text blocks        -> {"role": "user", "content"}
  user tool_result blocks -> {"role": "tool", "content", "tool_call_id"} (one message each, first)
  assistant text          -> content;  thinking -> reasoning_content;  tool_use -> tool_calls
Tools `{name, description, input_schema}` become OpenAI-style function tools for the template.
`thinking` {type: enabled|disabled} switches the template's thinking mode; `budget_tokens` is
accepted but not enforced. `tool_choice` any / tool is enforced by a tool-call grammar.
"""
from __future__ import annotations

from ..api import StructuredOutput
from . import fields as F
from .errors import invalid
from .openai_schema import only_tool, sampling_params
from .plan import GenPlan


def parse_messages(body, gateway) -> GenPlan:
    body = F.json_object(body, "messages")
    F.get(body, "model", "str")
    max_tokens = F.get(body, "max_tokens", "int", required=True, lo=1)
    messages = anthropic_messages(body)
    tools = _apply_tool_choice(body.get("tool_choice"), _tools(body))
    params = sampling_params(body, gateway, max_tokens=max_tokens, stop_key="stop_sequences",
                             temperature_hi=1.0, structured=_forced_tool_use(body, tools))
    stream = F.get(body, "stream", "bool", default=False)
    return GenPlan(prompt=messages, params=params, tools=tools,
                   enable_thinking=thinking_enabled(body, gateway), stream=stream,
                   stop=tuple(params.stop))


def parse_count_tokens(body, gateway) -> tuple:
    """-> (messages, tools, enable_thinking) for the chat template; `tool_choice` picks the tools
    as it does for /v1/messages, so the count is that request's `input_tokens`."""
    body = F.json_object(body, "count_tokens")
    F.get(body, "model", "str")
    tools = _apply_tool_choice(body.get("tool_choice"), _tools(body))
    return anthropic_messages(body), tools, thinking_enabled(body, gateway)


def thinking_enabled(body: dict, gateway) -> bool:
    thinking = F.get(body, "thinking", "dict")
    if thinking is None:
        return gateway.config.enable_thinking
    kind = thinking.get("type")
    if kind in ("enabled", "adaptive"):
        F.get(thinking, "budget_tokens", "int", param="thinking.budget_tokens", lo=1)
        return True
    if kind == "disabled":
        return False
    raise invalid(f"'thinking.type' must be 'enabled' or 'disabled', got {kind!r}",
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
    tool_msgs, texts = [], []
    for j, block in enumerate(_blocks(content, param)):
        p = f"{param}.{j}"
        if block["type"] == "text":
            texts.append(_block_text(block, p))
        elif block["type"] == "tool_result":
            use_id = F.get(block, "tool_use_id", "str", param=f"{p}.tool_use_id", required=True)
            inner = block.get("content", "")
            text = _blocks_text(inner, f"{p}.content") if inner else ""
            if block.get("is_error") is True:
                text = f"Error: {text}"
            tool_msgs.append({"role": "tool", "content": text, "tool_call_id": use_id})
        else:
            raise invalid(f"block type {block['type']!r} at '{p}' is not supported "
                          "(text and tool_result only)", f"{p}.type")
    out = tool_msgs
    if texts or not tool_msgs:
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
    single = F.get(choice, "disable_parallel_tool_use", "bool",
                   param="tool_choice.disable_parallel_tool_use", default=False)
    if choice["type"] == "tool":
        return StructuredOutput("tool_call", tool_name=choice.get("name"),
                                parallel_tool_calls=False)
    return StructuredOutput("tool_call", parallel_tool_calls=not single)


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
