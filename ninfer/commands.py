"""What the commands share: the engine-option flags, the backend and max_context settled from them,
the start-up line, and the generation flags of `run` and `chat` (their handlers: run_command.py,
serve_command.py, chat.py; the HTTP app is ninfer/serve/).

Bad input ends with one `ninfer: error: ...` line and exit status 2 (cli.main prints it).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
import typing

from .errors import Error



# ---- shared flags --------------------------------------------------------------------------------
#
# Every EngineOptions field is a flag of `run` and `serve`, generated from the dataclass (so a new
# option is a new flag without an edit here): --max-context, --prefix-cache-bytes 512M, --graphs /
# --no-graphs, ... A flag left out keeps the EngineOptions default (the run/serve concurrency
# defaults and max_context's model-derived default aside). `purpose` is fixed by the command;
# `default_enable_thinking` is --thinking / --no-thinking (left out: the model's default).

_OPTION_HELP = {
    "backend": "auto: cuda when a GPU is usable (the [cuda] extra installed and "
               "a device present), else numpy, said on stderr; numpy (CPU, float32) or cuda "
               "(one NVIDIA GPU)",
    "max_concurrency": "resident requests, 1..8",
    "max_context": "prompt + generated tokens per request (default: the model's "
                   "max_position_embeddings, bounded by the memory its KV cache may take)",
    "max_queue": "requests waiting beyond max-concurrency before 429",
    "prefill_chunk": "tokens per prefill / Replay window",
    "page_size": "tokens per KV page",
    "num_kv_pages": "KV pages (default: enough for max-concurrency * max-context)",
    "host_snapshot_bytes": "host memory for Snapshot pauses (0: Replay only); K/M/G suffixes",
    "prefix_cache": "the context cache: later requests start from the computed prefixes of "
                    "earlier ones (prompts, finished turns) instead of prefilling them again "
                    "(default: on, off with --batch-invariant)",
    "prefix_cache_device_fraction": "share of the KV pages and State slots the context cache "
                                    "may hold on the device, 0..1",
    "prefix_cache_host_bytes": "host memory for the context cache's checkpoints (cold ones "
                               "demoted from the device; cuda pins it, and a quarter more, at "
                               "load); K/M/G suffixes (default 256M)",
    "prefix_cache_bytes": "the older name of --prefix-cache-host-bytes",
    "checkpoint_interval": "tokens between context-cache checkpoints inside a long prompt",
    "queue_timeout_s": "seconds a request may wait in the queue (default: no limit)",
    "device_id": "cuda device ordinal",
    "graphs": "cuda: replay CUDA graphs for decode",
    "dtype": "compute dtype (cuda: default bfloat16; float32 matches the numpy backend exactly "
             "at about twice the memory; numpy: float32 only)",
    "kv_dtype": "KV cache storage: auto: unquantized, in the compute dtype "
                "(numpy: float32; cuda: bfloat16, float32 with --dtype float32); fp8 or int8: "
                "one byte per value and one scale per token and kv head (both backends, the "
                "same bytes; about half the memory of bfloat16 pages)",
    "fp8_activations": "fp8 weights on cuda: prefill GEMMs on the fp8 tensor cores, the "
                       "activations quantized per token and 128 columns as FP8 releases intend "
                       "(default: on where cuBLASLt has it, Hopper, except for scoring); "
                       "--no-fp8-activations: "
                       "weights dequantized to bfloat16, exact weights, slower prefill",
    "warmup": "cuda: capture the decode graphs and run one step before ready",
    "debug_checks": "re-check every batch inside the backend too",
    "batch_invariant": "a request's tokens independent of load (cuda: decode 5-9%% slower)",
    "speculative": "speculative decoding, the same tokens in fewer target steps: mtp, the "
                   "checkpoint's multi-token-prediction head; dflash, the artifact's DFlash "
                   "block drafter (numpy backend; convert --dflash)",
    "num_draft_tokens": "the most tokens drafted per decode step: mtp 1..4 (default 3), dflash "
                        "1 .. its block size - 1 (the default) (with --speculative)",
    "draft_policy": "adaptive: each step drafts the 0..K tokens that measure fastest (0: plain "
                    "decoding where drafts do not pay); fixed: always K (with --speculative)",
    "draft_vocab": "MTP drafts only the first N ids of the vocabulary: a draft step reads N "
                   "rows of the lm_head (default 2**17; the vocabulary's size or more: every "
                   "id) (with --speculative mtp)",
    "draft_head": "int8: MTP drafts read an int8 copy of the lm_head's draft rows (half the "
                  "bytes a draft step reads, the copy's memory: 0.54 GB for a 9B); bf16: the "
                  "lm_head itself (with --speculative mtp)",
    "vision_max_patches": "cuda: the most 16x16 patches of one image the GPU vision tower "
                          "holds; larger images run on the host tower (0: host tower only) "
                          "(default 128x128 patches, a 2048x2048 image)",
}
_NOT_FLAGS = ("purpose", "default_enable_thinking")       # see above
_FLAG_ALIASES = {"num_draft_tokens": ("--draft-tokens",)}
_FLAG_CHOICES = {"dtype": ("bfloat16", "float32"),        # free strings the options validate
                 "kv_dtype": ("auto", "fp8", "int8", "bfloat16"),
                 "backend": ("auto", "numpy", "cuda")}
# flags whose CLI default differs from the EngineOptions field's (shown in --help as such)
_FLAG_DEFAULTS = {"backend": "auto", "kv_dtype": "auto"}


def size_text(n: int) -> str:
    """A byte count as the size flags take it: the largest binary unit that divides it (256M,
    1G, 512K), else plain bytes, so help, logs and flags read alike."""
    for suffix, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _size(text: str) -> int:
    """A byte count: 1048576, 512K, 256M, 2G (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1048576, 512M, 2G)")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size >= 0")
    return int(value * scale)


def _flag_kind(hint):
    """(argparse type, choices) of one EngineOptions annotation (Optional[...] unwrapped)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is typing.Literal:
        return str, typing.get_args(hint)
    return hint, None


def _engine_flags(p, *, concurrency_default: int) -> None:
    from .options import EngineOptions
    hints = typing.get_type_hints(EngineOptions)
    g = p.add_argument_group("engine options (ninfer.EngineOptions)")
    for f in dataclasses.fields(EngineOptions):
        if f.name in _NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = concurrency_default if f.name == "max_concurrency" \
            else _FLAG_DEFAULTS.get(f.name, f.default)
        text = _OPTION_HELP.get(f.name, f"EngineOptions.{f.name}")
        if f.name.endswith("_bytes") and isinstance(default, int):
            default = size_text(default)
        if f.name != "max_context" and default is not None and "(default" not in text:
            text += f" (default {default})"
        kind, choices = _flag_kind(hints[f.name])
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        choices = _FLAG_CHOICES.get(f.name, choices)
        if f.name.endswith("_bytes"):
            kind = _size
        metavar = "SIZE" if kind is _size else "SECONDS" if f.name.endswith("_s") \
            else "F" if f.name.endswith("_fraction") else "N"
        if choices:     # bfloat16 stays accepted by --kv-dtype (the older name of auto), unshown
            metavar = "{" + ",".join(c for c in choices
                                     if not (f.name == "kv_dtype" and c == "bfloat16")) + "}"
        g.add_argument(flag, *_FLAG_ALIASES.get(f.name, ()), type=kind, choices=choices,
                       default=None, help=text, metavar=metavar)


def engine_kwargs(args, *, concurrency_default: int) -> dict:
    """EngineOptions keyword arguments of the flags given (max_concurrency always)."""
    from .options import EngineOptions
    out = {"max_concurrency": concurrency_default}
    for f in dataclasses.fields(EngineOptions):
        value = getattr(args, f.name, None)
        if f.name not in _NOT_FLAGS and value not in (None, "auto"):
            out[f.name] = value         # auto: the backend is settled by settle_backend; the KV
    return out                          # dtype is the EngineOptions default (unquantized)


def check_engine_flags(kwargs: dict) -> None:
    """The engine flags' values checked before anything loads (one error line). With the backend
    still auto, a value that one of the two backends takes (--dtype bfloat16: cuda) waits for
    the backend chosen; the Engine checks the final set again."""
    from .errors import RequestError
    from .options import EngineOptions
    if "backend" in kwargs:
        EngineOptions.from_kwargs(**kwargs)
        return
    first = None
    for backend in ("numpy", "cuda"):
        try:
            EngineOptions.from_kwargs(**kwargs, backend=backend)
            return
        except RequestError as exc:
            first = first or exc
    raise first


def settle_backend(args, *, concurrency_default: int = 1):
    """--backend auto (or left out) -> cuda or numpy (ninfer/backend_auto.py), then the engine
    flags checked against the backend chosen (a flag the chosen backend refuses is one error
    line that names the choice). Returns the line that says what auto chose (None when the
    backend was named), for the caller to print once the model is found."""
    from .backend_auto import choose_backend
    from .errors import RequestError
    args.backend, note = choose_backend(getattr(args, "backend", None),
                                        getattr(args, "device_id", None) or 0)
    try:
        check_engine_flags(engine_kwargs(args, concurrency_default=concurrency_default))
    except RequestError as exc:
        if note is None:
            raise
        raise Error(f"{exc}; {note}") from None
    return note


# Engine.startup_seconds' keys that are parts of "model" and of "warm_up"
_MODEL_PHASES = ("setup", "weights", "kernels")
_WARM_UP_PHASES = ("graphs", "speculative_graphs")


def startup_line(engine) -> str:
    """Where the Engine's start went (Engine.startup_seconds), for stderr and the server's log:
    ninfer: started in 6.5 s: tokenizer 0.0 s, model 4.1 s (setup 2.2 s, weights 1.8 s =
    10.1 GB/s, kernels 0.0 s), pools 0.3 s, warm-up 0.4 s (graphs 0.3 s)"""
    s = engine.startup_seconds

    rate = engine.stats().get("weights_load_gb_per_s")

    def parts(names):
        inner = ", ".join(f"{k} {s[k]:.1f} s" + (f" = {rate:.1f} GB/s" if k == "weights" and rate
                                                 else "") for k in names if k in s)
        return f" ({inner})" if inner else ""
    return (f"ninfer: started in {s['total']:.1f} s: tokenizer {s['tokenizer']:.1f} s, model "
            f"{s['model']:.1f} s{parts(_MODEL_PHASES)}"
            + (f", pools {s['pools']:.1f} s" if "pools" in s else "")
            + f", warm-up {s['warm_up']:.1f} s{parts(_WARM_UP_PHASES)}")


def say_backend(note) -> None:
    if note:
        print(f"ninfer: {note}", file=sys.stderr)


def default_max_context(path, kwargs: dict) -> tuple:
    """(max_context, how it was chosen) when --max-context is not given: the model's
    max_position_embeddings, bounded so that the KV cache of max_concurrency full-length
    sequences takes at most half of the memory free now (host memory on numpy, the GPU's on
    cuda: nvidia-smi), after the weights."""
    from .artifact import Artifact
    from .models import model_config
    from .models.qwen3_5.memory_plan import default_max_context as plan_max_context
    with Artifact(path) as art:
        text = model_config(art).text
        weights = os.path.getsize(path)
    itemsize = 2 if kwargs.get("backend") == "cuda" and kwargs.get("dtype") != "float32" else 4
    if kwargs.get("kv_dtype", "bfloat16") != "bfloat16":     # 1-byte codes + a float32 scale
        itemsize = 1 + 4 / text.head_dim                       # per token and head (kv_quant)
    free = _free_memory(kwargs.get("backend", "numpy"), kwargs.get("device_id", 0))
    limit, is_bounded = plan_max_context(text, max_concurrency=kwargs["max_concurrency"],
                                         kv_itemsize=itemsize, weights_bytes=weights,
                                         free_bytes=free)
    how = f"the model's max_position_embeddings {int(text.max_position_embeddings)}"
    if is_bounded:
        how += (f", bounded by the KV cache of {kwargs['max_concurrency']} sequences in half of "
                f"{free / (1 << 30):.1f} GiB free memory")
    return limit, how


def _free_memory(backend: str, device_id: int):
    """Free bytes of the memory the KV cache would live in, or None when unknown."""
    if backend == "numpy":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    import subprocess
    try:        # no CUDA context in this (pre-fork) process: ask nvidia-smi
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,"
                              "nounits", f"--id={device_id}"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        return int(out.split()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def resolved_engine_kwargs(args, path, *, concurrency_default: int) -> dict:
    """The Engine's keyword arguments: the flags given, and max_context from the model when not
    given (said on stderr, as vLLM logs its max_model_len)."""
    kwargs = engine_kwargs(args, concurrency_default=concurrency_default)
    if "max_context" not in kwargs:
        kwargs["max_context"], how = default_max_context(path, kwargs)
        print(f"ninfer: max_context {kwargs['max_context']} ({how}; --max-context N sets it)",
              file=sys.stderr)
    return kwargs


def read_chat_template(path):
    """--chat-template FILE: the Jinja source, or None when not given."""
    if path is None:
        return None
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Error(f"--chat-template {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _artifact_or_demo(path):
    """(artifact path, is_demo). No path -> the built-in demo model (generated on first use)."""
    if path is None:
        from .demo import REFERENCE_NOTICE, ensure_reference_artifact
        from .demo import reference_path as demo_path
        print(f"ninfer: {REFERENCE_NOTICE}", file=sys.stderr)
        if not demo_path().is_file():
            print(f"ninfer: building it on first use (a few seconds), cached at {demo_path()}",
                  file=sys.stderr)
        try:
            return ensure_reference_artifact(), True
        except OSError as exc:
            raise Error(f"cannot cache the demo model at {demo_path().parent}: "
                        f"{exc.strerror or exc}; set NINFER_CACHE_DIR to a writable directory "
                        "or name an artifact") from None
    p = pathlib.Path(path)
    if not p.is_file():
        raise Error(f"artifact {path}: no such file (convert a checkpoint with "
                    "`python -m ninfer convert`, or omit it to use the demo model)")
    return p, False


# ---- the flags and set-up `run` and `chat` share ------------------------------------------------

def generation_flags(p, *, max_new_help: str) -> None:
    """The flags `run` and `chat` share: the artifact, the chat template, every engine option,
    sampling, seed, the thinking switch and budget."""
    p.add_argument("artifact", nargs="?",
                   help="a .ninfer file (default: the built-in demo model, trained on Python)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template replacing the artifact's")
    _engine_flags(p, concurrency_default=1)
    sampling_flags(p)
    p.add_argument("--max-new", type=int, default=None, metavar="N", help=max_new_help)
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="seed of the sampler's random stream: the same seed, prompt and flags "
                        "give the same answer (default: a fresh one each time; greedy needs none)")
    p.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                   help="most reasoning tokens; then </think> is forced and the answer follows")
    thinking_flags(p, what="ask the chat template for")


def thinking_flags(p, *, what: str) -> None:
    """--thinking / --no-thinking -> args.thinking True / False; left out None: the model's
    default (its artifact's metadata.defaults.enable_thinking; on for an artifact without one)."""
    think = p.add_mutually_exclusive_group()
    think.add_argument("--thinking", dest="thinking", action="store_true", default=None,
                       help=f"{what} reasoning (default: the model's; the built-in reference "
                            "models: off, other models: on)")
    think.add_argument("--no-thinking", dest="thinking", action="store_false",
                       help=f"{what} no reasoning")


def generation_setup(args, **overrides) -> tuple:
    """Every cheap check first (one error line, nothing loaded), then the artifact:
    (path, enable_thinking, Engine keyword arguments, SamplingParams overrides)."""
    from .api import SamplingParams
    if args.max_new is not None and args.max_new < 1:
        raise Error(f"--max-new {args.max_new}: must be >= 1")
    overrides.update(sampling_overrides(args), seed=args.seed,
                     thinking_budget=args.thinking_budget)
    if args.max_new is not None:
        overrides["max_tokens"] = args.max_new
    else:           # a default budget is an upper bound: cut to what the context leaves
        overrides["clamp_max_tokens"] = True
    SamplingParams(**overrides).validate()
    check_engine_flags(engine_kwargs(args, concurrency_default=1))
    template = read_chat_template(args.chat_template)
    note = settle_backend(args)
    path, _ = _artifact_or_demo(args.artifact)
    say_backend(note)
    # None: the Engine's default, the model's own (the reference models: off)
    kwargs = dict(resolved_engine_kwargs(args, path, concurrency_default=1),
                  chat_template=template, default_enable_thinking=args.thinking)
    return path, args.thinking, kwargs, overrides


_SAMPLING_FLAGS = (("temperature", float, "0 = greedy"), ("top_p", float, ""),
                   ("top_k", int, "0 disables it"), ("min_p", float, ""),
                   ("repetition_penalty", float, ""), ("presence_penalty", float, ""),
                   ("frequency_penalty", float, ""))


def sampling_flags(p) -> None:
    """--temperature ... --frequency-penalty; left out -> the checkpoint's generation_config.json
    value, else SamplingParams' (greedy)."""
    for name, kind, text in _SAMPLING_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=(text + "; " if text else "") + "default: the checkpoint's "
                            "recommendation, else off")


def sampling_overrides(args) -> dict:
    """The SamplingParams fields the sampling flags set."""
    return {name: getattr(args, name) for name, _, _ in _SAMPLING_FLAGS
            if getattr(args, name) is not None}
