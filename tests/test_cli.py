"""`python -m ninfer run` and `serve` as a user runs them (subprocesses), on the built-in demo model.

The streamed stdout must be exactly the Engine's answer for the same request; bad input must end
with one `ninfer: error:` line and exit status 2, before any model is loaded."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ninfer import Engine, SamplingParams
from ninfer.demo import (DEMO_NOTICE, REFERENCE_NOTICE, ensure_demo_artifact,
                         ensure_reference_artifact)

STATS = re.compile(r"^\[prompt (\d+) tok \(\d+ cached\), prefill [\d.]+ tok/s "
                   r"\| generated (\d+) tok, decode [\d.]+ tok/s \| TTFT \d+ ms \| total [\d.]+ s "
                   r"\| finish (\w+)\]$")


def ninfer(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ninfer", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo():
    return ensure_demo_artifact()


@pytest.fixture(scope="module")
def engine(demo):
    with Engine(demo, max_concurrency=1) as e:
        yield e


def test_run_demo_streams_the_engines_answer():
    """The README's main job, with no artifact: the trained reference model (docs/models.md),
    said so on stderr."""
    r = ninfer("run", "--prompt", "def fibonacci(n):", "--max-new", 16)
    assert r.returncode == 0, r.stderr
    with Engine(ensure_reference_artifact(), max_concurrency=1) as reference:
        expected = reference.generate([{"role": "user", "content": "def fibonacci(n):"}],
                                      SamplingParams(max_tokens=16), enable_thinking=False)
    assert expected.text and r.stdout == expected.text + "\n"
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"ninfer: {REFERENCE_NOTICE}" and "trained on" in lines[0]
    m = STATS.match(lines[-1])
    assert m, lines[-1]
    assert (int(m[1]), int(m[2]), m[3]) == (expected.num_prompt_tokens, len(expected.token_ids),
                                            expected.finish_reason)


def test_run_messages_file_system_and_reasoning(tmp_path, demo, engine):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": messages}))
    r = ninfer("run", demo, "--messages", path, "--max-new", 6, "--thinking", "--seed", 5,
               "--temperature", 0.7, "--top-k", 50)
    assert r.returncode == 0, r.stderr
    expected = engine.generate(messages, SamplingParams(max_tokens=6, temperature=0.7, top_k=50,
                                                        seed=5), enable_thinking=True)
    # random weights never close <think>: the whole answer is reasoning, on stderr
    assert expected.reasoning_text and not expected.text
    assert r.stdout == ""
    assert f"[reasoning] {expected.reasoning_text}\n" in r.stderr
    assert DEMO_NOTICE not in r.stderr             # an artifact was named
    assert STATS.match(r.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x", "--max-new", "0"], "--max-new 0: must be >= 1"),
    (["--prompt", "x", "--temperature", "hot"], "invalid float value: 'hot'"),
    (["--prompt", "x", "--top-p", "0"], "top_p=0.0: must be in (0, 1]"),
    (["--prompt", "x", "--top-k", "-1"], "top_k=-1"),
    (["--prompt", "x", "--stop", ""], "stop"),
    (["--prompt", "x", "--backend", "tpu"], "invalid choice: 'tpu'"),
    (["missing.ninfer", "--prompt", "x"], "artifact missing.ninfer: no such file"),
    (["--messages", "/nonexistent/chat.json"], "--messages /nonexistent/chat.json: No such file"),
    ([], "one of the arguments --prompt --messages is required"),
    (["--prompt", "x", "--messages", "m.json"], "not allowed with argument"),
    (["--prompt", "x", "--raw", "--system", "s"], "--system needs the chat template"),
])
def test_run_bad_input_one_line_error(args, message):
    r = ninfer("run", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ninfer: error: ") and message in lines[0], \
        r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


@pytest.mark.parametrize("content, message", [
    ("[{\"role\": \"user\"", "not valid JSON"),
    ("{}", "expected a non-empty list of messages"),
    ("[{\"role\": \"wizard\", \"content\": \"x\"}]", "message 0 needs a 'role'"),
    ("[{\"role\": \"user\", \"content\": 3}]", "message 0 needs a string 'content'"),
    ("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": 5}",
     "'tools' must be a list"),
])
def test_run_bad_messages_file(tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    r = ninfer("run", "--messages", path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-concurrency", "9"], "max_concurrency=9: must be in 1..8"),
    (["--port", "0"], "--port 0: must be in 1..65535"),
    (["--temperature", "5"], "temperature=5.0: must be in [0, 2]"),
    (["--max-context", "1"], "max_context=1"),
    (["missing.ninfer"], "artifact missing.ninfer: no such file"),
    (["--max-body-mb", "inf"], "--max-body-mb inf: must be a finite number > 0"),
    (["--max-body-mb", "nan"], "--max-body-mb nan: must be a finite number > 0"),
    (["--drain-grace", "nan"], "drain_grace_s=nan: must be a finite number >= 0"),
    (["--drain-grace", "inf"], "drain_grace_s=inf: must be a finite number >= 0"),
    (["--allow-media-urls", "a,,b"], "--allow-media-urls 'a,,b': each entry must be a host"),
    (["--max-tokens-cap", "0"], "max_tokens_cap=0: must be >= 1"),
])
def test_serve_bad_input_one_line_error(args, message):
    r = ninfer("serve", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_serve_cli_demo_and_graceful_shutdown(demo):
    """`python -m ninfer serve` (gunicorn) on the demo model: it serves, /health goes 503 while it
    drains on SIGTERM, a stream still running after the grace period ends 'cancelled', and the
    server exits 0."""
    from test_serve_support import ServerProcess

    # the random demo named explicitly: it never ends a stream early, so the drain is what ends it
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", str(demo),
                         "--max-context", "4096", "--drain-grace", "1", "--model-id", "demo",
                         "--no-thinking"],
                        env={"NINFER_API_KEY": "k"})
    try:
        auth = {"authorization": "Bearer k"}
        assert httpx.get(srv.url + "/v1/models", headers=auth).json()["data"][0]["id"] == "demo"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        r = httpx.post(srv.url + "/v1/chat/completions", headers=auth, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
                "stream": True}
        finish, health = [], []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=auth, json=body,
                          timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
            srv.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            for line in lines:
                if len(health) < 1 and time.monotonic() - t0 > 0.3:
                    try:
                        health.append(httpx.get(srv.url + "/health", timeout=2).status_code)
                    except httpx.HTTPError:
                        health.append("refused")
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    if choice["finish_reason"]:
                        finish.append(choice["finish_reason"])
            elapsed = time.monotonic() - t0
        assert finish == ["cancelled"] and elapsed < 15
        # a new connection after SIGTERM is refused or answered 503 (draining)
        assert health and health[0] in (503, "refused")
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_demo_cache_dir_unusable_one_line_error(tmp_path, command):
    """A cache location that cannot hold the demo model (here: under a plain file) is one line
    that names it, not a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = [sys.executable, "-m", "ninfer", command] + (["--prompt", "x"] if command == "run" else [])
    env = {**os.environ, "NINFER_CACHE_DIR": str(blocker / "cache")}
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("ninfer: error: ")]
    assert len(errors) == 1 and str(blocker / "cache") in errors[0], r.stderr
    assert "NINFER_CACHE_DIR" in errors[0] and "Traceback" not in r.stderr


def test_serve_port_in_use_or_bad_host_one_line_error():
    """Checked before the model loads: one line, not gunicorn's five retries and log lines."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = ninfer("serve", "--port", port)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], r.stderr
    r = ninfer("serve", "--host", "999.1.1.1")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen on 999.1.1.1:8000" in lines[0], r.stderr


@pytest.mark.parametrize("args, line", [
    (["bogus"], "ninfer: error: argument COMMAND: invalid choice: 'bogus'"),
    (["--nope"], "ninfer: error: unrecognized arguments: --nope"),
    (["run", "--prompt"], "ninfer: error: run: argument --prompt: expected one argument"),
])
def test_flag_errors_name_the_subcommand_once(args, line):
    r = ninfer(*args)
    assert r.returncode == 2 and r.stderr.strip().startswith(line), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_serve_access_log_goes_to_stderr(demo, tmp_path):
    """--access-log logs each request to stderr (as documented), keeping stdout clean."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ninfer", "serve", "--port", str(port),
                             "--access-log"], stdout=out, stderr=err, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert httpx.get(url + "/v1/models/no-such-model", timeout=5).status_code == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    # uvicorn's access line (serve's worker): 127.0.0.1:PORT - "GET /path HTTP/1.1" 404
    assert re.search(r'"GET /v1/models/no-such-model HTTP/1\.1" 404\b', stderr), stderr
    assert "/v1/models/no-such-model" not in stdout, stdout
    # every access line whole: stderr here is a regular file, which the server's later log lines
    # must not overwrite (they did, when the access log reopened /dev/stderr as its own file)
    for line in stderr.splitlines():
        if ' HTTP/1.1" ' in line:
            assert re.match(r'127\.0\.0\.1:\d+ - "', line), stderr


def test_run_into_a_closed_pipe_exits_quietly(demo):
    """`ninfer run ... | head -c 5`: the reader goes away; no traceback, the shell's SIGPIPE
    status (141)."""
    proc = subprocess.Popen([sys.executable, "-m", "ninfer", "run", str(demo), "--prompt", "hi",
                             "--max-new", "300", "--no-thinking"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(5)) == 5
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(60) == 141, stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr


# ---- issue 23: defaults and flags of every command ----------------------------------------------

def _flag_help_missing(parser, path=()):
    """(command, flag) of every option without help text, through the subcommands."""
    import argparse
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _flag_help_missing(sub, path + (name,))
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append((" ".join(path), "/".join(action.option_strings) or action.dest))
    return missing


def _helps(command):
    from ninfer.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {a.dest: a.help for a in sub._actions}


def test_every_flag_has_help_and_sizes_read_alike():
    from ninfer.cli import build_parser
    assert _flag_help_missing(build_parser()) == []
    for command in ("run", "chat", "serve"):
        helps = _helps(command)
        assert "seed" in helps["seed"] if command != "serve" else "log" in helps["log_level"]
        # byte sizes in the one form the size flags take (256M), never a raw count beside it
        assert helps["host_snapshot_bytes"].endswith("(default 256M)")
        assert helps["prefix_cache_host_bytes"].endswith("(default 256M)")
        assert not [h for h in helps.values() if h and re.search(r"\d{5,}", h)]
        assert "--seed" in ninfer(command, "--help").stdout or command == "serve"


def test_kv_dtype_says_what_each_backend_stores():
    """numpy computes in float32: the default is 'auto' (unquantized, in the compute dtype), not a
    'bfloat16' the numpy backend never stores; the older value still parses."""
    from ninfer.cli import build_parser
    from ninfer.commands import engine_kwargs
    text = ninfer("run", "--help").stdout
    assert "--kv-dtype {auto,fp8,int8}" in text and "numpy: float32" in text
    for value, stored in ((None, None), ("auto", None), ("bfloat16", "bfloat16"), ("fp8", "fp8")):
        argv = ["run", "--prompt", "x"] + (["--kv-dtype", value] if value else [])
        kwargs = engine_kwargs(build_parser().parse_args(argv), concurrency_default=1)
        assert kwargs.get("kv_dtype") == stored


def test_backend_auto_picks_the_gpu_when_usable(monkeypatch):
    from ninfer import backend_auto
    assert backend_auto.choose_backend("auto", probe_fn=lambda d: (True, "CUDA device 0 of 1")) \
        == ("cuda", "backend cuda (auto: CUDA device 0 of 1; --backend numpy|cuda sets it)")
    choice, note = backend_auto.choose_backend(None,
                                               probe_fn=lambda d: (False, "no CUDA device found"))
    assert choice == "numpy" and note.startswith("backend numpy (auto: no CUDA device found;")

    def never(device_id):
        raise AssertionError("an explicit backend needs no probe")
    for name in ("numpy", "cuda"):
        assert backend_auto.choose_backend(name, probe_fn=never) == (name, None)
    # the probe: the extra first, then the device count (a child process; faked here)
    monkeypatch.setattr(backend_auto, "cuda_extra_missing", lambda: ["numba_cuda"])
    assert backend_auto.probe() == (False, "the [cuda] extra is not installed")
    monkeypatch.setattr(backend_auto, "cuda_extra_missing", lambda: [])
    monkeypatch.setattr(backend_auto, "cuda_device_count", lambda: (1, ""))
    assert backend_auto.probe(0) == (True, "CUDA device 0 of 1")
    assert backend_auto.probe(1) == (False, "no CUDA device 1 (1 found)")
    monkeypatch.setattr(backend_auto, "cuda_device_count", lambda: (0, "no usable NVIDIA driver"))
    assert backend_auto.probe() == (False, "no usable NVIDIA driver")


def test_a_flag_the_chosen_backend_refuses_is_one_line_naming_the_choice():
    """--dtype bfloat16 is cuda's; auto on this GPU-less machine chose numpy: one error line that
    says so, before any model is built."""
    r = ninfer("run", "--prompt", "x", "--dtype", "bfloat16")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "numpy backend computes in float32 only" in lines[0]
    assert "; backend numpy (auto: " in lines[0]
    r = ninfer("run", "--prompt", "x", "--dtype", "bfloat16", "--backend", "numpy")
    assert r.returncode == 2 and "auto" not in r.stderr


def test_no_gpu_here_the_real_probe_says_numpy():
    from ninfer import backend_auto
    usable, why = backend_auto.probe()
    assert usable is False and why


@pytest.mark.parametrize("argv", [["run", "m.ninfer", "--prompt", "x", "--max-context", "256"],
                                  ["chat", "m.ninfer", "--max-context", "256"],
                                  ["serve", "m.ninfer", "--max-context", "256"],
                                  ["score", "m.ninfer", "--text", "x y"]])
def test_every_command_defaults_to_auto_and_passes_the_choice_on(monkeypatch, argv, capsys):
    """With the probe faked to find a GPU, run / chat / serve / score hand backend='cuda' to the
    Engine and say so; --backend numpy is kept as given."""
    import ninfer.engine
    import ninfer.serve.launcher as launcher
    from ninfer import backend_auto, commands, serve_command
    from ninfer.cli import build_parser
    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(path, **kwargs):
        seen.update(kwargs)
        raise Stop
    monkeypatch.setattr(ninfer.engine, "Engine", fake_engine)
    for module in (commands, serve_command):       # run / chat / score, and serve
        monkeypatch.setattr(module, "_artifact_or_demo", lambda path: (path, False))
    monkeypatch.setattr(serve_command, "_check_can_listen", lambda host, port: None)
    monkeypatch.setattr(commands, "_free_memory", lambda backend, device_id: None)
    monkeypatch.setattr(launcher, "serve", lambda factory, config, **kw: factory())
    monkeypatch.setattr(backend_auto, "probe", lambda device_id=0: (True, "CUDA device 0 of 1"))
    for extra, expected in (([], "cuda"), (["--backend", "numpy"], "numpy")):
        args = build_parser().parse_args(argv + extra)
        with pytest.raises(Stop):
            args.handler(args)
        assert seen["backend"] == expected
        said = "ninfer: backend cuda (auto: CUDA device 0 of 1" in capsys.readouterr().err
        assert said == (expected == "cuda")


def test_score_and_eval_default_to_the_reference_model():
    r = ninfer("score", "--text", "def add(a, b):\n    return a + b\n")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"tokens \d+  total_logprob -[\d.]+  perplexity [\d.]+\n", r.stdout)
    assert f"ninfer: {REFERENCE_NOTICE}" in r.stderr
    assert "ninfer: backend numpy (auto: " in r.stderr
    e = ninfer("eval", "--dataset", "heldout", "--max-tokens", "64")
    assert e.returncode == 0, e.stderr
    assert e.stdout.startswith("tokens 64 ") and f"ninfer: {REFERENCE_NOTICE}" in e.stderr


def _readme_blocks():
    import pathlib
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    return re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)


def test_readme_main_job_prints_what_it_shows():
    """The README's main job (a raw continuation with the reference model) prints exactly the
    text the README shows after it."""
    blocks = _readme_blocks()
    i = next(i for i, (lang, body) in enumerate(blocks) if "ninfer run --raw" in body)
    command, (lang, shown) = blocks[i][1].strip(), blocks[i + 1]
    assert lang == "text" and command.startswith("python -m ninfer run --raw")
    r = subprocess.run(["bash", "-c", f"{sys.executable}{command.removeprefix('python')}"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout == shown and shown.strip()


# ---- warmup: the kernel cache filled ahead of a first start -----------------------------------

def test_warmup_fills_the_kernel_cache_for_the_models_geometry(tmp_path, monkeypatch, capsys):
    """In-process (--workers 0) with the compiler faked: what lands is one entry per kernel of
    the model's set, keyed for the asked architecture and dtype; a second run compiles nothing.
    The real compiler in worker processes: tests/test_cuda_nogpu.py."""
    from ninfer.artifact import Artifact
    from ninfer.cli import main
    from ninfer.core.cuda import kernels as K
    from ninfer.demo import ensure_reference_artifact
    from ninfer.models import model_config
    from ninfer.models.qwen3_5.cuda.kernel_set import geometry_specs
    from test_cuda_nogpu import _FAKE_PTX
    monkeypatch.setattr(K, "compile_spec", lambda spec, cc: _FAKE_PTX)
    with Artifact(ensure_reference_artifact()) as art:
        cfg = model_config(art).text
    for dtype, f32 in (("bfloat16", False), ("float32", True)):
        want = {K.cache_key(sp, (8, 9)) + ".ptx" for sp in geometry_specs(cfg, f32).values()}
        argv = ["warmup", "--arch", "sm_89", "--workers", "0", "--cache-dir", str(tmp_path),
                "--dtype", dtype]
        assert main(argv) == 0
        assert want <= {p.name for p in tmp_path.iterdir()}
        assert f"kernels for sm_89 ({dtype}): " in capsys.readouterr().out
    assert main(argv) == 0
    assert f"0 compiled, {len(want)} already cached" in capsys.readouterr().out


def test_warmup_releases_fills_the_cache_with_every_release_geometry(tmp_path, monkeypatch,
                                                                      capsys):
    from ninfer.cli import main
    from ninfer.core.cuda import kernels as K
    from ninfer.models.qwen3_5.releases import release_specs
    from test_cuda_nogpu import _FAKE_PTX
    monkeypatch.setattr(K, "compile_spec", lambda spec, cc: _FAKE_PTX)
    monkeypatch.setattr(K, "pack_dir", lambda: tmp_path / "no-pack")
    specs = release_specs()
    assert main(["warmup", "--releases", "--arch", "90", "--workers", "0", "--cache-dir",
                 str(tmp_path / "c")]) == 0
    assert {p.name for p in (tmp_path / "c").iterdir()} == \
        {K.cache_key(sp, (9, 0)) + ".ptx" for sp in specs}
    assert f"for sm_90: {len(specs)} compiled, 0 already" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--releases", "x.ninfer", "--arch", "90"], "--releases: the release geometries' bfloat16 "
                                                 "kernels; give no artifact and no --dtype"),
    (["--arch", "9x"], "--arch 9x: expected a compute capability such as 90, sm_90 or 9.0"),
    (["--arch", "90", "--workers", "-1"], "--workers -1: must be >= 0"),
    (["missing.ninfer", "--arch", "90"], "artifact missing.ninfer: no such file"),
])
def test_warmup_bad_input_one_line_error(args, message):
    r = ninfer("warmup", *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("ninfer: error: ") and message in lines[0], r.stderr
    assert r.stdout == ""


def test_run_says_where_the_start_went():
    """The start-up line (Engine.startup_seconds): the phases are measured, not made up: each
    within the whole, the weights within the model's load."""
    r = ninfer("run", "--raw", "--max-new", "2", "--prompt", "def f(x):")
    assert r.returncode == 0, r.stderr
    line, = [ln for ln in r.stderr.splitlines() if ln.startswith("ninfer: started in ")]
    assert re.fullmatch(r"ninfer: started in [\d.]+ s: tokenizer [\d.]+ s, model [\d.]+ s "
                        r"\(weights [\d.]+ s = [\d.]+ GB/s\), pools [\d.]+ s, warm-up [\d.]+ s",
                        line), line
    from ninfer.demo import ensure_reference_artifact
    with Engine(ensure_reference_artifact()) as engine:
        s = engine.startup_seconds
        stats = engine.stats()
        payload = engine.artifact.payload_bytes
    # stats() carries the start: its total, and the weights' rate over the artifact's payload
    assert stats["startup_seconds"] == s["total"]
    assert stats["weights_load_gb_per_s"] == pytest.approx(payload / s["weights"] / 1e9)
    assert set(s) == {"total", "tokenizer", "model", "weights", "pools", "warm_up"}
    assert all(v >= 0 for v in s.values()) and s["weights"] <= s["model"]
    assert s["tokenizer"] + s["model"] + s["pools"] + s["warm_up"] <= s["total"]
