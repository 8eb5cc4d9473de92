"""Render a chat template the way Hugging Face `apply_chat_template` does, in a sandbox.

Conventions kept from HF (a checkpoint's template is written against them): `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps non-ASCII text and key order
(`ensure_ascii=False`, optional `indent`), `raise_exception(msg)`, `strftime_now(fmt)`, the special token
strings (`bos_token`, `eos_token`, ...) and the variables `messages`, `tools`,
`add_generation_prompt`, plus any extra keyword (`enable_thinking`, `add_vision_id`, ...).
"""
from __future__ import annotations

import copy
import datetime
import json
import pathlib
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ....errors import ArtifactError, RequestError

BUILTIN_TEMPLATE_PATH = pathlib.Path(__file__).with_name("qwen3_5_chat_template.jinja")


class TemplateRaised(Exception):
    """`raise_exception` in a template: the template rejects the conversation."""


def _raise_exception(message):
    raise TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def builtin_template_source() -> str:
    return BUILTIN_TEMPLATE_PATH.read_text(encoding="utf-8")


class ChatTemplate:
    """One compiled template plus the special-token strings it may reference."""

    def __init__(self, source: str, special_tokens: Optional[Mapping[str, str]] = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ArtifactError(f"chat template: syntax error at line {exc.lineno}: {exc.message}")
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence] = None,
               add_generation_prompt: bool = True, **extra) -> str:
        messages = normalize_messages(messages)
        tools = normalize_tools(tools)
        context = {**self.special_tokens, **extra, "messages": messages, "tools": tools,
                   "add_generation_prompt": bool(add_generation_prompt)}
        try:
            return self._template.render(**context)
        except TemplateRaised as exc:
            raise RequestError(f"chat template rejected the messages: {exc}") from None
        except RecursionError:
            raise RequestError("messages or tools are nested too deeply to render") from None
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template failed on these messages: {exc}") from None
        except (TypeError, AttributeError, KeyError, ValueError) as exc:
            raise RequestError(f"chat template failed on these messages: "
                               f"{type(exc).__name__}: {exc}") from None


def normalize_messages(messages) -> list:
    """Check the message list's shape and return a deep copy the template may read.

    Assistant tool calls whose `arguments` are a JSON string (OpenAI's wire form) are parsed into a
    dict, as vLLM does, so templates that iterate the arguments (Qwen3.5's XML format) work."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        message = _copied(dict(message), f"messages[{i}]")
        calls = message.get("tool_calls")
        if calls is not None:
            if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
                raise RequestError(f"messages[{i}].tool_calls must be a list")
            message["tool_calls"] = [_normalize_call(call, i, j) for j, call in enumerate(calls)]
        out.append(message)
    return out


def _normalize_call(call, i: int, j: int):
    if not isinstance(call, Mapping):
        raise RequestError(f"messages[{i}].tool_calls[{j}] must be an object")
    call = dict(call)
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise RequestError(f"messages[{i}].tool_calls[{j}] needs a function name")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(f"messages[{i}].tool_calls[{j}].arguments is not valid JSON") from None
        if not isinstance(parsed, dict):
            raise RequestError(f"messages[{i}].tool_calls[{j}].arguments must be a JSON object")
        fn = {**fn, "arguments": parsed}
        if "function" in call:
            call["function"] = fn
        else:
            call = fn
    return call


def normalize_tools(tools) -> Optional[list]:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise RequestError("tools must be a list of tool definitions")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise RequestError(f"tools[{i}] must be an object")
    return [_copied(dict(t), f"tools[{i}]") for i, t in enumerate(tools)] or None


def _copied(value, what: str):
    """A deep copy the template may read. Input nested past the recursion limit (JSON a gateway
    parses fine) is the client's error, not ours."""
    try:
        return copy.deepcopy(value)
    except RecursionError:
        raise RequestError(f"{what} is nested too deeply") from None
