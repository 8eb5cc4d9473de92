"""Render a chat template the way Hugging Face `apply_chat_template` does, in a sandbox.

Conventions kept from HF (a checkpoint's template is written against them): `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps non-ASCII text and key order
(`ensure_ascii=False`, optional `indent`), `raise_exception(msg)`, `strftime_now(fmt)`, the special token
strings (`bos_token`, `eos_token`, ...) and the variables `messages`, `tools`,
`add_generation_prompt`, plus any extra keyword (`enable_thinking`, `add_vision_id`, ...).

Every render runs under a budget (`time_budget_s`, `max_output_chars`): the sandbox checks the clock
at each call, attribute lookup, filter and arithmetic operator and at each output chunk, and refuses
operations whose result would pass the size limit before building it (`"x" * n`, `str.center(n)`,
`|replace`, ...). A template that loops for minutes or builds a 100 MB string fails with a
RequestError (code "template_budget_exceeded") instead of holding a thread or the memory.
"""
from __future__ import annotations

import copy
import datetime
import functools
import json
import pathlib
import threading
import time
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
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


class _Budget(threading.local):
    """The running render's limits on this thread (None outside a render)."""
    deadline = None
    max_chars = 0
    time_budget_s = 0.0


_budget = _Budget()


def _over(what: str):
    return RequestError(f"chat template exceeded its render budget: {what}",
                        code="template_budget_exceeded")


def _tick() -> None:
    if _budget.deadline is not None and time.monotonic() > _budget.deadline:
        raise _over(f"rendering took more than {_budget.time_budget_s:g} s")


def _check_size(value) -> None:
    if _budget.deadline is not None and isinstance(value, (str, bytes, list, tuple, dict)) \
            and len(value) > _budget.max_chars:
        raise _over(f"a value of {len(value)} items exceeds {_budget.max_chars}")


def _check_counts(args, kwargs) -> None:
    """An integer argument beyond the size limit (`center(10**10)`, `indent(10**9)`) would make
    a result past the limit before any check could see it."""
    if _budget.deadline is None:
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and \
                abs(value) > _budget.max_chars:
            raise _over(f"an argument of {value} exceeds the size limit {_budget.max_chars}")


# filters whose integer arguments are output widths or counts (a big number elsewhere, as in
# `{{ schema.maximum|tojson }}`, is just data)
_SIZED_FILTERS = frozenset(["center", "indent", "wordwrap", "truncate", "batch", "slice"])


def _budgeted_filter(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _tick()
        if name in _SIZED_FILTERS:
            _check_counts(args[1:], kwargs)
        if name == "replace" and len(args) >= 3 and isinstance(args[0], str):
            text, old, new = str(args[0]), str(args[1]), str(args[2])
            hits = text.count(old) if old else len(text) + 1
            _check_size_estimate(len(text) + hits * len(new))
        result = fn(*args, **kwargs)
        _check_size(result)
        return result
    return run


def _check_size_estimate(n: int) -> None:
    if _budget.deadline is not None and n > _budget.max_chars:
        raise _over(f"a value of {n} items would exceed {_budget.max_chars}")


def _seq_len(value):
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class _BudgetedCodegen(CodeGenerator):
    """`a ~ b` compiles to a plain join the sandbox never sees; route it through the budget
    (doubling a string with `~` in a loop reached gigabytes between two clock checks)."""

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            return super().visit_Concat(node, frame)
        self.write("environment.budgeted_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = _BudgetedCodegen

    @staticmethod
    def budgeted_concat(parts) -> str:
        _tick()
        texts = [str(p) for p in parts]
        _check_size_estimate(sum(map(len, texts)))
        return "".join(texts)

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _seq_len(seq) is not None and isinstance(n, int):
                    _check_size_estimate(_seq_len(seq) * n)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(left) > 1 and right > 4096:
            raise _over(f"{left} ** {right} is too large a number")
        elif operator == "%" and isinstance(left, str) and "*" in left:
            raise _over("'%' formatting with a '*' width")
        result = super().call_binop(context, operator, left, right)
        _check_size(result)
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        _tick()
        if isinstance(getattr(__obj, "__self__", None), (str, bytes, list)):
            _check_counts(args, kwargs)         # 'x'.center(n), .ljust(n), .zfill(n), ...
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(result)
        return result

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)


def builtin_template_source() -> str:
    return BUILTIN_TEMPLATE_PATH.read_text(encoding="utf-8")


class ChatTemplate:
    """One compiled template plus the special-token strings it may reference."""

    def __init__(self, source: str, special_tokens: Optional[Mapping[str, str]] = None, *,
                 time_budget_s: float = 5.0, max_output_chars: int = 32 << 20):
        env = _BudgetedSandbox(trim_blocks=True, lstrip_blocks=True,
                               extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.filters = {name: _budgeted_filter(name, fn) for name, fn in env.filters.items()}
        self.time_budget_s = time_budget_s
        self.max_output_chars = max_output_chars
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
        _budget.deadline = time.monotonic() + self.time_budget_s
        _budget.max_chars, _budget.time_budget_s = self.max_output_chars, self.time_budget_s
        try:
            return self._render_within_budget(context)
        except TemplateRaised as exc:
            raise RequestError(f"chat template rejected the messages: {exc}") from None
        except RecursionError:
            raise RequestError("messages or tools are nested too deeply to render") from None
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template failed on these messages: {exc}") from None
        except (TypeError, AttributeError, KeyError, ValueError) as exc:
            raise RequestError(f"chat template failed on these messages: "
                               f"{type(exc).__name__}: {exc}") from None
        except (MemoryError, OverflowError) as exc:
            raise _over(f"{type(exc).__name__}") from None
        finally:
            _budget.deadline = None

    def _render_within_budget(self, context) -> str:
        parts, size = [], 0
        for chunk in self._template.generate(**context):
            size += len(chunk)
            if size > self.max_output_chars:
                raise _over(f"the output passed {self.max_output_chars} characters")
            _tick()
            parts.append(chunk)
        return "".join(parts)


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
