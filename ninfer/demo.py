"""The built-in demo model: a tiny Qwen3.5 with RANDOM weights, the real Qwen3.5 vocabulary
(248,320 ids, tokenizer.json built on the fly from the BPE ranks shipped with ninfer) and the built-in
Qwen3.5 chat template. Its text is gibberish; everything around it (tokenizer, template, Engine,
sampling, streaming, the HTTP API) is the real pipeline, so `python -m ninfer run` works on a fresh
machine with no download.

Generated on first use (seeded, so every machine gets the same bytes) and cached as
`<cache>/demo-v<N>.ninfer` (`$NINFER_CACHE_DIR` or `~/.cache/ninfer`), written atomically;
a cached file that fails its checksums is rebuilt.
The tied [vocab, hidden] embedding dominates its ~16 MB.

The trained reference models (`ensure_reference_artifact("dense" | "moe")`, docs/models.md) are what
`python -m ninfer run` uses with no artifact named: tiny Qwen3.5 models trained on the CPython
standard library, committed in compact form (ninfer/demo_models/*.npz) and expanded on first use
through the normal path (a Hugging Face checkpoint directory, then `ninfer convert`), cached as
`<cache>/ref-<name>-<digest>.ninfer` (with the model's DFlash drafter, `<name>-dflash.npz`, as the
artifact's `dflash` component where one ships). Their artifacts carry
`metadata.defaults.enable_thinking = false`: their chats were trained with thinking off, so run /
chat / serve / Engine render them that way unless told otherwise. The random model above stays for tests that want one (no defaults:
thinking on, as for any artifact without the field).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Optional

import ml_dtypes
import numpy as np

DEMO_VERSION = 1
DEMO_NAME = "ninfer-demo-random"
DEMO_NOTICE = ("using the built-in demo model: tiny, RANDOM weights, real Qwen3.5 vocabulary and "
               "chat template; its output is gibberish (convert a real checkpoint for real text)")
_SEED = 20260601
_HIDDEN = 32


def demo_config():
    from .models.qwen3_5.config import ModelConfig, TextConfig
    from .models.qwen3_5.frontend.vocab import ADDED_TOKENS, SPECIAL_START_ID

    ids = {content: SPECIAL_START_ID + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    layer_types = ("linear_attention",) * 3 + ("full_attention",)
    text = TextConfig(
        vocab_size=248320, hidden_size=_HIDDEN, intermediate_size=64,
        num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=10_000_000.0, partial_rotary_factor=0.25, mrope_section=(2, 1, 1),
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, layer_types=layer_types,
        eos_token_id=(ids["<|im_end|>"], ids["<|endoftext|>"]))
    return ModelConfig(architecture="Qwen3_5ForCausalLM", text=text)


def demo_path(cache_dir: Optional[pathlib.Path] = None) -> pathlib.Path:
    from .models.qwen3_5.frontend.vocab import cache_dir as default_cache_dir
    return pathlib.Path(cache_dir or default_cache_dir()) / f"demo-v{DEMO_VERSION}.ninfer"


def ensure_demo_artifact(cache_dir: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Path of the random demo artifact, generating it first if it is not cached yet."""
    return _ensure_cached(demo_path(cache_dir), write_demo_artifact)


REFERENCE_NOTICE = ("using the built-in reference model: a tiny Qwen3.5 (4.3 M parameters) trained "
                    "on the CPython standard library; it writes Python-like text, it is not an "
                    "assistant (convert a real checkpoint for real answers)")


# The run defaults of the reference models' artifacts: their chat conversations were rendered with
# enable_thinking=False in training (docs/models.md "Data"), so that is how they answer best.
REFERENCE_DEFAULTS = {"enable_thinking": False}
# Bumped when the expansion writes a different artifact from the same compact file (2: the
# defaults above), so that a cached artifact of an older expansion is not reused.
_EXPANSION_VERSION = 2


def reference_path(name: str = "dense", cache_dir: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Cache path of a reference model's artifact; its name carries the digest of the compact file
    and of the expansion, so a changed model file or expansion is expanded afresh."""
    from .models.qwen3_5.frontend.vocab import cache_dir as default_cache_dir
    from .reference_models import model_path

    h = hashlib.sha256(model_path(name).read_bytes())
    drafter = _shipped_drafter(name)
    if drafter is not None:
        h.update(b"/dflash " + drafter.read_bytes())
    h.update(f"/expansion {_EXPANSION_VERSION}".encode())
    digest = h.hexdigest()[:12]
    return pathlib.Path(cache_dir or default_cache_dir()) / f"ref-{name}-{digest}.ninfer"


def ensure_reference_artifact(name: str = "dense",
                              cache_dir: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Path of a trained reference model's artifact ("dense" or "moe"), expanded on first use."""
    return _ensure_cached(reference_path(name, cache_dir),
                          lambda out: write_reference_artifact(name, out))


def write_reference_artifact(name: str, path) -> pathlib.Path:
    """Compact file -> Hugging Face checkpoint directory (temporary) -> `.ninfer` at `path`."""
    from .convert import convert_checkpoint
    from .reference_models import expand_to_checkpoint, model_path

    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"ninfer-ref-{name}-"))
    try:
        expand_to_checkpoint(model_path(name), tmp / "model")
        drafter = _shipped_drafter(name)
        if drafter is not None:
            from .reference_models import expand_drafter
            expand_drafter(drafter, tmp / "dflash")
        convert_checkpoint(tmp / "model", path, name=f"ninfer-ref-{name}", progress=False,
                           defaults=REFERENCE_DEFAULTS,
                           dflash_dir=None if drafter is None else tmp / "dflash")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pathlib.Path(path)


def _shipped_drafter(name: str) -> Optional[pathlib.Path]:
    """The reference model's DFlash drafter (ninfer/demo_models/<name>-dflash.npz), carried in
    its artifact for speculative='dflash'; None where none is shipped."""
    from .reference_models import MODELS_DIR
    path = MODELS_DIR / f"{name}-dflash.npz"
    return path if path.is_file() else None


def _ensure_cached(path: pathlib.Path, write) -> pathlib.Path:
    if not _is_intact(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # a private name per process, then one atomic rename: concurrent first runs never meet
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _is_intact(path: pathlib.Path) -> bool:
    """Whether a cached file opens and every checksum holds (~20 ms): a damaged one (a crash
    mid-copy, a bad disk) is rebuilt instead of failing every later run."""
    from .artifact import Artifact
    from .errors import ArtifactError

    if not path.is_file():
        return False
    try:
        with Artifact(path, verify="eager"):
            return True
    except ArtifactError:
        return False


def _init(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Random values of the usual magnitudes (norm weights zero-centred -> scale 1)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("linear_attn.norm.weight"):
        return np.ones(shape, np.float32)                   # plain (not zero-centred) norm
    if name.endswith("norm.weight"):
        return np.zeros(shape, np.float32)
    if leaf == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if leaf == "dt_bias":
        return np.ones(shape, np.float32)
    if name == "text.embed_tokens.weight":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
    fan_in = shape[-1]
    return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)


def write_demo_artifact(path) -> pathlib.Path:
    """Write the demo artifact to `path` (atomically: a partial file, then a rename)."""
    from .artifact import ArtifactWriter
    from .convert.names import expected_text_shapes, use_site
    from .models.qwen3_5.frontend import builtin_template_source
    from .models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json

    config = demo_config()
    t = config.text
    shapes = expected_text_shapes(t, with_lm_head=False)
    rng = np.random.default_rng(_SEED)
    metadata = {"demo": {"version": DEMO_VERSION, "seed": _SEED, "weights": "random"}}
    generation_config = {"eos_token_id": list(t.eos_token_id), "do_sample": False}
    with ArtifactWriter(path, config, name=DEMO_NAME, metadata=metadata) as writer:
        for name in sorted(shapes):
            writer.add_object(name, _init(name, shapes[name], rng).astype(ml_dtypes.bfloat16))
            writer.bind(name, name)
        writer.bind("text.lm_head.weight", "text.embed_tokens.weight")
        for logical in sorted(shapes) + ["text.lm_head.weight"]:
            site, position = use_site(logical)
            writer.add_use(site, logical, [position], "A16Only")
        writer.add_resource("tokenizer.json", cached_qwen3_5_tokenizer_json())
        writer.add_resource("chat_template.jinja", builtin_template_source().encode("utf-8"))
        writer.add_resource("generation_config.json", json.dumps(generation_config).encode())
    return pathlib.Path(path)
