"""The text <-> token-id mapping: a `tokenizers` tokenizer plus a per-id byte table for cheap
incremental detokenization.

Byte-level BPE (every Qwen checkpoint) gives every id an exact byte string; the text of a sequence is
the UTF-8 decoding (invalid sequences -> U+FFFD) of the concatenated bytes. Keeping that table lets
the OutputSession decode one new token at a time without re-decoding the output. Other decoders
(WordPiece, Metaspace, ...) have no such table: `decode_window` serves the OutputSession's windowed
fallback instead.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

import numpy as np
import tokenizers

from ....errors import ArtifactError, RequestError
from .vocab import byte_to_unicode


class Tokenizer:
    def __init__(self, tokenizer_json: bytes):
        try:
            text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) \
                else tokenizer_json
            self._tk = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a bad artifact resource
            raise ArtifactError(f"tokenizer.json: cannot be loaded: {exc}") from None
        decoder = json.loads(self._tk.decoder.__getstate__()) if self._tk.decoder else None
        added = [{"id": i, "content": t.content, "special": t.special}
                 for i, t in self._tk.get_added_tokens_decoder().items()]
        self.is_byte_level = _is_byte_level(decoder)
        self.token_bytes: Optional[List[bytes]] = None
        if self.is_byte_level:
            self.token_bytes, self.special_ids, self.added_ids = _byte_table(
                self._tk.get_vocab(with_added_tokens=False), added)
            self.vocab_size = len(self.token_bytes)
        else:
            self.special_ids = frozenset(t["id"] for t in added if t["special"])
            self.added_ids = frozenset(t["id"] for t in added)
            self.vocab_size = max(self._tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._token_to_id: Dict[str, int] = {t["content"]: t["id"] for t in added}

    # ---- ids -----------------------------------------------------------------------------------
    def token_id(self, token: str) -> Optional[int]:
        """Id of an added token (`<|im_end|>`, `<think>`, ...) or of a single vocabulary entry."""
        if token in self._token_to_id:
            return self._token_to_id[token]
        return self._tk.token_to_id(token)

    def encode(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise RequestError(f"tokenize expects a str, got {type(text).__name__}")
        return np.asarray(self._tk.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = self.check_ids(ids)
        if not self.is_byte_level:
            return self._tk.decode(ids.tolist(), skip_special_tokens=skip_special_tokens)
        table, special = self.token_bytes, self.special_ids
        data = b"".join(table[i] for i in ids.tolist()
                        if not (skip_special_tokens and i in special))
        return data.decode("utf-8", errors="replace")

    def check_ids(self, ids, limit: int = None) -> np.ndarray:
        """Token ids as int32, each in [0, limit) (default vocab_size); RequestError names the
        first bad one."""
        limit = self.vocab_size if limit is None else limit
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise RequestError(f"token ids must be a 1-D sequence of integers "
                               f"(got shape {arr.shape}, dtype {arr.dtype})")
        if arr.size:
            bad = np.flatnonzero((arr < 0) | (arr >= limit))
            if bad.size:
                raise RequestError(f"token id {int(arr[bad[0]])} at position {int(bad[0])} is "
                                   f"outside the vocabulary [0, {limit})")
        return arr.astype(np.int32, copy=False)

    def decode_window(self, ids: tuple) -> str:
        """Text of a few ids (special tokens skipped), for the non-byte-level fallback."""
        return self._tk.decode([i for i in ids if 0 <= i < self.vocab_size],
                               skip_special_tokens=True)

    def piece_bytes(self, token_id: int, skip_special: bool) -> bytes:
        """The bytes one id contributes to the text; ids beyond the table (the model's padded
        vocabulary rows) contribute nothing."""
        if 0 <= token_id < self.vocab_size and not (skip_special and token_id in self.special_ids):
            return self.token_bytes[token_id]
        return b""


def _is_byte_level(decoder) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(_is_byte_level(d)
                                                     for d in decoder.get("decoders", []))


def _byte_table(vocab: Dict[str, int], added: List[dict]) -> tuple:
    """(list of bytes per id, special ids, added ids) of a byte-level BPE vocabulary."""
    # byte-level char -> the Latin-1 char of its byte, so str.translate + latin-1 encode gives bytes
    to_latin1 = {ord(u): chr(b) for b, u in byte_to_unicode().items()}
    size = max([*vocab.values(), *(int(t["id"]) for t in added), -1]) + 1
    table: List[bytes] = [b""] * size
    added_ids = frozenset(int(t["id"]) for t in added)
    for piece, idx in vocab.items():
        if idx in added_ids:
            continue                 # an added token's text is its content, set below
        try:
            table[idx] = piece.translate(to_latin1).encode("latin-1")
        except UnicodeEncodeError:
            raise ArtifactError(f"tokenizer.json: vocabulary entry {piece!r} (id {idx}) is not "
                                f"byte-level encoded") from None
    for tok in added:
        table[int(tok["id"])] = tok["content"].encode("utf-8")
    special = frozenset(int(t["id"]) for t in added if t.get("special", False))
    return table, special, added_ids

