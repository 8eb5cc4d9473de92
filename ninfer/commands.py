"""Parsers and handlers of `run` and `serve` (the Gateway/CLI owner; the HTTP app is ninfer/serve/).

Bad input ends with one `ninfer: error: ...` line and exit status 2 (cli.main prints it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
import typing

from .errors import Error

_ROLES = ("system", "developer", "user", "assistant", "tool")


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
                               "demoted from the device); K/M/G suffixes (default 256M)",
    "prefix_cache_bytes": "the older name of --prefix-cache-host-bytes",
    "checkpoint_interval": "tokens between context-cache checkpoints inside a long prompt",
    "queue_timeout_s": "seconds a request may wait in the queue (default: no limit)",
    "device_id": "cuda device ordinal",
    "graphs": "cuda: replay CUDA graphs for decode",
    "dtype": "compute dtype (cuda: default bfloat16; float32 matches the numpy backend exactly "
             "at about twice the memory; numpy: float32 only)",
    "kv_dtype": "KV cache storage: auto: unquantized, in the compute dtype "
                "(numpy: float32; cuda: bfloat16, float32 with --dtype float32); fp8 or int8: "
                "one byte per value and one scale per token and kv head (numpy backend only "
                "for now)",
    "warmup": "cuda: capture the decode graphs and run one step before ready",
    "debug_checks": "re-check every batch inside the backend too",
    "batch_invariant": "a request's tokens independent of load (cuda: decode 5-9%% slower)",
    "speculative": "mtp: speculative decoding with the checkpoint's multi-token-prediction head "
                   "(the same tokens, fewer target steps; numpy backend only for now)",
    "num_draft_tokens": "tokens the MTP head drafts per decode step, 1..4 (with --speculative)",
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
_WARM_UP_PHASES = ("graphs",)


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


# ---- run -----------------------------------------------------------------------------------------

def add_run_parser(sub) -> None:
    r = sub.add_parser("run", help="generate from a prompt, streaming the answer to stdout",
                       description="Generate from a prompt: the answer streams to stdout; "
                                   "reasoning and a stats line go to stderr.")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user message")
    src.add_argument("--messages", metavar="FILE",
                     help="JSON chat: a list of {role, content} messages, or "
                          "{\"messages\": [...], \"tools\": [...]}")
    r.add_argument("--system", help="a system message put first (with --prompt)")
    r.add_argument("--raw", action="store_true",
                   help="send --prompt as raw text, without the chat template")
    r.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")
    generation_flags(r, max_new_help="most tokens to generate (default: the checkpoint's, "
                                     "else 256)")
    r.set_defaults(handler=run_command)


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


def load_messages(path: str):
    """(messages, tools) from a --messages file; Error naming the file and the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise Error(f"--messages {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Error(f"--messages {path}: not valid JSON ({exc})") from None
    tools = None
    if isinstance(doc, dict):
        tools = doc.get("tools")
        doc = doc.get("messages")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise Error(f"--messages {path}: 'tools' must be a list of objects")
    if not isinstance(doc, list) or not doc:
        raise Error(f"--messages {path}: expected a non-empty list of messages "
                    "(or an object with a 'messages' list)")
    for i, m in enumerate(doc):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise Error(f"--messages {path}: message {i} needs a 'role' in {list(_ROLES)}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m["role"] == "assistant")):
            raise Error(f"--messages {path}: message {i} needs a string 'content'")
    return doc, tools


def _run_prompt(args):
    if args.messages is not None:
        if args.system is not None or args.raw:
            raise Error("--system and --raw go with --prompt, not --messages")
        return load_messages(args.messages)
    if args.raw:
        if args.system is not None:
            raise Error("--system needs the chat template; it cannot go with --raw")
        return args.prompt, None
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    return messages + [{"role": "user", "content": args.prompt}], None


class _Printer:
    """Answer to stdout as it streams; reasoning to stderr (dim on a terminal, else prefixed)."""

    def __init__(self):
        self.dim = sys.stderr.isatty()
        self.channel = None

    def text(self, channel: str, text: str) -> None:
        if channel == "reasoning":
            if self.channel != "reasoning":
                sys.stderr.write("\x1b[2m" if self.dim else "[reasoning] ")
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            self._end_reasoning()
            sys.stdout.write(text)
            sys.stdout.flush()
        self.channel = channel

    def tool_call(self, call) -> None:
        self._end_reasoning()
        print(json.dumps({"tool_call": {"name": call.name, "arguments": call.arguments}},
                         ensure_ascii=False), flush=True)
        self.channel = "tool"

    def _end_reasoning(self) -> None:
        if self.channel == "reasoning":
            sys.stderr.write("\x1b[0m\n" if self.dim else "\n")
            sys.stderr.flush()

    def end(self) -> None:
        self._end_reasoning()
        if self.channel == "content":
            sys.stdout.write("\n")
            sys.stdout.flush()


def stats_line(res, wall_s: float) -> str:
    """Prefill speed counts the tokens prefilled: the prompt less what the context cache gave."""
    n_prompt, n_out = res.num_prompt_tokens, len(res.token_ids)
    n_prefilled = n_prompt - res.num_cached_tokens
    prefill = f"{n_prefilled / res.prefill_seconds:.1f} tok/s" if res.prefill_seconds > 0 \
        else "n/a"
    decode = (f"{(n_out - 1) / res.decode_seconds:.1f} tok/s"
              if n_out > 1 and res.decode_seconds > 0 else "n/a")
    ttft = f"{res.time_to_first_token * 1000:.0f} ms" if res.time_to_first_token else "n/a"
    return (f"[prompt {n_prompt} tok ({res.num_cached_tokens} cached), prefill {prefill}"
            f" | generated {n_out} tok, decode {decode}"
            f" | TTFT {ttft} | total {wall_s:.2f} s | finish {res.finish_reason}]")


def run_command(args) -> int:
    from .api import Finished, TextDelta, ToolCallEvent

    prompt, tools = _run_prompt(args)
    path, thinking, kwargs, overrides = generation_setup(args, stop=tuple(args.stop))

    from .engine import Engine
    with Engine(path, **kwargs) as engine:
        print(startup_line(engine), file=sys.stderr)
        params = engine.default_sampling_params(**overrides)
        t0 = time.monotonic()
        handle = engine.submit(prompt, params, tools=tools, enable_thinking=thinking)
        out = _Printer()
        result = None
        try:
            for event in handle:
                if isinstance(event, TextDelta) and event.text:
                    out.text(event.channel, event.text)
                elif isinstance(event, ToolCallEvent):
                    out.tool_call(event.call)
                elif isinstance(event, Finished):
                    result = event.result
        finally:
            handle.close()
            out.end()
    if result is None or result.finish_reason == "error":
        raise Error(f"generation failed: {result.error if result else 'no result'}")
    print(stats_line(result, time.monotonic() - t0), file=sys.stderr)
    return 0


# ---- serve ---------------------------------------------------------------------------------------

def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI/Anthropic-compatible HTTP API (gunicorn)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/messages, "
                                   "/v1/models, /health and /metrics (see docs/serving.md).")
    s.add_argument("artifact", nargs="?",
                   help="a .ninfer file (default: the built-in demo model, trained on Python)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="bind port (default 8000)")
    _engine_flags(s, concurrency_default=4)
    s.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(default: $NINFER_API_KEY; unset = no auth)")
    s.add_argument("--model-id", help="model name in responses and /v1/models "
                                      "(default: the artifact's name)")
    sampling_flags(s)       # request defaults: a request's own field wins
    s.add_argument("--max-tokens", type=int, default=None,
                   help="default max_tokens (default: the checkpoint's, else whatever fits in "
                        "the context)")
    s.add_argument("--max-tokens-cap", type=int, default=None, metavar="N",
                   help="most tokens one request may ask for: a larger max_tokens is a 400 "
                        "naming N, a request naming none gets at most N (default: no cap but "
                        "the context)")
    thinking_flags(s, what="requests that do not say (chat_template_kwargs.enable_thinking) get")
    s.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template replacing the artifact's")
    s.add_argument("--lenient", action="store_true",
                   help="ignore request fields this server does not implement (default: 400 "
                        "naming the field)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="cancel a generation still running this long after it was submitted "
                        "(default: no limit)")
    s.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                   help="CORS: let browser pages from ORIGIN (https://host:port, or '*') call "
                        "the API (repeatable; default: none)")
    s.add_argument("--allow-media-urls", metavar="HOST,...", default=None,
                   help="fetch http(s) image URLs from these hosts (HOST or HOST:PORT, "
                        "comma-separated; 20 MiB and 10 s per image, redirects only to listed "
                        "hosts; default: none, images come inline as data: URLs)")
    s.add_argument("--threads", type=int, default=None,
                   help="HTTP worker threads (default max-concurrency + max-queue + 4)")
    s.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body, MiB (default 8)")
    s.add_argument("--drain-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, in-flight requests get this long before they are "
                        "cancelled (default 30)")
    s.add_argument("--access-log", action="store_true", help="log each request to stderr")
    s.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="the server's (gunicorn and uvicorn) log lines on stderr at this level "
                        "and above (default info)")
    s.set_defaults(handler=serve_command)


def serve_command(args) -> int:
    from .options import EngineOptions
    from .serve.config import ServeConfig, transport_overrides   # plain data: no falcon yet

    check_engine_flags(engine_kwargs(args, concurrency_default=4))   # one line, before any fork
    if not 1 <= args.port <= 65535:
        raise Error(f"--port {args.port}: must be in 1..65535")
    if args.threads is not None and args.threads < 1:
        raise Error(f"--threads {args.threads}: must be >= 1")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise Error(f"--max-body-mb {args.max_body_mb}: must be a finite number > 0")
    config = ServeConfig(model_id=args.model_id, api_key=args.api_key or None,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)),
                         max_tokens=args.max_tokens, max_tokens_cap=args.max_tokens_cap,
                         enable_thinking=args.thinking,
                         drain_grace_s=args.drain_grace, lenient=args.lenient,
                         request_timeout_s=args.request_timeout,
                         allowed_origins=tuple(args.allowed_origins),
                         **sampling_overrides(args), **transport_overrides(args)).validate()
    media_urls = None
    if args.allow_media_urls is not None:
        from .models.qwen3_5.frontend.media_fetch import MediaUrlPolicy
        try:
            media_urls = MediaUrlPolicy.parse(args.allow_media_urls)
        except ValueError as exc:
            raise Error(str(exc)) from None
    template = read_chat_template(args.chat_template)
    _check_can_listen(args.host, args.port)
    note = settle_backend(args, concurrency_default=4)
    path, _ = _artifact_or_demo(args.artifact)
    say_backend(note)
    kwargs = dict(resolved_engine_kwargs(args, path, concurrency_default=4),
                  default_enable_thinking=args.thinking)     # None: the model's default
    options = EngineOptions.from_kwargs(**kwargs)
    threads = args.threads or min(options.max_concurrency + options.max_queue + 4, 512)

    def engine_factory():
        from .engine import Engine
        engine = Engine(path, chat_template=template, **kwargs)
        # one write: this runs in the loading thread while the access log writes /health lines
        # to the same stream, and print() writes the text and its newline separately
        sys.stderr.write(startup_line(engine) + "\n")
        sys.stderr.flush()
        if media_urls is not None and engine.frontend is not None:
            engine.frontend.allow_media_urls(media_urls)
        return engine

    try:
        from .serve.launcher import serve
    except ImportError as exc:
        raise Error(f"serve needs the [serve] extra ({exc}); pip install 'ninfer[serve]'") from None
    print(f"ninfer: serving {path} on http://{args.host}:{args.port} "
          f"(OpenAI /v1/chat/completions, Anthropic /v1/messages)", file=sys.stderr)
    serve(engine_factory, config, host=args.host, port=args.port, threads=threads,
          access_log=args.access_log, log_level=args.log_level)
    return 0


def _check_can_listen(host: str, port: int) -> None:
    """Bind once (as gunicorn will, SO_REUSEADDR) so that a taken port or an unknown host is one
    error line before the model loads, not gunicorn's retries. A port taken in between still
    fails in gunicorn."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        raise Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
