"""The replica supervisor of `serve --data-parallel N`: N ordinary `python -m ninfer serve`
processes, each with its own Engine on its own GPU, on loopback ports the router forwards to.

Each replica is started as `python -m ninfer serve ... --host 127.0.0.1 --port P` (the whole
single-Engine server, gunicorn and all) with `CUDA_VISIBLE_DEVICES` naming its GPU, in a session
of its own (a terminal's Ctrl-C reaches the router, which forwards it) and with a parent-death
signal (Linux): if the router is killed, its replicas get SIGTERM and drain, so no Engine outlives
the router holding a GPU. The supervisor watches them from the router's event loop:

    STARTING --/health 200--> READY --/health 503 or no answer--> UNREADY --200--> READY
        any state --process exits--> DEAD --backoff--> STARTING (a new process, a new port)
        /health 503 "failed" (its Engine failed, or could not load) --SIGTERM--> exits --> DEAD

Only READY replicas get requests. A replica that exits is restarted after a backoff (0.5 s,
doubling up to 30 s while it keeps failing before it gets ready), under the same index, so its
keys come back to it (routing.py). `stop()` forwards a signal to every replica and stops
restarting them.
"""
from __future__ import annotations

import asyncio
import ctypes
import enum
import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

log = logging.getLogger("ninfer.serve")

HOST = "127.0.0.1"
POLL_S = 0.1                    # how often the processes are polled (a death is seen this soon)
HEALTH_READY_S = 1.0            # /health of a READY replica, this often
HEALTH_STARTING_S = 0.25        # /health of any other live replica, this often
HEALTH_TIMEOUT_S = 2.0
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
_PR_SET_PDEATHSIG = 1


class ReplicaState(str, enum.Enum):
    STARTING = "starting"       # process started; /health not yet 200 (loading the model)
    READY = "ready"             # /health answered 200: gets requests
    UNREADY = "unready"         # was ready; /health now 503 (draining, failed) or unreachable
    DEAD = "dead"               # the process exited; restarted at `restart_at`
    STOPPED = "stopped"         # the router is shutting down: not restarted


@dataclass(slots=True)
class Replica:
    index: int
    device: str                         # its CUDA_VISIBLE_DEVICES
    port: int = 0
    proc: Optional[subprocess.Popen] = None
    state: ReplicaState = ReplicaState.STARTING
    detail: str = ""                    # the replica's /health status, or how it exited
    num_restarts: int = 0
    num_failures_in_row: int = 0        # exits since it was last ready (the backoff's exponent)
    restart_at: float = 0.0
    next_health_at: float = 0.0
    is_terminating: bool = False        # sent SIGTERM because its engine failed

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def describe(self) -> dict:
        return {"index": self.index, "state": self.state.value, "detail": self.detail,
                "device": self.device, "port": self.port,
                "pid": self.proc.pid if self.proc is not None else None,
                "restarts": self.num_restarts}


def free_port() -> int:
    """A loopback port free now. A replica that loses it to another process in between exits
    with its one-line error and is restarted on a fresh port."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _parent_death_hook() -> Optional[Callable[[], None]]:
    """A function for Popen's preexec_fn that asks Linux to send the child SIGTERM when the router
    dies; None elsewhere. libc is looked up here, in the parent: between fork and exec the child
    only makes the one call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class Supervisor:
    """`argv_for(port)`: the command line of one replica serving on `port`; `devices`: one
    CUDA_VISIBLE_DEVICES value per replica; `env`: the replicas' environment."""

    def __init__(self, argv_for: Callable[[int], list], devices: Sequence[str], env: dict):
        self._argv_for = argv_for
        self._env = env
        self.replicas = [Replica(i, str(d)) for i, d in enumerate(devices)]
        self.is_stopping = False
        self._preexec = _parent_death_hook()
        self._checks: set = set()           # /health requests in flight

    # ---- what the router reads ----------------------------------------------------------------
    def ready(self) -> list:
        """Indices of the replicas that get requests."""
        return [r.index for r in self.replicas if r.state is ReplicaState.READY]

    def url(self, index: int) -> str:
        return self.replicas[index].url

    def mark_unreachable(self, index: int, why: str) -> None:
        """The router could not use this replica (no connection, a 503): no requests until its
        /health says 200 again."""
        r = self.replicas[index]
        if r.state is ReplicaState.READY:
            r.state, r.detail, r.next_health_at = ReplicaState.UNREADY, why, 0.0

    def describe(self) -> list:
        return [r.describe() for r in self.replicas]

    # ---- processes ----------------------------------------------------------------------------
    def start(self) -> None:
        for r in self.replicas:
            self._spawn(r)

    def _spawn(self, r: Replica) -> None:
        r.port = free_port()
        env = {**self._env, "CUDA_VISIBLE_DEVICES": r.device}
        try:
            r.proc = subprocess.Popen(self._argv_for(r.port), env=env, start_new_session=True,
                                      preexec_fn=self._preexec)
        except OSError as exc:          # no process at all: tried again after the backoff
            r.proc = None
            self._died(r, f"could not start ({exc})")
            return
        r.state, r.detail, r.next_health_at = ReplicaState.STARTING, "", 0.0
        r.is_terminating = False
        log.info("replica %d: pid %d on port %d (CUDA_VISIBLE_DEVICES=%s)", r.index, r.proc.pid,
                 r.port, r.device)

    def _reap(self, r: Replica) -> None:
        code = r.proc.poll()
        if code is None:
            return
        if self.is_stopping:
            r.state, r.detail = ReplicaState.STOPPED, f"exited with status {code}"
        else:
            self._died(r, f"pid {r.proc.pid} exited with status {code}")

    def _died(self, r: Replica, what: str) -> None:
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** r.num_failures_in_row)
        r.num_failures_in_row += 1
        r.state, r.restart_at = ReplicaState.DEAD, time.monotonic() + delay
        r.detail = f"{what}; restarting in {delay:g} s"
        log.warning("replica %d: %s", r.index, r.detail)

    async def watch(self, client) -> None:
        """Poll the processes, restart the dead (until `stop()`), check /health: a task on the
        router's loop, cancelled when the router exits; `client`: an httpx.AsyncClient."""
        while True:
            now = time.monotonic()
            for r in self.replicas:
                if r.state is ReplicaState.DEAD and now >= r.restart_at and not self.is_stopping:
                    r.num_restarts += 1
                    self._spawn(r)
                if r.state in (ReplicaState.DEAD, ReplicaState.STOPPED):
                    continue
                self._reap(r)
                if r.state not in (ReplicaState.DEAD, ReplicaState.STOPPED) \
                        and now >= r.next_health_at:
                    # a check that hangs must not delay noticing deaths: it runs on its own, and
                    # the next one waits for it (next_health_at is pushed past its timeout)
                    r.next_health_at = now + HEALTH_TIMEOUT_S + 1.0
                    task = asyncio.ensure_future(self._check_health(client, r))
                    self._checks.add(task)
                    task.add_done_callback(self._checks.discard)
            await asyncio.sleep(POLL_S)

    async def _check_health(self, client, r: Replica) -> None:
        proc = r.proc
        try:
            resp = await client.get(r.url + "/health", timeout=HEALTH_TIMEOUT_S)
            status = resp.status_code
            detail = _health_status(resp)
        except Exception as exc:  # noqa: BLE001 - any failure means: not serving now
            status, detail = None, f"unreachable ({type(exc).__name__})"
        if r.proc is not proc or r.state in (ReplicaState.DEAD, ReplicaState.STOPPED):
            return                          # it died (or was replaced) while we asked
        r.next_health_at = time.monotonic() + (HEALTH_READY_S if status == 200
                                               else HEALTH_STARTING_S)
        if status == 200:
            if r.state is not ReplicaState.READY:
                log.info("replica %d ready (port %d)", r.index, r.port)
            r.state, r.detail, r.num_failures_in_row = ReplicaState.READY, "", 0
        elif r.state is ReplicaState.READY or r.state is ReplicaState.UNREADY:
            r.state, r.detail = ReplicaState.UNREADY, detail
        else:
            r.detail = detail if status is not None else ""     # STARTING: not listening yet
        if detail == "failed" and not r.is_terminating and not self.is_stopping:
            # its Engine failed (or could not load) and will not recover: end the process, and
            # the watch restarts it like one that died
            log.warning("replica %d: its engine has failed; restarting it", r.index)
            r.is_terminating = True
            proc.terminate()

    def stop(self, sig: int) -> None:
        """Stop restarting; send `sig` to every replica still running (SIGTERM: they drain).
        Only the first call signals: a replica told to drain is not then told to hurry."""
        if self.is_stopping:
            return
        self.is_stopping = True
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                try:
                    r.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            elif r.state is not ReplicaState.STOPPED:
                r.state = ReplicaState.STOPPED

    def running(self) -> list:
        return [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]

    async def wait_stopped(self, timeout_s: float) -> None:
        """Wait for every replica to exit, SIGKILL whichever is left after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        for r in self.running():
            log.warning("replica %d (pid %d) still running after %g s: killing it", r.index,
                        r.proc.pid, timeout_s)
            r.proc.kill()
        for r in self.replicas:
            if r.proc is not None:
                try:
                    r.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                r.state = ReplicaState.STOPPED


def _health_status(resp) -> str:
    try:
        return str(resp.json().get("status", resp.status_code))
    except Exception:  # noqa: BLE001 - not our server, or not JSON
        return f"HTTP {resp.status_code}"

