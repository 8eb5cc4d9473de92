"""The Gateway core shared by the WSGI and ASGI apps: one resident Engine, the requests in flight,
metrics, and shutdown.

Gateway threads only submit and read their own handle; the Engine worker stays the only mutator.
Each Generation pumps its handle's events into an EventQueue from a small thread, so the WSGI
thread can wait with a timeout (the SSE keep-alive writes; it notices a vanished client only when
it writes), and the ASGI app's event loop is woken by the queue's listener instead of waiting in a
thread (it sees the disconnect at once and releases the Generation, asgi.py).
Whoever consumes a Generation must call `release()` at the end: a request not yet finished is
cancelled, and the handle is closed so the Engine frees its capacity.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Callable, Optional

from ..api import Finished, GenerationResult, ServedEngine, TextDelta, ToolCallEvent
from ..errors import ContextLengthError
from .config import ServeConfig
from .errors import ApiError, from_engine_error
from .metrics import Metrics

log = logging.getLogger("ninfer.serve")

_END = object()


class EventQueue(queue.Queue):
    """The events of a Generation (or of a ChoiceGroup's choices). `listener`, when set, is called
    after every put, from the pumping thread: the ASGI app sets one that wakes its event loop, so
    no thread has to wait in get() for each event of a stream (asgi.py)."""

    def __init__(self):
        super().__init__()
        self.listener: Optional[Callable[[], None]] = None

    def put(self, item, block: bool = True, timeout: Optional[float] = None) -> None:
        super().put(item, block, timeout)
        listener = self.listener
        if listener is not None:
            listener()


class _PumpFailure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class Gateway:
    """`engine` is a ready Engine (the caller keeps ownership), or a zero-argument callable that
    builds one (run in a background thread, /health answers 503 "loading" until it returns; the
    Gateway then owns the Engine and closes it in `close()`)."""

    def __init__(self, engine, config: Optional[ServeConfig] = None):
        self.config = (config or ServeConfig()).validate()
        self.metrics = Metrics(self)
        self.created = int(time.time())
        self._lock = threading.Lock()
        self._live: set = set()
        self._draining = False
        self._closed = False
        self._is_cancelling_all = False
        self._load_error: Optional[BaseException] = None
        self._local = threading.local()         # .watch: the ClientWatch of this thread's request
        # an Engine (api.ServedEngine) is not callable; a factory is, and the Gateway owns what
        # it returns
        self._owns_engine = callable(engine)
        if self._owns_engine:
            self._engine, self._state = None, "loading"
            threading.Thread(target=self._load, args=(engine,), name="ninfer-engine-load",
                             daemon=True).start()
        elif isinstance(engine, ServedEngine):
            self._engine, self._state = engine, "ready"
        else:
            raise TypeError("Gateway: engine must be an Engine or a callable returning one")

    def _load(self, factory) -> None:
        try:
            engine = factory()
        except BaseException as exc:  # noqa: BLE001 - reported through /health and 503s
            log.error("engine failed to load: %s", exc)
            with self._lock:
                self._state, self._load_error = "failed", exc
            return
        with self._lock:
            if self._closed:
                engine.close()
                return
            self._engine, self._state = engine, "ready"
        log.info("engine ready: %s", engine.name)

    # ---- state ------------------------------------------------------------------------------------
    def health_state(self) -> str:
        """'loading', 'ready', 'draining' or 'failed'."""
        with self._lock:
            state, engine, draining = self._state, self._engine, self._draining
        if state == "ready" and engine.health != "ready":
            return "failed"
        if state == "ready" and draining:
            return "draining"
        return state

    def engine(self):
        """The Engine, or a 503 ApiError while it is loading, draining or failed."""
        state = self.health_state()
        if state == "ready":
            return self._engine
        detail = {"loading": "the model is still loading",
                  "draining": "the server is shutting down",
                  "failed": "the engine has failed"}[state]
        if state == "failed" and self._load_error is not None:
            detail += f" ({self._load_error})"
        raise ApiError(503, detail, code=f"engine_{state}")

    def engine_stats(self) -> dict:
        engine = self._engine
        if engine is None:
            return {}
        try:
            return dict(engine.stats())
        except Exception:  # noqa: BLE001 - a failed engine must not break /metrics
            return {}

    @property
    def model_id(self) -> str:
        if self.config.model_id:
            return self.config.model_id
        engine = self.engine()
        return str(engine.name or "ninfer")

    def max_context(self) -> Optional[int]:
        engine = self._engine
        return None if engine is None else engine.options.max_context

    def default_thinking(self) -> bool:
        """enable_thinking of a request that does not say: the server's flag when given, else the
        Engine's default (the model's own: its artifact's metadata.defaults, else on)."""
        if self.config.enable_thinking is not None:
            return bool(self.config.enable_thinking)
        engine = self._engine           # None while loading: the request gets its 503 anyway
        value = None if engine is None else getattr(engine.options, "default_enable_thinking",
                                                    None)
        return True if value is None else bool(value)

    def tokens_left_default(self) -> int:
        """max_tokens of a request that names none: the server default, the checkpoint's, or the
        whole context (openai_schema.sampling_params bounds it by --max-tokens-cap and sends it
        with clamp_max_tokens: the Engine cuts it to what the prompt leaves)."""
        return (self.config.max_tokens or self.sampling_defaults().get("max_tokens")
                or self.max_context() or 4096)

    def sampling_defaults(self) -> dict:
        """SamplingParams fields a request leaves out: the checkpoint's generation_config.json,
        overridden by the serve flags that were given."""
        engine = self._engine
        out = {} if engine is None else dict(engine.sampling_defaults)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "max_tokens"):
            value = getattr(self.config, name)
            if value is not None:
                out[name] = value
        return out

    # ---- requests ---------------------------------------------------------------------------------
    def start(self, prompt, params, *, tools=None, enable_thinking=None, request_id=None,
              session=None, sink: Optional[EventQueue] = None, index: int = 0,
              share_prompt: bool = False, max_tokens_param: str = "max_tokens"):
        """Submit one request; ApiError on a bad or unacceptable request. `session`: the
        context cache's session hint. `sink`: a queue shared by the choices of one response
        (ChoiceGroup), which gets this request's events tagged with `index`; `share_prompt`:
        the first of them (Engine.submit's). `max_tokens_param`: the request field that set
        max_tokens (named by the 400 when prompt + max_tokens exceed the context)."""
        engine = self.engine()
        request_id = request_id or uuid.uuid4().hex
        t0 = time.monotonic()
        try:
            handle = engine.submit(prompt, params, tools=tools, enable_thinking=enable_thinking,
                                   request_id=request_id, timeout_s=self.config.request_timeout_s,
                                   session=session,
                                   **({"share_prompt": True} if share_prompt else {}))
        except ContextLengthError as exc:
            raise ApiError(400, exc.describe(max_tokens_param), param=max_tokens_param,
                           code=exc.code) from exc
        except Exception as exc:  # noqa: BLE001 - mapped to the client's status
            raise from_engine_error(exc) from exc
        gen = Generation(self, handle, request_id, t0, sink=sink, index=index)
        with self._lock:
            self._live.add(gen)
            is_late = self._is_cancelling_all
        self.metrics.in_flight.inc()
        if is_late:         # submitted after cancel_all() had looked at _live: cancel it too
            gen.cancel()
        watch = getattr(self._local, "watch", None)
        if watch is not None:
            watch.add(gen)
        return gen

    def run_watched(self, watch: "ClientWatch", fn, *args):
        """fn(*args) on this thread, with every request it starts registered in `watch` (the
        HTTP layer cancels them when the client disconnects before the answer is ready)."""
        self._local.watch = watch
        try:
            return fn(*args)
        finally:
            self._local.watch = None

    def _forget(self, gen: "Generation") -> None:
        with self._lock:
            if gen not in self._live:
                return
            self._live.discard(gen)
        self.metrics.in_flight.dec()

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    # ---- shutdown ---------------------------------------------------------------------------------
    def drain(self, grace_s: Optional[float] = None) -> None:
        """Refuse new requests (503, /health 503) and cancel the ones still running after
        `grace_s` seconds (they end with finish_reason 'cancelled')."""
        grace_s = self.config.drain_grace_s if grace_s is None else grace_s
        with self._lock:
            self._draining = True
        timer = threading.Timer(grace_s, self.cancel_all)
        timer.daemon = True
        timer.start()

    def cancel_all(self) -> None:
        """Cancel every request in flight, and any that a racing start() still adds."""
        with self._lock:
            self._is_cancelling_all = True
            live = list(self._live)
        for gen in live:
            gen.cancel()

    def close(self) -> None:
        """Refuse new requests, cancel the running ones, and close the Engine if this Gateway
        built it (an Engine passed in stays open: its owner closes it)."""
        with self._lock:
            self._closed, self._draining = True, True
            engine = self._engine
        self.cancel_all()
        if engine is not None and self._owns_engine:
            engine.close()


class ClientWatch:
    """The Generations one HTTP request started; `cancel()` (the client went away) cancels them
    and any started later."""

    def __init__(self):
        self._lock = threading.Lock()
        self._gens: list = []
        self.is_cancelled = False

    def add(self, gen: "Generation") -> None:
        with self._lock:
            self._gens.append(gen)
            cancelled = self.is_cancelled
        if cancelled:
            gen.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.is_cancelled = True
            gens = list(self._gens)
        for gen in gens:
            gen.cancel()


class Generation:
    """One submitted request as the HTTP thread sees it."""

    def __init__(self, gateway: Gateway, handle, request_id: str, t_submit: float, *,
                 sink: Optional[queue.Queue] = None, index: int = 0):
        self.gateway = gateway
        self.index = index
        self.handle = handle
        self.request_id = request_id
        self.result: Optional[GenerationResult] = None
        self.num_reasoning_tokens = 0
        self._raw_parts: list = []       # every channel's text, in order (raw completions)
        self._t_submit = t_submit
        self._t_last: Optional[float] = None
        self._released = False
        self._events = EventQueue()
        # one response's choices share a sink: items go there as (index, item) (ChoiceGroup)
        self._put = self._events.put if sink is None else \
            (lambda item: sink.put((index, item)))
        threading.Thread(target=self._pump, name=f"ninfer-pump-{request_id[:8]}",
                         daemon=True).start()

    def _pump(self) -> None:
        try:
            for event in self.handle:
                self._observe(event)      # here, not in the consumer: a vanished client counts too
                self._put(event)
                if isinstance(event, Finished):
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the HTTP thread
            self._put(_PumpFailure(exc))
        finally:
            self._put(_END)

    def set_listener(self, listener: Optional[Callable[[], None]]) -> None:
        """Call `listener` (from another thread) whenever an event arrives (EventQueue)."""
        self._events.listener = listener

    def next_event(self, timeout: Optional[float] = None):
        """The next event; None on timeout (0: only what has arrived, never waits); raises
        ApiError if the engine fails; StopIteration after the Finished event."""
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        return self.interpret(item)

    def interpret(self, item):
        """A queued item as next_event returns it (the event; StopIteration at the end; ApiError
        for a failure)."""
        if item is _END:
            if self.result is None:
                raise ApiError(500, "the engine ended the request without a result",
                               code="internal_error")
            raise StopIteration
        if isinstance(item, _PumpFailure):
            raise from_engine_error(item.exc)
        return item

    def events(self):
        """Every event up to and including Finished (blocking)."""
        while True:
            try:
                event = self.next_event()
            except StopIteration:
                return
            yield event
            if isinstance(event, Finished):
                return

    def collect(self) -> GenerationResult:
        """Consume the whole request; returns its result."""
        for _ in self.events():
            pass
        if self.result is None:  # pragma: no cover - events() ends only after Finished
            raise ApiError(500, "no result", code="internal_error")
        return self.result

    def _observe(self, event) -> None:
        m = self.gateway.metrics
        now = time.monotonic()
        produced = 0
        if isinstance(event, TextDelta):
            produced = len(event.token_ids)
            self._raw_parts.append(event.text)
            if event.channel == "reasoning":
                self.num_reasoning_tokens += produced
        elif isinstance(event, ToolCallEvent):
            produced = 1
        if produced:
            if self._t_last is None:
                m.ttft.observe(now - self._t_submit)
            else:
                per_token = (now - self._t_last) / produced
                for _ in range(produced):
                    m.itl.observe(per_token)
            self._t_last = now
        if isinstance(event, Finished):
            self.result = res = event.result
            m.prompt_tokens.inc(res.num_prompt_tokens)
            m.generated_tokens.inc(len(res.token_ids))
            m.finished.labels(res.finish_reason or "unknown").inc()
            m.duration.observe(now - self._t_submit)

    @property
    def raw_text(self) -> str:
        return "".join(self._raw_parts)

    def cancel(self) -> None:
        try:
            self.handle.cancel()
        except Exception:  # noqa: BLE001 - cancelling a finished request is harmless
            pass

    def release(self) -> None:
        """End of consumption (normal or not): cancel if unfinished, close the handle."""
        if self._released:
            return
        self._released = True
        if self.result is None:
            self.cancel()
        try:
            self.handle.close()
        except Exception:  # noqa: BLE001
            log.exception("closing request %s", self.request_id)
        self.gateway._forget(self)


class ChoiceGroup:
    """The n Generations of one response (OpenAI `n`), read as one: `next_event` returns
    (choice index, event) in arrival order, None on timeout, and raises StopIteration once every
    choice has ended (ApiError when one fails); `release()` releases them all (cancelling the
    unfinished ones: a client that leaves stops every choice)."""

    def __init__(self, gens: list, sink: EventQueue):
        self.gens, self._sink = gens, sink
        self._open = len(gens)

    def set_listener(self, listener: Optional[Callable[[], None]]) -> None:
        self._sink.listener = listener

    @property
    def gateway(self) -> Gateway:
        return self.gens[0].gateway

    def next_event(self, timeout: Optional[float] = None):
        while True:
            if not self._open:
                raise StopIteration
            try:
                index, item = self._sink.get(timeout=timeout)
            except queue.Empty:
                return None
            try:
                return index, self.gens[index].interpret(item)
            except StopIteration:
                self._open -= 1

    def collect(self) -> list:
        """Consume every choice; their results in choice order."""
        while True:
            try:
                self.next_event()
            except StopIteration:
                break
        return [gen.result for gen in self.gens]

    def release(self) -> None:
        for gen in self.gens:
            gen.release()
