"""PreparedPrompt: the owning, immutable result of prompt preparation."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ....errors import RequestError

THINK_NONE, THINK_OPEN, THINK_CLOSED = "none", "open", "closed"


@dataclass(frozen=True, eq=False)
class PreparedPrompt:
    """What later stages need to run one prompt.

    token_ids          int32 [num_tokens], read-only, owned (never a view of the caller's array)
    media              media slots in prompt order; empty for text (Vision fills it later)
    mrope_positions    None for text: position of token i is i on all MRoPE axes; else int32 [3, T]
    media_digest       blake2b-128 of every medium's kind, grid and pixels in order (b"" for text):
                       with the token ids it identifies a prompt with media (placeholder tokens
                       are equal for different images), the key part cache lookups need
    digest             blake2b-128 hex of the token ids (little-endian int32 bytes)
    text               the rendered prompt text when it came from text or messages, else None
    enable_thinking    the flag the template was rendered with
    think_state        where the prompt leaves the assistant's think block:
                         "open"   - it ends inside <think> (the template opened it): the output starts
                                    on the reasoning channel
                         "closed" - the current turn already had its think block (thinking disabled)
                         "none"   - no think block in the current turn
    num_reusable_tokens  the prefix a next-turn rendering of this conversation repeats token for
                       token: up to and including the generation prompt's `<|im_start|>assistant\n`
                       (the think opening after it is rendered differently in history)
    """

    token_ids: np.ndarray
    media: tuple = ()
    mrope_positions: Optional[np.ndarray] = None
    media_digest: bytes = b""
    digest: str = ""
    text: Optional[str] = None
    enable_thinking: bool = True
    think_state: str = THINK_NONE
    num_reusable_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def starts_in_reasoning(self) -> bool:
        return self.think_state == THINK_OPEN

    def prefix_digests(self, block_size: int) -> List[bytes]:
        """Chained digests of each full block: entry k identifies token_ids[:(k+1)*block_size]
        (equal entries mean equal prefixes), the key a shared prefix index can use."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        out, prev = [], b""
        ids = self.token_ids
        for start in range(0, ids.shape[0] - block_size + 1, block_size):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(ids[start:start + block_size].astype("<i4", copy=False).tobytes())
            prev = h.digest()
            out.append(prev)
        return out


def make_prepared(token_ids: np.ndarray, *, text: Optional[str], enable_thinking: bool,
                  think_ids: tuple, im_start_id: Optional[int]) -> PreparedPrompt:
    """Own a copy of the ids and derive the think state and reuse boundary from them."""
    ids = np.array(token_ids, dtype=np.int32, copy=True)
    ids.setflags(write=False)
    digest = hashlib.blake2b(ids.astype("<i4", copy=False).tobytes(), digest_size=16).hexdigest()
    think_open, think_close = think_ids
    if think_open is None and text is not None:
        # the tokenizer has no <think> token (tiny test vocabularies): read the state off the text
        state = _think_state(text.rfind("<|im_start|>"), text.rfind("<think>"),
                             text.rfind("</think>"))
        reusable = ids.shape[0]
    else:
        last_turn = _last_index(ids, im_start_id)
        last_open = _last_index(ids, think_open)
        last_close = _last_index(ids, think_close)
        state = _think_state(last_turn, last_open, last_close)
        in_turn = [p for p in (last_open, last_close) if p > last_turn]
        reusable = min(in_turn) if last_turn >= 0 and in_turn else ids.shape[0]
    return PreparedPrompt(token_ids=ids, digest=digest, text=text,
                          enable_thinking=bool(enable_thinking), think_state=state,
                          num_reusable_tokens=int(reusable))


def _think_state(last_turn: int, last_open: int, last_close: int) -> str:
    """From the positions (-1: absent) of the last turn start, <think> and </think>."""
    if last_open > max(last_close, last_turn):
        return THINK_OPEN
    if max(last_open, last_close) > last_turn:
        return THINK_CLOSED
    return THINK_NONE


def _last_index(ids: np.ndarray, token_id: Optional[int]) -> int:
    if token_id is None or ids.size == 0:
        return -1
    hits = np.flatnonzero(ids == token_id)
    return int(hits[-1]) if hits.size else -1


# ---- checks before tokenizing ----------------------------------------------------------------------

def max_token_bytes(tokenizer) -> int:
    """The longest token of a byte-level vocabulary in bytes (0: unknown, no byte bound). Any text
    of n UTF-8 bytes is then at least ceil(n / this) tokens."""
    cached = getattr(tokenizer, "_max_token_bytes", None)
    if cached is None:
        table = getattr(tokenizer, "token_bytes", None)
        cached = max(map(len, table), default=0) if table else 0
        tokenizer._max_token_bytes = cached     # one scan of the vocabulary per tokenizer
    return cached


def precheck_prompt(prompt, max_context: int, token_bytes: int) -> None:
    """Refuse, before any tokenizing, a prompt that is not Unicode text (a lone UTF-16 surrogate:
    the tokenizer would raise a bare TypeError) or whose byte length alone proves it longer than
    max_context (a 5 MB string took seconds to tokenize only to be refused). RequestError."""
    if isinstance(prompt, str):
        nbytes = _utf8_length(prompt, "the prompt")
        if token_bytes and nbytes > (max_context - 1) * token_bytes:
            at_least = -(-nbytes // token_bytes)
            raise RequestError(
                f"prompt has {nbytes} UTF-8 bytes, so at least {at_least} tokens (no token is "
                f"longer than {token_bytes} bytes); max_context={max_context} allows at most "
                f"{max_context - 1} prompt tokens (plus at least one generated)",
                code="context_length_exceeded")
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
        # chat messages (token ids have no text to check, and a list mixing ids and messages is
        # refused by Frontend.prepare: walking a 4,096-id list cost ~1 ms of its first token)
        stack = [prompt]
        while stack:                        # chat messages: every string in them, keys too
            item = stack.pop()
            if isinstance(item, str):
                _utf8_length(item, "a chat message")
            elif isinstance(item, Mapping):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)


def _utf8_length(text: str, what: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} is not valid Unicode text: a lone UTF-16 surrogate "
                           f"{text[exc.start]!r} at character {exc.start}") from None
