"""Reliability soak: a real `python -m ninfer serve` under mixed, hostile load for N minutes.

    PYTHONPATH=. python bench/soak.py [--minutes 10] [--artifact PATH] [--clients 12] [--out soak.json]

Clients (threads) pick a scenario at random, with the official `openai` and `anthropic` SDKs where a
well-behaved client would use them and raw sockets where a hostile one would not:
  twins        chat / completions / messages, the same greedy request streamed and not: the texts
               (and reasoning) must be equal
  disconnect   a stream dropped after a few events; a non-streamed request whose socket closes
  cancel       an SDK stream closed early (`with ... as stream: break`), an SDK call that times out
  overload     a burst beyond max-concurrency + max-queue (429s expected, 5xx never)
  slow reader  a stream read a few bytes at a time with pauses
  slow client  a request line dribbled byte by byte; a body announced longer than sent
  invalid      bodies from a generator: broken JSON, wrong types, out-of-range numbers, huge
               integers, deep nesting, lone surrogates, unknown routes, chunked garbage
Afterwards it waits for the server to settle and checks through /metrics that every KV page, State
slot, resident lane, outstanding request and in-flight generation is back to zero, then sends
SIGTERM and expects exit status 0. Prints one summary table (also written as JSON with --out); the
exit status is 1 when any check failed (a 5xx, a twin mismatch, a leak, a client exception).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai

KEY = "soak-key"
AUTH = {"authorization": f"Bearer {KEY}"}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WORDS = ("alpha", "river", "stone", "light", "seven", "market", "quiet", "north", "engine", "paper")


class Tally:
    def __init__(self):
        self._lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.statuses: collections.Counter = collections.Counter()
        self.failures: list = []

    def add(self, key, n=1):
        with self._lock:
            self.counts[key] += n

    def status(self, code):
        with self._lock:
            self.statuses[str(code)] += 1

    def fail(self, what):
        with self._lock:
            self.counts["failures"] += 1
            if len(self.failures) < 1000:
                self.failures.append(what)


def sentence(rng, n=None):
    return " ".join(rng.choice(WORDS) for _ in range(n or rng.randint(2, 40)))


class Soak:
    def __init__(self, url, rng_seed, tally: Tally):
        self.url, self.tally, self.seed = url, tally, rng_seed
        self.port = int(url.rsplit(":", 1)[1])

    def oai(self, timeout=120):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=timeout)

    def claude(self, timeout=120):
        return anthropic.Anthropic(base_url=self.url, api_key=KEY, max_retries=0, timeout=timeout)

    # ---- scenarios ------------------------------------------------------------------------------
    def twins_chat(self, rng):
        kw = dict(model="m", messages=[{"role": "user", "content": sentence(rng)}],
                  max_tokens=rng.randint(1, 24), temperature=0, extra_body=NO_THINK
                  if rng.random() < 0.5 else None)
        full = self.oai().chat.completions.create(**kw)
        parts = []
        for chunk in self.oai().chat.completions.create(**kw, stream=True):
            parts += [c.delta.content or "" for c in chunk.choices]
        self.tally.status(200)
        self.compare("chat", full.choices[0].message.content or "", "".join(parts))

    def twins_completions(self, rng):
        kw = dict(model="m", prompt=sentence(rng), max_tokens=rng.randint(1, 24), temperature=0)
        full = self.oai().completions.create(**kw)
        text = "".join(c.choices[0].text for c in self.oai().completions.create(**kw, stream=True)
                       if c.choices)
        self.tally.status(200)
        self.compare("completions", full.choices[0].text, text)

    def twins_messages(self, rng):
        kw = dict(model="m", max_tokens=rng.randint(1, 24), extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": sentence(rng)}])
        full = self.claude().messages.create(**kw)
        with self.claude().messages.stream(**kw) as stream:
            streamed = stream.get_final_message()
        self.tally.status(200)
        flat = [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None))
                for b in full.content]
        flat2 = [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None))
                 for b in streamed.content]
        self.compare("messages", repr(flat), repr(flat2))

    def compare(self, kind, full, streamed):
        self.tally.add("twins_compared")
        if full != streamed:
            self.tally.fail(f"{kind} stream differs from its twin: {full[:80]!r} vs "
                            f"{streamed[:80]!r}")

    def disconnect_stream(self, rng):
        body = {"model": "m", "messages": [{"role": "user", "content": sentence(rng)}],
                "max_tokens": 64, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", self.url + "/v1/chat/completions", json=body,
                               headers=AUTH) as resp:
                self.tally.status(resp.status_code)
                lines = resp.iter_lines()
                for _ in range(rng.randint(0, 6)):
                    next(lines, None)
        self.tally.add("faults_disconnect_stream")

    def disconnect_plain(self, rng):
        body = json.dumps({"model": "m", "prompt": sentence(rng), "max_tokens": 64}).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                         + KEY.encode() + b"\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
            time.sleep(rng.uniform(0, 0.5))
        self.tally.add("faults_disconnect_plain")

    def cancel_sdk(self, rng):
        if rng.random() < 0.5:
            with self.claude().messages.stream(
                    model="m", max_tokens=64,
                    messages=[{"role": "user", "content": sentence(rng)}]) as stream:
                for _ in stream:
                    break
            self.tally.status(200)
        else:
            try:
                self.oai(timeout=rng.uniform(0.05, 0.5)).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": sentence(rng)}],
                    max_tokens=64)
                self.tally.status(200)
            except openai.APITimeoutError:
                pass
        self.tally.add("faults_cancel")

    def overload(self, rng):
        results = []

        def one():
            try:
                r = httpx.post(self.url + "/v1/completions", headers=AUTH, timeout=120,
                               json={"model": "m", "prompt": sentence(rng), "max_tokens": 8})
                results.append(r.status_code)
            except httpx.HTTPError as exc:
                results.append(type(exc).__name__)
        threads = [threading.Thread(target=one) for _ in range(rng.randint(16, 32))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for code in results:
            if isinstance(code, int):
                self.tally.status(code)
            else:
                self.tally.fail(f"overload: {code}")
        self.tally.add("overload_bursts")
        self.tally.add("overload_refused_429", sum(c == 429 for c in results))

    def slow_reader(self, rng):
        body = json.dumps({"model": "m", "max_tokens": 32, "stream": True,
                           "messages": [{"role": "user", "content": sentence(rng)}]}).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: " + KEY.encode()
                         + b"\r\nconnection: close\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
            data = b""
            while chunk := sock.recv(rng.randint(16, 256)):
                data += chunk
                time.sleep(rng.uniform(0, 0.05))
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
        self.tally.status(status)
        if status == 200 and b"message_stop" not in data:
            self.tally.fail("slow reader: the stream ended without message_stop")
        self.tally.add("faults_slow_reader")

    def slow_client(self, rng):
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            if rng.random() < 0.5:      # headers dribbled, then completed
                req = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                for i in range(len(req)):
                    sock.send(req[i:i + 1])
                    time.sleep(0.02)
            else:                       # a body announced longer than what is sent
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: "
                             b"Bearer " + KEY.encode() + b"\r\ncontent-length: 100\r\n\r\n{\"a\"")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
        self.tally.status(status)
        self.tally.add("faults_slow_client")

    def invalid(self, rng):
        path, content, headers = invalid_request(rng)
        r = httpx.post(self.url + path, content=content, timeout=60,
                       headers={**AUTH, "content-type": "application/json", **headers})
        self.tally.status(r.status_code)
        self.tally.add("bad_inputs_tried")
        if r.status_code < 400 and r.status_code != 200:
            self.tally.fail(f"invalid body got {r.status_code}")
        if r.status_code >= 400:
            try:
                body = r.json()
                assert "error" in body
            except Exception:  # noqa: BLE001 - any non-JSON error reply is a finding
                self.tally.fail(f"{path}: {r.status_code} reply is not a JSON error: "
                                f"{r.text[:100]!r}")

    def misc(self, rng):
        choice = rng.randrange(4)
        if choice == 0:
            self.oai().models.list()
        elif choice == 1:
            self.claude().messages.count_tokens(
                model="m", messages=[{"role": "user", "content": sentence(rng)}])
        elif choice == 2:
            r = httpx.head(self.url + "/health", timeout=30)
            if r.status_code != 200:
                self.tally.fail(f"HEAD /health: {r.status_code}")
        else:
            r = httpx.get(self.url + "/metrics", headers=AUTH, timeout=30)
            if r.status_code != 200:
                self.tally.fail(f"/metrics: {r.status_code}")
        self.tally.status(200)


SCENARIOS = [("twins_chat", 5), ("twins_completions", 3), ("twins_messages", 3),
             ("disconnect_stream", 2), ("disconnect_plain", 2), ("cancel_sdk", 2),
             ("overload", 1), ("slow_reader", 2), ("slow_client", 1), ("invalid", 6), ("misc", 2)]


def invalid_request(rng):
    """(path, body bytes, extra headers): one malformed request from a small grammar."""
    path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/messages",
                       "/v1/messages/count_tokens"])
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
            "max_tokens": 4}
    bad_values = [None, -1, 0, 1.5, 4.0, 1e308, "x", "", [], {}, [1, "a"], {"a": 1}, True,
                  2 ** 70, -2 ** 70, "\ud800", "A" * 10000]
    kind = rng.randrange(8)
    if kind == 0:                       # a field given a wrong or absurd value
        body = dict(good)
        body[rng.choice(["model", "messages", "prompt", "max_tokens", "temperature", "top_p",
                         "stop", "tools", "tool_choice", "logit_bias", "n", "seed", "system",
                         "stream", "response_format", "top_k", "stop_sequences"])] = \
            rng.choice(bad_values)
        text = json.dumps(body)
    elif kind == 1:                     # a huge integer anywhere
        text = json.dumps(good)[:-1] + ', "junk": ' + "9" * rng.randint(4301, 20000) + "}"
    elif kind == 2:                     # nested past any parser's patience
        n = rng.randint(100, 100000)
        text = '{"model": "m", "messages": ' + "[" * n + "]" * n + "}"
    elif kind == 3:                     # broken JSON
        text = json.dumps(good)
        cut = rng.randrange(len(text))
        text = text[:cut] + rng.choice(["", "}", "\x00", "\\", '"', "{{"]) + text[cut + 1:]
    elif kind == 4:                     # not an object, or an empty one
        text = rng.choice(["[]", "null", "1", '"x"', "{}", "", " "])
    elif kind == 5:                     # non-finite numbers
        text = json.dumps(good)[:-1] + ', "temperature": ' + rng.choice(
            ["NaN", "Infinity", "-Infinity", "1e999"]) + "}"
    elif kind == 6:                     # invalid UTF-8 / lone surrogate escapes
        return path, rng.choice([b'{"model": "m", "prompt": "\xff\xfe"}',
                                 b'{"model": "m", "prompt": "\\udc00"}']), {}
    else:                               # a tool with an invalid schema
        body = dict(good, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "wat", "properties": 5}}}],
            tool_choice=rng.choice(["required", "auto", {"type": "any"}]))
        text = json.dumps(body)
    return path, text.encode("utf-8", "surrogatepass"), {}


def client_loop(soak: Soak, deadline: float, index: int):
    rng = random.Random(soak.seed * 1000 + index)
    names = [n for n, w in SCENARIOS for _ in range(w)]
    while time.monotonic() < deadline:
        name = rng.choice(names)
        soak.tally.add(f"scenario_{name}")
        try:
            getattr(soak, name)(rng)
        except openai.APIStatusError as exc:
            soak.tally.status(exc.status_code)
            if exc.status_code >= 500:
                soak.tally.fail(f"{name}: {exc.status_code} {exc.message[:120]}")
        except anthropic.APIStatusError as exc:
            soak.tally.status(exc.status_code)
            if exc.status_code >= 500:
                soak.tally.fail(f"{name}: {exc.status_code} {exc.message[:120]}")
        except Exception as exc:  # noqa: BLE001 - every client-side surprise is a finding
            soak.tally.fail(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")


def metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def settle(url, timeout=60.0) -> dict:
    """Metrics once nothing is outstanding (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m.get("ninfer_engine_outstanding", 1) == 0 and
                m.get("ninfer_generations_in_flight", 1) == 0) or time.monotonic() > deadline:
            return m


def start_server(args, port) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ninfer", "serve", *([args.artifact] if args.artifact else []),
            "--port", str(port), "--api-key", KEY, "--max-concurrency", str(args.max_concurrency),
            "--max-queue", str(args.max_queue), "--max-context", "1024", "--drain-grace", "5",
            "--log-level", "warning"]
    log = open(args.server_log, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}; see {args.server_log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server not ready in 300 s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--artifact", help="a .ninfer file (default: the demo model)")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", help="write the summary as JSON here")
    p.add_argument("--server-log", default="/tmp/ninfer-soak-server.log")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    before = metrics(url)               # /health answered 503 "loading" while the model loaded
    tally = Tally()
    soak = Soak(url, seed, tally)
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    threads = [threading.Thread(target=client_loop, args=(soak, deadline, i), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    m = settle(url)
    leaks = {k: m.get(k) for k in ("ninfer_engine_outstanding",
                                   "ninfer_engine_state_slots_used", "ninfer_resident_requests",
                                   "ninfer_queue_depth", "ninfer_generations_in_flight")}
    # the context cache keeps the KV pages of its device checkpoints: every other page is free
    leaks["ninfer_engine_kv_pages_used (less the context cache's)"] = \
        m.get("ninfer_engine_kv_pages_used", 0) - m.get("ninfer_engine_prefix_cache_kv_pages", 0)
    for name, value in leaks.items():
        if value != 0:
            tally.fail(f"after the soak {name} = {value}")
    server_5xx_by = {k[len("ninfer_http_requests_total"):]: v - before.get(k, 0)
                     for k, v in m.items()
                     if k.startswith("ninfer_http_requests_total") and 'status="5' in k
                     and v > before.get(k, 0)}
    server_5xx = sum(server_5xx_by.values())
    client_5xx = sum(v for k, v in tally.statuses.items() if k.startswith("5"))
    if server_5xx or client_5xx:
        tally.fail(f"5xx: server {server_5xx_by}, client {client_5xx}")
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "hung"
    if rc != 0:
        tally.fail(f"server exit status after SIGTERM: {rc}")
    finished = {k.split('"')[1]: v for k, v in m.items()
                if k.startswith("ninfer_generations_finished_total")}
    summary = {
        "seed": seed, "minutes": round(wall / 60, 2), "clients": args.clients,
        "requests_by_status": dict(sorted(tally.statuses.items())),
        "server_requests": int(sum(v - before.get(k, 0) for k, v in m.items()
                                   if k.startswith("ninfer_http_requests_total"))),
        "generations_finished": finished,
        "generated_tokens": int(m.get("ninfer_generated_tokens_total", 0)),
        "counts": dict(sorted(tally.counts.items())),
        "after": leaks, "server_5xx": int(server_5xx), "client_5xx": int(client_5xx),
        "exit_status": rc,
        "failures": dict(collections.Counter(tally.failures).most_common()),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {json.dumps(value)}")
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
