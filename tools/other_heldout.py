"""Build bench/data/ninfer_source.txt: held-out text of a different source than the reference
models' training corpus, for bench/quant_quality.py --other-text.

    python tools/other_heldout.py [--commit 4b18645] [--out bench/data/ninfer_source.txt]

The reference models learned CPython's standard library (tools/reference_corpus.py); this text is
NInfer's own Python source at a fixed commit (other authors, other idioms: numpy-heavy, typed,
f-strings), which no reference model saw. Every EVERY-th `ninfer/**/*.py` file in sorted path
order, each as `# file: <path>` + its source (the held-out text's form), joined by a newline,
whole files until MAX_CHARS. Deterministic: read from git objects, not the working tree.
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess

COMMIT = "4b18645"
EVERY = 6
MAX_CHARS = 60_000


def build(commit: str, repo: pathlib.Path) -> str:
    git = ["git", "-C", str(repo)]
    names = subprocess.run(git + ["ls-tree", "-r", "--name-only", commit, "ninfer"], check=True,
                           capture_output=True, text=True).stdout.split()
    parts, size = [], 0
    for path in sorted(n for n in names if n.endswith(".py"))[::EVERY]:
        src = subprocess.run(git + ["show", f"{commit}:{path}"], check=True,
                             capture_output=True, text=True).stdout
        if not src.strip():
            continue
        parts.append(f"# file: {path}\n{src}")
        size += len(parts[-1]) + 1
        if size >= MAX_CHARS:
            break
    return "\n".join(parts)


def main() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default=COMMIT)
    ap.add_argument("--out", type=pathlib.Path, default=root / "bench/data/ninfer_source.txt")
    args = ap.parse_args()
    text = build(args.commit, root)
    args.out.write_text(text)
    print(f"wrote {args.out}: {len(text):,} characters")


if __name__ == "__main__":
    main()
