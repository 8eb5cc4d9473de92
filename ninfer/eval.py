"""`python -m ninfer eval ARTIFACT --text FILE | --dataset NAME`: perplexity and bits per byte.

The text is tokenized once and cut into windows of `--context` tokens; each window is scored
independently through CausalScoring, starting from `<|endoftext|>` (the corpus's document
separator), so every token of the text is predicted exactly once with up to `context - 1` tokens
of history. Figures:

    perplexity     exp(-sum log p / tokens)
    bits per byte  -sum log p / ln 2 / UTF-8 bytes of the text scored (tokenizer-independent)

Named datasets are texts shipped with the package (`heldout`: the reference models' held-out
CPython source, docs/models.md). The quantization and KV-format quality gates and the
speculative-decoding acceptance figures use these numbers.
"""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import asdict, dataclass

import numpy as np

from .errors import Error

DATASETS = {"heldout": pathlib.Path(__file__).with_name("demo_models") / "heldout.txt"}
DOC_SEPARATOR = "<|endoftext|>"


@dataclass(frozen=True, slots=True)
class EvalResult:
    num_tokens: int              # tokens predicted (the whole text, or its first max_tokens)
    num_bytes: int               # UTF-8 bytes those tokens decode to
    num_windows: int
    total_logprob: float         # natural log, summed

    @property
    def perplexity(self) -> float:
        return math.exp(-self.total_logprob / self.num_tokens)

    @property
    def bits_per_byte(self) -> float:
        return -self.total_logprob / math.log(2) / self.num_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte}


def dataset_path(name: str) -> pathlib.Path:
    path = DATASETS.get(name)
    if path is None:
        raise Error(f"--dataset {name!r}: unknown (known: {', '.join(sorted(DATASETS))})")
    return path


def evaluate(engine, text: str, *, context: int = 512, max_tokens: int | None = None) -> EvalResult:
    """Score `text` with a purpose='scoring' Engine in independent windows (see the module doc)."""
    if context < 2:
        raise Error(f"--context must be >= 2, got {context}")
    ids = np.asarray(engine.tokenize(text), np.int32)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.size == 0:
        raise Error("the text has no tokens to score")
    sep = engine.frontend.token_id(DOC_SEPARATOR)
    if sep is None:
        raise Error(f"the artifact's tokenizer has no {DOC_SEPARATOR} to start windows with")
    step = context - 1
    total, windows = 0.0, 0
    for start in range(0, ids.size, step):
        window = np.concatenate([[sep], ids[start:start + step]]).astype(np.int32)
        total += engine.score(window).total_logprob
        windows += 1
    num_bytes = len(engine.detokenize(ids).encode("utf-8"))
    return EvalResult(num_tokens=int(ids.size), num_bytes=num_bytes, num_windows=windows,
                      total_logprob=total)


# ---- CLI ----------------------------------------------------------------------------------------

def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="perplexity and bits per byte of a text or a shipped dataset")
    e.add_argument("artifact", nargs="?",
                   help="a .ninfer file (default: the built-in demo model, trained on Python)")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="FILE", help="a UTF-8 text file")
    src.add_argument("--dataset", metavar="NAME",
                     help=f"a text shipped with ninfer: {', '.join(sorted(DATASETS))}")
    e.add_argument("--context", type=int, default=512, metavar="N",
                   help="tokens per independently scored window (default 512, the reference "
                        "models' training length)")
    e.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="score only the first N tokens of the text")
    from .cli import add_backend_flag
    add_backend_flag(e)
    e.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="compute dtype (cuda: default bfloat16; numpy: float32 only)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(handler=eval_command)


def eval_command(args) -> int:
    from .engine import Engine

    path = pathlib.Path(args.text) if args.text is not None else dataset_path(args.dataset)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise Error(f"--text {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise Error(f"--text {path}: not UTF-8 ({exc})") from None
    if args.max_tokens is not None and args.max_tokens < 1:
        raise Error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.context < 2:
        raise Error(f"--context must be >= 2, got {args.context}")
    from .commands import _artifact_or_demo, say_backend, settle_backend
    note = settle_backend(args)
    artifact, _ = _artifact_or_demo(args.artifact)
    say_backend(note)
    with Engine(artifact, backend=args.backend, purpose="scoring", dtype=args.dtype,
                prefill_chunk=args.context) as engine:
        res = evaluate(engine, text, context=args.context, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        print(f"tokens {res.num_tokens}  bytes {res.num_bytes}  windows {res.num_windows}  "
              f"perplexity {res.perplexity:.4f}  bits_per_byte {res.bits_per_byte:.4f}")
    return 0
