"""Issue 11's CLI: every EngineOptions field is a flag of run, chat and serve (generated from the
dataclass), sizes with units, the model-derived max_context default, --chat-template."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from ninfer.cli import build_parser
from ninfer.commands import default_max_context, engine_kwargs
from ninfer.options import EngineOptions

COMMANDS = ("run", "chat", "serve")


def _subparser(name):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[name]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_option_is_a_flag(command):
    flags = {s for a in _subparser(command)._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineOptions):
        if f.name == "purpose":                 # fixed by the command
            continue
        if f.name == "default_enable_thinking":  # --thinking / --no-thinking
            assert "--no-thinking" in flags
            continue
        assert "--" + f.name.replace("_", "-") in flags, f.name


def test_flags_reach_engine_options():
    argv = ["serve", "--prefix-cache-bytes", "1M", "--host-snapshot-bytes", "2G",
            "--no-graphs", "--queue-timeout-s", "2.5", "--num-kv-pages", "64", "--dtype",
            "float32", "--backend", "cuda", "--prefill-chunk", "128"]
    args = build_parser().parse_args(argv)
    kw = engine_kwargs(args, concurrency_default=4)
    opts = EngineOptions.from_kwargs(**kw)
    assert (opts.prefix_cache_bytes, opts.host_snapshot_bytes) == (1 << 20, 2 << 30)
    assert (opts.graphs, opts.queue_timeout_s, opts.num_kv_pages) == (False, 2.5, 64)
    assert (opts.dtype, opts.prefill_chunk, opts.max_concurrency) == ("float32", 128, 4)
    # flags left out keep the dataclass defaults
    assert opts.page_size == EngineOptions().page_size and "page_size" not in kw


def test_bad_flag_values_are_one_line_errors():
    for argv in (["run", "--prompt", "x", "--prefix-cache-bytes", "lots"],
                 ["serve", "--dtype", "float16"], ["chat", "--max-concurrency", "x"]):
        r = subprocess.run([sys.executable, "-m", "ninfer", *argv], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("ninfer: error:")


def test_max_context_defaults_to_the_model_bounded_by_memory(monkeypatch):
    from ninfer import commands
    from ninfer.demo import ensure_demo_artifact
    path = ensure_demo_artifact()
    n, how = default_max_context(path, {"max_concurrency": 1})
    assert n == 32768 and "max_position_embeddings 32768" in how     # the demo's
    monkeypatch.setattr(commands, "_free_memory", lambda backend, device: 64 << 20)
    n, how = default_max_context(path, {"max_concurrency": 4})
    assert 256 <= n < 32768 and n % 256 == 0 and "free memory" in how


def test_chat_template_flag(tmp_path):
    import ninfer
    from ninfer.demo import ensure_demo_artifact
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "[assistant] ")
    with ninfer.Engine(ensure_demo_artifact(), chat_template=template.read_text()) as engine:
        text = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "[user] hi\n[assistant] "
    r = subprocess.run([sys.executable, "-m", "ninfer", "run", "--prompt", "x",
                        "--chat-template", str(tmp_path / "missing.jinja")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--chat-template" in r.stderr and r.stderr.count("\n") == 1
