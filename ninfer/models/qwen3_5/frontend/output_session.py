"""OutputSession: one request's generated tokens -> text deltas per channel, tool calls, stop.

Each token goes through three stages, each holding back only what it cannot decide yet:

    token id ──> bytes ──UTF-8──> text ──stop strings──> released text ──channels──> events
                 (pending: an       (stop_hold: a suffix     (parse_hold: a possible tag prefix
                  incomplete         that may still begin     or the newline run before it;
                  character)         a stop string)           tool_buf: an open <tool_call>)

Semantics (the Gateway and the Engine rely on these):
- Text is the UTF-8 decoding of the tokens' bytes; special tokens (`<|im_end|>`, `<|vision_pad|>`,
  ...) contribute no text; `<think>`, `</think>`, `<tool_call>`, `</tool_call>` are ordinary added
  tokens and are recognised as text, so a tag spelled with several tokens works the same.
  (Tokenizers that are not byte-level decode a small window of recent ids instead.)
- Stop token ids (params.stop_token_ids, plus the EOS ids unless ignore_eos) end the output; the
  stop token is accepted. Stop strings are matched on the decoded output (tags included), across
  token boundaries; the match and everything after it are dropped; the token completing the match
  is the last one accepted. Both give finish_reason "stop".
- Channels: the output starts in "reasoning" when the prompt ends inside `<think>` (the template
  opened it), else in "content". `</think>` switches reasoning -> content; in content, `<think>`
  opens reasoning only while nothing but whitespace has been written and the prompt has not already
  had its think block; a `<think>` repeated at the start of a template-opened block is dropped.
  Newlines right around a tag are the template's separators and are dropped (the template writes
  them back when the turn is rendered as history); if a `<tool_call>` turns out not to be a call,
  the newlines before it come back with its text.
- Tool calls (only when the request has tools): a `<tool_call>` in the content channel opens a call;
  at `</tool_call>` the body is parsed (tool_parser.py) and a ToolCallEvent is emitted, or, if the
  body is malformed, the whole `<tool_call>...</tool_call>` text comes back as content. A call inside
  reasoning is reasoning text (the model has not committed to it; vLLM's reasoning-then-tools parsing
  agrees). A `<tool_call>` followed by neither `<function=` nor a JSON object (the Qwen3 form,
  parsed as a fallback) is text as soon as that is known. A call still open when the output is cut
  (length, cancel, error) is dropped: the complete calls stand, finish_reason says why it ended,
  and no raw markup reaches the content; one still open at a stop (EOS, stop token or string: the
  model ended it unclosed) comes back as content text. With params.parallel_tool_calls False the
  first complete call ends the output (finish_reason "stop"; the token closing it is the last
  accepted), whether the grammar forced the call or the model chose it.
- Tool call ids are `call_<nonce>_<index>`; the nonce derives from the request id (and prompt digest,
  see Frontend.new_output_session) when one is given, else it is random.

Request-level controls the session owns:
- min_tokens: until that many tokens are out, `token_mask()` bans the EOS and stop token ids, and
  stop strings are not matched (text before the minimum cannot end a match; vLLM's rule).
- thinking_budget: reasoning tokens are counted while the channel is "reasoning"; once the budget is
  spent, `forced_tokens()` names `</think>` plus the template's separator ("\n\n"), which the
  Engine runs as a control unit (forced, not sampled); the output then continues as content.
  Budget 0 on a prompt that opened `<think>` closes it at once.

preview() never mutates the session: it runs the tokens on a copy of the small state; commit() adopts
that copy. Work per token is bounded by the stop-string and tag lengths (no re-decoding).

Constrained decoding (params.structured): the session holds the request's grammar matcher
(frontend/grammar.py). `token_mask()` is the allowed set of the next token (the sampler applies
it); preview() checks the accepted tokens against the grammar without consuming them (a token the
grammar rejects is an error that ends the request, never silently accepted); commit() consumes them.
The matcher only moves at commit, so pause / Replay (which re-run history without republishing)
leave it where the published output left it.
"""
from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import operator
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ....api import SamplingParams, TextDelta, ToolCall, ToolCallEvent
from .tool_parser import FUNCTION_OPEN, parse_tool_call, tool_schemas

REASONING, CONTENT = "reasoning", "content"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class _State:
    """Everything a token can change, kept small so preview can copy it."""

    channel: str = CONTENT
    think_allowed: bool = True        # a <think> may still open the reasoning channel
    strip_newlines: bool = False      # drop "\n" that starts the segment after a tag
    pending_bytes: bytes = b""
    stop_hold: str = ""
    parse_hold: str = ""
    tool_buf: Optional[str] = None    # text after an open <tool_call>, None when no call is open
    call_sep: str = ""                # the newlines dropped before it (restored if it is no call)
    num_tool_calls: int = 0
    num_tokens: int = 0
    num_reasoning_tokens: int = 0     # tokens run while the channel was "reasoning"
    finish_reason: Optional[str] = None
    ended_by_eos: bool = False
    stop_sequence: Optional[str] = None   # the stop string that ended the output, if one did
    window: tuple = ()                # non-byte-level tokenizers: ids not yet fully decoded
    window_read: int = 0              # how many of `window` already produced their text

    def clone(self) -> "_State":
        # every field is immutable: a shallow copy is whole (positional: once per row per
        # step, ~7x cheaper than dataclasses.replace)
        return _State(*_state_values(self))

    def as_tuple(self) -> tuple:
        return _state_values(self)


# every _State field in declaration order (clone passes them positionally)
_state_values = operator.attrgetter(*(f.name for f in dataclasses.fields(_State)))


@dataclass(slots=True, frozen=True)
class OutputPreview:
    """The effect of some tokens, not yet applied. `accepted`: how many of the previewed tokens the
    output keeps (fewer when a stop token or string ends it); `events`: TextDelta / ToolCallEvent in
    order; `finish_reason`: "stop", None, or (from preview_finish) the reason given.

    Token attribution: the accepted ids ride on the first TextDelta; when the step produced no text
    (held back: a partial character, a possible stop-string or tag prefix) an empty TextDelta carries
    them, so a consumer sees every accepted token exactly once."""

    accepted: int
    events: list
    finish_reason: Optional[str]
    token_ids: tuple = ()
    _state: Optional[_State] = field(default=None, repr=False, compare=False)
    _base: Optional[_State] = field(default=None, repr=False, compare=False)


class _Collector:
    """Events of one preview; adjacent text on one channel is merged into one delta."""

    __slots__ = ("items",)

    def __init__(self):
        self.items: list = []             # [channel, [str, ...]] or ToolCallEvent

    def text(self, channel: str, text: str) -> None:
        last = self.items[-1] if self.items else None
        if isinstance(last, list) and last[0] == channel:
            last[1].append(text)
        else:
            self.items.append([channel, [text]])

    def call(self, event: ToolCallEvent) -> None:
        self.items.append(event)

    def events(self, token_ids: tuple, channel: str) -> list:
        out: list = []
        for item in self.items:
            if isinstance(item, list):
                ids, token_ids = token_ids, ()
                out.append(TextDelta(channel=item[0], text="".join(item[1]), token_ids=ids))
            else:
                out.append(item)
        if token_ids:
            out.insert(0, TextDelta(channel=channel, text="", token_ids=token_ids))
        return out


class OutputSession:
    def __init__(self, tokenizer, params: SamplingParams, *, eos_token_ids: Sequence[int] = (),
                 starts_in_reasoning: bool = False, think_allowed: bool = True, tools=None,
                 request_id: Optional[str] = None, matcher=None, think_close: tuple = ()):
        """`think_close`: the token ids a spent thinking budget forces (`</think>` + separator);
        empty when the vocabulary has no `</think>` token (the budget is then not enforceable)."""
        self._tok = tokenizer
        self._matcher = matcher
        self._min_tokens = int(params.min_tokens)
        budget = params.thinking_budget
        self._thinking_budget = None if budget is None or not think_close else int(budget)
        self._think_close = tuple(int(t) for t in think_close)
        stop_ids = set(int(t) for t in params.stop_token_ids)
        self._eos_ids = frozenset(int(t) for t in eos_token_ids)
        if not params.ignore_eos:
            stop_ids |= self._eos_ids
        self._stop_ids = frozenset(stop_ids)
        stops = params.stop if not isinstance(params.stop, str) else (params.stop,)
        self._stops: Tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._stop_firsts = frozenset(s[0] for s in self._stops)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._schemas = tool_schemas(tools)
        self._tools_enabled = bool(tools)
        self._one_call = not params.parallel_tool_calls     # the first complete call ends it
        seed = request_id.encode("utf-8") if request_id is not None else os.urandom(16)
        self._nonce = hashlib.blake2b(seed, digest_size=6).hexdigest()
        # think_allowed on the reasoning channel: a redundant <think> the model repeats right after
        # the template's is dropped
        self._state = _State(channel=REASONING if starts_in_reasoning else CONTENT,
                             think_allowed=think_allowed or starts_in_reasoning,
                             strip_newlines=starts_in_reasoning)
        self._content: List[str] = []
        self._reasoning: List[str] = []
        self._tool_calls: List[ToolCall] = []

    # ---- results so far (committed) ----------------------------------------------------------
    @property
    def text(self) -> str:
        return "".join(self._content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> list:
        return list(self._tool_calls)

    @property
    def finish_reason(self) -> Optional[str]:
        return self._state.finish_reason

    @property
    def stop_sequence(self) -> Optional[str]:
        """The stop string that ended the output (None for stop tokens, EOS and other ends)."""
        return self._state.stop_sequence

    @property
    def is_finished(self) -> bool:
        return self._state.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return self._state.num_tokens

    @property
    def channel(self) -> str:
        return self._state.channel

    @property
    def ended_turn(self) -> bool:
        """True when an EOS token (`<|im_end|>`) closed the output: prompt + output tokens then end
        on a complete assistant turn (the boundary a continuation can reuse)."""
        return self._state.ended_by_eos

    def snapshot(self) -> tuple:
        """Every piece of session state, for equality checks in tests."""
        grammar = () if self._matcher is None else (self._matcher.state_key(),)
        return self._state.as_tuple() + (tuple(self._content), tuple(self._reasoning),
                                         tuple(self._tool_calls)) + grammar

    @property
    def is_constrained(self) -> bool:
        return self._matcher is not None

    @property
    def may_force_tokens(self) -> bool:
        """A control unit may come later: the thinking budget can be spent."""
        return self._thinking_budget is not None

    @property
    def needs_mask(self) -> bool:
        """Whether `token_mask()` may return a mask for the next token (a grammar, or a minimum
        output length not reached yet)."""
        return self._matcher is not None or bool(self.forced_tokens()) or (
            self._state.num_tokens < self._min_tokens and bool(self._stop_ids))

    def token_mask(self):
        """bool [tokenizer vocab] of the tokens allowed next (ids past it are never allowed), or
        None when anything goes: the grammar's mask, with the stop ids banned while fewer than
        min_tokens are out. A spent thinking budget allows only `</think>` (a row that must sample,
        e.g. the first token after prefill, cannot take a control unit)."""
        return self._mask_at(self._state, self._matcher)

    def token_masks_along(self, token_ids) -> list:
        """Speculative verification: the masks `token_mask()` would give once token_ids[:1],
        token_ids[:2], ... were committed, in order; the list ends before the first prefix that
        ends the output, that the grammar refuses, or after which the next token is forced (a
        spent thinking budget), since no sampled position follows those. Mutates nothing."""
        ids = [int(t) for t in token_ids]
        if self._matcher is None and self._thinking_budget is None and not self._min_tokens:
            return [None] * len(ids)            # nothing to walk: anything goes at every position
        st = self._state.clone()
        matcher = None if self._matcher is None else self._matcher.fork()
        masks = []
        for tok in ids:
            if st.finish_reason is not None or (matcher is not None and not matcher.advance(tok)):
                break
            if st.channel == REASONING:
                st.num_reasoning_tokens += 1
            st.num_tokens += 1
            if self._step(st, tok, _Collector(), st.num_tokens) or self._forced_at(st):
                break
            masks.append(self._mask_at(st, matcher))
        return masks

    def _mask_at(self, st: _State, matcher):
        """token_mask() of a session state and grammar matcher (the committed ones, or a walk's)."""
        forced = self._forced_at(st)
        if forced and 0 <= forced[0] < self._tok.vocab_size:
            mask = np.zeros(self._tok.vocab_size, np.bool_)
            mask[forced[0]] = True
            return mask
        mask = None if matcher is None else matcher.mask()
        if st.num_tokens < self._min_tokens and self._stop_ids:
            banned = [t for t in self._stop_ids if 0 <= t < self._tok.vocab_size]
            if mask is None:
                mask = np.ones(self._tok.vocab_size, np.bool_)
            else:
                mask = mask.copy()
            mask[banned] = False
            if not mask.any():          # only a stop token is allowed: the grammar is done
                mask[banned] = True
        return mask

    def forced_tokens(self) -> tuple:
        """Token ids the next unit must produce without sampling (a control unit), or () to
        sample: `</think>` + separator once the thinking budget is spent inside reasoning."""
        return self._forced_at(self._state)

    def _forced_at(self, st: _State) -> tuple:
        if (self._thinking_budget is None or st.finish_reason is not None
                or st.channel != REASONING or st.tool_buf is not None
                or st.num_reasoning_tokens < self._thinking_budget):
            return ()
        return self._think_close

    # ---- preview / commit ----------------------------------------------------------------------
    def preview(self, token_ids) -> OutputPreview:
        ids = [int(t) for t in (token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)]
        base = self._state
        if base.finish_reason is not None:
            raise RuntimeError(f"OutputSession.preview after the output finished "
                               f"({base.finish_reason})")
        st, out = base.clone(), _Collector()
        start_channel = st.channel
        accepted = 0
        for tok in ids:
            accepted += 1
            if st.channel == REASONING:
                st.num_reasoning_tokens += 1
            if self._step(st, tok, out, st.num_tokens + accepted):
                break
        st.num_tokens += accepted
        kept = tuple(ids[:accepted])
        if self._matcher is not None:
            ok = self._matcher.validate(kept)
            if ok < len(kept):
                raise RuntimeError(f"token {kept[ok]} breaks the structured-output grammar")
        return OutputPreview(accepted, out.events(kept, start_channel), st.finish_reason, kept,
                             st, base)

    def preview_finish(self, reason: str) -> OutputPreview:
        """Flush everything held back when generation ends without a stop (length, cancelled,
        error): a partial character becomes U+FFFD; a tool call still open is dropped (the
        output was cut inside it: the complete calls before it stand, and its raw markup is no
        answer to show as text)."""
        base = self._state
        if base.finish_reason is not None:
            return OutputPreview(0, [], base.finish_reason, (), base, base)
        st, out = base.clone(), _Collector()
        self._flush(st, out, drop_open_call=True)
        st.finish_reason = reason
        return OutputPreview(0, out.events((), st.channel), reason, (), st, base)

    def commit(self, preview: OutputPreview) -> None:
        if preview._base is not self._state:
            raise RuntimeError("OutputSession.commit: the preview is stale (the session changed "
                               "since it was computed) or belongs to another session")
        if self._matcher is not None and preview.token_ids:
            self._matcher.consume(preview.token_ids)
        self._state = preview._state
        for event in preview.events:
            if isinstance(event, TextDelta):
                if event.text:
                    (self._reasoning if event.channel == REASONING else self._content).append(
                        event.text)
            else:
                self._tool_calls.append(event.call)

    # ---- stage 1: bytes and stops ------------------------------------------------------------
    def _step(self, st: _State, tok: int, out: _Collector, num_out: int) -> bool:
        """Run one token (the `num_out`-th of the output); True when it ends the output."""
        if tok in self._stop_ids and num_out > self._min_tokens:
            self._flush(st, out)
            st.finish_reason = "stop"
            st.ended_by_eos = tok in self._eos_ids
            return True
        if self._tok.is_byte_level:
            data = st.pending_bytes + self._tok.piece_bytes(tok, True)
            text, used = codecs.utf_8_decode(data, "replace", False)
            st.pending_bytes = data[used:]
        else:
            text = self._window_text(st, tok)
        if not self._stops or num_out <= self._min_tokens:
            text = st.stop_hold + text          # below min_tokens no stop string matches yet
            st.stop_hold = ""
            if text:
                self._feed(st, text, False, out)
            return st.finish_reason is not None     # a call that ends the output (_one_call)
        held = st.stop_hold + text
        hits = [(i, k) for k, i in enumerate(held.find(s) for s in self._stops) if i >= 0]
        if hits:
            cut, k = min(hits)              # the earliest match; on a tie, the first listed stop
            st.stop_hold, st.pending_bytes, st.window, st.window_read = "", b"", (), 0
            self._feed(st, held[:cut], True, out)
            st.finish_reason = "stop"
            st.stop_sequence = self._stops[k]
            return True
        keep = self._stop_prefix_length(held)
        st.stop_hold = held[len(held) - keep:]
        if len(held) > keep:
            self._feed(st, held[:len(held) - keep], False, out)
        if st.finish_reason is not None:         # a call that ended the output (_one_call)
            st.stop_hold = ""
            return True
        return False

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with (only suffixes
        shorter than the longest stop, starting at a stop's first character, can qualify)."""
        for i in range(max(0, len(text) - self._max_stop_len + 1), len(text)):
            if text[i] in self._stop_firsts:
                tail = text[i:]
                if any(s.startswith(tail) for s in self._stops):
                    return len(text) - i
        return 0

    def _window_text(self, st: _State, tok: int) -> str:
        """Decode a few recent ids and emit what the new one added (the prefix/read-offset method),
        waiting while the text ends in U+FFFD (a character split over tokens) for a few tokens."""
        if not 0 <= tok < self._tok.vocab_size or tok in self._tok.special_ids:
            return ""                # skipped in the text; kept out of the window's context
        ids = st.window + (tok,)
        full = self._tok.decode_window(ids)
        if full.endswith("\ufffd") and len(ids) - st.window_read < 6:
            st.window = ids
            return ""
        prefix = self._tok.decode_window(ids[:st.window_read])
        st.window, st.window_read = ids[st.window_read:], len(ids) - st.window_read
        return full[len(prefix):]

    def _flush(self, st: _State, out: _Collector, drop_open_call: bool = False) -> None:
        tail = codecs.utf_8_decode(st.pending_bytes, "replace", True)[0]
        if st.window:
            prefix = self._tok.decode_window(st.window[:st.window_read])
            tail += self._tok.decode_window(st.window)[len(prefix):]
            st.window, st.window_read = (), 0
        held = st.stop_hold + tail
        st.pending_bytes, st.stop_hold = b"", ""
        self._feed(st, held, True, out, drop_open_call)

    # ---- stage 2: channels and tool calls ------------------------------------------------------
    def _tags(self, st: _State) -> Tuple[str, ...]:
        if st.channel == REASONING:
            return (THINK_CLOSE, THINK_OPEN) if st.think_allowed else (THINK_CLOSE,)
        tags = (CALL_OPEN,) if self._tools_enabled else ()
        return tags + (THINK_OPEN,) if st.think_allowed else tags

    def _feed(self, st: _State, text: str, final: bool, out: _Collector,
              drop_open_call: bool = False) -> None:
        buf, st.parse_hold = st.parse_hold + text, ""
        while buf:
            if st.tool_buf is not None:
                buf = self._feed_call(st, buf, out)
                continue
            tags = self._tags(st)
            pos, tag = _earliest(buf, tags)
            if tag is None:
                keep = 0 if final else _hold_length(buf, tags)
                self._emit(st, buf[:len(buf) - keep], out)
                st.parse_hold = buf[len(buf) - keep:]
                break
            before = buf[:pos].rstrip("\n")
            self._emit(st, before, out)
            buf_sep = buf[len(before):pos]
            buf = buf[pos + len(tag):]
            if tag == CALL_OPEN:
                st.tool_buf, st.call_sep = "", buf_sep
            else:
                st.channel = REASONING if tag == THINK_OPEN else CONTENT
                st.think_allowed = False
                st.strip_newlines = True
        if final and st.tool_buf is not None:
            raw, st.tool_buf = st.call_sep + CALL_OPEN + st.tool_buf, None
            if not drop_open_call:              # a stop inside the call: back as text
                self._emit(st, raw, out)

    def _feed_call(self, st: _State, text: str, out: _Collector) -> str:
        """Extend the open call with `text`; returns the text left to parse after the call closed
        or turned out not to be a call ('' while it stays open)."""
        old = st.tool_buf
        body = old + text
        end = body.find(CALL_CLOSE, max(0, len(old) - len(CALL_CLOSE) + 1))
        if not _could_be_call(body if end < 0 else body[:end]):
            st.tool_buf = None                       # prose mentioning <tool_call>: plain text
            self._emit(st, st.call_sep + CALL_OPEN, out)
            return body
        if end < 0:
            st.tool_buf = body
            return ""
        st.tool_buf = None
        parsed = parse_tool_call(body[:end], self._schemas)
        if parsed is None:
            self._emit(st, st.call_sep + CALL_OPEN + body[:end] + CALL_CLOSE, out)
        else:
            st.strip_newlines = True                 # the separator after a call
            name, args = parsed
            index = st.num_tool_calls
            call = ToolCall(id=f"call_{self._nonce}_{index}", name=name,
                            arguments=json.dumps(args, ensure_ascii=False))
            out.call(ToolCallEvent(index=index, call=call))
            st.num_tool_calls += 1
            st.think_allowed = False
            if self._one_call:                       # what follows the call is not generated
                st.finish_reason = "stop"
                return ""
        return body[end + len(CALL_CLOSE):]

    def _emit(self, st: _State, text: str, out: _Collector) -> None:
        if st.strip_newlines:
            text = text.lstrip("\n")
            if not text:
                return
            st.strip_newlines = False
        if not text:
            return
        if st.think_allowed and not text.isspace():
            st.think_allowed = False
        out.text(st.channel, text)


def _earliest(text: str, tags: Tuple[str, ...]):
    best, best_tag = len(text), None
    for tag in tags:
        i = text.find(tag)
        if 0 <= i < best:
            best, best_tag = i, tag
    return best, best_tag


def _hold_length(text: str, tags: Tuple[str, ...]) -> int:
    """What to keep back at the end of `text`: the longest suffix a tag starts with, and the run
    of newlines before it (dropped if the tag follows)."""
    if not tags:
        return 0
    keep = 0
    for tag in tags:
        for k in range(min(len(text), len(tag) - 1), keep, -1):
            if tag.startswith(text[-k:]):
                keep = k
                break
    i = len(text) - keep
    while i > 0 and text[i - 1] == "\n":
        i -= 1
    return len(text) - i


def _could_be_call(body: str) -> bool:
    """Whether the text after `<tool_call>` may still be a call: the XML `<function=` form, or
    a JSON object (the Qwen3 form the parser takes as a fallback)."""
    head = body.lstrip()
    return head.startswith((FUNCTION_OPEN, "{")) or FUNCTION_OPEN.startswith(head)
