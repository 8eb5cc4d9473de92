"""`python -m ninfer chat [ARTIFACT]`: an interactive terminal chat (like `ollama run`).

Answers stream as they are generated; reasoning is shown dim (or hidden with --hide-thinking or
`/think hide`); the conversation is kept across turns, so each turn re-sends the history and the
Engine's context cache reuses what it computed for the last one (the conversation is one
`session=` hint). Ctrl-C stops the current answer at once (what was shown stays in the history;
nothing more of it prints) and returns to the prompt; Ctrl-D or /exit leaves.
One line is one message; a line of three double quotes starts a block that the next such line
ends; a line ending in a backslash continues on the next. Commands: /reset, /system TEXT,
/save FILE, /think show|hide, /set NAME VALUE, /stats, /help, /exit.
"""
from __future__ import annotations

import dataclasses
import json
import sys

from .errors import Error

_HELP = """commands:
  /reset          forget the conversation (keeps the system message)
  /system TEXT    set the system message (and reset the conversation)
  /save FILE      write the conversation as JSON (a --messages file for `run`)
  /think show     show reasoning (dim); /think hide: hide it
  /set NAME VALUE a sampling parameter (temperature, top_p, max_tokens, min_tokens, seed, ...)
  /stats          context-cache reuse and tokens generated so far
  /help           this text
  /exit, Ctrl-D   leave;   Ctrl-C stops the current answer
multi-line input: a line of three double quotes starts and ends a block; a line ending in a
backslash continues on the next line"""


_SETTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "max_tokens", "min_tokens", "seed", "thinking_budget")


def add_chat_parser(sub) -> None:
    from .commands import generation_flags
    c = sub.add_parser("chat", help="chat interactively in the terminal",
                       description="Chat in the terminal: streamed answers, history kept across "
                                   "turns, /help for commands, Ctrl-C stops an answer.")
    c.add_argument("--system", help="the system message")
    c.add_argument("--hide-thinking", action="store_true",
                   help="do not print the reasoning (it is still generated)")
    generation_flags(c, max_new_help="most tokens per answer (default: the checkpoint's, "
                                     "else 1024)")
    c.set_defaults(handler=chat_command)


def chat_command(args) -> int:
    from .commands import generation_setup, startup_line
    from .engine import Engine

    path, thinking, kwargs, overrides = generation_setup(args)
    with Engine(path, **kwargs) as engine:
        print(startup_line(engine), file=sys.stderr)
        overrides.setdefault("max_tokens", engine.sampling_defaults.get("max_tokens", 1024))
        session = ChatSession(engine, engine.default_sampling_params(**overrides),
                              system=args.system, thinking=thinking,
                              show_thinking=not args.hide_thinking)
        print(f"ninfer chat: {engine.name} (/help for commands, Ctrl-D to leave)",
              file=sys.stderr, flush=True)
        session.loop()
    return 0


def _new_session() -> str:
    import uuid
    return f"chat-{uuid.uuid4().hex}"


class ChatSession:
    """One terminal conversation. `messages` is the history in the chat-template form."""

    def __init__(self, engine, params, *, system=None, thinking=True, show_thinking=True,
                 stdin=None, stdout=None):
        self.engine, self.params = engine, params
        self.system, self.thinking, self.show_thinking = system, thinking, show_thinking
        self.stdin = stdin or sys.stdin
        self.out = stdout or sys.stdout
        self.dim = self.out.isatty()
        self.messages: list = []
        self.session = _new_session()       # the context cache's hint: one per conversation
        self.last_result = None             # the last turn's GenerationResult
        self._channel = None                # the channel being written ("content", "reasoning")

    # ---- input ------------------------------------------------------------------------------------
    def _ask(self, prompt: str) -> str:
        if self.stdin is sys.stdin and self.out is sys.stdout:
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:
                pass
            return input(prompt)
        self.out.write(prompt)
        self.out.flush()
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def read_message(self):
        """The next message (multi-line forms joined), or None at end of input."""
        try:
            line = self._ask(">>> ")
            if line.strip() == '"""':
                lines = []
                while (line := self._ask("... ")).strip() != '"""':
                    lines.append(line)
                return "\n".join(lines)
            lines = []
            while line.endswith("\\"):
                lines.append(line[:-1])
                line = self._ask("... ")
            return "\n".join(lines + [line])
        except EOFError:
            return None

    def loop(self) -> None:
        while True:
            try:
                text = self.read_message()
            except KeyboardInterrupt:       # Ctrl-C at the prompt: a fresh prompt, like a shell
                self.out.write("\n(Ctrl-D or /exit to leave)\n")
                continue
            if text is None:
                self.out.write("\n")
                return
            if not text.strip():
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
                continue
            self.turn(text)

    # ---- commands ---------------------------------------------------------------------------------
    def command(self, text: str) -> bool:
        """Run one /command; False when it asks to leave."""
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/reset":
            self.messages, self.session = [], _new_session()
            self._say("(conversation cleared)")
        elif name == "/system":
            self.system, self.messages, self.session = (rest or None), [], _new_session()
            self._say("(system message set; conversation cleared)" if rest
                      else "(system message removed; conversation cleared)")
        elif name == "/save" and rest:
            try:
                with open(rest, "w", encoding="utf-8") as f:
                    json.dump({"messages": self.history()}, f, ensure_ascii=False, indent=1)
            except OSError as exc:
                self._say(f"(cannot save to {rest}: {exc.strerror or exc})")
            else:
                self._say(f"(saved {len(self.history())} messages to {rest})")
        elif name == "/set":
            self._set(rest)
        elif name == "/think" and rest in ("show", "hide"):
            self.show_thinking = rest == "show"
            self._say(f"(reasoning {'shown' if self.show_thinking else 'hidden'})")
        elif name == "/stats":
            self._say(self._stats())
        elif name in ("/help", "/?"):
            self._say(_HELP)
        else:
            self._say(f"(unknown command {text!r}; /help lists them)")
        return True

    def _stats(self) -> str:
        stats = self.engine.stats()
        last = self.last_result
        turn = "" if last is None else \
            f" (last turn: {last.num_cached_tokens} of {last.num_prompt_tokens} prompt tokens)"
        return (f"(prefix cache: {stats.get('prefix_cache_hits', 0)} hits of "
                f"{stats.get('prefix_cache_lookups', 0)} lookups, "
                f"{stats.get('prefix_cache_tokens_reused', 0)} tokens reused{turn}; "
                f"{stats.get('tokens_generated', 0)} tokens generated)")

    def _set(self, rest: str) -> None:
        """/set NAME VALUE: one sampling parameter for the next answers (VALUE as JSON)."""
        from .errors import RequestError
        key, _, raw = rest.partition(" ")
        if key not in _SETTABLE:
            self._say(f"(/set takes one of {', '.join(_SETTABLE)})")
            return
        try:
            value = json.loads(raw) if raw.strip() else None
            self.params = dataclasses.replace(self.params, **{key: value}).validate()
        except (ValueError, RequestError) as exc:
            self._say(f"(/set {key}: {exc})")
            return
        self._say(f"({key} = {value!r})")

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def history(self) -> list:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    # ---- one turn ---------------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        from .api import Finished, TextDelta, ToolCallEvent
        self.messages.append({"role": "user", "content": text})
        handle = self.engine.submit(self.history(), self.params, enable_thinking=self.thinking,
                                    session=self.session)
        shown = {"content": "", "reasoning": ""}
        calls = []                          # the tool calls shown
        self._channel = None
        result = None
        try:
            for event in handle:
                if isinstance(event, TextDelta) and event.text:
                    # counted before it is written: a Ctrl-C inside the write must not make the
                    # rest below print it a second time
                    shown[event.channel] += event.text
                    self._show(event.channel, event.text)
                elif isinstance(event, ToolCallEvent):
                    calls.append(event.call)
                    self._say(json.dumps({"tool_call": {"name": event.call.name,
                                                        "arguments": event.call.arguments}}))
                elif isinstance(event, Finished):
                    result = event.result
        except KeyboardInterrupt:
            handle.cancel()
            # Tokens the Engine committed before the cancel took hold are dropped: the answer
            # ends where the screen does, so "[stopped]" is the last line of this turn and the
            # history holds what the user saw.
            result = dataclasses.replace(handle.result(timeout=60), text=shown["content"],
                                         reasoning_text=shown["reasoning"], tool_calls=calls)
            self._end()
            self._say("[stopped]")
        finally:
            handle.close()
        self._end()
        if result is None:
            return
        self.last_result = result
        if result.finish_reason == "error":
            self.messages.pop()
            raise Error(f"generation failed: {result.error}")
        reply = {"role": "assistant", "content": result.text}
        if result.reasoning_text:
            reply["reasoning_content"] = result.reasoning_text
        if result.tool_calls:
            reply["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                "name": c.name, "arguments": json.loads(c.arguments)}} for c in result.tool_calls]
        self.messages.append(reply)
        if result.finish_reason == "length":
            self._say(f"[answer cut at {len(result.token_ids)} tokens; --max-new sets the limit]")

    def _show(self, channel: str, text: str) -> None:
        """Write a piece of the answer; `self._channel` is set before the write, so that `_end`
        closes what was started even when a Ctrl-C lands inside it."""
        if channel == "reasoning":
            if not self.show_thinking:
                return
            if self._channel != "reasoning":
                self._channel = "reasoning"
                self.out.write("\x1b[2m" if self.dim else "[reasoning] ")
        elif self._channel == "reasoning":
            self._end()
        self._channel = channel
        self.out.write(text)
        self.out.flush()

    def _end(self) -> None:
        """End the line of the channel being written (the reasoning's dim style too), if any."""
        channel, self._channel = getattr(self, "_channel", None), None
        if channel == "reasoning":
            self.out.write("\x1b[0m\n" if self.dim else "\n")
        elif channel == "content":
            self.out.write("\n")
        self.out.flush()
