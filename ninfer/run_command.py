"""`python -m ninfer run`: one prompt, the answer streamed to stdout.

Bad input ends with one `ninfer: error: ...` line and exit status 2 (cli.main prints it).
"""
from __future__ import annotations

import json
import sys
import time

from .commands import generation_flags, generation_setup, startup_line
from .errors import Error

_ROLES = ("system", "developer", "user", "assistant", "tool")


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
