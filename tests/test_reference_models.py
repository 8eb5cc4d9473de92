"""The trained reference models (ninfer/demo_models, docs/models.md): compact files, expansion into
normal artifacts (MTP weights carried), recorded greedy continuations and held-out perplexities,
and `python -m ninfer eval`."""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from ninfer import Engine, SamplingParams
from ninfer.artifact import Artifact
from ninfer.demo import ensure_reference_artifact, reference_path
from ninfer.eval import dataset_path, evaluate
from ninfer.reference_models import EMBED, MODELS_DIR, CompactModel, model_path
from reference_records import (GREEDY, GREEDY_RAW, HELDOUT_BYTES, HELDOUT_PPL, HELDOUT_TOKENS,
                               NAMES, PROMPT)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PPL_REL_TOL = 0.01
MAX_FILE_BYTES = 5 << 20


@pytest.fixture(scope="module", params=NAMES)
def reference(request, tmp_path_factory):
    cache = tmp_path_factory.mktemp(f"ref_{request.param}")
    return request.param, ensure_reference_artifact(request.param, cache)


@pytest.mark.parametrize("name", NAMES)
def test_compact_file_is_small_and_self_describing(name):
    path = model_path(name)
    assert path.stat().st_size <= MAX_FILE_BYTES
    m = CompactModel(path)
    arch = "Qwen3_5MoeForCausalLM" if name == "moe" else "Qwen3_5ForCausalLM"
    assert m.config["architectures"] == [arch] and m.config["vocab_size"] == 248320
    assert m.config["mtp_num_hidden_layers"] == 1 and m.config["tie_word_embeddings"]
    types = set(m.config["layer_types"])
    assert types == {"linear_attention", "full_attention"}                 # hybrid
    assert m.meta["pre_training_steps"] > 0 and m.meta["kept_rows"] == m.kept_ids.size
    assert np.all(np.diff(m.kept_ids) > 0) and m.kept_ids[-1] < 248320
    if name == "moe":
        assert m.config["num_experts"] == 4 and m.config["num_experts_per_tok"] == 2


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no reference model 'nope'.*dense"):
        model_path("nope")


def test_expanded_artifact_carries_mtp_dflash_and_zero_unseen_rows(reference):
    name, path = reference
    assert path == reference_path(name, path.parent)
    m = CompactModel(model_path(name))
    H = m.config["hidden_size"]
    with Artifact(path, verify="eager") as art:
        assert art.manifest["components"] == ["text", "mtp", "dflash"]
        assert art.tensor("dflash.fc.weight").shape == (H, 3 * H)
        assert art.tensor("mtp.fc.weight").shape == (H, 2 * H)
        for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                  "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
                  "mtp.layers.0.input_layernorm.weight"):
            assert art.has(n), n
        if name == "moe":
            assert art.tensor("mtp.layers.0.mlp.experts.gate_up_proj").shape[0] == 4
        emb = art.tensor("text.embed_tokens.weight").astype(np.float32)
        unseen = np.ones(emb.shape[0], bool)
        unseen[m.kept_ids] = False
        assert not np.any(emb[unseen]) and np.all(np.any(emb[m.kept_ids], axis=1))
        # the stored rows are the compact file's dequantized values, rounded once to bfloat16
        kept = m.tensor(EMBED)[m.kept_ids[:50]]
        assert np.allclose(emb[m.kept_ids[:50]], kept, rtol=2 ** -8, atol=0)


def test_greedy_continuations_are_the_recorded_ones(reference):
    name, path = reference
    with Engine(path, max_concurrency=1) as engine:
        chat = engine.generate([{"role": "user", "content": PROMPT}],
                               SamplingParams(max_tokens=24), enable_thinking=False)
        raw = engine.generate(PROMPT + "\n", SamplingParams(max_tokens=24))
    assert chat.token_ids == GREEDY[name], chat.text
    assert raw.token_ids == GREEDY_RAW[name], raw.text
    assert chat.text.startswith("def ") and chat.text.count("\n") >= 2       # a Python function


def test_heldout_perplexity_is_the_recorded_one(reference):
    name, path = reference
    text = dataset_path("heldout").read_text(encoding="utf-8")
    with Engine(path, purpose="scoring", prefill_chunk=512) as engine:
        res = evaluate(engine, text, context=512, max_tokens=HELDOUT_TOKENS)
        unseen_logit = engine.score(np.array([198, 248045, 262], np.int32), return_logits=True)
    assert (res.num_tokens, res.num_windows, res.num_bytes) == (HELDOUT_TOKENS, 2, HELDOUT_BYTES)
    assert abs(res.perplexity / HELDOUT_PPL[name] - 1) < PPL_REL_TOL, res.perplexity
    assert res.bits_per_byte == pytest.approx(
        res.num_tokens * math.log2(res.perplexity) / res.num_bytes, rel=1e-9)
    # trained: far better than uniform over the vocabulary (ppl 248,320) and than the unigram
    assert res.perplexity < 100
    # ids whose rows were not kept (unseen or rare in training) have logit exactly 0
    m = CompactModel(model_path(name))
    unkept = np.setdiff1d(np.arange(248320), m.kept_ids)[:1000]
    logits = unseen_logit.logits
    assert np.all(logits[:, unkept] == 0.0) and np.all(logits.max(axis=1) > 5.0)


def _ninfer(*args):
    return subprocess.run([sys.executable, "-m", "ninfer", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_eval_cli_json_and_errors(tmp_path):
    path = ensure_reference_artifact("dense", tmp_path)
    r = _ninfer("eval", path, "--dataset", "heldout", "--max-tokens", 100, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    with Engine(path, purpose="scoring", prefill_chunk=512) as engine:
        want = evaluate(engine, dataset_path("heldout").read_text(encoding="utf-8"),
                        max_tokens=100).to_json()
    assert doc == pytest.approx(want, rel=1e-6) and doc["num_tokens"] == 100
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n", encoding="utf-8")
    r = _ninfer("eval", path, "--text", text)
    assert r.returncode == 0 and r.stdout.startswith("tokens ") and "bits_per_byte" in r.stdout
    for args, message in ((("--dataset", "nope"), "unknown (known: heldout)"),
                          (("--text", tmp_path / "missing.txt"), "No such file"),
                          (("--dataset", "heldout", "--max-tokens", 0), "--max-tokens must be"),
                          (("--dataset", "heldout", "--context", 1), "--context must be")):
        r = _ninfer("eval", path, *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
    r = _ninfer("eval", tmp_path / "no.ninfer", "--dataset", "heldout")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_shipped_files_are_package_data():
    """pyproject ships ninfer/demo_models/* in the wheel (a fresh install runs the demo)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    shipped = [p for p in MODELS_DIR.iterdir() if p.is_file()]
    assert {p.suffix for p in shipped} == {".npz", ".txt"}
    assert '"ninfer" = ["demo_models/*.npz", "demo_models/*.txt"]' in pyproject


def test_torch_model_matches_numpy_model():
    """tools/train_reference.py's torch model (the one trained) against ninfer's numpy model on
    random weights of both configs, through compact file -> HF checkpoint -> convert."""
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "train_reference.py"), "check"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "check ok" in r.stdout, r.stdout + r.stderr
