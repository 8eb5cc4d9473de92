"""The ASGI app's SSE loop (asgi._sse_events): events arrive from another thread and wake the
event loop (no thread waits per event); keep-alive comments come from the stream's own timer while
nothing arrives; a client that leaves ends the stream at once; the iterator is always closed.
(Falcon's TestClient marks a request disconnected as soon as it is sent, so these drive the async
generator directly; the real servers' streams are in test_serve_http.py.)"""
import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ninfer.serve import asgi


class FedIterator:
    """An SseIterator's poll/set_listener/close, fed from a thread."""

    def __init__(self):
        self.items, self.listener, self.is_done, self.closed = deque(), None, False, 0

    def set_listener(self, fn):
        self.listener = fn

    def poll(self):
        if self.items:
            return self.items.popleft()
        if self.is_done:
            raise StopIteration
        return None

    def close(self):
        self.closed += 1

    def feed(self, messages, gap_s: float, end: bool = True):
        def run():
            for msg in messages:
                time.sleep(gap_s)
                self.items.append(msg)
                if self.listener:
                    self.listener()
            if end:
                self.is_done = True
                if self.listener:
                    self.listener()
        threading.Thread(target=run, daemon=True).start()


def collect(it, keepalive_s: float, leave_after_s: float = None):
    async def main():
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()
        if leave_after_s is not None:
            loop.call_later(leave_after_s, gone.set)
        with ThreadPoolExecutor(1) as ex:
            t0 = time.perf_counter()
            out = [e async for e in asgi._sse_events(loop, ex, it, gone, keepalive_s)]
            return out, time.perf_counter() - t0
    return asyncio.run(main())


def test_events_in_order_with_keepalives_between():
    it = FedIterator()
    msgs = [("message", f"{i}".encode()) for i in range(5)]
    it.feed(msgs, 0.12)
    out, _ = collect(it, keepalive_s=0.05)
    data = [(e.event, e.data) for e in out if e.comment is None]
    assert data == msgs, data
    # at least one keep-alive in each 0.12 s gap, each alone between events
    assert sum(1 for e in out if e.comment == "keep-alive") >= 5
    assert it.closed == 1 and it.listener is None


def test_a_burst_of_events_is_sent_whole_without_keepalives():
    it = FedIterator()
    msgs = [("message", f"{i}".encode()) for i in range(200)]
    it.feed(msgs, 0.0)
    out, _ = collect(it, keepalive_s=30.0)
    assert [(e.event, e.data) for e in out] == msgs
    assert it.closed == 1


def test_client_leaving_ends_the_stream_at_once():
    it = FedIterator()
    it.feed([("message", b"x")], 0.05, end=False)     # then nothing, ever
    out, elapsed = collect(it, keepalive_s=30.0, leave_after_s=0.3)
    assert [(e.event, e.data) for e in out] == [("message", b"x")]
    assert elapsed < 2.0, elapsed                       # not at the 30 s keep-alive
    assert it.closed == 1 and it.listener is None
