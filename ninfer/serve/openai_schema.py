"""OpenAI request bodies (/v1/chat/completions, /v1/completions) -> GenPlan; /v1/embeddings ->
(inputs, encoding_format, dimensions).

Every top-level field is either implemented or refused: an unknown field is a 400 naming it
(`serve --lenient` ignores unknown fields instead; CHAT_FIELDS / COMPLETION_FIELDS list the
accepted ones, docs/serving.md documents them). A known field with a bad value is a 400 that names
it. Sampling fields a request leaves out take the server's defaults (serve flags, then the
checkpoint's generation_config.json, then greedy). Messages become the Hugging Face chat form the
Qwen3.5 template reads:
  system/developer -> {"role": "system", "content"}
  user             -> {"role": "user", "content"}
  assistant        -> {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}
                      (tool call `arguments` JSON strings are parsed into objects)
  tool             -> {"role": "tool", "content", "tool_call_id"}
Only text content parts are accepted (the vision path is not served yet).

Thinking: `chat_template_kwargs.enable_thinking` switches it; `reasoning_effort` bounds it by a
budget of reasoning tokens (REASONING_BUDGETS; "none" turns it off). A forced tool choice
(`required` or a named function) with thinking on is bounded too (FORCED_TOOL_THINKING_BUDGET, at
most half of max_tokens), so the reasoning leaves room for the forced call.
"""
from __future__ import annotations

import json

from ..api import MAX_CHOICES, SamplingParams, StructuredOutput
from ..errors import RequestError
from . import fields as F
from .errors import invalid
from .plan import GenPlan
from .structured_outputs import GUIDED_FIELDS, guided_output

# fields a sampling request of either OpenAI endpoint accepts
_SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
                    "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "n", "stream",
                    "stream_options", "response_format",
                    # the context cache's session hint (session_hint below)
                    "prompt_cache_key", "user",
                    # informational fields the official SDKs send that cannot change the output
                    # (storage, billing tier, abuse tracking): accepted, no effect
                    "store", "metadata", "service_tier", "safety_identifier")
_SAMPLING_FIELDS += GUIDED_FIELDS       # vLLM's constraints: structured_outputs.py
CHAT_FIELDS = frozenset(_SAMPLING_FIELDS + (
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort"))
COMPLETION_FIELDS = frozenset(_SAMPLING_FIELDS + ("prompt", "logprobs", "echo", "suffix",
                                                  "best_of"))
# reasoning_effort -> most reasoning tokens (None: thinking off)
REASONING_BUDGETS = {"none": None, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384}
FORCED_TOOL_THINKING_BUDGET = 1024
_MAX_COUNT = (1 << 31) - 1          # max_tokens and friends above this are a 400, not a clamp


def parse_chat(body, gateway) -> GenPlan:
    body = F.json_object(body, "chat completion")
    F.check_known(body, CHAT_FIELDS, gateway, "chat completion")
    structured = guided_output(body, gateway, _common_checks(body))
    messages = chat_messages(F.get(body, "messages", "list", required=True))
    tools = chat_tools(body)
    forced = _forced_tool_call(body, tools)
    tools = _apply_tool_choice(body.get("tool_choice"), tools)
    if forced is not None:
        if structured is not None:
            raise invalid("an output constraint ('response_format' json modes, "
                          "'structured_outputs', 'guided_*') and a forced 'tool_choice' cannot be "
                          "combined (the output is either constrained content or tool calls)",
                          "response_format")
        structured = forced
    kwargs = F.get(body, "chat_template_kwargs", "dict", default={})
    thinking = F.get(kwargs, "enable_thinking", "bool", param="chat_template_kwargs.enable_thinking",
                     default=gateway.default_thinking())
    effort = F.get(body, "reasoning_effort", "str")
    if effort is not None and effort not in REASONING_BUDGETS:
        raise invalid(f"'reasoning_effort' must be one of {list(REASONING_BUDGETS)}, got "
                      f"{effort!r}", "reasoning_effort")
    budget = None
    if effort == "none":
        thinking = False
    elif effort is not None:
        budget = REASONING_BUDGETS[effort]
    want_logprobs = F.get(body, "logprobs", "bool", default=False)
    top = F.get(body, "top_logprobs", "int", lo=0, hi=20)
    if top is not None and not want_logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_param = "max_completion_tokens"
    max_tokens = F.get(body, max_param, "int", lo=1, hi=_MAX_COUNT)
    if max_tokens is None:
        max_param = "max_tokens"
        max_tokens = F.get(body, max_param, "int", lo=1, hi=_MAX_COUNT)
    params = sampling_params(body, gateway, max_tokens=max_tokens, max_tokens_param=max_param,
                             logprobs=(top or 0) if want_logprobs else None,
                             structured=structured)
    if forced is not None and thinking:
        # the call must come: reasoning before it gets a bounded budget
        budget = min(budget or FORCED_TOOL_THINKING_BUDGET, params.max_tokens // 2)
    if thinking and budget is not None:
        params.thinking_budget = budget
    params.parallel_tool_calls = F.get(body, "parallel_tool_calls", "bool", default=True)
    stream, include_usage = _stream_flags(body)
    plan = GenPlan(prompt=messages, params=params, tools=tools, enable_thinking=thinking,
                   stream=stream, include_usage=include_usage, want_logprobs=want_logprobs,
                   stop=tuple(params.stop), session=session_hint(body),
                   max_tokens_param=max_param)
    return _with_choices(body, plan)


def parse_completion(body, gateway) -> GenPlan:
    body = F.json_object(body, "completion")
    F.check_known(body, COMPLETION_FIELDS, gateway, "completion")
    structured = guided_output(body, gateway, _common_checks(body))
    prompt = _completion_prompt(body.get("prompt"))
    if F.get(body, "suffix", "str"):
        raise invalid("'suffix' is not supported", "suffix")
    n_logprobs = F.get(body, "logprobs", "int", lo=0, hi=20)
    max_tokens = F.get(body, "max_tokens", "int", lo=1, hi=_MAX_COUNT)
    # a missing max_tokens is OpenAI's documented default for the legacy endpoint, 16
    params = sampling_params(body, gateway, max_tokens=max_tokens, logprobs=n_logprobs,
                             structured=structured, default_max_tokens=16)
    stream, include_usage = _stream_flags(body)
    plan = GenPlan(prompt=prompt, params=params, enable_thinking=False, stream=stream,
                   include_usage=include_usage, want_logprobs=n_logprobs is not None,
                   stop=tuple(params.stop), session=session_hint(body))
    plan.echo = F.get(body, "echo", "bool", default=False)
    return _with_choices(body, plan)


def _with_choices(body: dict, plan: GenPlan) -> GenPlan:
    """`n` choices (1..MAX_CHOICES, each a request of its own: routes submit them with
    choice_params' seeds); `best_of` (completions) is refused unless it equals n: ranking extra
    samples by their likelihood is not implemented."""
    plan.n = F.get(body, "n", "int", lo=1, hi=MAX_CHOICES, default=1)
    best_of = F.get(body, "best_of", "int")
    if best_of is not None and best_of != plan.n:
        raise invalid(f"'best_of' is not supported (it must be absent or equal 'n' = {plan.n}): "
                      "ask for 'n' choices instead", "best_of")
    return plan


def session_hint(body: dict):
    """The context cache's session hint: `prompt_cache_key` (OpenAI's cache-routing key), else
    `user` (the end user's id); each is checked when present. Only a hint: which checkpoint a
    request reuses is decided by exact token comparison, so a wrong or shared key costs at most
    a miss."""
    key = F.session_hint(body, "prompt_cache_key")
    user = F.session_hint(body, "user")
    return key if key is not None else user


def sampling_params(body: dict, gateway, *, max_tokens, logprobs=None, stop_key="stop",
                    temperature_hi=2.0, structured=None, max_tokens_param="max_tokens",
                    default_max_tokens=None) -> SamplingParams:
    """The sampling fields both protocols share; the server's defaults fill the gaps (serve
    flags, then the checkpoint's generation_config.json, then SamplingParams' own).

    max_tokens: the request's (None: it named none). One it names must fit under
    --max-tokens-cap (else a 400 here) and, with the prompt, in the context (else the Engine's
    ContextLengthError, a 400 naming the numbers); a missing one is the default
    (`default_max_tokens`, else the server's), at most the cap, cut to what the context leaves."""
    base = gateway.sampling_defaults()
    cap = gateway.config.max_tokens_cap
    clamp = max_tokens is None
    if clamp:
        max_tokens = default_max_tokens or gateway.tokens_left_default()
        max_tokens = max_tokens if cap is None else min(max_tokens, cap)
    elif cap is not None and max_tokens > cap:
        raise invalid(f"'{max_tokens_param}' is {max_tokens}, over this server's cap of {cap} "
                      "tokens (serve --max-tokens-cap)", max_tokens_param)
    params = SamplingParams(
        max_tokens=max_tokens,
        clamp_max_tokens=clamp,
        temperature=F.get(body, "temperature", "number", lo=0, hi=temperature_hi,
                          default=min(base.get("temperature", 0.0), temperature_hi)),
        top_p=F.get(body, "top_p", "number", lo=0, lo_open=True, hi=1,
                    default=base.get("top_p", 1.0)),
        top_k=_top_k(body, base.get("top_k", 0)),
        min_p=F.get(body, "min_p", "number", lo=0, hi=1, default=base.get("min_p", 0.0)),
        presence_penalty=F.get(body, "presence_penalty", "number", lo=-2, hi=2,
                               default=base.get("presence_penalty", 0.0)),
        frequency_penalty=F.get(body, "frequency_penalty", "number", lo=-2, hi=2,
                                default=base.get("frequency_penalty", 0.0)),
        repetition_penalty=F.get(body, "repetition_penalty", "number", lo=0, lo_open=True,
                                 default=base.get("repetition_penalty", 1.0)),
        seed=F.get(body, "seed", "int", lo=0, hi=(1 << 63) - 1),
        stop=F.stop_strings(body.get(stop_key), stop_key),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        ignore_eos=F.get(body, "ignore_eos", "bool", default=False),
        min_tokens=F.get(body, "min_tokens", "int", lo=0, hi=max_tokens, default=0),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        structured=structured,
    )
    try:
        return params.validate()
    except RequestError as exc:  # the field checks above should have caught it first
        raise invalid(str(exc)) from exc


def _token_ids(body: dict, key: str) -> tuple:
    ids = F.get(body, key, "list", default=[])
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_COUNT:
            raise invalid(f"'{key}[{i}]' must be a token id (an integer >= 0), got {t!r}",
                          f"{key}[{i}]")
    return tuple(ids)


def _logit_bias(body: dict):
    """{"token id": bias in [-100, 100]} (OpenAI's form: JSON object keys are strings). Ids outside
    the vocabulary are a 400 at submit, where the vocabulary is known."""
    bias = F.get(body, "logit_bias", "dict")
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        param = f"logit_bias.{key}"
        text = key.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 10):   # '\u00b2'.isdigit()
            raise invalid(f"'logit_bias' keys must be token ids (non-negative integers), got "
                          f"{key!r}", param)
        out[int(text)] = F.get(bias, key, "number", param=param, lo=-100, hi=100,
                               required=True)
    return out


def _top_k(body: dict, default: int) -> int:
    top_k = F.get(body, "top_k", "int", hi=_MAX_COUNT, default=default)
    if top_k == -1:       # vLLM's spelling of "disabled"
        return 0
    if top_k < 0:
        raise invalid(f"'top_k' must be >= 0 (or -1 to disable), got {top_k}", "top_k")
    return top_k


def _common_checks(body: dict):
    """Shared field checks; returns the StructuredOutput `response_format` asks for (or None)."""
    F.get(body, "model", "str")
    return _response_format(body)


def _response_format(body: dict):
    """text -> None; json_object -> any JSON object; json_schema -> JSON matching
    `json_schema.schema` (enforced by a grammar whether or not `strict` is set; no schema: any
    JSON value)."""
    fmt = F.get(body, "response_format", "dict")
    if fmt is None:
        return None
    kind = F.get(fmt, "type", "str", param="response_format.type", default="text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = F.get(fmt, "json_schema", "dict", param="response_format.json_schema",
                     required=True)
        F.get(spec, "name", "str", param="response_format.json_schema.name")
        F.get(spec, "strict", "bool", param="response_format.json_schema.strict")
        schema = F.get(spec, "schema", "dict", param="response_format.json_schema.schema",
                       default={})
        F.check_json_schema(schema, "response_format.json_schema.schema")
        return StructuredOutput("json_schema", schema)
    raise invalid(f"response_format type {kind!r} must be 'text', 'json_object' or "
                  "'json_schema'", "response_format.type")


def _forced_tool_call(body: dict, tools):
    """tool_choice 'required' -> one or more calls of any tool (one only when
    parallel_tool_calls is false); a named function -> exactly one call of it."""
    choice = body.get("tool_choice")
    parallel = F.get(body, "parallel_tool_calls", "bool", default=True)
    if choice == "required":
        if not tools:
            raise invalid("tool_choice 'required' needs 'tools'", "tool_choice")
        return StructuredOutput("tool_call", parallel_tool_calls=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        return StructuredOutput("tool_call", tool_name=choice["function"]["name"],
                                parallel_tool_calls=False)
    return None


def _stream_flags(body: dict) -> tuple:
    stream = F.get(body, "stream", "bool", default=False)
    opts = F.get(body, "stream_options", "dict", default={})
    include_usage = F.get(opts, "include_usage", "bool", param="stream_options.include_usage",
                          default=False)
    return stream, bool(stream and include_usage)


def _completion_prompt(prompt):
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]          # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        return prompt
    # JSON's numbers are int or float, so exactly {int} is ids (no bool); by types, not per id
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int} and \
            min(prompt) >= 0:
        return list(prompt)
    raise invalid("'prompt' must be a non-empty string or an array of token ids "
                  "(one prompt per request)", "prompt")


# ---- messages and tools --------------------------------------------------------------------------

def text_content(content, param: str, *, allow_none: bool = False) -> str:
    """A message's content: a string or an array of text parts."""
    if content is None:
        if allow_none:
            return ""
        raise invalid(f"'{param}' is required", param)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or an array of content parts", param)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"'{p}' must be an object", p)
        kind = part.get("type")
        if kind in ("text", "refusal"):
            text = part.get(kind)
            if not isinstance(text, str):
                raise invalid(f"'{p}.{kind}' must be a string", f"{p}.{kind}")
            texts.append(text)
        else:
            raise invalid(f"content part type {kind!r} at '{p}' is not supported (text only)",
                          f"{p}.type")
    return "\n".join(texts)


_MEDIA_PARTS = ("image_url", "video_url")


def user_content(content, param: str):
    """A user message's content: text as text_content makes it, or, when it holds `image_url` or
    `video_url` parts, the list of text and media parts in order (the Frontend decodes the
    media). A video part goes on as {"type": "video", "video_url": ...}, which the Qwen chat
    template renders as a video (it knows no "video_url" type)."""
    if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") in _MEDIA_PARTS for p in content):
        return text_content(content, param)
    parts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            url = part.get(kind)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise invalid(f"'{p}.{kind}.url' must be a string", f"{p}.{kind}.url")
            # data: URLs, and http(s) URLs the Frontend fetches from --allow-media-urls hosts
            if not url.startswith(("data:", "http://", "https://")):
                raise invalid(f"'{p}.{kind}.url' must be a data: URL (base64), or an http(s) "
                              "URL on a server started with --allow-media-urls",
                              f"{p}.{kind}.url")
            parts.append({"type": "image_url", "image_url": {"url": url}} if kind == "image_url"
                         else {"type": "video", "video_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": text_content([part], param)})
    return parts


def chat_messages(raw: list) -> list:
    if not raw:
        raise invalid("'messages' must hold at least one message", "messages")
    out = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"'{param}' must be an object", param)
        role = m.get("role")
        content_param = f"{param}.content"
        if role in ("system", "developer"):
            out.append({"role": "system", "content": text_content(m.get("content"), content_param)})
        elif role == "user":
            out.append({"role": "user", "content": user_content(m.get("content"), content_param)})
        elif role == "assistant":
            out.append(_assistant_message(m, param))
        elif role == "tool":
            msg = {"role": "tool", "content": text_content(m.get("content"), content_param)}
            call_id = F.get(m, "tool_call_id", "str", param=f"{param}.tool_call_id")
            if call_id is not None:
                msg["tool_call_id"] = call_id
            out.append(msg)
        else:
            raise invalid(f"'{param}.role' must be system, developer, user, assistant or tool; "
                          f"got {role!r}", f"{param}.role")
    return out


def _assistant_message(m: dict, param: str) -> dict:
    msg = {"role": "assistant",
           "content": text_content(m.get("content"), f"{param}.content", allow_none=True)}
    reasoning = F.get(m, "reasoning_content", "str", param=f"{param}.reasoning_content")
    if reasoning is None:
        reasoning = F.get(m, "reasoning", "str", param=f"{param}.reasoning")
    if reasoning:
        msg["reasoning_content"] = reasoning
    calls = F.get(m, "tool_calls", "list", param=f"{param}.tool_calls", default=[])
    if calls:
        msg["tool_calls"] = [_assistant_tool_call(c, f"{param}.tool_calls[{k}]")
                             for k, c in enumerate(calls)]
    return msg


def _assistant_tool_call(call, param: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise invalid(f"'{param}' must be an object with a 'function' object", param)
    fn = call["function"]
    name = F.get(fn, "name", "str", param=f"{param}.function.name", required=True)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise invalid(f"'{param}.function.arguments' is not valid JSON: {exc}",
                          f"{param}.function.arguments") from exc
    if not isinstance(args, dict):
        raise invalid(f"'{param}.function.arguments' must encode a JSON object",
                      f"{param}.function.arguments")
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def chat_tools(body: dict):
    """The request's `tools` (function form), each schema checked; None when there are none."""
    raw = F.get(body, "tools", "list")
    if not raw:
        return None
    tools = []
    for i, t in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(t.get("function"), dict):
            raise invalid(f"'{param}' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                          param)
        fn = t["function"]
        F.get(fn, "name", "str", param=f"{param}.function.name", required=True)
        F.get(fn, "description", "str", param=f"{param}.function.description")
        schema = F.get(fn, "parameters", "dict", param=f"{param}.function.parameters")
        if schema is not None:
            F.check_json_schema(schema, f"{param}.function.parameters")
        tools.append({"type": "function", "function": dict(fn)})
    return tools


def _apply_tool_choice(choice, tools):
    """none -> no tools in the prompt; auto/required -> all tools; a named function -> only that
    tool. `required` and a named choice are also enforced by a grammar (_forced_tool_call)."""
    if choice is None or choice in ("auto", "required"):
        return tools
    if choice == "none":
        return None
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        return only_tool(tools, choice["function"].get("name"), "tool_choice", "function")
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def only_tool(tools, name, param: str, what: str) -> list:
    """The tools (function form) named `name`; a 400 naming `param` when there is none."""
    chosen = [t for t in tools or () if t["function"]["name"] == name]
    if not chosen:
        raise invalid(f"tool_choice names {what} {name!r}, which is not in 'tools'", param)
    return chosen


# ---- /v1/embeddings ------------------------------------------------------------------------------

EMBEDDING_FIELDS = frozenset(("model", "input", "encoding_format", "dimensions", "user"))


def parse_embeddings(body, gateway) -> tuple:
    """-> (inputs, encoding_format, dimensions): `input` a string, an array of strings, an array
    of token ids or an array of those arrays (OpenAI's four forms); `encoding_format` "float"
    (default) or "base64" (little-endian float32, what the openai SDK asks for and decodes);
    `dimensions` (Matryoshka truncation, checked against the model's size at embed)."""
    body = F.json_object(body, "embeddings")
    F.check_known(body, EMBEDDING_FIELDS, gateway, "embeddings")
    F.get(body, "model", "str")
    F.get(body, "user", "str")
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_is_token(t) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a non-empty string, an array of strings, an array of "
                      "token ids or an array of token id arrays", "input")
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise invalid(f"'input[{i}]' must not be empty", f"input[{i}]")
        elif not (isinstance(item, list) and item and all(_is_token(t) for t in item)):
            raise invalid(f"'input[{i}]' must be a non-empty string or a non-empty array of "
                          "token ids", f"input[{i}]")
    fmt = F.get(body, "encoding_format", "str", default="float")
    if fmt not in ("float", "base64"):
        raise invalid(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                      "encoding_format")
    dimensions = F.get(body, "dimensions", "int", lo=1, hi=_MAX_COUNT)
    return raw, fmt, dimensions


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_COUNT
