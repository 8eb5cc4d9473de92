"""Public request and result types (the contract between users, the Gateway and the Engine).

Plain, slotted data. The Engine worker produces results and events; other threads only read them.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from .errors import RequestError

FinishReason = Literal["stop", "length", "cancelled", "error"]
# longest context-cache session hint (submit's `session=`; Anthropic's metadata.user_id limit)
MAX_SESSION_CHARS = 256
# most choices one request may ask for (Engine.submit_n, OpenAI `n`): each is a request of its own
MAX_CHOICES = 16
Channel = Literal["content", "reasoning"]
StructuredKind = Literal["json_schema", "json_object", "tool_call", "regex", "choice", "grammar"]
STRUCTURED_KINDS = ("json_schema", "json_object", "tool_call", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """Output the sampler is constrained to (a grammar masks every sampled token).

    kind "json_schema": the content is JSON matching `schema`; "json_object": any JSON object;
    "tool_call": the content is one or more Qwen3.5 XML tool calls of the request's `tools`
    (only `tool_name` when given: then exactly one call; else `parallel_tool_calls` says whether
    more than one may follow); "regex": the whole content matches `pattern` (Rust `regex`
    syntax, as llguidance reads it: no look-around, no backreferences; `^` / `$` are implied);
    "choice": the content is exactly one of the strings `choices`; "grammar": the content is a
    sentence of `grammar`, a Lark grammar (llguidance's dialect, rule `start`) or a GBNF one
    (llama.cpp's, rule `root`). A prompt that opened a `<think>` block keeps free reasoning first.
    `validate()` compiles a pattern or grammar, so a bad one is a RequestError there.
    """

    kind: StructuredKind
    schema: Optional[Mapping[str, Any]] = None
    tool_name: Optional[str] = None
    parallel_tool_calls: bool = True
    pattern: Optional[str] = None
    choices: Optional[Sequence[str]] = None
    grammar: Optional[str] = None

    def validate(self) -> "StructuredOutput":
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(f"structured output kind {self.kind!r}: must be one of "
                               + ", ".join(repr(k) for k in STRUCTURED_KINDS))
        if self.kind == "json_schema":
            if not isinstance(self.schema, Mapping):
                raise RequestError("structured output 'json_schema' needs a JSON schema object "
                                   f"(got {type(self.schema).__name__})")
        elif self.schema is not None:
            raise RequestError(f"structured output {self.kind!r} takes no schema")
        if self.tool_name is not None and (self.kind != "tool_call"
                                           or not isinstance(self.tool_name, str)
                                           or not self.tool_name):
            raise RequestError(f"structured output tool_name={self.tool_name!r}: a non-empty "
                               "function name, only with kind 'tool_call'")
        for name, kind in (("pattern", "regex"), ("choices", "choice"), ("grammar", "grammar")):
            if getattr(self, name) is not None and self.kind != kind:
                raise RequestError(f"structured output {self.kind!r} takes no {name} (only "
                                   f"kind {kind!r} does)")
        if self.kind == "regex":
            _check_text(self.pattern, "regex", "pattern")
            _check_compiles("regex", self.pattern)
        elif self.kind == "grammar":
            _check_text(self.grammar, "grammar", "grammar")
            _check_compiles("grammar", self.grammar)
        elif self.kind == "choice":
            choices = self.choices
            if isinstance(choices, str) or not isinstance(choices, (Sequence, np.ndarray)) \
                    or len(choices) == 0:
                raise RequestError("structured output 'choice' needs choices: a non-empty list "
                                   f"of strings (got {choices!r:.80})")
            for i, choice in enumerate(choices):
                if not isinstance(choice, str) or not choice:
                    raise RequestError(f"structured output 'choice': choices[{i}]={choice!r:.80} "
                                       "must be a non-empty string")
            object.__setattr__(self, "choices", tuple(choices))   # frozen: one immutable copy
        return self


def _check_text(value, kind: str, name: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"structured output {kind!r} needs {name}: a non-empty string "
                           f"(got {value!r:.80})")


def _check_compiles(kind: str, text: str) -> None:
    """RequestError when llguidance cannot compile the regex or grammar (no vocabulary needed:
    the Frontend compiles it again against its tokenizer)."""
    import llguidance
    try:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(grammar_as_lark(text))
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - llguidance's own refusals (ValueError, ...)
        error = str(exc)
    if error:
        raise RequestError(f"structured output {kind!r} does not compile: "
                           f"{grammar_error_line(error, regex_only=kind == 'regex')}")


def grammar_as_lark(text: str) -> str:
    """A `grammar` in llguidance's Lark dialect: Lark as given, GBNF (`root ::= ...`) converted
    by llguidance's converter; RequestError when the GBNF does not convert."""
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        return any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain Exceptions
        raise RequestError(f"structured output 'grammar' does not compile (as GBNF): "
                           f"{grammar_error_line(str(exc))}") from None


def grammar_error_line(error: str, *, regex_only: bool = False) -> str:
    """One line of an llguidance error. A regex's: the parser's reason (`unclosed group`), with
    the grammar position before it unless the regex is the whole spec (`regex_only`: the
    position is then in llguidance's wrapper, not in the user's text)."""
    lines = [ln.strip() for ln in (error or "unknown error").strip().splitlines() if ln.strip()]
    head = lines[0] if lines else "unknown error"
    detail = next((ln[len("error:"):].strip() for ln in lines if ln.startswith("error:")), None)
    if detail:
        head = detail if regex_only else \
            head.replace("regex parse error:", "").strip().rstrip(":") + ": " + detail
    return head[:500]


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. These defaults are greedy with a 256-token budget; a checkpoint's
    recommended settings (its generation_config.json) come from `Engine.default_sampling_params()`,
    which `Engine.submit` uses when no params are given (vLLM's convention)."""

    max_tokens: int = 256
    temperature: float = 0.0          # 0 -> greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0                    # 0 -> disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None        # None -> a seed drawn at submit; results are then not reproducible
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None    # None -> no logprobs; n >= 0 -> sampled token logprob + top-n
    structured: Optional[StructuredOutput] = None   # None -> unconstrained
    # token id -> bias added to its logit before any filter (OpenAI's logit_bias; -100 bans it,
    # +100 all but forces it). Ids must be in the model's vocabulary (checked at submit).
    logit_bias: Optional[Mapping[int, float]] = None
    min_tokens: int = 0               # EOS, stop tokens and stop strings are ignored until this many
    # most tokens of reasoning (the thinking channel): then `</think>` is forced and the answer
    # follows. None -> unbounded. Needs a prompt that thinks (enable_thinking on).
    thinking_budget: Optional[int] = None
    # False: prompt + max_tokens over the Engine's max_context is a RequestError
    # (errors.ContextLengthError, naming the numbers), as OpenAI and vLLM answer. True: max_tokens
    # is an upper bound only, cut to what the context leaves (the server's default for a request
    # that names no max_tokens).
    clamp_max_tokens: bool = False
    # False: the output ends with its first complete tool call (OpenAI parallel_tool_calls=false,
    # Anthropic disable_parallel_tool_use), also when the model may choose not to call (auto)
    parallel_tool_calls: bool = True

    def validate(self) -> "SamplingParams":
        """Raise RequestError naming the first bad field; return self for chaining."""
        def bad(name, rule):
            raise RequestError(f"sampling parameter {name}={getattr(self, name)!r}: {rule}")

        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            bad("seed", "must be a non-negative integer")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, Sequence) or any(not isinstance(s, str) or not s
                                                       for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        ids = self.stop_token_ids
        if isinstance(ids, str) or not isinstance(ids, (Sequence, np.ndarray)) \
                or any(not isinstance(t, (int, np.integer)) or t < 0 for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, (int, np.integer))
                                          or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        if not isinstance(self.min_tokens, (int, np.integer)) or isinstance(self.min_tokens, bool) \
                or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.thinking_budget is not None and (
                not isinstance(self.thinking_budget, (int, np.integer))
                or isinstance(self.thinking_budget, bool) or self.thinking_budget < 0):
            bad("thinking_budget", "must be an integer >= 0 (or None: unbounded)")
        if not isinstance(self.clamp_max_tokens, (bool, np.bool_)):
            bad("clamp_max_tokens", "must be true or false")
        if not isinstance(self.parallel_tool_calls, (bool, np.bool_)):
            bad("parallel_tool_calls", "must be true or false")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                bad("structured", "must be a StructuredOutput")
            self.structured.validate()
            if self.ignore_eos:
                bad("ignore_eos", "cannot be combined with structured output (the grammar ends "
                                  "the output with EOS)")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _checked_logit_bias(bias) -> dict:
    """{token id: bias}; RequestError naming the first bad entry. The vocabulary bound is checked at
    submit, where the model is known."""
    if not isinstance(bias, Mapping):
        raise RequestError(f"sampling parameter logit_bias: must be a mapping of token id to bias, "
                           f"got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("+-").isdigit():
            try:
                key = int(key)              # JSON object keys are strings
            except ValueError:              # isdigit() yet no integer ('\u00b2', '+-7'): refused below
                pass
        if not isinstance(key, (int, np.integer)) or isinstance(key, bool) or key < 0:
            raise RequestError(f"sampling parameter logit_bias: key {key!r} must be a token id "
                               "(an integer >= 0)")
        if isinstance(value, bool) or not _finite(value) or not -100 <= value <= 100:
            raise RequestError(f"sampling parameter logit_bias[{key}]={value!r}: must be a number "
                               "in [-100, 100]")
        out[int(key)] = float(value)
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float, np.floating, np.integer)) and math.isfinite(x)


def choice_params(params: SamplingParams, n: int) -> list:
    """The SamplingParams of n choices of one prompt: copies, choice i seeded `seed + i` when
    `params.seed` is set (vLLM's convention: reproducible, yet the choices differ), each drawing
    its own seed otherwise. RequestError when n is not in [1, MAX_CHOICES]."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n={n!r}: the number of choices must be an integer in "
                           f"[1, {MAX_CHOICES}]")
    out = []
    for i in range(int(n)):
        p = copy.copy(params)
        if params.seed is not None:     # kept in the 63-bit range a seed may take
            p.seed = (int(params.seed) + i) & ((1 << 63) - 1)
        out.append(p)
    return out


@dataclass(slots=True, frozen=True)
class ScoreResult:
    """`logprobs[i] = log p(token[i+1] | token[:i+1])`, float32 [T-1]; `logits` float32 [T, vocab]
    when asked for; `top[i]`: ((token id, logprob), ...) of the k likeliest tokens at position i
    (best first) when asked for `top_logprobs=k`."""

    logprobs: np.ndarray
    logits: Optional[np.ndarray] = None
    top: Optional[tuple] = None

    @property
    def total_logprob(self) -> float:
        return float(np.sum(self.logprobs, dtype=np.float64))

    @property
    def perplexity(self) -> float:
        n = len(self.logprobs)
        return float(math.exp(-self.total_logprob / n)) if n else float("nan")


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One parsed tool call; `arguments` is a JSON object string (OpenAI's convention)."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple = ()                   # ((token_id, logprob), ...) best first


@dataclass(slots=True)
class GenerationResult:
    text: str = ""
    reasoning_text: str = ""
    tool_calls: list = field(default_factory=list)       # [ToolCall]
    token_ids: list = field(default_factory=list)        # generated token ids (accepted)
    finish_reason: Optional[FinishReason] = None
    num_prompt_tokens: int = 0
    # prompt tokens the context cache supplied (not prefilled again); set when the request binds
    num_cached_tokens: int = 0
    logprobs: Optional[list] = None                      # [TokenLogprob] when asked for
    error: Optional[str] = None
    stop_sequence: Optional[str] = None                  # the stop string that ended it, if any
    # timing, seconds (monotonic): submit -> first token, and total decode wall time
    time_to_first_token: Optional[float] = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


# ---- events a GenerationHandle yields, in publication order ------------------------------------

@dataclass(slots=True, frozen=True)
class GenerationStart:
    """Published once, after admission, before any delta (never again after a pause/resume)."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0       # of those, what the context cache supplied at bind


@dataclass(slots=True, frozen=True)
class TextDelta:
    """New text on one channel; `token_ids` are the tokens accepted in this step."""

    channel: Channel
    text: str
    token_ids: tuple = ()
    logprobs: tuple = ()             # (TokenLogprob, ...) for these tokens when asked for


@dataclass(slots=True, frozen=True)
class ToolCallEvent:
    """A tool call completed in the stream (index counts calls of this response from 0)."""

    index: int
    call: ToolCall


@dataclass(slots=True, frozen=True)
class Finished:
    """The terminal event; always the last one."""

    result: GenerationResult


Event = Union[GenerationStart, TextDelta, ToolCallEvent, Finished]

Prompt = Union[str, list, np.ndarray]   # text, a message list, or token ids


@runtime_checkable
class ServedEngine(Protocol):
    """What the Gateway (ninfer/serve) needs of an Engine: ninfer.engine.Engine, or a test's fake.
    Every member is declared here so the Gateway reads them directly instead of probing."""

    name: str                   # the model id the API reports when the server names none
    health: str                 # "ready", "failed" or "closed"
    options: Any                # EngineOptions (the Gateway reads max_context and
                                # default_enable_thinking)
    sampling_defaults: dict     # the checkpoint's recommended SamplingParams fields ({}: none)
    vocab_size: Optional[int]   # the tokenizer's; None when the engine has no tokenizer

    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               tools: Optional[Sequence[dict]] = None, enable_thinking: Optional[bool] = None,
               request_id: Optional[str] = None, timeout_s: Optional[float] = None,
               session: Optional[str] = None, share_prompt: bool = False): ...

    def stats(self) -> dict: ...

    def tokenize(self, text: str) -> np.ndarray: ...

    def detokenize(self, ids) -> str: ...

    def apply_chat_template(self, messages: list, tools: Optional[list] = None,
                            add_generation_prompt: bool = True,
                            enable_thinking: Optional[bool] = None) -> str: ...

    def count_prompt_tokens(self, messages: list, *, tools: Optional[list] = None,
                            enable_thinking: Optional[bool] = None) -> int:
        """Tokens `messages` take as a request sends them (media expanded to their tokens)."""

    def score(self, token_ids, return_logits: bool = False, top_logprobs: int = 0
              ) -> ScoreResult: ...

    def embedding_input_ids(self, item) -> np.ndarray:
        """The token ids `embed` pools for one input (text: tokenized, `<|endoftext|>` added)."""

    def embed(self, inputs, *, dimensions: Optional[int] = None) -> np.ndarray: ...

    def close(self) -> None: ...
