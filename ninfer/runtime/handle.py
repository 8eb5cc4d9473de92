"""GenerationHandle: the consumer's side of one request.

The worker publishes events into a `_Channel`; the consumer reads them through the handle. The
worker holds only the channel, so dropping the last handle reference abandons the request
(cancellation + consumer_released) even while it is still generating.

Outstanding capacity is released exactly once, when both hold:
    response_done      the worker published Finished
    consumer_released  result() / iteration returned the end, cancel(), close(), or the handle
                       was dropped

A handle's events are read once, by one consumer: a second iteration while one is open (also from
another thread) raises RequestError instead of silently splitting or losing events. An iteration
that ended early (a TimeoutError, or the consumer left the loop) hands its claim back, so a later
events() call continues with the next unread event.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional

from ..api import Finished, GenerationResult
from ..errors import RequestError


class _Channel:
    def __init__(self, request_id: str, wake_worker: Callable[[], None],
                 release_capacity: Callable[[], None]):
        self.request_id = request_id
        self._cond = threading.Condition(threading.RLock())
        self._events = deque()
        self._result: Optional[GenerationResult] = None
        self.is_cancel_requested = False
        self._is_consumer_released = False
        self._is_capacity_released = False
        self._is_iterated = False
        self._wake_worker = wake_worker
        self._release_capacity = release_capacity

    # ---- worker side --------------------------------------------------------------------------
    def publish(self, event) -> None:
        with self._cond:
            if self._result is not None:
                raise RuntimeError(f"request {self.request_id}: event after Finished")
            self._events.append(event)
            if isinstance(event, Finished):
                self._result = event.result
            self._cond.notify_all()
        if isinstance(event, Finished):
            self._maybe_release()

    # ---- consumer side ------------------------------------------------------------------------
    def next_event(self, timeout: Optional[float]):
        """The next event, or None once Finished has been taken (nothing will ever follow)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._events or self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id}: no event within {timeout} s")
            return self._events.popleft() if self._events else None

    def wait_result(self, timeout: Optional[float]) -> GenerationResult:
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id}: not finished within {timeout} s")
            return self._result

    def cancel(self) -> None:
        self.is_cancel_requested = True
        self._wake_worker()

    def claim_iteration(self) -> None:
        with self._cond:
            if self._is_iterated:
                raise RequestError(f"request {self.request_id}: its events are already being (or "
                                   f"were) iterated; a handle's events can be read once, by one "
                                   f"consumer (result() still returns the result)")
            self._is_iterated = True

    def unclaim_iteration(self) -> None:
        with self._cond:
            self._is_iterated = False

    def release_consumer(self) -> None:
        with self._cond:
            self._is_consumer_released = True
        self._maybe_release()

    @property
    def is_done(self) -> bool:
        return self._result is not None

    def _maybe_release(self) -> None:
        with self._cond:
            if self._is_capacity_released or self._result is None or \
                    not self._is_consumer_released:
                return
            self._is_capacity_released = True
        self._release_capacity()


class GenerationHandle:
    """Iterate the events (GenerationStart, TextDelta, ToolCallEvent ..., Finished last), or wait
    with result(). cancel() asks the worker to stop the request at its next boundary; close()
    abandons it (cancel + release). Safe to use from any thread."""

    __slots__ = ("_channel", "__weakref__")

    def __init__(self, channel: _Channel):
        self._channel = channel

    @property
    def request_id(self) -> str:
        return self._channel.request_id

    @property
    def done(self) -> bool:
        return self._channel.is_done

    def __iter__(self):
        return self.events()

    def events(self, timeout: Optional[float] = None):
        """Yield events until Finished (inclusive); `timeout` bounds each wait (TimeoutError).
        One open iteration per handle: a second call while one is open (from any thread) raises
        RequestError; after a TimeoutError or an early exit from the loop, events() continues
        with the next unread event."""
        self._channel.claim_iteration()
        return self._events(timeout)

    def _events(self, timeout: Optional[float]):
        event = None
        try:
            while True:
                event = self._channel.next_event(timeout)
                if event is None:                   # an earlier pass already took Finished
                    return
                yield event
                if isinstance(event, Finished):
                    return
        except BaseException:
            # TimeoutError, or GeneratorExit when the consumer left the loop: nothing was lost
            # (an event is taken only when it is yielded), so a later events() may go on
            if not isinstance(event, Finished):
                self._channel.unclaim_iteration()
            raise
        finally:
            if isinstance(event, Finished):         # also when the loop was left at Finished
                self._channel.release_consumer()

    def result(self, timeout: Optional[float] = None) -> GenerationResult:
        """Block until the request finishes; raises TimeoutError if `timeout` seconds pass."""
        result = self._channel.wait_result(timeout)
        self._channel.release_consumer()
        return result

    def cancel(self) -> None:
        """Ask the worker to stop the request; the consumer is done with it, so its capacity is
        released as soon as the engine has settled it (Finished "cancelled"). The events up to
        then (and result()) can still be read."""
        if not self._channel.is_done:
            self._channel.cancel()
        self._channel.release_consumer()

    def close(self) -> None:
        self.cancel()
        self._channel.release_consumer()

    def __enter__(self) -> "GenerationHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to release
            pass
