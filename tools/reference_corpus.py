"""Build the training corpus of the reference models (tools/train_reference.py) on this machine.

    python tools/reference_corpus.py OUT_DIR [--heldout ninfer/demo_models/heldout.txt]

Sources, all on every CPython install (PSF license): the standard library's `.py` files of the
running interpreter (tests, idlelib, lib2to3, site-packages and `__pycache__` left out), in sorted
path order. Every 25th file (sorted order) is held out; the held-out text is written once and
committed (ninfer/demo_models/heldout.txt), so later interpreters need not reproduce it.

OUT_DIR gets:
  train.npy      int32 token ids: "# file: <relative path>\n" + source, joined by <|endoftext|>
  chat.npy       int32 token ids of the synthetic chat conversations, joined by <|endoftext|>
  chat_mask.npy  uint8, 1 where a token is the assistant's (the loss of the chat-tuned pass)
  heldout.npy    int32 token ids of the held-out text (for the trainer's own figures)
  vocab.npy      int32 sorted ids seen at least MIN_COUNT times in train + chat, plus the special
                 tokens of the chat template: the embedding rows the models keep
  manifest.json  counts and the interpreter version
Deterministic: the same interpreter and tokenizer give the same bytes.
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
import sysconfig
import textwrap

import numpy as np

HELD_OUT_EVERY = 25
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo",
             "ensurepip", "pydoc_data"}
MAX_FILE_BYTES = 200_000           # a few generated tables (unicode data) are not code to learn
NUM_CHATS = 600
MIN_COUNT = 3                      # 20k of 28.6k seen ids, 99.6% of the tokens: fits 5 MB at H=128
MAX_CHAT_ANSWER_LINES = 24


def stdlib_files(root: pathlib.Path) -> list:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(p)
    return out


def read_source(p: pathlib.Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def functions(source: str) -> list:
    """(signature line, first docstring line, dedented source) of short top-level-ish functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        n_lines = node.end_lineno - node.lineno + 1
        if node.decorator_list or not 3 <= n_lines <= MAX_CHAT_ANSWER_LINES:
            continue
        body = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        signature = body.splitlines()[0]
        if not signature.rstrip().endswith(":"):
            continue
        doc = ast.get_docstring(node)
        out.append((signature.strip(), doc.strip().splitlines()[0] if doc else None, body))
    return out


def chat_conversations(train_sources: list) -> list:
    """(user message, assistant answer) pairs: the user gives a signature or asks for a named
    function by its docstring's first line; the answer is that function from the library."""
    candidates = []
    for src in train_sources:
        candidates.extend(functions(src))
    rng = np.random.default_rng(14)
    order = rng.permutation(len(candidates))
    convs = []
    for i in order[:NUM_CHATS]:
        signature, doc, body = candidates[int(i)]
        name = signature[4:].split("(", 1)[0]
        if doc and i % 2 == 0:
            user = f"Write a Python function `{name}`: {doc}"
        else:
            user = signature
        convs.append((user, body))
    return convs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=pathlib.Path)
    ap.add_argument("--heldout", type=pathlib.Path, default=None,
                    help="also write the held-out text here")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import tokenizers
    from ninfer.models.qwen3_5.frontend import ChatTemplate, builtin_template_source
    from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json

    tok = tokenizers.Tokenizer.from_str(cached_qwen3_5_tokenizer_json().decode("utf-8"))
    eot = tok.token_to_id("<|endoftext|>")
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    train_docs, train_sources, held = [], [], []
    for k, p in enumerate(stdlib_files(root)):
        src = read_source(p)
        if src is None:
            continue
        doc = f"# file: {p.relative_to(root).as_posix()}\n{src}"
        if k % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            held.append(doc)
        else:
            train_docs.append(doc)
            train_sources.append(src)

    ids = []
    for enc in tok.encode_batch(train_docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    train = np.asarray(ids, np.int32)

    template = ChatTemplate(builtin_template_source(), {"eos_token": "<|im_end|>"})
    chat_ids, chat_mask = [], []
    for user, answer in chat_conversations(train_sources):
        prompt = template.render([{"role": "user", "content": user}], add_generation_prompt=True,
                                 enable_thinking=False)
        p_ids = tok.encode(prompt, add_special_tokens=False).ids
        a_ids = tok.encode(answer + "<|im_end|>\n", add_special_tokens=False).ids
        chat_ids.extend(p_ids + a_ids + [eot])
        chat_mask.extend([0] * len(p_ids) + [1] * len(a_ids) + [0])
    chat = np.asarray(chat_ids, np.int32)

    ids_seen, counts = np.unique(np.concatenate([train, chat]), return_counts=True)
    specials = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                             "<think>", "</think>")]
    vocab = np.union1d(ids_seen[counts >= MIN_COUNT], specials)
    held_text = "\n".join(held)
    heldout_ids = np.asarray(tok.encode(held_text, add_special_tokens=False).ids, np.int32)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    np.save(args.out_dir / "train.npy", train)
    np.save(args.out_dir / "chat.npy", chat)
    np.save(args.out_dir / "chat_mask.npy", np.asarray(chat_mask, np.uint8))
    np.save(args.out_dir / "vocab.npy", vocab.astype(np.int32))
    np.save(args.out_dir / "heldout.npy", heldout_ids)
    manifest = {"python": sys.version.split()[0], "train_files": len(train_docs),
                "heldout_files": len(held), "train_tokens": int(train.size),
                "chat_conversations": NUM_CHATS, "chat_tokens": int(chat.size),
                "vocab_seen": int(ids_seen.size), "vocab_kept": int(vocab.size),
                "min_count": MIN_COUNT, "heldout_tokens": int(heldout_ids.size)}
    (args.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if args.heldout is not None:
        args.heldout.parent.mkdir(parents=True, exist_ok=True)
        args.heldout.write_text(held_text, encoding="utf-8")
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
