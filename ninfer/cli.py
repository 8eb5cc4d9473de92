"""`python -m ninfer {convert,score,eval,run,chat,serve,warmup}`.

Bad input ends with one line on stderr (`ninfer: error: ...`) and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

from .errors import Error


class _Parser(argparse.ArgumentParser):
    """Bad flags end with one line (the subcommand's `--help` has the usage), exit status 2."""

    def error(self, message):
        command = self.prog.split()[3:]         # prog: "python -m ninfer [COMMAND]"
        where = f"{' '.join(command)}: " if command else ""
        self.exit(2, f"ninfer: error: {where}{message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m ninfer",
                                description="Torch-free inference for the Qwen3.5 model family.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint directory to .ninfer")
    c.add_argument("src", help="checkpoint directory (config.json, *.safetensors, tokenizer files)")
    c.add_argument("out", help="output .ninfer path (written atomically)")
    c.add_argument("--name", help="metadata.name (default: the architecture name)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--quantize", choices=("fp8", "int8", "int4"),
                   help="store the text projections quantized (fp8 blocks of 128x128, int8 / int4 "
                        "groups of --group-size; see docs/artifact.md); default: as in the "
                        "checkpoint")
    c.add_argument("--group-size", type=int, choices=(32, 64, 128), metavar="{32,64,128}",
                   help="with --quantize int8 / int4: columns per scale group, 32, 64 or 128 "
                        "(default 128; 64 for int4 with --calibration; docs/artifact.md 6)")
    c.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantize: the lm_head too (default: kept 16-bit)")
    c.add_argument("--lm-head-format", choices=("fp8", "int8", "int4"),
                   help="with --quantize: the lm_head quantized in this format (e.g. int8 beside "
                        "an int4 body, as decode reads the whole head every token)")
    c.add_argument("--calibration", metavar="TEXT_FILE",
                   help="with --quantize: GPTQ error compensation from the model's "
                        "inputs on this text (numpy forward; small models; docs/artifact.md 6)")
    c.add_argument("--default-thinking", choices=("on", "off"),
                   help="store the model's default enable_thinking (metadata.defaults): what "
                        "run / chat / serve / Engine use unless told otherwise (default: none "
                        "stored, which means on)")
    c.add_argument("--dflash", metavar="DRAFTER_DIR",
                   help="also store this DFlash drafter (a Hugging Face directory in z-lab's "
                        "layout: config.json with dflash_config, *.safetensors), for "
                        "--speculative dflash (docs/artifact.md 8)")
    c.set_defaults(handler=_convert)

    s = sub.add_parser("score", help="score text or token ids: total logprob and perplexity")
    s.add_argument("artifact", nargs="?",
                   help="a .ninfer file (default: the built-in demo model, trained on Python)")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="text to score")
    g.add_argument("--ids", help="file of whitespace-separated token ids")
    add_backend_flag(s)
    s.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="compute dtype (cuda: default bfloat16, float32 for reference-precision "
                        "scores; numpy: float32 only)")
    s.add_argument("--chunk", type=int, default=512, help="scoring window (tokens)")
    s.set_defaults(handler=_score)

    from .chat import add_chat_parser
    from .run_command import add_run_parser
    from .serve_command import add_serve_parser
    from .eval import add_eval_parser
    add_eval_parser(sub)
    add_run_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    from .warmup import add_warmup_parser
    add_warmup_parser(sub)
    from .serve.config import add_transport_flags   # issue 17: timeouts, connection cap
    add_transport_flags(sub.choices["serve"])
    return p


def _convert(args) -> int:
    from .convert import Quantize, convert_checkpoint
    if (args.quantize_lm_head or args.lm_head_format) and not args.quantize:
        raise Error(f"--{'lm-head-format' if args.lm_head_format else 'quantize-lm-head'} "
                    "needs --quantize")
    if args.calibration and not args.quantize:
        raise Error("--calibration needs --quantize")
    if args.group_size is not None and args.quantize not in ("int8", "int4"):
        raise Error("--group-size needs --quantize int8 or int4 (fp8 has 128x128 blocks)")
    calibration = None
    if args.calibration:
        try:
            calibration = pathlib.Path(args.calibration).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Error(f"--calibration {args.calibration}: cannot read ({exc})") from exc
    head = args.lm_head_format or args.quantize_lm_head
    group = {} if args.group_size is None else {"group": args.group_size}
    recipe = Quantize(args.quantize, quantize_lm_head=head, calibration=calibration,
                      **group) if args.quantize else None
    defaults = None if args.default_thinking is None \
        else {"enable_thinking": args.default_thinking == "on"}
    out = convert_checkpoint(args.src, args.out, name=args.name, progress=not args.quiet,
                             recipe=recipe, defaults=defaults, dflash_dir=args.dflash)
    print(f"wrote {out}")
    return 0


def add_backend_flag(p) -> None:
    """--backend of score / eval (run, chat and serve get theirs from EngineOptions)."""
    from .backend_auto import CHOICES
    p.add_argument("--backend", default="auto", choices=CHOICES,
                   help="auto: cuda when a GPU is usable (the [cuda] extra installed and a "
                        "device present), else numpy, said on stderr (default auto)")


def _score(args) -> int:
    import numpy as np

    from .commands import _artifact_or_demo, say_backend, settle_backend
    from .engine import Engine
    if args.chunk < 1:
        raise Error(f"--chunk {args.chunk}: must be >= 1")
    note = settle_backend(args)
    path, _ = _artifact_or_demo(args.artifact)
    say_backend(note)
    with Engine(path, backend=args.backend, purpose="scoring", dtype=args.dtype,
                prefill_chunk=args.chunk) as engine:
        if args.text is not None:
            ids = engine.tokenize(args.text)
        else:
            try:
                with open(args.ids) as f:
                    ids = np.array([int(x) for x in f.read().split()], dtype=np.int32)
            except (OSError, ValueError) as exc:
                raise Error(f"--ids {args.ids}: {exc}") from exc
        if len(ids) < 2:
            raise Error(f"need at least 2 tokens to score, got {len(ids)}")
        res = engine.score(ids)
    print(f"tokens {len(ids)}  total_logprob {res.total_logprob:.6f}  "
          f"perplexity {res.perplexity:.6f}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except Error as exc:
        print(f"ninfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ninfer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (`| head`): stop quietly, as a SIGPIPE would; stdout to
        # /dev/null so that the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
