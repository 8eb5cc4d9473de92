"""Constrained decoding: StructuredOutput specs -> llguidance grammars -> per-request matchers.

One GrammarCompiler per Frontend (one vocabulary). It builds the llguidance tokenizer lazily (about
1.5 s for the 248k Qwen3.5 vocabulary, only when the first structured request arrives), compiles
each distinct spec once into a prototype matcher (cached, keyed by the spec's canonical JSON), and
hands every request a `deep_copy` of it (microseconds; the compiled grammar is shared).

Grammars (Lark-like llguidance syntax):
- a prompt that opened `<think>` (the template's generation prompt with thinking on) starts with
  free reasoning text closed by the `</think>` token, then optional newlines; otherwise the
  structured part starts at the first token;
- json_schema / json_object: `%json {schema}` with fixed separators `", "` / `": "` and no other
  whitespace (a model free to emit whitespace can emit it forever; the fixed form is what
  `json.dumps` writes, so real models follow it naturally);
- tool_call: `<tool_call>\\n<function=NAME>\\n` + parameters + `</function>\\n</tool_call>`, the
  Qwen3.5 chat template's format (frontend/tool_parser.py parses it back). Parameters follow the
  tool's JSON schema `properties` in declaration order, required ones mandatory, optional ones
  optional; a string (or untyped, or string-admitting) value is free text up to the first
  `</parameter>` (never containing a `<parameter=...>` tag, which would split it), bounded by the
  schema's `maxLength` / `minLength` / `pattern` / `format` (FORMAT_PATTERNS) when a string-only
  property has them; an enum (or const) of strings is one of its values, anything else is
  `%json {property schema}` (which enforces the JSON-schema bounds llguidance supports:
  minimum/maximum, item counts, ...). A tool with no declared properties takes any `<parameter=NAME>` free-text parameters.
  One call when the spec names a tool or forbids parallel calls, else one or more separated by a
  newline; after the last of several, at most one newline, then EOS.
- regex / choice / grammar (text_rules): the regex as one lexeme, the choices as literals, a Lark
  (or converted GBNF) grammar nested whole with `%lark {...}`.
Every grammar ends the output: once complete, only EOS is allowed.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ....api import StructuredOutput, grammar_as_lark
from ....errors import RequestError
from .tool_parser import tool_schemas

_CACHE_SIZE = 128
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# free text of a parameter value: up to (and including) the first </parameter>, never holding a
# <parameter=NAME> opening that the parser would take for the next parameter
_VALUE_TERMINAL = (r"PVALUE: /(?s:.*)<\/parameter>\n/ & "
                   r"~/(?s:.*)<parameter=[^>\n<]*>(?s:.*)/")
_NAME_TERMINAL = r"PNAME: /[^>\n<]+/"


_LLTOK_LOCK = threading.Lock()
_LLTOKS: "OrderedDict[tuple, Any]" = OrderedDict()


def _shared_lltokenizer(tokenizer_json, vocab_size: int, eos: tuple):
    """One llguidance tokenizer per (tokenizer.json, vocabulary size, EOS ids) in the process:
    Engines over the same checkpoint (tests, reloads) skip the ~1.5 s build. Immutable once
    built, so sharing is safe."""
    import hashlib

    import llguidance
    data = tokenizer_json.encode("utf-8") if isinstance(tokenizer_json, str) else tokenizer_json
    key = (hashlib.blake2b(data, digest_size=16).hexdigest(), vocab_size, eos)
    with _LLTOK_LOCK:
        tok = _LLTOKS.get(key)
        if tok is None:
            tok = llguidance.LLTokenizer(data.decode("utf-8"), n_vocab=vocab_size,
                                         eos_token=list(eos))
            _LLTOKS[key] = tok
            while len(_LLTOKS) > 4:
                _LLTOKS.popitem(last=False)
        return tok


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class GrammarCompiler:
    """Compiled grammars of one vocabulary. Thread-safe: submit threads compile concurrently."""

    def __init__(self, tokenizer_json: bytes, vocab_size: int, eos_token_ids: Sequence[int],
                 token_id):
        self._tokenizer_json = tokenizer_json
        self._vocab_size = int(vocab_size)
        self._eos = [int(t) for t in eos_token_ids]
        self._token_id = token_id            # str -> Optional[int] (added tokens)
        self._lock = threading.Lock()
        self._lltok = None
        self._cache: "OrderedDict[str, Any]" = OrderedDict()

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                self._lltok = _shared_lltokenizer(self._tokenizer_json, self._vocab_size,
                                                  tuple(self._eos))
            return self._lltok

    def matcher(self, spec: StructuredOutput, tools=None, *, think_open: bool) -> "GrammarMatcher":
        """A fresh matcher for one request; RequestError naming the problem when the spec does not
        compile (bad schema, unknown tool)."""
        lark = self.lark(spec, tools, think_open=think_open)
        with self._lock:
            proto = self._cache.get(lark)
            if proto is not None:
                self._cache.move_to_end(lark)
        if proto is None:
            import llguidance
            proto = llguidance.LLMatcher(self.lltokenizer, llguidance.LLMatcher.grammar_from_lark(lark),
                                         log_level=0)
            if proto.is_error():
                raise RequestError(f"structured output ({spec.kind}) does not compile: "
                                   f"{_first_line(proto.get_error())}")
            with self._lock:
                self._cache[lark] = proto
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarMatcher(proto.deep_copy(), self._vocab_size, self._eos)

    # ---- grammar text ------------------------------------------------------------------------
    def lark(self, spec: StructuredOutput, tools=None, *, think_open: bool) -> str:
        if spec.kind == "tool_call":
            body = self._tool_rules(spec, tools)
        elif spec.kind in TEXT_KINDS:
            body = text_rules(spec)
        else:
            schema = spec.schema if spec.kind == "json_schema" else {"type": "object"}
            body = ["body: %json " + _schema_json(_with_options(schema))]
        if think_open:
            close = self._tag("</think>")
            head = [f"start: REASONING {close} NEWLINES body", "REASONING: /(?s:.*)/",
                    r"NEWLINES: /\n*/"]
        else:
            head = ["start: body"]
        return "\n".join(head + body) + "\n"

    def _tag(self, text: str) -> str:
        """A tag the vocabulary has as one added token is that token (llguidance treats added
        tokens as special, never as their text); otherwise its text."""
        tid = self._token_id(text)
        return f"<[{tid}]>" if tid is not None else _lark_str(text)

    def _tool_rules(self, spec: StructuredOutput, tools) -> list:
        schemas = tool_schemas(tools)
        if not schemas:
            raise RequestError("structured output 'tool_call' needs at least one tool")
        if spec.tool_name is not None:
            if spec.tool_name not in schemas:
                raise RequestError(f"structured output names tool {spec.tool_name!r}, which is "
                                   "not among the request's tools")
            schemas = {spec.tool_name: schemas[spec.tool_name]}
        many = spec.parallel_tool_calls and spec.tool_name is None
        # parallel calls: after each complete call the model may stop (EOS), also after the
        # newline it would write before another call (that newline used to commit it to one
        # more call, so a model fond of newlines ran call after call into the length limit).
        # One call: only EOS follows it.
        rules = ['body: call ("\\n" call)* "\\n"?' if many else "body: call",
                 "call: " + " | ".join(f"fn{i}" for i in range(len(schemas))),
                 _VALUE_TERMINAL, _NAME_TERMINAL, "pvalue[lazy]: PVALUE"]
        open_, close = self._tag("<tool_call>"), self._tag("</tool_call>")
        for i, (name, schema) in enumerate(schemas.items()):
            if not name or any(c in name for c in "<>\n"):
                raise RequestError(f"tool name {name!r} cannot be written as <function=NAME>")
            params = self._param_rules(f"fn{i}", name, schema, rules)
            rules.append(f"fn{i}: {open_} {_lark_str(chr(10) + '<function=' + name + '>' + chr(10))}"
                         f" {params} \"</function>\\n\" {close}")
        return rules

    def _param_rules(self, prefix: str, tool_name: str, schema, rules: list) -> str:
        if not isinstance(schema, Mapping):
            schema = {}
        props = schema.get("properties")
        if not isinstance(props, Mapping) or not props:
            if schema.get("properties") is not None or schema.get("additionalProperties") is False:
                return ""                   # declared empty: no parameters
            rules.append(f'{prefix}_any: "<parameter=" PNAME ">\\n" pvalue')
            return f"{prefix}_any*"
        required = schema.get("required")
        required = [] if required is None else required
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise RequestError(f"tool {tool_name!r}: 'required' must be an array of property "
                               f"names, got {required!r}")
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        parts = []
        for j, (key, sub) in enumerate(props.items()):
            if not isinstance(key, str) or not key or any(c in key for c in "<>\n"):
                raise RequestError(f"tool parameter name {key!r} cannot be written as "
                                   "<parameter=NAME>")
            name = f"{prefix}_p{j}"
            head = _lark_str(f"<parameter={key}>\n")
            rules.append(f"{name}: {head} {self._value_rule(sub, defs, rules, name)}")
            parts.append(name if key in required else f"{name}?")
        return " ".join(parts)

    def _value_rule(self, schema, defs, rules: list, name: str) -> str:
        if not isinstance(schema, Mapping):
            return "pvalue"
        types = _types(schema)
        enum = schema.get("enum")
        if isinstance(schema.get("const"), str):
            enum = [schema["const"]]
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "(" + " | ".join(_lark_str(v + "\n</parameter>\n") for v in enum) + ")"
        if types == ["string"]:
            bounded = _string_terminal(schema)
            if bounded is not None:          # maxLength / minLength / pattern, on the raw text
                terminal = name.upper() + "_V"
                rules += [f"{terminal}: {bounded}", f"{name}_v[lazy]: {terminal}"]
                return f"{name}_v"
        if not types or "string" in types:
            return "pvalue"                 # the parser keeps such values as written
        sub = {**defs, **schema} if defs else dict(schema)
        return f'%json {_schema_json(_with_options(sub))} "\\n</parameter>\\n"'


TEXT_KINDS = ("regex", "choice", "grammar")


def text_rules(spec: StructuredOutput) -> list:
    """The `body` rule of a regex / choice / grammar spec (StructuredOutput.validate has checked
    that it compiles). A regex is one lexeme matched whole (its `^` / `$` change nothing); the
    choices are literal strings; a grammar is nested whole (`%lark {...}`: its own rule names and
    `start`, GBNF converted first), so it never clashes with the reasoning prefix's rules."""
    import llguidance
    if spec.kind == "regex":
        return [f"body: /{llguidance.regex_to_lark(spec.pattern)}/"]
    if spec.kind == "choice":
        return ["body: " + " | ".join(_lark_str(c) for c in spec.choices)]
    return ["body: %lark {", grammar_as_lark(spec.grammar).rstrip("\n"), "}"]


class GrammarMatcher:
    """One request's grammar state. The OutputSession validates tokens in preview (no mutation)
    and consumes them in commit; `mask()` is the next token's allowed set."""

    __slots__ = ("_m", "_vocab_size", "_eos")

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int]):
        self._m = matcher
        self._vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)

    def validate(self, token_ids) -> int:
        """How many of `token_ids` the grammar accepts from the committed state (no mutation)."""
        ids = list(token_ids)
        if ids and self._m.is_stopped():
            # a complete grammar stops the matcher; llguidance's validate_tokens then counts
            # nothing, although consume_token still takes the EOS that ends the output
            return int(not self._m.is_error() and ids[0] in self._eos)
        return int(self._m.validate_tokens(ids))

    def consume(self, token_ids) -> None:
        # one at a time: consume_tokens refuses the EOS a stopped matcher takes singly
        for tok in token_ids:
            if not self._m.consume_token(int(tok)):
                raise RuntimeError(f"grammar rejected committed token {tok}: "
                                   f"{_first_line(self._m.get_error())}")

    def fork(self) -> "GrammarMatcher":
        """An independent copy of the committed state (speculative verification walks drafts on
        it, `advance`; the request's own matcher does not move)."""
        return GrammarMatcher(self._m.deep_copy(), self._vocab_size, self._eos)

    def advance(self, token_id: int) -> bool:
        """Consume one token if the grammar allows it; False (nothing consumed) if not."""
        return bool(self._m.consume_token(int(token_id)))

    def mask(self) -> Optional[np.ndarray]:
        """bool [vocab_size]: the tokens the grammar allows next. None if it allows none (a
        matcher in error): the row then samples freely and preview rejects the token, which ends
        only this request instead of failing the sampler."""
        packed = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[:self._vocab_size]
        return bits.view(np.bool_) if bits.any() else None

    @property
    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def state_key(self) -> tuple:
        """What tests compare to see that nothing moved: the next-token mask and the flags."""
        mask = self.mask()
        return (None if mask is None else mask.tobytes(), self._m.is_accepting(), self._m.is_stopped(),
                self._m.is_error())


_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?" \
        r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# JSON-schema `format`s a string parameter's value must match (RFC 3339 date / time / date-time
# without leap seconds, RFC 4122 uuid, dotted-quad ipv4 without leading zeros, RFC 1123 hostname,
# an addr-spec-shaped email, a scheme-led uri). Other formats are annotations, as JSON schema
# treats formats by default: not enforced. [0-9], never \d (Unicode digits in llguidance's regex).
FORMAT_PATTERNS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "[Tt]" + _TIME,
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"(?:{_OCTET}\.){{3}}{_OCTET}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL})*",
    "email": rf"[A-Za-z0-9.!#$%&'*+/=?^_`{{|}}~-]+@{_LABEL}(?:\.{_LABEL})*",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]*:[^\s<>]+",
}


def _string_terminal(schema: Mapping) -> Optional[str]:
    """The lexeme of a string parameter value with JSON-schema bounds, followed by its closing
    `\n</parameter>\n` (one lazy lexeme, as PVALUE: the value ends at the first close tag), or
    None when the schema bounds nothing. Length counts characters (code points) as JSON schema
    does; `pattern` must match the whole value (llguidance anchors JSON-schema patterns too)."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    pattern = schema.get("pattern")
    is_count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    lo = lo if is_count(lo) else None
    hi = hi if is_count(hi) else None
    pattern = pattern if isinstance(pattern, str) else None
    fmt = FORMAT_PATTERNS.get(schema.get("format")) if isinstance(schema.get("format"), str) \
        else None
    if lo is None and hi is None and pattern is None and fmt is None:
        return None
    close = r"\n<\/parameter>\n"
    parts = []
    if lo is not None or hi is not None:
        parts.append(f"/(?s:.{{{lo or 0},{'' if hi is None else hi}}}){close}/")
    if pattern is not None:
        core = pattern[1:] if pattern.startswith("^") else pattern
        core = core[:-1] if core.endswith("$") and not core.endswith("\\$") else core
        parts.append(f"/(?:{_escape_slashes(core)}){close}/")
    if fmt is not None:
        parts.append(f"/(?:{_escape_slashes(fmt)}){close}/")
    parts.append(r"~/(?s:.*)<parameter=[^>\n<]*>(?s:.*)/")
    return " & ".join(parts)


def _escape_slashes(regex: str) -> str:
    """`regex` inside a lark /.../ literal: each unescaped `/` escaped; an escaped one (`\\/`, as
    JavaScript-written patterns have) is left as it is (escaping it again ended the literal)."""
    return re.sub(r"(\\.)|/", lambda m: m.group(1) or "\\/", regex, flags=re.S)


def _types(schema: Mapping) -> list:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out = []
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        if subs is None:
            continue
        if not isinstance(subs, list):
            raise RequestError(f"tool parameter schema: '{key}' must be an array of schemas, "
                               f"got {subs!r}")
        for sub in subs:
            if isinstance(sub, Mapping):
                out += [t for t in _types(sub) if t not in out]
            if isinstance(sub, Mapping) and not _types(sub):
                return []                   # an untyped branch admits anything
    return out


def _with_options(schema: Mapping) -> dict:
    out = dict(schema)
    guidance = dict(out.get("x-guidance") or {}) if isinstance(out.get("x-guidance"), Mapping) \
        else {}
    out["x-guidance"] = {**_JSON_OPTIONS, **guidance}
    return out


def _schema_json(schema: Mapping) -> str:
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"structured output schema is not JSON: {exc}") from None


def _first_line(text: str) -> str:
    return (text or "unknown error").strip().splitlines()[0][:500]
